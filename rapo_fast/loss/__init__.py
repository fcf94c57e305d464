"""The loss part: per-token log-probs (from logits or hidden states x lm_head), the RAPO/GRPO policy loss, its options.

Each module's docstring says what it holds. Not here: the Triton kernels (rapo_fast.kernels.loss) and the plain-PyTorch
spec (rapo_fast.reference). Import from the modules; this package re-exports nothing, so that importing one module
never pulls in the others.
"""
