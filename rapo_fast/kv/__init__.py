"""The KV-splice part: inserting a retrieved step's cached K/V into a running KV cache, re-rotated to its new positions.

Not here: the C++/CUDA splice kernels (csrc/) and the spec (rapo_fast.reference.kv_splice). This package re-exports
nothing.
"""
