"""RAPO inside TRL with a real model's tokenizer and a chat dataset: the set-up a user bringing their own model needs.

What it is: a runnable example of the TRL path on a chat model: the tags made single tokens (`add_rapo_tags`: a
byte-level BPE such as Qwen2.5's splits `</tool>` into pieces, and the rollout ends tool steps on its id), a
conversational dataset ({"prompt": [{"role": "user", ...}]}, the chat template applied as TRL does, tool output in the
template's tool turn), a step buffer seeded from a scripted solver, RAPOGRPOTrainer with checkpoints that carry the
buffer. `--model Qwen/Qwen2.5-0.5B-Instruct` (or a local folder) loads pretrained weights when they are at hand
(offline: the Hugging Face cache or a path); the default builds a tiny Qwen2 and its BPE tokenizer offline
(rapo_fast.demo.tiny_qwen) and warms it up briefly on chain arithmetic modulo 10 with 1-2 operations (values one
digit each, which the tiny model copies more easily). The rewards: a right answer (1.0), and a small format reward
for the policy's own tool calls that the calculator could compute, which gives GRPO a signal from the first steps,
before the tiny policy finds right answers (rare in a few steps). What it is not: a benchmark.

    PYTHONPATH=. python examples/trl/rapo_grpo_chat.py --steps 2
    PYTHONPATH=. python examples/trl/rapo_grpo_chat.py --model Qwen/Qwen2.5-0.5B-Instruct --steps 2
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from pathlib import Path

import torch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="pretrained model name or folder (default: a tiny Qwen2, offline)")
    p.add_argument("--steps", type=int, default=2, help="GRPO optimiser steps")
    p.add_argument("--group-size", type=int, default=4, help="num_generations")
    p.add_argument("--prompts-per-step", type=int, default=2)
    p.add_argument("--warmup-steps", type=int, default=150, help="warm-up steps of the tiny model (0: none)")
    p.add_argument("--modulus", type=int, default=10, help="the task's values live modulo this (single digits)")
    p.add_argument("--max-ops", type=int, default=2, help="operations per problem: 1 to this")
    p.add_argument("--retrieve-prob", type=float, default=1.0)
    p.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: no checkpoints)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output folder (default: a temporary one)")
    return p.parse_args(argv)


def make_task(args: argparse.Namespace):
    from rapo_fast.demo.tasks import ChainArithmeticTask

    return ChainArithmeticTask(modulus=args.modulus, min_ops=1, max_ops=args.max_ops)


def user_text(problem) -> str:
    return problem.prompt.removeprefix("<bos> ")  # the task's word-level prompt, without its own <bos> marker


def chat_solution(task, problem, render_prompt, tool_turn) -> str:
    """A chat-formatted solved trajectory: the templated prompt, tool calls, tool turns, the answer, <|im_end|>."""
    text = render_prompt([{"role": "user", "content": user_text(problem)}])
    for step in task.solution(problem)[:-1]:
        call, _, obs = step.partition("</tool>")
        text += call + "</tool>" + tool_turn(obs.strip())
    return text + task.answer_text(problem.answer).replace(" <eos>", "") + "<|im_end|>"


def load_model(args: argparse.Namespace, task, problems):
    """(model, tokenizer) with the RAPO tags as single tokens: pretrained weights, or the tiny Qwen2 warmed up."""
    from rapo_fast.integrations.trl import add_rapo_tags
    from rapo_fast.integrations.trl_setup import ChatFormat

    if args.model is not None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
        add_rapo_tags(tok, model)  # the one set-up call a real model needs
        return model, tok
    from rapo_fast.demo.tiny_qwen import CHATML_TEMPLATE, build_tiny_qwen, warm_up

    corpus = [CHATML_TEMPLATE] + [" ".join(task.solution(p)) + " " + user_text(p) for p in problems]
    model, tok = build_tiny_qwen(corpus, seed=args.seed)
    add_rapo_tags(tok, model)  # the tokenizer was trained without the tags: they are split into pieces until then
    if args.warmup_steps:
        chat = ChatFormat(tok)
        texts = [chat_solution(task, p, lambda m: chat.prompt(m)[0], chat.tool_output) for p in problems]
        warm_up(model, tok, texts, steps=args.warmup_steps)
    return model, tok


def build_trainer(args: argparse.Namespace, out: Path, model_and_tok=None):
    """(trainer, rollout_func, (model, tokenizer)); pass model_and_tok to reuse a built model (its weights are
    copied, so each trainer starts from the same ones)."""
    import copy

    try:
        from datasets import Dataset
        from trl import GRPOConfig
    except ImportError as exc:  # stop with the command, not a bare ModuleNotFoundError
        raise SystemExit(f'{exc.name} is missing: this example needs the trl extra, pip install -e ".[trl]"') from None

    from rapo_fast.demo.tasks import solver_trajectories, write_jsonl
    from rapo_fast.integrations.trl import HashedNgramEncoder, RAPOGRPOTrainer, StepTraces, make_rollout_func

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL
    task = make_task(args)
    train = task.make_problems(16, seed=args.seed)
    if model_and_tok is None:
        model_and_tok = load_model(args, task, task.make_problems(400, seed=args.seed + 2, start_qid=200_000))
    model, tok = copy.deepcopy(model_and_tok[0]), model_and_tok[1]
    by_text = {user_text(p): p for p in train}
    jsonl = write_jsonl(solver_trajectories(task, train, n_per_query=8, seed=args.seed), out / "offpolicy.jsonl")
    traces = StepTraces.from_jsonl(jsonl, HashedNgramEncoder(), tok, top_k=5)

    def problem_of(prompt):  # a chat prompt: its user message holds the task's text
        return by_text[prompt[-1]["content"]]

    def text(completion) -> str:
        return completion[0]["content"] if isinstance(completion, list) else completion

    def correct(prompts, completions, **_):
        return [task.verify(problem_of(p), text(c)) for p, c in zip(prompts, completions)]

    def tool_calls(completions, **_):
        """0.2 x the share of the policy's own tool calls the calculator could compute (a retrieved step's call is not
        the policy's): a format reward, so that GRPO has a signal before the tiny policy finds right answers."""
        obs = [re.findall(r"<obs> (\S+) </obs>", re.sub(r"<retrieve>.*?</retrieve>", "", text(c))) for c in completions]
        return [0.2 * sum(o != "error" for o in found) / len(found) if found else 0.0 for found in obs]

    rollout_func = make_rollout_func(
        task,
        traces,
        success_fn=lambda prompt, completion: task.verify(problem_of(prompt), completion) > 0.5,
        retrieve_prob=args.retrieve_prob,
        max_step_tokens=24,
    )
    config = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=args.group_size * args.prompts_per_step,
        per_device_eval_batch_size=args.group_size * args.prompts_per_step,
        num_generations=args.group_size,
        max_completion_length=256,
        temperature=1.0,
        learning_rate=1e-3,
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
    prompts = [[{"role": "user", "content": user_text(p)}] for p in train]
    trainer = RAPOGRPOTrainer(
        model=model,
        reward_funcs=[correct, tool_calls],
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        eval_dataset=Dataset.from_dict({"prompt": prompts[:2]}),
        processing_class=tok,
        rollout_func=rollout_func,
    )
    return trainer, rollout_func, model_and_tok


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # a tiny model: more threads only wait on each other (and on a busy CPU, much longer)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        out.mkdir(parents=True, exist_ok=True)
        trainer, rollout_func, _ = build_trainer(args, out)
        size0 = len(rollout_func.traces)
        result = trainer.train()
        rows = [row for row in trainer.state.log_history if "reward" in row]
        for row in rows:
            keys = ("loss", "reward", "rewards/correct/mean", "rapo/retrieval_points", "rapo/retrievals")
            print({k: round(v, 4) for k, v in row.items() if k in keys and isinstance(v, float | int)})
        reward = sum(r["reward"] for r in rows) / max(len(rows), 1)
        print(
            f"trained {trainer.state.global_step} steps, mean loss {result.training_loss:.4f}, mean reward "
            f"{reward:.4f}, buffer {size0} -> {len(rollout_func.traces)} steps"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
