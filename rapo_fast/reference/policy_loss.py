"""Reference (spec) of the policy_loss op; see rapo_fast/reference/__init__.py."""

__all__: list[str] = []
