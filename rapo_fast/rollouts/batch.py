"""RolloutBatch: what a rollout returns (padded token tensors, per-token kinds, behaviour log-probs, entropies, step
spans, retrievals) and the masks the trainer derives from it.

Token kinds (KIND_PAD 0, KIND_PROMPT 1, KIND_GEN 2, KIND_RET 3, KIND_TOOL 4, KIND_OFF 5) and which enter the loss:
docs/rollout.md section 3.
What this is not: the generation loop (rapo_fast/rollouts/loop.py) or the loss (rapo_fast/loss/policy_loss.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

KIND_PAD, KIND_PROMPT, KIND_GEN, KIND_RET, KIND_TOOL, KIND_OFF = 0, 1, 2, 3, 4, 5


@dataclass
class RolloutBatch:
    """B trajectories, right-padded to T tokens. Shapes:

    input_ids [B, T] int64; attention_mask [B, T] int64; kinds [B, T] int8; behav_logp [B, T] fp32 (log-prob of
    each generated token under the sampling policy, 0 elsewhere); entropy [B, T] fp32 (full-vocabulary entropy of
    the sampling distribution at each generated token, 0 elsewhere); step_spans [S, 3] int64 rows (row, start, end)
    of each generated step's tokens [start, end) (the observation excluded); step_obs_end [S] int64 (end of the step
    including its tool output); retrievals [R, 5] int64 rows (row, span index of the step before or -1 when retrieved
    right after the prompt, span index of the step after or -1, payload id, token count); group_ids [B] int64 (prompt
    query ids); prompt_index [B] int64;
    hybrid [B] bool; parent [B] int64 (ARPO: the row a branch was copied from, -1 otherwise); branch_at [B] int64;
    origin [B, T] int64 (ARPO: a token id shared by every branch holding the same sampled token, -1 for non-generated).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    kinds: torch.Tensor
    behav_logp: torch.Tensor
    entropy: torch.Tensor
    step_spans: torch.Tensor
    step_obs_end: torch.Tensor
    retrievals: torch.Tensor
    group_ids: torch.Tensor
    prompt_index: torch.Tensor
    hybrid: torch.Tensor
    parent: torch.Tensor
    branch_at: torch.Tensor
    origin: torch.Tensor
    prompt_len: torch.Tensor
    completions: list[str]
    mode: str = "exact"
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def loss_mask(self) -> torch.Tensor:
        """[B, T] bool: the tokens in the loss: generated, and the model tokens of whole off-policy trajectories
        (never a retrieved step, tool output, prompt or padding)."""
        return (self.kinds == KIND_GEN) | (self.kinds == KIND_OFF)

    @property
    def retrieved_mask(self) -> torch.Tensor:
        """[B, T] bool: tokens not sampled by the policy that rapo_loss treats as off-policy: retrieved steps (out of
        the loss) and off-policy trajectories' model tokens (in it, trained by offpolicy_train)."""
        return (self.kinds == KIND_RET) | (self.kinds == KIND_OFF)

    @property
    def offpolicy_rows(self) -> torch.Tensor:
        """[B] bool: the rows that are whole off-policy trajectories (trajectory-level off-policy)."""
        return (self.kinds == KIND_OFF).any(1)

    @property
    def response_mask(self) -> torch.Tensor:
        """[B, T] bool: every token after the prompt (generated, retrieved, tool output, off-policy): its length."""
        return (self.kinds >= KIND_GEN) & (self.kinds <= KIND_OFF)

    def retrieved_fraction(self) -> torch.Tensor:
        """F_ret [B] fp32 = retrieved-step tokens / trajectory length (response tokens), the RAPO shaping's F (an
        off-policy trajectory retrieves nothing: 0)."""
        n = self.response_mask.sum(1).clamp_min(1)
        return (self.kinds == KIND_RET).sum(1).float() / n.float()

    def num_retrievals(self) -> torch.Tensor:
        """[B] int64: retrievals per trajectory."""
        out = torch.zeros(self.batch_size, dtype=torch.int64)
        if self.retrievals.numel():
            out.index_add_(0, self.retrievals[:, 0], torch.ones(len(self.retrievals), dtype=torch.int64))
        return out

    def shifted(self) -> dict[str, torch.Tensor]:
        """Next-token alignment for scoring: position t of the outputs predicts token t + 1 of input_ids.

        Returns input_ids / attention_mask [B, T] (the model's input), and targets, loss_mask, retrieved_mask,
        response_mask, behav_logp, entropy, origin, each [B, T - 1].
        """
        return {
            "input_ids": self.input_ids,
            "attention_mask": self.attention_mask,
            "targets": self.input_ids[:, 1:],
            "loss_mask": self.loss_mask[:, 1:],
            "retrieved_mask": self.retrieved_mask[:, 1:],
            "response_mask": self.response_mask[:, 1:],
            "behav_logp": self.behav_logp[:, 1:],
            "entropy": self.entropy[:, 1:],
            "origin": self.origin[:, 1:],
        }

    def step_spans_shifted(self) -> torch.Tensor:
        """step_spans in the coordinates of `shifted()` tensors (token t sits at index t - 1)."""
        s = self.step_spans.clone()
        s[:, 1:] -= 1
        return s

    def to(self, device: torch.device | str) -> RolloutBatch:
        kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return RolloutBatch(**kw)
