"""The continuous endpoint of the Table-1 runs: the teacher-forced log-probability of the correct trajectory on the
held-out questions, beside greedy success.

What this is: for each DISTINCT held-out question (the evaluation draws questions with replacement; each is scored
once, keyed by its prompt), the policy's log-probability of its own tokens of the correct solution (`task.solution`:
each correct search step through `</tool>`, the answer step through `<eos>`), prompt and observations given, summed
per question, then averaged over the questions; temperature 1, eval mode, no sampling. The trajectory is rendered as
a rollout and the SFT warm-up render it (rollouts.rows.prompt_ids, rollouts.offpolicy.split_step).
What this is not: a success rate (a policy can put more mass on the correct hops and still decode a wrong one
greedily), nor a score with retrieval: no retrieved step is shown.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rapo_fast.rollouts.offpolicy import split_step
from rapo_fast.rollouts.rows import prompt_ids


def distinct_questions(problems: Sequence) -> list:
    """The first problem of each distinct prompt, in order of first appearance."""
    seen: dict[str, object] = {}
    for p in problems:
        seen.setdefault(p.prompt, p)
    return list(seen.values())


def correct_tokens(task, tokenizer, problem) -> tuple[list[int], list[bool]]:
    """(token ids, scored) of `problem`'s correct trajectory: prompt, then each step of `task.solution`; `scored`
    marks the policy's own tokens (not the prompt, not the observations)."""
    ids = prompt_ids(tokenizer, problem)
    scored = [False] * len(ids)
    for step in task.solution(problem):
        gen, obs = split_step(step, tokenizer)
        ids += gen + obs
        scored += [True] * len(gen) + [False] * len(obs)
    return ids, scored


@torch.no_grad()
def question_logprobs(model, tokenizer, task, problems: Sequence, batch_size: int = 64) -> dict[str, float]:
    """prompt -> the summed log-probability of its correct trajectory's policy tokens, one entry per distinct
    question (module docstring)."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"question_logprobs: batch_size must be a positive int, got {batch_size!r}")
    questions = distinct_questions(problems)
    if not questions:
        raise ValueError("question_logprobs: problems is empty")
    dev = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out: dict[str, float] = {}
    try:
        for i in range(0, len(questions), batch_size):
            chunk = questions[i : i + batch_size]
            rendered = [correct_tokens(task, tokenizer, p) for p in chunk]
            T = max(len(ids) for ids, _ in rendered)
            ids = torch.full((len(chunk), T), tokenizer.pad_token_id, dtype=torch.long)
            mask = torch.zeros(len(chunk), T, dtype=torch.long)
            scored = torch.zeros(len(chunk), T, dtype=torch.bool)
            for b, (x, sc) in enumerate(rendered):
                ids[b, : len(x)] = torch.tensor(x)
                mask[b, : len(x)] = 1
                scored[b, : len(sc)] = torch.tensor(sc)
            logits = model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits[:, :-1].float().cpu()
            logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            per_q = (logp * scored[:, 1:]).sum(dim=1)
            out.update({p.prompt: float(v) for p, v in zip(chunk, per_q)})
    finally:
        model.train(was_training)
    return out


def heldout_logp(model, tokenizer, task, problems: Sequence, batch_size: int = 64) -> float:
    """The endpoint: the mean over distinct questions of `question_logprobs` (nats; higher is better, 0 the most)."""
    per_q = question_logprobs(model, tokenizer, task, problems, batch_size)
    return sum(per_q.values()) / len(per_q)


__all__ = ["distinct_questions", "correct_tokens", "question_logprobs", "heldout_logp"]
