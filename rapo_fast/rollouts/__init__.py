"""The rollout part: hybrid-policy, multi-turn, tool-integrated generation for RAPO, GRPO and ARPO.

Not here: rewards (the task's verifier) and the loss. This package re-exports nothing.
"""
