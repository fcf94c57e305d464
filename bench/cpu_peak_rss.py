"""Extra peak resident memory (VmHWM - VmRSS before) of one call on the CPU, each in a fresh process: a second opinion
on the benches' CPU `peak_mem_mb`, which sums torch.profiler's per-op allocations and can miss buffers allocated inside
an op's own backward (it read 36 MiB for torch's chunked F.linear_cross_entropy, whose grad_W alone is 64 MiB at the
shape below). `extra_peak_rss_mib` is the probe (bench_token_logprobs.py --parity uses it too); run as a script, it
measures one forward+backward of each bench_loss.py provider.

The window holds the second call at the measured shape, never the first: a process's first call of torch's chunked op
(any torch.library custom op) imports torch._dynamo, ~150 MiB of RSS once (half of it code pages), and a warm-up that
takes another route (a small batch goes through torch's unchunked op) would leave that import in one provider's window
only. Before the window the warm-up's gradients are dropped and glibc's free heap pages are handed back
(malloc_trim), so that what the window allocates counts whatever the warm-up left resident.

Usage: `python bench/cpu_peak_rss.py [--shape N,H,V] [--providers a,b,...]`; prints one line per provider. Linux with
glibc only (/proc/self/status, /proc/self/clear_refs, malloc_trim). Includes the gradients the provider allocates
([N, H] and [V, H], the same for every provider). What this is not: a timing, nor a GPU measurement (bench_loss.py
--gpu reads the CUDA allocator).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap
from pathlib import Path

BENCH = str(Path(__file__).resolve().parent)
PROBE = """
import ctypes, gc, sys
sys.path.insert(0, {bench!r})
{setup}
def step():
{step}
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1])
step()  # warm-up at the measured shape (module docstring)
{reset}
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
base = status("VmRSS")
step()
print((status("VmHWM") - base) / 1024)
"""
LOSS_SETUP = """
import torch
import bench_loss as bl
args = bl._inputs({n}, {h}, {v}, torch.float32, torch.device("cpu"))
fn = bl.lp.make_provider({name!r}, torch.device("cpu"))
hh = args[0].detach().requires_grad_(True)
ww = args[1].detach().requires_grad_(True)
"""


def extra_peak_rss_mib(setup: str, step: str, reset: str = "") -> float:
    """MiB of extra peak RSS of `step` (a statement block) run a second time in a fresh interpreter after `setup`;
    `reset` drops what the first run left that the second would replace (its gradients). Raises RuntimeError with the
    child's last line of stderr if it fails."""
    code = PROBE.format(bench=BENCH, setup=setup, step=textwrap.indent(step.strip(), "    "), reset=reset)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError((r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[-1][-300:])
    return float(r.stdout.split()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/cpu_peak_rss.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="2048,512,32768", help="N,H,V (default 2048,512,32768)")
    p.add_argument(
        "--providers",
        default="torch_eager,rapo_fast_hidden,torch_linear_ce,liger",
        help="comma-separated bench_loss.py providers (default: eager, ours from hidden, torch's chunked op, Liger)",
    )
    a = p.parse_args(argv)
    n, h, v = (int(x) for x in a.shape.split(","))
    for name in a.providers.split(","):
        setup = LOSS_SETUP.format(n=n, h=h, v=v, name=name)
        try:
            mib = f"{extra_peak_rss_mib(setup, 'fn(hh, ww, *args[2:]).backward()', 'hh.grad = ww.grad = None'):.1f}"
        except RuntimeError as exc:
            mib = f"error: {exc}"
        grads = (n * h + v * h) / 2**18
        print(f"{name:28s} N={n} H={h} V={v}: extra peak RSS {mib} MiB (grads included: {grads:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
