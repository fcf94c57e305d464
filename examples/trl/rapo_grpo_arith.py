"""RAPO inside TRL on the CPU: RAPOGRPOTrainer + RAPO's hybrid rollout_func on the demo's chain-arithmetic task.

What it is: a runnable example (no downloads): a tiny Llama built from a config (rapo_fast.demo.tiny_policy), a short
SFT warm-up so that the policy makes tool calls, a step buffer seeded from the demo's scripted solver (JSONL ->
rapo_fast.StepTraces), then a few GRPO steps of TRL with `rollout_func=make_rollout_func(task, traces, ...)`: hybrid
rollouts that retrieve steps, retrieved tokens out of the loss, RAPO's retrieval-reward advantage, the buffer grown from
successful steps. `--trainer grpo` runs TRL's own GRPOTrainer with the same rollout_func; `--no-retrieval` plain
multi-turn rollouts. What it is not: a benchmark (a few steps of a ~200k-parameter policy learn little).

    PYTHONPATH=. python examples/trl/rapo_grpo_arith.py --steps 3
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch


def hf_tokenizer(words):
    """A transformers fast tokenizer with the ids of rapo_fast.demo's WordTokenizer (TRL needs a HF one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words.vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3, help="GRPO optimiser steps")
    p.add_argument("--group-size", type=int, default=4, help="num_generations")
    p.add_argument("--prompts-per-step", type=int, default=2)
    p.add_argument("--sft-steps", type=int, default=40, help="SFT warm-up steps before RL (0: none)")
    p.add_argument("--retrieve-prob", type=float, default=0.5)
    p.add_argument("--no-retrieval", action="store_true", help="plain multi-turn rollouts (no StepTraces)")
    p.add_argument("--trainer", choices=("rapo", "grpo"), default="rapo")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--optim", default="adamw_torch", help="transformers optimiser name (e.g. sgd)")
    p.add_argument("--shaping", type=float, default=0.05, help="RAPO shaping_m (rapo trainer only; 0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: no checkpoints)")
    p.add_argument("--out", default=None, help="output folder (default: a temporary one)")
    return p.parse_args(argv)


def build_trainer(args: argparse.Namespace, out: Path, warm_state: dict | None = None):
    """(trainer, rollout_func, warm_state): the model built from the seed, then warmed up or loaded from warm_state."""
    try:
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as exc:  # stop with the command, not a bare ModuleNotFoundError
        raise SystemExit(f'{exc.name} is missing: this example needs the trl extra, pip install -e ".[trl]"') from None

    from rapo_fast.demo.tasks import ChainArithmeticTask, solver_trajectories, write_jsonl
    from rapo_fast.demo.tiny_policy import build_tiny_policy
    from rapo_fast.integrations.trl import HashedNgramEncoder, RAPOGRPOTrainer, StepTraces, make_rollout_func

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL
    task = ChainArithmeticTask()
    words = task.tokenizer()
    tok = hf_tokenizer(words)
    train = task.make_problems(16, seed=args.seed)
    by_prompt = {p.prompt: p for p in train}
    model = build_tiny_policy(words.vocab_size, seed=args.seed)
    if warm_state is None:
        if args.sft_steps:
            from rapo_fast.train.sft import sft_warmup

            pool = task.make_problems(2000, seed=args.seed + 2, start_qid=200_000)
            sft_warmup(model, words, task, pool, steps=args.sft_steps, batch_size=16, lr=3e-3, seed=args.seed)
        warm_state = {k: v.clone() for k, v in model.state_dict().items()}
    else:
        model.load_state_dict(warm_state)
    traces = None
    if not args.no_retrieval:
        jsonl = write_jsonl(solver_trajectories(task, train, n_per_query=8, seed=args.seed), out / "offpolicy.jsonl")
        traces = StepTraces.from_jsonl(jsonl, HashedNgramEncoder(), tok, top_k=5)

    def correct(prompts, completions, **_):
        return [task.verify(by_prompt[p], c) for p, c in zip(prompts, completions)]

    def answered(completions, **_):  # a small format reward: some signal before the policy solves anything
        return [0.2 if "<answer>" in c else 0.0 for c in completions]

    rollout_func = make_rollout_func(
        task,
        traces,
        success_fn=lambda prompt, completion: task.verify(by_prompt[prompt], completion) > 0.5,
        retrieve_prob=args.retrieve_prob,
        max_step_tokens=16,
    )
    config = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=args.group_size * args.prompts_per_step,
        num_generations=args.group_size,
        max_completion_length=160,
        temperature=1.0,
        learning_rate=args.lr,
        optim=args.optim,
        max_steps=args.steps,
        logging_steps=1,
        seed=args.seed,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        loss_type="grpo",
        disable_tqdm=True,
    )
    extra = {"rapo_options": {"shaping_m": args.shaping} if args.shaping else {}} if args.trainer == "rapo" else {}
    cls = RAPOGRPOTrainer if args.trainer == "rapo" else GRPOTrainer
    trainer = cls(
        model=model,
        reward_funcs=[correct, answered],
        args=config,
        train_dataset=Dataset.from_dict({"prompt": [p.prompt for p in train]}),
        processing_class=tok,
        rollout_func=rollout_func,
        **extra,
    )
    return trainer, rollout_func, warm_state


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # a tiny model: more threads only wait on each other (and on a busy CPU, much longer)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        out.mkdir(parents=True, exist_ok=True)
        trainer, _, _ = build_trainer(args, out)
        result = trainer.train()
        for row in trainer.state.log_history:
            keys = (
                "loss",
                "reward",
                "clip_ratio/region_mean",
                "rapo/retrieval_rate",
                "rapo/retrieval_reward",
                "rapo/buffer_size",
            )
            print({k: round(v, 4) for k, v in row.items() if k in keys and isinstance(v, float | int)})
        print(f"trained {trainer.state.global_step} steps, mean loss {result.training_loss:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
