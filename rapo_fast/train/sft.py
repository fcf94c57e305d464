"""Supervised warm-up on generated traces (the demo's first phase) and greedy evaluation of a policy on a task.

What this is: `sft_examples` (correct solutions in the rollout's token format, some later steps wrapped in
<retrieve> ... </retrieve> and masked out of the loss, as in RL, in a retrieve style: a callable, `replace_step` by
default), `sft_warmup` and `evaluate` (greedy success without retrieval).
What this is not: the RL trainer (rapo_fast/train/trainer.py).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rapo_fast._checks import brief, check_int
from rapo_fast._tokens import encode_plain
from rapo_fast.rollouts.batch import KIND_GEN, KIND_PROMPT, KIND_RET, KIND_TOOL
from rapo_fast.rollouts.offpolicy import split_step

# A retrieve style: (problem, k, solution) -> None when step k may not be shown retrieved, else (the text inside the
# <retrieve> block, whether the policy's own copy of step k follows it). Asked before the retrieve_frac draw, so a
# style that refuses a step leaves the draws of the others as they were.
RetrieveStyle = Callable[[Any, int, Sequence[str]], tuple[str, bool] | None]


def replace_step(problem, k: int, solution: Sequence[str]) -> tuple[str, bool]:
    """The default style: the retrieved block stands for step k (the policy goes on with the next one)."""
    return solution[k], False


def hint_step(problem, k: int, solution: Sequence[str]) -> tuple[str, bool]:
    """The block shows step k, then the policy takes step k itself (it learns to copy a retrieved step)."""
    return solution[k], True


def sft_examples(
    task, tokenizer, problems: Sequence, retrieve_frac: float, rng: random.Random, style: RetrieveStyle = replace_step
):
    """One (token ids, kinds) pair per problem: prompt, solution steps, answer; each step after the first that is not
    the answer is shown retrieved with probability `retrieve_frac`, as `style` renders it (replace_step, hint_step, or
    a callable of the RetrieveStyle shape). Kinds follow rapo_fast.rollouts.batch (only KIND_GEN is trained)."""
    if not callable(style):
        raise TypeError(f"sft_examples: style: expected a callable (problem, k, solution), got {brief(style)}")
    out = []
    for p in problems:
        ids = tokenizer.encode(p.prompt)
        kinds = [KIND_PROMPT] * len(ids)
        solution = task.solution(p)
        for k, step in enumerate(solution):
            shown = None
            if 1 <= k < len(solution) - 1 and not step.startswith("<answer>"):
                shown = style(p, k, solution)
            if shown is not None and rng.random() < retrieve_frac:
                seg = encode_plain(tokenizer, f"<retrieve> {shown[0]} </retrieve>")  # mid-sequence: no BOS
                ids += seg
                kinds += [KIND_RET] * len(seg)
                if not shown[1]:
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
    retrieve_style: RetrieveStyle = replace_step,
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


__all__ = ["RetrieveStyle", "evaluate", "hint_step", "replace_step", "sft_examples", "sft_warmup"]
