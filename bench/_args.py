"""The command line every bench shares: argparse types (counts, output folders), the options that say where a run
writes (`--out DIR`, `--record`, else a new temporary folder) and which grid it takes (`--shape`, `--providers`,
`--rep-ms`, `--quick`, `--gpu`, `--plan`), and the plan printed by `--plan`.

What this is not: the run itself, its rows or timing (bench/_common.py), nor any op's providers.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def positive_int(text: str) -> int:
    """argparse type of a count that must be >= 1 (--repeats, --threads): a bad value is argparse's one-line error
    and exit code 2, not a traceback (a repeat count of -3 once failed with "no median for empty data")."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {v}")
    return v


def writable_dir(text: str) -> Path:
    """argparse type of --out: a folder that exists or can be created (no file on the way, the nearest existing
    ancestor writable)."""
    p = Path(text)
    for q in [p, *p.parents]:
        if q.exists():
            if not q.is_dir():
                raise argparse.ArgumentTypeError(f"{text!r} cannot be a folder: {str(q)!r} is a file")
            if not os.access(q, os.W_OK | os.X_OK):
                raise argparse.ArgumentTypeError(f"{text!r} cannot be written: {str(q)!r} is not writable")
            break
    return p


class UsageError(SystemExit):
    """A bad combination of flags found after parsing: exit code 2, as argparse's own errors; str() is the message."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def usage_error(prog: str, message: str) -> UsageError:
    """The exit of a bad flag found after parsing: argparse's format ("PROG: error: MESSAGE" on stderr) and its exit
    code 2. Use as `raise usage_error(...)`."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return UsageError(message)


def add_output_args(parser: argparse.ArgumentParser, files: str) -> None:
    """The two options that say where a run writes `files` (named in the help): `--out DIR` or `--record` (else a
    new temporary folder)."""
    g = parser.add_mutually_exclusive_group()
    g.add_argument(
        "--out",
        type=writable_dir,
        default=None,
        metavar="DIR",
        help=f"write {files} into DIR, created if missing; rows are appended to a CSV already there",
    )
    g.add_argument(
        "--record",
        action="store_true",
        help="append the rows to the committed results in bench/results/ (the figures the README quotes); "
        "without --out or --record the run writes into a new temporary folder and prints its path",
    )


def output_dir(args: argparse.Namespace, bench: str) -> Path:
    """The folder a run writes into (see the module docstring); a `--quick` run is never recorded."""
    if getattr(args, "record", False) and getattr(args, "quick", False):
        raise usage_error(
            f"rapo-fast bench {bench}", "--quick rows are smoke numbers, never recorded; drop --record or --quick"
        )
    if args.out is not None:
        out = Path(args.out)
    elif getattr(args, "record", False):
        out = RESULTS
    else:
        out = Path(tempfile.mkdtemp(prefix=f"rapo_fast_bench_{bench}_"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"bench {bench}: writing results to {out}")
    return out


def add_grid_args(parser: argparse.ArgumentParser, dims: str | None, providers: bool = True) -> None:
    """Options that narrow a run to a bounded grid (used by the staged GPU validation, bench/gpu/): `--shape` (one
    shape, repeatable, replaces the built-in grid; its fields named by `dims`, e.g. "N,H,V"; none when dims is None),
    `--providers` (a comma-separated subset) and `--rep-ms` (time budget per measurement, the cap on slow providers'
    repeats)."""
    n = len((dims or "").split(","))

    def shape(text: str) -> tuple[int, ...]:
        parts = text.split(",")
        if len(parts) != n or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
            raise argparse.ArgumentTypeError(f"--shape expects {n} integers >= 1 {dims}, got {text!r}")
        return tuple(int(p) for p in parts)

    if dims:
        parser.add_argument(
            "--shape",
            type=shape,
            action="append",
            default=None,
            metavar=dims,
            help=f"run only this shape ({dims}); repeatable; replaces the built-in grid",
        )
    if providers:
        parser.add_argument(
            "--providers",
            type=lambda s: [p for p in s.split(",") if p],
            default=None,
            metavar="A,B",
            help="run only these providers (comma-separated names as in the CSV's provider column)",
        )
    parser.add_argument(
        "--rep-ms",
        type=positive_int,
        default=None,
        metavar="MS",
        help="time budget of each measurement in ms (caps the repeats of slow providers)",
    )


def add_bench_args(parser: argparse.ArgumentParser, *, quick: str, gpu: str, png: str, files: str) -> None:
    """The options of every timing bench: `--quick` (a smoke run) and `--gpu` (the CUDA device at LLM shapes) with the
    bench's own help texts, `--plan`, `--no-plot` (for the staged GPU runs, whose output folder holds few files;
    `--plot`, once needed to draw the PNG, is still accepted, hidden) and where `files` go (add_output_args)."""
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--gpu", action="store_true", help=gpu)
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print the rows this run would take, in order, one a line as BENCH,PROVIDER,FIELD=VALUE,... and exit "
        "without creating inputs or measuring (works without a GPU, --gpu included)",
    )
    parser.add_argument(
        "--no-plot",
        action="store_true",
        help=f"do not draw {png} next to the CSV (drawn by default at the end of every run)",
    )
    parser.add_argument("--plot", action="store_true", help=argparse.SUPPRESS)
    add_output_args(parser, files)


def add_dtype_arg(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["bfloat16", "float16", "float32"],
        help=f"dtype of {what} (default bfloat16 with --gpu, float32 on the CPU)",
    )


def grid_of(args: argparse.Namespace, gpu: list, cpu: list, quick: list, rep_ms: tuple[int, int, int]) -> tuple:
    """(device, shapes, dtype, rep_ms) of an N,H,V bench's run: the GPU grid in bf16 (rep_ms[0]), else the CPU grid
    (rep_ms[2]) or with --quick the smoke grid (rep_ms[1]) in fp32 (bf16 matmul on the CPU is emulated and slow; the
    numbers are CPU numbers either way); --shape, --dtype and --rep-ms override."""
    if args.gpu:
        device, shapes, dtype, rep = torch.device("cuda"), gpu, torch.bfloat16, rep_ms[0]
    else:
        device, dtype = torch.device("cpu"), torch.float32
        shapes, rep = (quick, rep_ms[1]) if args.quick else (cpu, rep_ms[2])
    return device, args.shape or shapes, getattr(torch, args.dtype) if args.dtype else dtype, args.rep_ms or rep


def check_providers(parser: argparse.ArgumentParser, asked: list[str] | None, known: list[str]) -> None:
    """A name in --providers that no provider has is a typo: argparse's error (exit 2), so that a GPU run's dry run
    (which asks every bench for its --plan) catches it before any device time is spent."""
    bad = [p for p in asked or [] if p not in known]
    if bad:
        parser.error(f"--providers: unknown {', '.join(bad)} (known: {', '.join(known)})")


def ordered(asked: list[str] | None, default: list[str]) -> list[str]:
    """The providers of a run in the order it takes them: those of --providers in the order given (the GPU plan puts
    its headline rows first), else the bench's default list."""
    return list(dict.fromkeys(asked)) if asked else list(default)


def plan_line(bench: str, key: dict) -> str:
    """`bench,provider,field=value,...`: one planned row (the fields are the row's key columns besides provider)."""
    return ",".join([bench, str(key["provider"]), *(f"{k}={v}" for k, v in key.items() if k != "provider")])


def print_plan(bench: str, keys: list[dict]) -> int:
    """`--plan`: the planned rows, one a line, in the order the run takes them; exit status 0."""
    print("\n".join(plan_line(bench, key) for key in keys), flush=True)
    return 0
