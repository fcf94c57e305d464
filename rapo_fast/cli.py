"""The `rapo-fast` command line: `demo`, `bench {loss,logprobs,retrieval,kv,buffer}`, `info`,
`verl-build-buffer`, `verl-traces`.

What this is: argument routing only, and the one module outside rapo_fast/demo/ allowed to import the demo (nothing in
the library imports this module; tools/check_layout.py checks both). The demo's options live in
rapo_fast/demo/main.py and each benchmark's in bench/bench_<op>.py (a `main(argv)` each, which parses and documents
its own options); this module finds bench/ next to the package, which holds for a source checkout or an editable
install (the benches are not shipped in a wheel, and the error says so).
What this is not: a place for any option of the demo or of a benchmark.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import platform
import subprocess
import sys
from pathlib import Path

# name -> (file in bench/, one line for `rapo-fast bench --help`)
BENCHES = {
    "loss": ("bench_loss.py", "fused policy loss (rapo_loss) forward+backward: time and peak memory"),
    "logprobs": ("bench_token_logprobs.py", "token_logprobs alone (logits and hidden x lm_head): time and memory"),
    "retrieval": ("bench_retrieval.py", "exact top-k step retrieval (StepBuffer.search): queries per second"),
    "kv": ("bench_kv_splice.py", "KV splice (splice_kv) against re-prefill and a plain-torch splice"),
    "buffer": ("bench_buffer_actor.py", "verl step buffer under N concurrent loops: old vs new design, requests/s"),
}

_BENCH_DESCRIPTION = (
    "Microbenchmarks of rapo_fast's ops against the plain-PyTorch (and faiss / Liger) ways of doing the same, "
    "side by side in one run. Each writes CSV rows stamped with device, date and commit: into --out DIR when "
    "given, into the committed bench/results/ only with --record, otherwise into a new temporary folder whose "
    "path it prints. `rapo-fast bench NAME --help` lists a benchmark's own options (shapes, --quick, --gpu, ...)."
)


def _bench_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "bench"


def _run_bench(name: str, argv: list[str]) -> int:
    path = _bench_dir() / BENCHES[name][0]
    if not path.exists():
        raise SystemExit(
            f"rapo-fast bench {name}: {path} not found; the benchmarks ship with the source checkout "
            "(clone the repository and `pip install -e .`)."
        )
    spec = importlib.util.spec_from_file_location(f"rapo_fast_bench_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))  # benches may share helpers in bench/
    try:
        spec.loader.exec_module(module)
        return int(module.main(argv) or 0)
    finally:
        sys.path.remove(str(path.parent))


def _commit() -> str | None:
    """The source checkout's commit (`git describe --always --dirty`), or None for an installed wheel."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "describe", "--always", "--dirty", "--abbrev=12"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def info() -> dict:
    """What a bug report needs (as `trl env`): rapo_fast's version and commit, the platform, the extension's build
    facts (rapo_fast._ext.build_info) and the versions of the libraries the integrations use."""
    from rapo_fast import __version__
    from rapo_fast._ext import build_info

    out = {"rapo_fast": __version__, "commit": _commit(), "python": platform.python_version()}
    out["platform"] = platform.platform()
    out.update(build_info())
    out.update({name: _dist_version(name) for name in ("transformers", "trl", "verl")})
    return out


def _parser() -> argparse.ArgumentParser:
    from rapo_fast import __version__

    parser = argparse.ArgumentParser(prog="rapo-fast", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"rapo-fast {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="{demo,bench,info,verl-build-buffer,verl-traces}")
    # demo and each benchmark parse their own options (add_help=False here, so `--help` reaches them)
    sub.add_parser("demo", help="train RAPO vs GRPO on a synthetic tool task (CPU, minutes)", add_help=False)
    bench = sub.add_parser("bench", help="microbenchmarks: " + ", ".join(BENCHES), description=_BENCH_DESCRIPTION)
    names = bench.add_subparsers(dest="which", required=True, metavar="{" + ",".join(BENCHES) + "}", title="benchmarks")
    for name, (_, line) in BENCHES.items():
        names.add_parser(name, help=line, add_help=False)
    sub.add_parser(
        "info",
        help="version, commit, build and runtime facts, for bug reports (backends, architectures, versions)",
        description="Print, as JSON, rapo_fast's version and source commit (None for an installed wheel), the "
        "Python version and platform, how rapo_fast was built and what it finds at run time: whether the C++ "
        "extension loaded (and the error if not), its CPU (OpenMP) and CUDA backends, the CUDA architectures "
        "compiled in, the torch, Triton, transformers, trl and verl versions, and whether a CUDA device is visible. "
        "Takes no options.",
    )
    sub.add_parser(
        "verl-build-buffer",
        help="build RAPO's step buffer for a verl job from off-policy JSONL traces (README 'RAPO on verl')",
        add_help=False,
    )
    sub.add_parser(
        "verl-traces",
        help="make the off-policy traces JSONL (verl-build-buffer's input) from verl's rollout dumps, by reward",
        add_help=False,
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.cmd == "demo":
        from rapo_fast.demo import main as demo

        return int(demo.main(rest) or 0)
    if args.cmd == "bench":
        return _run_bench(args.which, rest)
    if args.cmd == "verl-build-buffer":
        from rapo_fast.integrations.verl import buffer_setup

        return int(buffer_setup.main(rest) or 0)
    if args.cmd == "verl-traces":
        from rapo_fast.integrations.verl import traces

        return int(traces.main(rest) or 0)
    if rest:
        parser.error(f"info takes no arguments, got {' '.join(rest)}")
    print(json.dumps(info(), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
