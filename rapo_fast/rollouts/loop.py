"""rapo_fast.rollouts.loop: hybrid-policy, multi-turn, tool-integrated rollouts of a HF causal LM, batched over G per
prompt.

What this is: the generation loop of RAPO (DESIGN.md section 2). Each prompt gets `group_size` rows; a step ends at a
tool call (`</tool>`: the environment's output is appended as non-trainable tool tokens) or at <eos> (the answer).
Strategies:
- "hybrid" (RAPO): the first `n_hybrid` rows of each group are hybrid. Step 0 is always on-policy; before each later
  step of a hybrid row, with probability `retrieve_prob` (a float or a callable of the step index) the history is
  encoded, the step buffer is searched (top-1; excluding the prompt's own group when the buffer holds on-policy steps),
  and the retrieved step is inserted between <retrieve> and </retrieve>; the policy then generates the next step.
  mode="exact" runs the model over the inserted tokens; mode="splice" appends their cached K/V rotated to the row's
  positions (rapo_fast.rollouts.splice) and runs the model over the closing </retrieve> only.
- "on_policy": plain GRPO sampling (no retrieval).
- "arpo": ARPO's entropy-adaptive branching (rapo_fast.rollouts.arpo).
Recorded per token: kind (generated / retrieved / tool / prompt), behaviour log-prob and entropy of each generated
token, step boundaries, retrievals. What this is not: the reward (the environment's verifier, called by the trainer)
or the loss.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

import torch

from rapo_fast.rollouts.batch import KIND_GEN, KIND_PAD, KIND_PROMPT, KIND_RET, KIND_TOOL, RolloutBatch
from rapo_fast.rollouts.engine import DecodeEngine, sample

STRATEGIES = ("hybrid", "on_policy", "arpo")
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

    def snapshot(self) -> dict:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in self.__dict__.items() if k != "arpo"} | {
            "steps": [list(s) for s in self.steps], "retrievals": [list(r) for r in self.retrievals]}

    def restore(self, snap: dict) -> None:
        for k, v in snap.items():
            setattr(self, k, list(v) if isinstance(v, list) else v)
        self.steps = [list(s) for s in snap["steps"]]
        self.retrievals = [list(r) for r in snap["retrievals"]]


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
) -> RolloutBatch:
    """Roll out `group_size` trajectories for each problem; see the module docstring.

    Args: model (HF causal LM), tokenizer (encode/decode, pad/bos/eos ids, the special tokens of tiny_policy), env
    (`execute(call_text) -> observation text`, `prompt` attribute of each problem, `qid` its group id), traces (a
    StepTraces for hybrid rollouts), exclude_own_group (None: exclude exactly when the buffer holds on-policy steps),
    generator (torch.Generator for token sampling; `seed` seeds the retrieval/branching coin flips, default drawn
    from the generator). Returns a RolloutBatch on the CPU.
    """
    _check_args(group_size, strategy, n_hybrid, retrieve_prob, mode, temperature, max_steps, max_step_tokens, traces)
    t_start = time.perf_counter()
    timings = {"retrieval": 0.0, "splice": 0.0, "tool": 0.0}
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    if generator is None:
        generator = torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,)).item()))
    coin = random.Random(int(torch.randint(0, 2**62, (1,), generator=generator).item()) if seed is None else seed)
    tool_end = tokenizer.convert_tokens_to_ids("</tool>")
    tool_open = tokenizer.convert_tokens_to_ids("<tool>")
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id
    G = group_size
    n_init = G if strategy != "arpo" else (arpo_initial or max(1, G // 2))
    rows: list[_Row] = []
    for pi, prob in enumerate(problems):
        ids = tokenizer.encode(prob.prompt)
        if not ids or ids[0] != tokenizer.bos_token_id:
            ids = [tokenizer.bos_token_id] + ids  # column 0 must be <bos> for every row (engine invariant)
        for g in range(G):
            rows.append(_Row(ids, int(prob.qid), pi, strategy == "hybrid" and g < n_hybrid, g < n_init))
    B = len(rows)
    if B == 0:
        raise ValueError("rollout: problems is empty")
    engine = DecodeEngine(model, B, device)
    _feed(engine, rows, [r.tokens for r in rows], pad)
    for r in rows:
        r.to_feed = []
    exclude = traces is not None and (traces.has_on_policy if exclude_own_group is None else exclude_own_group)
    arpo = None
    if strategy == "arpo":
        from rapo_fast.rollouts.arpo import ArpoBrancher

        arpo = ArpoBrancher(rows, engine, G, n_init, arpo_beam, arpo_k, arpo_alpha, arpo_beta, coin)
    token_counter = [0]

    while True:
        live = [i for i, r in enumerate(rows) if r.active and not r.done]
        if not live and (arpo is None or not arpo.refresh()):
            break
        live = [i for i, r in enumerate(rows) if r.active and not r.done]
        # 1. retrieval before a hybrid row's next step (never before step 0: at_boundary is set by a tool result)
        cand = []
        for i in live:
            r = rows[i]
            if r.at_boundary and r.hybrid:
                p = retrieve_prob(len(r.steps)) if callable(retrieve_prob) else retrieve_prob
                if coin.random() < p:
                    cand.append(i)
            r.at_boundary = False
        if cand:
            _retrieve(engine, rows, cand, traces, tokenizer, exclude, mode, timings)
        # 2. sample for rows with nothing queued
        samp = [i for i in live if not rows[i].to_feed]
        if samp:
            if arpo is not None:
                arpo.before_sample(samp)
            tok, lp, ent = sample(engine.last_logits[samp], temperature, generator)
            for i, t, l_, e in zip(samp, tok.tolist(), lp.tolist(), ent.tolist()):
                r = rows[i]
                if r.cur_start is None:
                    r.cur_start = len(r.tokens)
                r.tokens.append(t)
                r.kinds.append(KIND_GEN)
                r.logp.append(l_)
                r.ent.append(e)
                r.origin.append(token_counter[0])
                token_counter[0] += 1
                r.to_feed.append(t)
                n_step = len(r.tokens) - r.cur_start
                if t == tool_end:
                    end = len(r.tokens)
                    r.n_tool += 1
                    if r.n_tool > max_steps:
                        r.steps.append([r.cur_start, end, end])
                        r.done = True
                        continue
                    call = _last_call(r.tokens, tool_open, r.cur_start)
                    t0 = time.perf_counter()
                    obs = tokenizer.encode(env.execute(tokenizer.decode(call)))
                    timings["tool"] += time.perf_counter() - t0
                    for o in obs:
                        r.tokens.append(o)
                        r.kinds.append(KIND_TOOL)
                        r.logp.append(0.0)
                        r.ent.append(0.0)
                        r.origin.append(-1)
                    r.to_feed.extend(obs)
                    r.steps.append([r.cur_start, end, len(r.tokens)])
                    r.cur_start = None
                    r.at_boundary = True
                elif t == eos or n_step >= max_step_tokens:
                    r.steps.append([r.cur_start, len(r.tokens), len(r.tokens)])
                    r.cur_start = None
                    r.done = True
            if arpo is not None:
                arpo.after_sample(samp)
        # 3. feed everything queued (done rows need no further model calls)
        for r in rows:
            if r.done:
                r.to_feed = []
        if any(r.to_feed for r in rows):
            _feed(engine, rows, [r.to_feed for r in rows], pad)
            for r in rows:
                r.to_feed = []
    if was_training:
        model.train()
    keep = [i for i, r in enumerate(rows) if r.active]  # ARPO slots never used are not trajectories
    new_index = {old: new for new, old in enumerate(keep)}
    rows = [rows[i] for i in keep]
    for r in rows:
        r.parent = new_index.get(r.parent, -1)
    batch = _collate(rows, pad, mode)
    batch.completions = [tokenizer.decode(r.tokens[r.prompt_len :]) for r in rows]
    batch.timings = timings | {"total": time.perf_counter() - t_start}
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


def _retrieve(engine, rows, cand, traces, tokenizer, exclude, mode, timings) -> None:
    t0 = time.perf_counter()
    hist = [tokenizer.decode(rows[i].tokens) for i in cand]
    segs, pids, _ = traces.retrieve(hist, [rows[i].group for i in cand] if exclude else None)
    timings["retrieval"] += time.perf_counter() - t0
    spliced = []
    for i, seg, pid in zip(cand, segs, pids.tolist()):
        if seg is None:
            continue
        r = rows[i]
        r.retrievals.append([len(r.steps), pid, len(seg)])
        if mode == "splice":
            spliced.append((i, seg, pid))
            continue
        r.tokens.extend(seg)
        r.kinds.extend([KIND_RET] * len(seg))
        r.logp.extend([0.0] * len(seg))
        r.ent.extend([0.0] * len(seg))
        r.origin.extend([-1] * len(seg))
        r.to_feed.extend(seg)
    if spliced:
        from rapo_fast.rollouts.splice import splice_segments

        t0 = time.perf_counter()
        splice_segments(engine, rows, spliced, traces)
        timings["splice"] += time.perf_counter() - t0


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

