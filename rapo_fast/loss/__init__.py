"""The loss part: per-token log-probs (from logits or hidden states x lm_head), the RAPO/GRPO policy loss, its options.

Holds: `logprobs` (token_logprobs and its logits-path ops), `linear_logprobs` (its hidden-state-path ops), `tiles`
(the logits tiles of the hidden-state path, shared by linear_logprobs and fused_linear), `policy_loss` (rapo_loss,
RAPOLoss, policy_loss_from_logp), `policy_op` (the registered per-token policy-loss op and its Triton launches),
`policy_layout` (token codes, mode codes and metric layout shared with the kernel), `fused_linear` (the one-pass
hidden-state loss), `options` (LossOptions: every loss option, its default and its check; the tensor checks),
`presets` (named option sets), `advantages` (step entropy, retrieval reward, RAPO advantages). Not here: the Triton
kernels (rapo_fast.kernels.loss) and the plain-PyTorch spec (rapo_fast.reference). Import from the modules; this
package re-exports nothing, so that importing one module never pulls in the others.
"""
