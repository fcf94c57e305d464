"""Reference (spec) of the logprobs op; see rapo_fast/reference/__init__.py."""

__all__: list[str] = []
