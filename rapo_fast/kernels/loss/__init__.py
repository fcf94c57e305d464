"""Triton kernels of the loss part: per-token log-probs (forward/backward) and the policy loss (forward/backward).

Launched from rapo_fast.loss; the spec is rapo_fast.reference. Not importable without triton, except policy_layout.py,
the plain-Python contract the kernels and their launchers share.
"""
