"""Extra peak resident memory (VmHWM - VmRSS before) of one forward+backward of a loss-bench provider on the CPU, each
in a fresh process: a second opinion on bench_loss.py's CPU `peak_mem_mb`, which sums torch.profiler's per-op
allocations and can miss buffers allocated inside an op's own backward (it read 36 MiB for torch's chunked
F.linear_cross_entropy, whose grad_W alone is 64 MiB at the shape below).

Usage: `python bench/cpu_peak_rss.py [--shape N,H,V] [--providers a,b,...]`; prints one line per provider. Linux only
(/proc/self/status, /proc/self/clear_refs). Includes the gradients the provider allocates ([N, H] and [V, H], the same
for every provider). What this is not: a timing, nor a GPU measurement (bench_loss.py --gpu reads the CUDA allocator).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

CHILD = """
import gc, sys
sys.path.insert(0, {bench!r})
import torch
import bench_loss as bl
n, h, v = {shape}
args = bl._inputs(n, h, v, torch.float32, torch.device("cpu"))
fn = bl.lp.make_provider({name!r}, torch.device("cpu"))
hh = args[0].detach().requires_grad_(True)
ww = args[1].detach().requires_grad_(True)
fn(hh[:1, :8], ww, *(a[:1, :8] if a.dim() == 2 else a[:1] for a in args[2:])).backward()  # warm-up, tiny
hh.grad = ww.grad = None
gc.collect()
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1])
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
base = status("VmRSS")
fn(hh, ww, *args[2:]).backward()
print((status("VmHWM") - base) / 1024)
"""


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
    bench = str(Path(__file__).resolve().parent)
    for name in a.providers.split(","):
        code = CHILD.format(bench=bench, shape=(n, h, v), name=name)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        mib = f"{float(r.stdout.split()[-1]):.1f}" if r.returncode == 0 else f"error: {r.stderr.strip()[-200:]}"
        grads = (n * h + v * h) / 2**18
        print(f"{name:28s} N={n} H={h} V={v}: extra peak RSS {mib} MiB (grads included: {grads:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
