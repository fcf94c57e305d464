"""The KV-splice part: inserting a retrieved step's cached K/V into a running KV cache, re-rotated to its new positions.

Holds: `splice` (splice_kv, StepKVStore and the registered op), `rope` (RopeSpec: the rotary embedding read from a
transformers config), `hf_cache` (access to transformers' cache classes). Not here: the C++/CUDA splice kernels
(csrc/) and the spec (rapo_fast.reference.kv_splice). This package re-exports nothing.
"""
