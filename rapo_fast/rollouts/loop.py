"""Hybrid-policy, multi-turn, tool-integrated rollouts of a HF causal LM, batched over G per prompt: `rollout()`.

What this is: the generation loop of RAPO. Each prompt gets `group_size` rows; a step ends at a tool call or at <eos>.
Strategies "hybrid" (RAPO: retrieval at step boundaries, mode "exact" or "splice"), "on_policy" (GRPO), "arpo"
(rapo_fast.rollouts.arpo) and "offpolicy_traj"; recorded per token: kind, behaviour log-prob and entropy, step
boundaries, retrievals. The spec is docs/rollout.md (strategies section 2, token kinds section 3, the result section 6).
What this is not: the reward (the environment's verifier, called by the trainer), the loss, or the decoding engine
(rapo_fast.rollouts.engine).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rapo_fast._tokens import encode_plain
from rapo_fast.rollouts.batch import KIND_GEN, KIND_PAD, KIND_PROMPT, KIND_RET, KIND_TOOL, RolloutBatch
from rapo_fast.rollouts.engine import DecodeEngine, sample

STRATEGIES = ("hybrid", "on_policy", "arpo", "offpolicy_traj")
MODES = ("exact", "splice")


class _Row:
    """Python-side state of one trajectory."""

    def __init__(self, prompt_ids: list[int], group: int, pidx: int, hybrid: bool, active: bool):
        n = len(prompt_ids)
        self.tokens, self.kinds = list(prompt_ids), [KIND_PROMPT] * n
        self.logp, self.ent, self.origin = [0.0] * n, [0.0] * n, [-1] * n
        self.cols: list[int] = []
        self.to_feed: list[int] = []
        self.group, self.pidx, self.hybrid, self.active = group, pidx, hybrid, active
        self.done = False
        self.steps: list[list[int]] = []  # [start, end_generated, end_with_observation]
        self.cur_start: int | None = None
        self.n_tool = 0
        self.at_boundary = False
        self.retrievals: list[list[int]] = []  # [index of the step after, payload id, token count]
        self.parent, self.branch_at = -1, -1
        self.prompt_len = n
        self.arpo: dict = {}

    def append(self, ids: list[int], kind: int) -> None:
        """Append tokens the policy did not sample (tool output, a retrieved step): no log-prob, entropy or origin."""
        n = len(ids)
        self.tokens.extend(ids)
        self.kinds.extend([kind] * n)
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


def _check_offpolicy(group_size: int, n_offpolicy, offpolicy) -> None:
    if offpolicy is None:
        raise ValueError("rollout: strategy='offpolicy_traj' needs offpolicy (an OffPolicyTrajectories), got None")
    if not isinstance(n_offpolicy, int) or isinstance(n_offpolicy, bool) or not 1 <= n_offpolicy < group_size:
        raise ValueError(
            f"rollout: n_offpolicy must be an int in [1, group_size={group_size}) for strategy='offpolicy_traj' "
            f"(at least one on-policy member per group), got {n_offpolicy!r}"
        )


def _check_args(group_size, strategy, n_hybrid, retrieve_prob, mode, temperature, max_steps, max_step_tokens, traces):
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"rollout: group_size must be a positive int, got {group_size!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"rollout: strategy must be one of {STRATEGIES}, got {strategy!r}")
    if mode not in MODES:
        raise ValueError(f"rollout: mode must be one of {MODES}, got {mode!r}")
    if not isinstance(n_hybrid, int) or not 0 <= n_hybrid <= group_size:
        raise ValueError(f"rollout: n_hybrid must be an int in [0, group_size={group_size}], got {n_hybrid!r}")
    if not callable(retrieve_prob) and not 0.0 <= float(retrieve_prob) <= 1.0:
        raise ValueError(f"rollout: retrieve_prob must be in [0, 1] or a callable of the step, got {retrieve_prob!r}")
    if strategy == "hybrid" and n_hybrid > 0 and traces is None:
        raise ValueError("rollout: strategy='hybrid' with n_hybrid > 0 needs traces (a StepTraces), got None")
    if temperature < 0:
        raise ValueError(f"rollout: temperature must be >= 0 (0 = greedy), got {temperature!r}")
    for name, v in (("max_steps", max_steps), ("max_step_tokens", max_step_tokens)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"rollout: {name} must be a positive int, got {v!r}")


@torch.no_grad()
def rollout(
    model: torch.nn.Module,
    tokenizer,
    env,
    problems: Sequence,
    *,
    group_size: int = 16,
    strategy: str = "hybrid",
    n_hybrid: int = 8,
    retrieve_prob: float | Callable[[int], float] = 0.5,
    traces=None,
    exclude_own_group: bool | None = None,
    mode: str = "exact",
    temperature: float = 1.0,
    max_steps: int = 6,
    max_step_tokens: int = 24,
    generator: torch.Generator | None = None,
    seed: int | None = None,
    arpo_initial: int | None = None,
    arpo_beam: int = 2,
    arpo_k: int = 20,
    arpo_alpha: float = 0.5,
    arpo_beta: float = 0.2,
    arpo_rule: str = "paper",
    arpo_topk: int = 10,
    n_offpolicy: int = 0,
    offpolicy=None,
) -> RolloutBatch:
    """Roll out `group_size` trajectories for each problem; see the module docstring.

    Args: model (HF causal LM), tokenizer (encode/decode, pad/bos/eos ids, the special tokens of tiny_policy), env
    (`execute(call_text) -> observation text`, `prompt` attribute of each problem, `qid` its group id), traces (a
    StepTraces for hybrid rollouts), exclude_own_group (None: exclude exactly when the buffer holds on-policy steps),
    generator (torch.Generator for token sampling; `seed` seeds the retrieval/branching coin flips, default drawn
    from the generator). ARPO (strategy="arpo"): arpo_rule "paper" or "released" (rapo_fast/rollouts/arpo.py), with
    arpo_alpha / arpo_beta the released code's branch_probability / entropy_weight under "released", arpo_k its
    first-k tokens (20) and arpo_topk its top-k log-probs (10). Trajectory-level off-policy
    (strategy="offpolicy_traj"): `n_offpolicy` members of each group are whole trajectories of `offpolicy` (an
    OffPolicyTrajectories: the top-K of the step buffer's JSONL source for that prompt, drawn by the coin; a prompt
    without any keeps all its members on-policy), appended after the on-policy rows. Returns a RolloutBatch on the
    CPU.
    """
    _check_args(group_size, strategy, n_hybrid, retrieve_prob, mode, temperature, max_steps, max_step_tokens, traces)
    if strategy == "offpolicy_traj":
        _check_offpolicy(group_size, n_offpolicy, offpolicy)
    t_start = time.perf_counter()
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        generator, coin = _random_sources(generator, seed)
        n_init = group_size if strategy != "arpo" else (arpo_initial or max(1, group_size // 2))
        picks = [offpolicy.pick(p.qid, n_offpolicy, coin) if strategy == "offpolicy_traj" else [] for p in problems]
        sizes = [group_size - len(pk) for pk in picks]
        rows = _make_rows(tokenizer, problems, sizes, n_hybrid if strategy == "hybrid" else 0, n_init)
        engine = DecodeEngine(model, len(rows), device)
        loop = _Lockstep(
            engine,
            rows,
            tokenizer,
            env,
            traces=traces,
            mode=mode,
            retrieve_prob=retrieve_prob,
            exclude=traces is not None and (traces.has_on_policy if exclude_own_group is None else exclude_own_group),
            temperature=temperature,
            max_steps=max_steps,
            max_step_tokens=max_step_tokens,
            generator=generator,
            coin=coin,
        )
        loop.prefill()
        if strategy == "arpo":
            from rapo_fast.rollouts.arpo import ArpoBrancher

            loop.arpo = ArpoBrancher(
                rows, engine, group_size, n_init, arpo_beam, arpo_k, arpo_alpha, arpo_beta, coin,
                rule=arpo_rule, topk=arpo_topk, temperature=temperature,
            )  # fmt: skip
        loop.run()
        rows += _offpolicy_rows(tokenizer, problems, picks)
    finally:
        if was_training:
            model.train()
    return _finish(rows, tokenizer, mode, loop.timings | {"total": time.perf_counter() - t_start})


def _random_sources(generator: torch.Generator | None, seed: int | None) -> tuple[torch.Generator, random.Random]:
    """The token sampler's generator (a fresh one seeded from torch's global RNG when None) and the coin of the
    retrieval/branching decisions (seeded by `seed`, or by a draw from the generator)."""
    if generator is None:
        generator = torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,)).item()))
    coin = random.Random(int(torch.randint(0, 2**62, (1,), generator=generator).item()) if seed is None else seed)
    return generator, coin


def _prompt_ids(tokenizer, prob) -> list[int]:
    ids = tokenizer.encode(prob.prompt)
    if not ids or ids[0] != tokenizer.bos_token_id:
        ids = [tokenizer.bos_token_id] + ids  # column 0 must be <bos> for every row (engine invariant)
    return ids


def _make_rows(tokenizer, problems: Sequence, sizes: list[int], n_hybrid: int, n_init: int) -> list[_Row]:
    """sizes[i] generated rows for problem i: the first `n_hybrid` of a group hybrid, the first `n_init` started."""
    rows: list[_Row] = []
    for pi, (prob, size) in enumerate(zip(problems, sizes)):
        ids = _prompt_ids(tokenizer, prob)
        for g in range(size):
            rows.append(_Row(ids, int(prob.qid), pi, g < n_hybrid, g < n_init))
    if not rows:
        raise ValueError("rollout: problems is empty")
    return rows


def _offpolicy_rows(tokenizer, problems: Sequence, picks: list[list[dict]]) -> list[_Row]:
    """The whole off-policy trajectories of each problem as finished rows (never fed to the model: the trainer scores
    them with the current policy like every row)."""
    from rapo_fast.rollouts.offpolicy import trajectory_tokens

    out = []
    for pi, (prob, records) in enumerate(zip(problems, picks)):
        for rec in records:
            r = _Row(_prompt_ids(tokenizer, prob), int(prob.qid), pi, False, True)
            ids, kinds, steps = trajectory_tokens(rec, tokenizer)
            base = len(r.tokens)
            r.tokens += ids
            r.kinds += kinds
            r.logp += [0.0] * len(ids)
            r.ent += [0.0] * len(ids)
            r.origin += [-1] * len(ids)
            r.steps = [[a + base, b + base, c + base] for a, b, c in steps]
            r.done = True
            out.append(r)
    return out


@dataclass
class _Lockstep:
    """The lockstep loop of one rollout. Each iteration: (1) retrieval for hybrid rows at a step boundary, (2) one
    sampled token for every live row with nothing queued (running the tool when a call closes), (3) one model call
    over everything queued. `arpo` (an ArpoBrancher) is consulted around sampling and restarts rows when all ended."""

    engine: DecodeEngine
    rows: list[_Row]
    tokenizer: Any
    env: Any
    traces: Any
    mode: str
    retrieve_prob: float | Callable[[int], float]
    exclude: bool
    temperature: float
    max_steps: int
    max_step_tokens: int
    generator: torch.Generator
    coin: random.Random
    arpo: Any = None
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
            self._retrieve_at_boundaries(live)
            self._sample(live)
            self._feed_queued()

    def _live_rows(self) -> list[int]:
        """Indices of the started rows not yet done; when none are left, ARPO may start fresh ones first."""
        live = [i for i, r in enumerate(self.rows) if r.active and not r.done]
        if not live and self.arpo is not None and self.arpo.refresh():
            live = [i for i, r in enumerate(self.rows) if r.active and not r.done]
        return live

    def _retrieve_at_boundaries(self, live: list[int]) -> None:
        """A hybrid row just past a tool result retrieves with probability retrieve_prob(step). Never before step 0:
        at_boundary is only set by a tool result."""
        cand = []
        for i in live:
            r = self.rows[i]
            if r.at_boundary and r.hybrid:
                p = self.retrieve_prob(len(r.steps)) if callable(self.retrieve_prob) else self.retrieve_prob
                if self.coin.random() < p:
                    cand.append(i)
            r.at_boundary = False
        if cand:
            self._retrieve(cand)

    def _retrieve(self, cand: list[int]) -> None:
        """Top-1 step for each candidate row's history, queued (exact mode) or spliced into the cache (splice)."""
        t0 = time.perf_counter()
        hist = [self.tokenizer.decode(self.rows[i].tokens) for i in cand]
        segs, pids, _ = self.traces.retrieve(hist, [self.rows[i].group for i in cand] if self.exclude else None)
        self.timings["retrieval"] += time.perf_counter() - t0
        spliced = []
        for i, seg, pid in zip(cand, segs, pids.tolist()):
            if seg is None:
                continue
            r = self.rows[i]
            r.retrievals.append([len(r.steps), pid, len(seg)])
            if self.mode == "splice":
                spliced.append((i, seg, pid))
            else:
                r.append(seg, KIND_RET)
                r.to_feed.extend(seg)
        if spliced:
            from rapo_fast.rollouts.splice import splice_segments

            t0 = time.perf_counter()
            splice_segments(self.engine, self.rows, spliced, self.traces)
            self.timings["splice"] += time.perf_counter() - t0

    def _sample(self, live: list[int]) -> None:
        """One token for each live row with nothing queued, from its last next-token logits."""
        samp = [i for i in live if not self.rows[i].to_feed]
        if not samp:
            return
        if self.arpo is not None:
            self.arpo.before_sample(samp)
        tok, lp, ent = sample(self.engine.last_logits[samp], self.temperature, self.generator)
        for i, t, l_, e in zip(samp, tok.tolist(), lp.tolist(), ent.tolist()):
            self._take_token(self.rows[i], t, l_, e)
        if self.arpo is not None:
            self.arpo.after_sample(samp)

    def _take_token(self, r: _Row, t: int, logp: float, ent: float) -> None:
        """Record a sampled token; `</tool>` ends a tool step, <eos> or the step's token budget ends the answer."""
        if r.cur_start is None:
            r.cur_start = len(r.tokens)
        r.append_sampled(t, logp, ent, self.next_origin)
        self.next_origin += 1
        if t == self.tool_end:
            self._end_tool_step(r)
        elif t == self.eos or len(r.tokens) - r.cur_start >= self.max_step_tokens:
            r.steps.append([r.cur_start, len(r.tokens), len(r.tokens)])
            r.cur_start = None
            r.done = True

    def _end_tool_step(self, r: _Row) -> None:
        """Run the step's tool call and queue its output; past `max_steps` tool calls the trajectory ends instead."""
        end = len(r.tokens)
        r.n_tool += 1
        if r.n_tool > self.max_steps:
            r.steps.append([r.cur_start, end, end])
            r.done = True
            return
        call = _last_call(r.tokens, self.tool_open, r.cur_start)
        t0 = time.perf_counter()
        obs = encode_plain(self.tokenizer, self.env.execute(self.tokenizer.decode(call)))  # mid-rollout: no BOS
        self.timings["tool"] += time.perf_counter() - t0
        r.append(obs, KIND_TOOL)
        r.to_feed.extend(obs)
        r.steps.append([r.cur_start, end, len(r.tokens)])
        r.cur_start = None
        r.at_boundary = True

    def _feed_queued(self) -> None:
        """One model call over every row's queued tokens (done rows need no further model calls)."""
        for r in self.rows:
            if r.done:
                r.to_feed = []
        if any(r.to_feed for r in self.rows):
            _feed(self.engine, self.rows, [r.to_feed for r in self.rows], self.pad)
            for r in self.rows:
                r.to_feed = []


def _finish(rows: list[_Row], tokenizer, mode: str, timings: dict[str, float]) -> RolloutBatch:
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


def _feed(engine: DecodeEngine, rows: list[_Row], seqs: list[list[int]], pad: int) -> None:
    L = max(len(s) for s in seqs)
    tok = torch.full((len(rows), L), pad, dtype=torch.long)
    valid = torch.zeros(len(rows), L, dtype=torch.bool)
    for i, s in enumerate(seqs):
        if s:
            tok[i, : len(s)] = torch.tensor(s)
            valid[i, : len(s)] = True
    col0 = int(engine.feed(tok, valid))
    for r, s in zip(rows, seqs):
        r.cols.extend(range(col0, col0 + len(s)))


def _collate(rows: list[_Row], pad: int, mode: str) -> RolloutBatch:
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
            rets.append([b, base + after - 1, base + after if after < len(r.steps) else -1, pid, ntok])
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
