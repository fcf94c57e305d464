"""Shared bench plumbing: timing (do_bench on GPU, torch.utils.benchmark on CPU), peak memory, device naming, the
CSV row format (device, date, commit on every row) and where a run writes (`--out DIR`, `--record`, or a new
temporary folder).

Where results go: a run writes its CSV (and plot) into `--out DIR` when given, into the committed bench/results/ only
with `--record`, and otherwise into a fresh temporary folder whose path it prints; `--quick` (smoke) runs cannot be
recorded, so no smoke run ever changes a tracked file (tools/check_layout.py checks this).
Rows are written one at a time (RowWriter): each is appended to the CSV, and the file closed, as soon as it is measured,
so a run stopped at any moment keeps every finished row. The rows a run will take are known before it starts (its plan,
printed by `--plan` as `bench,provider,field=value,...`, without a GPU); a SIGINT or SIGTERM (stop_on_signals) ends the
run with one "interrupted: step budget" row for what was being measured and exit code 130. A provider that raises gets
its own "error: ..." row and the others still run, one that cannot run here "unavailable: ..."; one that disagrees
with the bench's reference is marked DISAGREES and the run exits 1, so a broken provider cannot post a fast time.
`--providers` picks and orders them. At the end of a run the bench's plot is drawn as <csv>.png beside the CSV.
The flags themselves (--out, --record, --plan, the grid) are bench/_args.py's.
What this is not: a place for any op's providers (those live in bench/bench_<op>.py), nor a plotting module.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime as _dt
import os
import platform
import signal
import statistics
import subprocess
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from _args import output_dir, print_plan

RESULTS = Path(__file__).resolve().parent / "results"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} ({os.cpu_count()} cores, torch threads {torch.get_num_threads()})"


def commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except OSError:
        return os.environ.get("RAPO_FAST_COMMIT", "unknown")


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def time_fn(fn: Callable[[], object], device: torch.device, *, rep_ms: int = 200, min_runs: int = 5) -> dict:
    """Median and 20/80% quantiles of `fn` in ms: triton's do_bench on CUDA, torch.utils.benchmark on CPU (which also
    reports `samples`: at least `min_runs` timed blocks, each the mean of one or more calls)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        q = do_bench(fn, rep=rep_ms, quantiles=[0.5, 0.2, 0.8], return_mode="median")
        return {"median_ms": q[0], "p20_ms": q[1], "p80_ms": q[2]}
    import torch.utils.benchmark as tub

    fn()  # warm-up (compilation, allocator)
    m = tub.Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=rep_ms / 1000.0)
    times = [t * 1e3 for t in m.times]
    while len(times) < min_runs:
        extra = tub.Timer(stmt="fn()", globals={"fn": fn}).timeit(1)
        times.append(extra.median * 1e3)
    return {**quantiles_ms(times), "samples": len(times)}


def quantiles_ms(times: list[float]) -> dict:
    """The median and 20/80% quantiles (the nearest sample below) of timings in ms, as the rows name them."""
    t, last = sorted(times), len(times) - 1
    return {"median_ms": statistics.median(t), "p20_ms": t[int(0.2 * last)], "p80_ms": t[int(0.8 * last)]}


def peak_memory_mb(fn: Callable[[], object], device: torch.device) -> float:
    """Peak memory above the baseline while `fn` runs: CUDA allocator stats, or on the CPU (no allocator stats) the
    running sum of torch.profiler's per-op self allocations, an op's net allocation counted when it starts and its net
    release when it ends. Why at the end: an op that wraps others (a custom op, an autograd Function) is charged with
    the frees of its children's buffers as its own negative "self" memory; counted at its start, those frees would
    cancel allocations that have not happened yet (torch's chunked linear_cross_entropy read 0 MiB that way).
    Transient peaks inside one op's own body are not seen; everything allocated by torch ops is."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - base) / 2**20
    from _quiet import native_output_captured
    from torch.profiler import ProfilerActivity, profile

    with native_output_captured(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()  # the profiler's own lines (kineto's start/stop, c10's "unknown size" warning) are dropped
    steps = []  # (time, 0 for an allocation / 1 for a release at the same time, bytes)
    for e in prof.events():
        b = e.self_cpu_memory_usage
        if b > 0:
            steps.append((e.time_range.start, 0, b))
        elif b < 0:
            steps.append((e.time_range.end, 1, b))
    cur = best = 0
    for _, _, b in sorted(steps):
        cur += b
        best = max(best, cur)
    return best / 2**20


def measure_copy_bandwidth_gbs(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Measured device-to-device copy bandwidth (bytes read + written per second), the roofline for our byte counts."""
    n = nbytes // 4 if device.type == "cuda" else (1 << 26) // 4
    src = torch.empty(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), device)["median_ms"]
    return 2 * n * 4 / (t * 1e-3) / 1e9


def append_rows(name: str, rows: list[dict], out_dir: Path) -> Path:
    """Append rows to <out_dir>/<name>.csv (header written once; columns = union, stable order). A row bringing new
    columns rewrites the file with the widened header into a temporary file renamed over the old one, so a run killed
    during the rewrite leaves the old file whole, never half of it."""
    out = Path(out_dir) / f"{name}.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    fields: list[str] = []
    for r in rows:
        for k in r:
            if k not in fields:
                fields.append(k)
    exists = out.exists() and out.stat().st_size > 0
    if exists:
        with out.open(newline="") as f:
            header = next(csv.reader(f), [])
        fields = header + [k for k in fields if k not in header]
        if header != fields:  # new columns: rewrite with the widened header
            with out.open(newline="") as f:
                old = list(csv.DictReader(f))
            tmp = out.with_name(out.name + ".tmp")
            with tmp.open("w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=fields)
                w.writeheader()
                w.writerows(old)
            os.replace(tmp, out)
    with out.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        if not exists:
            w.writeheader()
        w.writerows(rows)
    return out


INTERRUPTED = "interrupted: step budget"
INTERRUPTED_RC = 130  # a shell's code for "ended by SIGINT"; the GPU runner reads it, at the budget, as a timeout
BAD_STATUS = ("DISAGREES", "error", INTERRUPTED)  # a run with such a row exits non-zero; "unavailable" is not one


class Unavailable(Exception):
    """Raised while building a provider that cannot run here (not installed, needs another device): its row says
    "unavailable: <reason>", which is not a failure of the run."""


# The stop signals' state: `received` the first signal; while `defer` > 0 (a row being written) a signal only sets
# `pending`, raised as KeyboardInterrupt once the row is out, so no row is ever half written.
_STOP = {"received": None, "defer": 0, "pending": False}


def _on_stop_signal(signum, frame) -> None:
    _STOP["received"] = _STOP["received"] or signum
    if _STOP["defer"]:
        _STOP["pending"] = True
        return
    raise KeyboardInterrupt


def stop_requested() -> bool:
    """A stop signal arrived: an exception caught meanwhile (a compiler subprocess killed by the same SIGINT, a
    library that turned the KeyboardInterrupt into its own error) is the interruption, not the provider's error."""
    return _STOP["received"] is not None


@contextlib.contextmanager
def stop_on_signals():
    """SIGINT and SIGTERM raise KeyboardInterrupt inside the block (even where the process inherited SIGINT ignored,
    as a background job of a non-interactive shell does); the previous handlers come back after it."""
    old = {}
    try:
        for s in (signal.SIGINT, signal.SIGTERM):
            old[s] = signal.signal(s, _on_stop_signal)
    except ValueError:  # not the main thread (a test calling main() from a worker): leave the handlers alone
        pass
    _STOP.update(received=None, defer=0, pending=False)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        _STOP.update(received=None, defer=0, pending=False)


class RowWriter:
    """The rows of one run, in the order of its plan (`planned`: each row's key columns), each appended to
    <out_dir>/<csv_name>.csv as soon as it is written, stamped with device, date and commit.

    `pending()` is what is being measured now: the keys given to `measuring()` (a round-robin timing measures several
    at once), else the first planned row not yet written; on a stop signal the bench writes one interrupted row for
    each (`interrupted()`). `finish()` writes an error row for any planned row the run did not write, so that the
    CSV always has exactly the rows `--plan` lists."""

    def __init__(self, csv_name: str, out_dir: Path, device: torch.device, planned: list[dict], columns=()):
        self.csv_name, self.out_dir = csv_name, Path(out_dir)
        self.meta = {"device": device_name(device), "commit": commit()}
        self.planned = [dict(k) for k in planned]
        self.done = [False] * len(self.planned)
        # every row carries every known column (blank when it has no value), so the header is written once
        self.columns = list(dict.fromkeys([*(k for key in self.planned for k in key), *columns, "status"]))
        self.rows: list[dict] = []
        self._now: list[dict] | None = None

    def _index(self, row: dict) -> int | None:
        for i, key in enumerate(self.planned):
            if not self.done[i] and all(row.get(k) == v for k, v in key.items()):
                return i
        return None

    def measuring(self, keys: list[dict] | None) -> None:
        self._now = None if keys is None else [dict(k) for k in keys]

    def pending(self) -> list[dict]:
        if self._now:
            return [k for k in self._now if self._index(k) is not None]
        return next(([k] for i, k in enumerate(self.planned) if not self.done[i]), [])

    def write(self, row: dict, echo: tuple[str, ...] = ()) -> dict:
        full = {c: "" for c in self.columns}
        full.update(row)
        full.update(self.meta, date=now())
        _STOP["defer"] += 1
        try:
            append_rows(self.csv_name, [full], self.out_dir)
            self.rows.append(full)
            i = self._index(full)
            if i is not None:
                self.done[i] = True
        finally:
            _STOP["defer"] -= 1
        if echo:
            print({k: full.get(k) for k in echo}, flush=True)
        if _STOP["pending"] and not _STOP["defer"]:
            _STOP["pending"] = False
            raise KeyboardInterrupt
        return full

    def interrupted(self, **extra) -> None:
        """One "interrupted: step budget" row for each row being measured; signals meanwhile change nothing."""
        _STOP["defer"] += 1
        try:
            for key in self.pending():
                self.write({**key, **extra, "status": INTERRUPTED})
        finally:
            _STOP["defer"] -= 1
            _STOP["pending"] = False

    def finish(self) -> list[dict]:
        for i, key in enumerate(self.planned):
            if not self.done[i]:
                self.write({**key, "status": "error: no row was measured for this planned row"})
        return self.rows

    def bad(self) -> list[dict]:
        return [r for r in self.rows if str(r.get("status", "")).startswith(BAD_STATUS)]


def error_status(exc: BaseException, phase: str = "") -> str:
    """The status of a provider that raised: "error: [phase: ]repr" (one line, 200 characters). Raised again as
    KeyboardInterrupt when a stop signal came meanwhile: then the row is the interrupted one, not an error."""
    if stop_requested():
        raise KeyboardInterrupt from exc
    text = f"{phase}: {exc!r}" if phase else repr(exc)
    return ("error: " + " ".join(text.split()))[:200]


@contextlib.contextmanager
def env_var(name: str, value: str | None):
    """Environment variable `name` set to `value` inside the block (left as it is when `value` is None), then as
    before: the switches the library reads per call (RAPO_FAST_DISABLE_TRITON, the retrieval backend)."""
    saved = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def free_device_memory(device: torch.device) -> None:
    """After a provider (an error may leave its buffers to the collector): the next starts from a clean allocator."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_rows(writer: RowWriter, body: Callable[[], None], **interrupted_extra) -> int:
    """Run `body` (which writes the rows through `writer`) under stop_on_signals: 0 when every row is ok or
    unavailable/skipped, 1 when one erred or disagrees, INTERRUPTED_RC (after the interrupted row) on a stop signal.
    An exception out of `body` itself (a bug of the bench, not a provider's) still leaves one error row for each
    planned row, with its traceback on stderr."""
    with stop_on_signals():
        try:
            try:
                body()
            except Exception as exc:  # a fault of the bench's own loop, not of a provider: still one row each
                traceback.print_exc()
                status = error_status(exc, "bench")
                for key in writer.pending():
                    writer.write({**key, "status": status})
            writer.finish()
        except KeyboardInterrupt:
            writer.interrupted(**interrupted_extra)
            print(f"interrupted: rows written to {writer.out_dir / writer.csv_name}.csv", file=sys.stderr, flush=True)
            return INTERRUPTED_RC
    return 1 if writer.bad() else 0


def run_bench(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    keys: list[dict],
    *,
    bench: str,
    csv_name: str,
    device: torch.device,
    columns: list[str],
    body: Callable[[RowWriter], None],
    plot: Callable | None,
    plan: str | None = None,
    **interrupted_extra,
) -> tuple[int, RowWriter | None]:
    """A bench's run once its flags are parsed: `--plan` prints `keys` as `plan` (default `csv_name`) rows before any
    device check (the GPU run's dry run lists its rows on any machine) and returns (0, None); else `--gpu` needs a
    CUDA device, `body(writer)` writes the rows into output_dir(args, bench) under run_rows (Python warnings dropped
    in a --quick run) and, unless --no-plot or the run was interrupted, `plot` draws <csv_name>.png next to the CSV.
    Returns (exit code, the writer)."""
    if args.plan:
        return print_plan(plan or csv_name, keys), None
    if args.gpu and not torch.cuda.is_available():
        parser.error("--gpu: no CUDA device is visible")
    from _plot_style import draw_after_run

    writer = RowWriter(csv_name, output_dir(args, bench), device, keys, columns)
    with warnings.catch_warnings():
        if args.quick:  # a smoke run's output is its rows; a bench that records warnings in a row catches them itself
            warnings.simplefilter("ignore")
        rc = run_rows(writer, lambda: body(writer), **interrupted_extra)
    if rc != INTERRUPTED_RC and not args.no_plot:
        csv_path = writer.out_dir / f"{csv_name}.csv"
        draw_after_run(plot, csv_path, csv_path.with_suffix(".png"), args.quick)
    return rc, writer


def exit_process(rc: int) -> None:
    """The end of a bench run as a script: an interrupted run leaves at once (os._exit, after flushing), without
    waiting on interpreter shutdown (compile worker pools, CUDA teardown) that the runner's SIGKILL would cut anyway."""
    if rc == INTERRUPTED_RC:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    raise SystemExit(rc)
