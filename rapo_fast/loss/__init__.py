"""The loss part: per-token log-probs (from logits or hidden states x lm_head), the RAPO/GRPO policy loss, its options.

Holds: `logprobs` (token_logprobs and its registered ops), `policy_loss` (rapo_loss, RAPOLoss, policy_loss_from_logp),
`fused_linear` (the one-pass hidden-state loss), `options` (the loss options and their checks), `presets`
(named option sets), `advantages` (step entropy, retrieval reward, RAPO advantages). Not here: the Triton kernels
(rapo_fast.kernels.loss) and the plain-PyTorch spec (rapo_fast.reference). Import from the modules; this package
re-exports nothing, so that importing one module never pulls in the others.
"""
