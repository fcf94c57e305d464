"""The `rapo-fast` command line: `demo`, `bench {loss,retrieval,kv}`, `info`.

What this is: argument routing only. The demo lives in rapo_fast/demo/main.py and each benchmark in bench/bench_<op>.py
(a `main(argv)` each); this module finds bench/ next to the package, which holds for a source checkout or an editable
install (the benches are not shipped in a wheel, and the error says so).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

BENCHES = {"loss": "bench_loss.py", "retrieval": "bench_retrieval.py", "kv": "bench_kv_splice.py"}


def _bench_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "bench"


def _run_bench(name: str, argv: list[str]) -> int:
    path = _bench_dir() / BENCHES[name]
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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="rapo-fast", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("demo", help="train RAPO vs GRPO on a synthetic tool task (CPU, minutes)", add_help=False)
    b = sub.add_parser("bench", help="microbenchmarks: loss, retrieval, kv", add_help=False)
    b.add_argument("which", choices=sorted(BENCHES))
    sub.add_parser("info", help="build and runtime facts (backends, architectures, versions)")
    args, rest = parser.parse_known_args(argv)
    if args.cmd == "demo":
        from rapo_fast.demo import main as demo

        return int(demo.main(rest) or 0)
    if args.cmd == "bench":
        return _run_bench(args.which, rest)
    from rapo_fast._ext import build_info

    print(json.dumps(build_info(), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
