"""Triton kernels of the loss part: per-token log-probs (forward/backward) and the policy loss (forward/backward).

Launched from rapo_fast.loss; the spec is rapo_fast.reference. Not importable without triton.
"""
