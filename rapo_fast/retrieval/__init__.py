"""The retrieval part: the step buffer, its nearest-neighbour search op, its file format, step traces, encoders.

Each module's docstring says what it holds. Not here: the C++/CUDA search kernels (csrc/) and the spec
(rapo_fast.reference.retrieval). This package re-exports nothing.
"""
