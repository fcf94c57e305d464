"""Turns a JSONL of questions into the parquet files verl's RLHFDataset reads, for the recipe.

Input: one JSON object per line with "question" and "answer" (a string or a list of accepted strings), optionally
"id" and "data_source". Output: train.parquet / val.parquet under --out with verl's fields: "prompt" (the chat:
system instructions + the question), "data_source", "reward_model" {"style": "rule", "ground_truth"},
"extra_info" {"index", "question"}, "agent_name" ("rapo_tool_agent": the loop registered by rapo_fast's plugin).
What it is not: a dataset download (bring your own JSONL; no network here). Needs pandas + pyarrow (verl's deps).

    python examples/verl/prepare_data.py --train train.jsonl --val val.jsonl --out ~/data/rapo
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SYSTEM = (
    "Answer the question. Think step by step. You may call the `search` tool to look facts up, as many times as "
    "you need. Give the final answer as <answer> ... </answer>."
)


def rows(path: Path, split: str) -> list[dict]:
    out = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        rec = json.loads(line)
        if "question" not in rec or "answer" not in rec:
            raise ValueError(f"{path}:{i + 1}: expected keys 'question' and 'answer', got {sorted(rec)}")
        answers = rec["answer"] if isinstance(rec["answer"], list) else [rec["answer"]]
        out.append(
            {
                "data_source": rec.get("data_source", "rapo_search"),
                "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": rec["question"]}],
                "reward_model": {"style": "rule", "ground_truth": [str(a) for a in answers]},
                "extra_info": {"index": int(rec.get("id", i)), "question": rec["question"], "split": split},
                "agent_name": "rapo_tool_agent",
            }
        )
    return out


def main(argv: list[str] | None = None) -> None:
    import pandas as pd

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", type=Path, required=True)
    ap.add_argument("--val", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for split, path in (("train", args.train), ("val", args.val)):
        pd.DataFrame(rows(path, split)).to_parquet(args.out / f"{split}.parquet")


if __name__ == "__main__":
    main()
