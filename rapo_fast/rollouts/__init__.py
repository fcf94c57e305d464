"""The rollout part: hybrid-policy, multi-turn, tool-integrated generation for RAPO, GRPO and ARPO.

Holds: `loop` (the public rollout function), `batch` (RolloutBatch and token kinds), `engine` (batched decoding
over a HF cache), `splice` (splice-mode insertion of retrieved steps), `arpo` (entropy-adaptive branching). Not here:
rewards (the task's verifier) and the loss. This package re-exports nothing.
"""
