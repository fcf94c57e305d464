"""Reference (spec) of the retrieval op; see rapo_fast/reference/__init__.py."""

__all__: list[str] = []
