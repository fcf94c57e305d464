"""Reference (spec) of the kv_splice op; see rapo_fast/reference/__init__.py."""

__all__: list[str] = []
