"""The Python-side state of one trajectory of a rollout: `Row`, and `RowState`, the one place its life is recorded.

What this is: a row's recorded tokens and per-token facts, the methods that append to them, snapshot / restore (ARPO's
branches) and one explicit `RowState` in place of separate active / done / at-boundary flags.
What this is not: the loop that advances rows (rapo_fast/rollouts/loop.py) or a strategy's decisions
(rapo_fast/rollouts/strategies.py).
"""

from __future__ import annotations

import enum

from rapo_fast.rollouts.batch import KIND_GEN, KIND_PROMPT

__all__ = ["Row", "RowState", "prompt_ids"]


class RowState(enum.Enum):
    IDLE = "idle"  # a slot not started yet (ARPO starts rows as branches or fresh rollouts)
    RUNNING = "running"  # live: samples its next token or feeds queued ones
    BOUNDARY = "boundary"  # live, just past a tool result: a hybrid row may retrieve before its next token
    DONE = "done"  # answered, out of budget, or a whole off-policy trajectory: no further model calls


class Row:
    """Python-side state of one trajectory (see the module docstring)."""

    def __init__(self, prompt_ids: list[int], group: int, pidx: int, hybrid: bool, state: RowState):
        n = len(prompt_ids)
        self.tokens, self.kinds = list(prompt_ids), [KIND_PROMPT] * n
        self.logp, self.ent, self.origin = [0.0] * n, [0.0] * n, [-1] * n
        self.cols: list[int] = []
        self.to_feed: list[int] = []
        self.group, self.pidx, self.hybrid, self.state = group, pidx, hybrid, state
        self.steps: list[list[int]] = []  # [start, end_generated, end_with_observation]
        self.cur_start: int | None = None
        self.n_tool = 0
        self.retrievals: list[list[int]] = []  # [index of the step after, payload id, token count]
        self.parent, self.branch_at = -1, -1
        self.prompt_len = n
        self.arpo: dict = {}

    @property
    def active(self) -> bool:
        """Started (live or done): the row is a trajectory of the batch."""
        return self.state is not RowState.IDLE

    @property
    def done(self) -> bool:
        return self.state is RowState.DONE

    @property
    def live(self) -> bool:
        return self.state is RowState.RUNNING or self.state is RowState.BOUNDARY

    def start(self) -> None:
        """Make the row live (a fresh ARPO rollout, or a branch just restored from its parent's snapshot)."""
        self.state = RowState.RUNNING

    def append(self, ids: list[int], kind: int | list[int]) -> None:
        """Append tokens the policy did not sample (tool output, a retrieved step, an off-policy trajectory): no
        log-prob, entropy or origin. `kind`: one kind for every token, or a list of one per token."""
        n = len(ids)
        kinds = [kind] * n if isinstance(kind, int) else list(kind)
        if len(kinds) != n:
            raise ValueError(f"Row.append: kinds: expected one per token ({n}), got {len(kinds)}")
        self.tokens.extend(ids)
        self.kinds.extend(kinds)
        self.logp.extend([0.0] * n)
        self.ent.extend([0.0] * n)
        self.origin.extend([-1] * n)

    def append_sampled(self, token: int, logp: float, ent: float, origin: int) -> None:
        """Append a token the policy sampled (in the loss) and queue it for the next model call."""
        self.tokens.append(token)
        self.kinds.append(KIND_GEN)
        self.logp.append(logp)
        self.ent.append(ent)
        self.origin.append(origin)
        self.to_feed.append(token)

    def snapshot(self) -> dict:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in self.__dict__.items() if k != "arpo"} | {
            "steps": [list(s) for s in self.steps],
            "retrievals": [list(r) for r in self.retrievals],
        }

    def restore(self, snap: dict) -> None:
        for k, v in snap.items():
            setattr(self, k, list(v) if isinstance(v, list) else v)
        self.steps = [list(s) for s in snap["steps"]]
        self.retrievals = [list(r) for r in snap["retrievals"]]


def prompt_ids(tokenizer, prob) -> list[int]:
    """The prompt's token ids: `prob.prompt_ids` when the problem carries them (a chat-templated prompt: the template
    places its own special tokens), else its text encoded, starting with <bos> when the tokenizer has one. Column 0
    must be a real token in every row (an engine invariant); without <bos> (Qwen's tokenizers) it is the prompt's
    first token, which is never padding: prompts are fed from column 0 on, padded on the right."""
    ids = getattr(prob, "prompt_ids", None)
    if ids is None:
        ids = list(tokenizer.encode(prob.prompt))
        bos = tokenizer.bos_token_id
        if bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
    if not ids:
        raise ValueError(f"rollout: problems: expected a prompt of >= 1 token, got none for qid={prob.qid}")
    return list(ids)
