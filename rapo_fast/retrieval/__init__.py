"""The retrieval part: the step buffer, its nearest-neighbour search op, its file format, step traces, encoders.

Holds: `buffer` (StepBuffer), `buffer_args` (its argument checks and NumPy conversion), `sharded` (ShardedStepBuffer),
`rwlock` (the buffer's reader-writer lock), `op` (the registered search op over rapo_fast._C), `io` (the snapshot
format), `jsonl` (the trajectory JSONL format), `step_traces` (StepTraces: trajectories split into steps, encoded and
indexed), `encoders` (text and policy-hidden encoders). Not here: the C++/CUDA search kernels (csrc/) and the spec
(rapo_fast.reference.retrieval).
This package re-exports nothing.
"""
