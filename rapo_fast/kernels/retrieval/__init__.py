"""Triton kernels of the retrieval part: the tensor-core scoring kernel of StepBuffer.search with a fused top-k.

Launched from rapo_fast/retrieval/triton_search.py; the spec is rapo_fast/reference/retrieval.py. Not importable
without triton.
"""
