"""Hybrid-policy, multi-turn, tool-integrated rollouts of a HF causal LM, batched over G per prompt: `rollout()`.

What this is: the generation loop of RAPO; the strategy's hooks (rapo_fast/rollouts/strategies.py) decide what each
row does, and the rows live in rapo_fast/rollouts/rows.py. The spec is docs/rollout.md (strategies section 2, token
kinds section 3, the result section 6).
What this is not: the reward, the loss, or the decoding engine (rapo_fast.rollouts.engine).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rapo_fast._tokens import encode_plain
from rapo_fast.rollouts.batch import KIND_PAD, KIND_TOOL, RolloutBatch
from rapo_fast.rollouts.config import MODES, STRATEGIES, RolloutConfig
from rapo_fast.rollouts.engine import DecodeEngine, sample
from rapo_fast.rollouts.rows import Row, RowState, prompt_ids
from rapo_fast.rollouts.strategies import RolloutStrategy, strategy_for

__all__ = ["rollout", "RolloutConfig", "STRATEGIES", "MODES"]


@torch.no_grad()
def rollout(
    model: torch.nn.Module,
    tokenizer,
    env,
    problems: Sequence,
    cfg: RolloutConfig | None = None,
    *,
    traces=None,
    offpolicy=None,
    generator: torch.Generator | None = None,
    seed: int | None = None,
) -> RolloutBatch:
    """Roll out `cfg.group_size` trajectories for each problem (docs/rollout.md).

    model (HF causal LM), tokenizer (encode/decode, pad/bos/eos ids, the special tokens of tiny_policy), env
    (`execute(call_text) -> observation text`, `prompt` attribute of each problem, `qid` its group id), cfg (a
    RolloutConfig: strategy, mode, budgets and each strategy's sub-config; None: the defaults). The run's resources
    and random sources: traces (a StepTraces, for hybrid rows), offpolicy (an OffPolicyTrajectories, for strategy
    "offpolicy_traj": its top-K trajectories of each prompt, drawn by the coin), generator (torch.Generator for token
    sampling), seed (seeds the retrieval/branching coin; default: a draw from the generator). Returns a RolloutBatch
    on the CPU.
    """
    if cfg is None:
        cfg = RolloutConfig()
    elif not isinstance(cfg, RolloutConfig):
        raise TypeError(f"rollout: cfg: expected a RolloutConfig, got {type(cfg).__name__}")
    strategy = strategy_for(cfg, traces=traces, offpolicy=offpolicy)
    t_start = time.perf_counter()
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        generator, coin = _random_sources(generator, seed)
        sizes = strategy.plan(problems, coin)
        rows = _make_rows(tokenizer, problems, sizes, strategy.n_hybrid, cfg.n_initial)
        engine = DecodeEngine(model, len(rows), device)
        loop = _Lockstep(engine, rows, tokenizer, env, strategy, cfg, generator=generator, coin=coin)
        loop.prefill()
        strategy.start(loop)
        loop.run()
        rows += strategy.extra_rows(tokenizer, problems)
    finally:
        if was_training:
            model.train()
    return _finish(rows, tokenizer, cfg.mode, loop.timings | {"total": time.perf_counter() - t_start})


def _random_sources(generator: torch.Generator | None, seed: int | None) -> tuple[torch.Generator, random.Random]:
    """The token sampler's generator (a fresh one seeded from torch's global RNG when None) and the coin of the
    retrieval/branching decisions (seeded by `seed`, or by a draw from the generator)."""
    if generator is None:
        generator = torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,)).item()))
    coin = random.Random(int(torch.randint(0, 2**62, (1,), generator=generator).item()) if seed is None else seed)
    return generator, coin


def _make_rows(tokenizer, problems: Sequence, sizes: list[int], n_hybrid: int, n_init: int) -> list[Row]:
    """sizes[i] generated rows for problem i: the first `n_hybrid` of a group hybrid, the first `n_init` started."""
    rows: list[Row] = []
    for pi, (prob, size) in enumerate(zip(problems, sizes)):
        ids = prompt_ids(tokenizer, prob)
        for g in range(size):
            state = RowState.RUNNING if g < n_init else RowState.IDLE
            rows.append(Row(ids, int(prob.qid), pi, g < n_hybrid, state))
    if not rows:
        raise ValueError("rollout: problems: expected at least one problem, got none")
    return rows


@dataclass
class _Lockstep:
    """The lockstep loop of one rollout. Each iteration: (1) the strategy acts on the rows at a tool-result boundary
    (hybrid: retrieval), (2) one sampled token for every live row with nothing queued (running the tool when a call
    closes), the strategy called before and after (ARPO: branching), (3) one model call over everything queued. When
    no row is live the strategy may start more (ARPO's fresh rollouts). Row life is a RowState."""

    engine: DecodeEngine
    rows: list[Row]
    tokenizer: Any
    env: Any
    strategy: RolloutStrategy
    cfg: RolloutConfig
    generator: torch.Generator
    coin: random.Random
    timings: dict[str, float] = field(default_factory=lambda: {"retrieval": 0.0, "splice": 0.0, "tool": 0.0})
    next_origin: int = 0  # ARPO's shared token ids: one per sampled token, copied with a branch's prefix

    def __post_init__(self) -> None:
        self.tool_end = self.tokenizer.convert_tokens_to_ids("</tool>")
        self.tool_open = self.tokenizer.convert_tokens_to_ids("<tool>")
        self.eos, self.pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id

    def prefill(self) -> None:
        """Feed every row's prompt (the same columns for all rows, padding masked)."""
        _feed(self.engine, self.rows, [r.tokens for r in self.rows], self.pad)
        for r in self.rows:
            r.to_feed = []

    def run(self) -> None:
        while live := self._live_rows():
            self._compact()
            self._at_boundaries(live)
            self._sample(live)
            self._feed_queued()

    def _compact(self) -> None:
        """Drop finished rows and unused columns from the engine once they are a quarter of its rows or half of its
        columns: otherwise every model call runs every row ever started over every column any row used (a few long
        rows, e.g. those with retrieved steps, would keep the whole batch and its widest cache going). Only the cost
        changes: the rows' tokens, log-probs and entropies agree up to float rounding (DecodeEngine.compact)."""
        if self.strategy.reuses_rows:
            return
        eng = self.engine
        held = eng.held.tolist()
        keep = [i for i in held if not self.rows[i].done]
        widest = max(len(self.rows[i].cols) for i in keep) if keep else 0
        if not keep or (4 * (len(held) - len(keep)) < len(held) and eng.num_columns < 2 * widest):
            return
        if eng.compact(keep):
            for i in keep:  # the row's columns, moved to the front in order
                self.rows[i].cols = list(range(len(self.rows[i].cols)))

    def _live_rows(self) -> list[int]:
        """Indices of the live rows; when none are left, the strategy may start fresh ones first."""
        live = [i for i, r in enumerate(self.rows) if r.live]
        if not live and self.strategy.refresh():
            live = [i for i, r in enumerate(self.rows) if r.live]
        return live

    def _at_boundaries(self, live: list[int]) -> None:
        """The strategy sees the rows just past a tool result (and, for a hybrid strategy with at_prompt, the rows
        just past their prompt), which then run on."""
        at = [i for i in live if self.rows[i].state is RowState.BOUNDARY]
        if at:
            self.strategy.at_boundaries(self, at)
            for i in at:
                self.rows[i].state = RowState.RUNNING

    def _sample(self, live: list[int]) -> None:
        """One token for each live row with nothing queued, from its last next-token logits."""
        samp = [i for i in live if not self.rows[i].to_feed]
        if not samp:
            return
        self.strategy.before_sample(samp)
        tok, lp, ent = sample(self.engine.last_logits[samp], self.cfg.temperature, self.generator)
        for i, t, l_, e in zip(samp, tok.tolist(), lp.tolist(), ent.tolist()):
            self._take_token(self.rows[i], t, l_, e)
        self.strategy.after_sample(samp)

    def _take_token(self, r: Row, t: int, logp: float, ent: float) -> None:
        """Record a sampled token; `</tool>` ends a tool step, <eos> or the step's token budget ends the answer."""
        if r.cur_start is None:
            r.cur_start = len(r.tokens)
        r.append_sampled(t, logp, ent, self.next_origin)
        self.next_origin += 1
        if t == self.tool_end:
            self._end_tool_step(r)
        elif t == self.eos or len(r.tokens) - r.cur_start >= self.cfg.max_step_tokens:
            r.steps.append([r.cur_start, len(r.tokens), len(r.tokens)])
            r.cur_start = None
            r.state = RowState.DONE

    def _end_tool_step(self, r: Row) -> None:
        """Run the step's tool call and queue its output; past `max_steps` tool calls the trajectory ends instead."""
        end = len(r.tokens)
        r.n_tool += 1
        if r.n_tool > self.cfg.max_steps:
            r.steps.append([r.cur_start, end, end])
            r.state = RowState.DONE
            return
        call = _last_call(r.tokens, self.tool_open, r.cur_start)
        t0 = time.perf_counter()
        obs = encode_plain(self.tokenizer, self.env.execute(self.tokenizer.decode(call)))  # mid-rollout: no BOS
        self.timings["tool"] += time.perf_counter() - t0
        r.append(obs, KIND_TOOL)
        r.to_feed.extend(obs)
        r.steps.append([r.cur_start, end, len(r.tokens)])
        r.cur_start = None
        r.state = RowState.BOUNDARY

    def _feed_queued(self) -> None:
        """One model call over every row's queued tokens (done rows need no further model calls)."""
        for r in self.rows:
            if r.done:
                r.to_feed = []
        if any(r.to_feed for r in self.rows):
            _feed(self.engine, self.rows, [r.to_feed for r in self.rows], self.pad)
            for r in self.rows:
                r.to_feed = []


def _finish(rows: list[Row], tokenizer, mode: str, timings: dict[str, float]) -> RolloutBatch:
    """The batch of the rows that ran (ARPO slots never used are not trajectories), parents renumbered."""
    keep = [i for i, r in enumerate(rows) if r.active]
    new_index = {old: new for new, old in enumerate(keep)}
    rows = [rows[i] for i in keep]
    for r in rows:
        r.parent = new_index.get(r.parent, -1)
    batch = _collate(rows, tokenizer.pad_token_id, mode)
    batch.completions = [tokenizer.decode(r.tokens[r.prompt_len :]) for r in rows]
    batch.timings = timings
    return batch


def _last_call(tokens: list[int], tool_open: int, step_start: int) -> list[int]:
    """The tokens between the step's last <tool> and the closing </tool> (exclusive); empty without a <tool>."""
    for j in range(len(tokens) - 2, step_start - 1, -1):
        if tokens[j] == tool_open:
            return tokens[j + 1 : -1]
    return []


def _feed(engine: DecodeEngine, rows: list[Row], seqs: list[list[int]], pad: int) -> None:
    L = max(len(s) for s in seqs)
    # one tensor from one list (a tensor per row costs more than the model call on a small batch)
    tok = torch.tensor([t for s in seqs for t in (*s, *[pad] * (L - len(s)))], dtype=torch.long).view(len(rows), L)
    valid = torch.arange(L)[None, :] < torch.tensor([len(s) for s in seqs])[:, None]
    col0 = int(engine.feed(tok, valid))
    for r, s in zip(rows, seqs):
        r.cols.extend(range(col0, col0 + len(s)))


def _collate(rows: list[Row], pad: int, mode: str) -> RolloutBatch:
    B, T = len(rows), max(len(r.tokens) for r in rows)
    ids = torch.full((B, T), pad, dtype=torch.long)
    kinds = torch.full((B, T), KIND_PAD, dtype=torch.int8)
    logp, ent = torch.zeros(B, T), torch.zeros(B, T)
    origin = torch.full((B, T), -1, dtype=torch.long)
    spans, obs_end, rets = [], [], []
    for b, r in enumerate(rows):
        n = len(r.tokens)
        ids[b, :n] = torch.tensor(r.tokens)
        kinds[b, :n] = torch.tensor(r.kinds, dtype=torch.int8)
        logp[b, :n] = torch.tensor(r.logp)
        ent[b, :n] = torch.tensor(r.ent)
        origin[b, :n] = torch.tensor(r.origin)
        base = len(spans)
        for s in r.steps:
            spans.append([b, s[0], s[1]])
            obs_end.append(s[2])
        for after, pid, ntok in r.retrievals:
            # a retrieval inserted before step `after`; the step before it is after - 1 (step 0 never retrieves)
            before = base + after - 1 if after > 0 else -1  # retrieved right after the prompt: no step before
            rets.append([b, before, base + after if after < len(r.steps) else -1, pid, ntok])
    return RolloutBatch(
        input_ids=ids,
        attention_mask=(kinds != KIND_PAD).long(),
        kinds=kinds,
        behav_logp=logp,
        entropy=ent,
        step_spans=torch.tensor(spans, dtype=torch.long).reshape(-1, 3),
        step_obs_end=torch.tensor(obs_end, dtype=torch.long),
        retrievals=torch.tensor(rets, dtype=torch.long).reshape(-1, 5),
        group_ids=torch.tensor([r.group for r in rows], dtype=torch.long),
        prompt_index=torch.tensor([r.pidx for r in rows], dtype=torch.long),
        hybrid=torch.tensor([r.hybrid for r in rows]),
        parent=torch.tensor([r.parent for r in rows], dtype=torch.long),
        branch_at=torch.tensor([r.branch_at for r in rows], dtype=torch.long),
        origin=origin,
        prompt_len=torch.tensor([r.prompt_len for r in rows], dtype=torch.long),
        completions=[],
        mode=mode,
    )
