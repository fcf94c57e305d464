"""Exact-match outcome reward of the recipe (verl's `reward.custom_reward_function`: `compute_score`).

What it is: 1.0 when the last `<answer> ... </answer>` of the response equals one of the ground-truth answers after
SQuAD-style normalisation (lower case, no punctuation or articles), else 0.0, as in Search-R1 / the RAPO paper's
knowledge-intensive tasks. What it is not: the retrieval reward (rapo_fast's "rapo" advantage estimator adds that).
"""

from __future__ import annotations

import re
import string

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def normalize(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None) -> float:
    answers = _ANSWER.findall(solution_str)
    if not answers:
        return 0.0
    targets = ground_truth if isinstance(ground_truth, (list, tuple)) else [ground_truth]
    return float(normalize(answers[-1]) in {normalize(str(t)) for t in targets})
