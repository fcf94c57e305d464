"""Supervised warm-up on generated traces (the demo's first phase) and greedy evaluation of a policy on a task.

What this is: `sft_examples` (correct solutions in the rollout's token format, some later steps wrapped in
<retrieve> ... </retrieve> and masked out of the loss, as in RL), `sft_warmup` and `evaluate` (greedy success without
retrieval). What this is not: the RL trainer (rapo_fast/train/trainer.py).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from rapo_fast._checks import brief, check_choice, check_int
from rapo_fast._tokens import encode_plain
from rapo_fast.rollouts.batch import KIND_GEN, KIND_PROMPT, KIND_RET, KIND_TOOL
from rapo_fast.rollouts.offpolicy import split_step

RETRIEVE_STYLES = ("replace", "hint", "foreign", "advance")


def sft_examples(task, tokenizer, problems: Sequence, retrieve_frac: float, rng: random.Random, style: str = "replace"):
    """One (token ids, kinds) pair per problem: prompt, solution steps, answer; each later step is shown as
    retrieved with probability `retrieve_frac`. style "replace": the retrieved block stands for the step (the policy
    goes on with the next one); "hint": the block comes before the policy's own copy of the step (the policy takes
    the step itself after seeing it retrieved); "foreign": as "hint", but the block is another question's step with the
    same relation (`problem.hints[k]`, e.g. rapo_fast.demo.tasks.kb_alias), so the policy learns to take a retrieved
    step's relation and apply it to its own entity; "advance": as "replace", but never the last step before the
    answer (retrieval in rapo_fast/demo/tasks/kb_step.py never supplies the last hop). Kinds follow
    rapo_fast.rollouts.batch (only KIND_GEN is trained)."""
    check_choice("sft_examples: style", style, RETRIEVE_STYLES)
    out = []
    for p in problems:
        if style == "foreign" and len(getattr(p, "hints", ())) < len(task.solution(p)) - 1:
            raise ValueError(f"sft_examples: style 'foreign' needs problems with one hint per step, got {brief(p)}")
        ids = tokenizer.encode(p.prompt)
        kinds = [KIND_PROMPT] * len(ids)
        solution = task.solution(p)
        last = len(solution) - 2 if style == "advance" else len(solution) - 1  # the first step never shown retrieved
        for k, step in enumerate(solution):
            is_answer = step.startswith("<answer>")
            if 1 <= k < last and not is_answer and rng.random() < retrieve_frac:
                shown = p.hints[k] if style == "foreign" else step
                seg = encode_plain(tokenizer, f"<retrieve> {shown} </retrieve>")  # mid-sequence: no BOS
                ids += seg
                kinds += [KIND_RET] * len(seg)
                if style in ("replace", "advance"):
                    continue
            gen_ids, obs_ids = split_step(step, tokenizer)
            ids += gen_ids + obs_ids
            kinds += [KIND_GEN] * len(gen_ids) + [KIND_TOOL] * len(obs_ids)
        out.append((ids, kinds))
    return out


def _collate(examples, pad: int):
    T = max(len(i) for i, _ in examples)
    ids = torch.full((len(examples), T), pad, dtype=torch.long)
    mask = torch.zeros(len(examples), T, dtype=torch.long)
    train = torch.zeros(len(examples), T, dtype=torch.bool)
    for b, (i, k) in enumerate(examples):
        ids[b, : len(i)] = torch.tensor(i)
        mask[b, : len(i)] = 1
        train[b, : len(k)] = torch.tensor(k) == KIND_GEN
    return ids, mask, train


def sft_warmup(
    model,
    tokenizer,
    task,
    problems: Sequence,
    *,
    steps: int,
    batch_size: int = 32,
    lr: float = 3e-3,
    retrieve_frac: float = 0.3,
    retrieve_style: str = "replace",
    seed: int = 0,
    progress: bool = False,
) -> list[float]:
    """Cross-entropy on the generated tokens of rendered solutions (sft_examples: `retrieve_frac`,
    `retrieve_style`); returns the loss per step."""
    check_int("sft_warmup: steps", steps, lo=0)
    if not problems:
        raise ValueError("sft_warmup: problems is empty")
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    dev = next(model.parameters()).device
    losses = []
    bar = None
    if progress:
        from rapo_fast.train.progress import progress_bar

        bar = progress_bar(steps, "sft")
    for _ in range(steps):
        batch = sft_examples(
            task,
            tokenizer,
            rng.sample(list(problems), min(batch_size, len(problems))),
            retrieve_frac,
            rng,
            retrieve_style,
        )
        ids, mask, train = (t.to(dev) for t in _collate(batch, tokenizer.pad_token_id))
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        tgt_mask = train[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits[tgt_mask], ids[:, 1:][tgt_mask])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return losses


@torch.no_grad()
def evaluate(model, tokenizer, task, problems: Sequence, *, max_steps: int = 6, max_step_tokens: int = 24) -> float:
    """Greedy success rate (no retrieval) on `problems`."""
    from rapo_fast.rollouts.config import RolloutConfig
    from rapo_fast.rollouts.loop import rollout

    cfg = RolloutConfig(
        group_size=1,
        strategy="on_policy",
        hybrid={"n_hybrid": 0},
        temperature=0.0,
        max_steps=max_steps,
        max_step_tokens=max_step_tokens,
    )
    batch = rollout(model, tokenizer, task, problems, cfg)
    rewards = [task.verify(p, c) for p, c in zip(problems, batch.completions)]
    return sum(rewards) / max(1, len(rewards))


__all__ = ["sft_examples", "sft_warmup", "evaluate"]
