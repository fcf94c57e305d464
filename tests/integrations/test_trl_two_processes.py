"""The TRL path under two processes: RAPOGRPOTrainer with RAPO's rollout_func, two CPU processes in a gloo group (set
up by accelerate from RANK / WORLD_SIZE / MASTER_PORT, as under torchrun), the whole trainer, not a model of it.

Each process rolls out its own prompts and grows the step buffer from its own successful steps; the rollout gathers
every process's new steps and adds them on each, so after every step both processes hold the same buffer (digest), both
having sent steps; the checkpoint (written by process 0) holds every process's steps; a resume from it restores that
buffer on both processes; and the resumed step repeats the uninterrupted run's step exactly: the same payload ids
retrieved on each process, the same buffer after it (retrievals reproducible given the seed). The worker:
trl_two_process_worker.py (both runs in one launch of the two processes: their start-up, imports included, is most of
the time). About a minute on two idle CPU cores.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

try:
    from trl import GRPOTrainer  # noqa: F401
except Exception as exc:  # ImportError, or any error raised while trl imports its own needs
    pytest.skip(f"trl integration needs trl and its imports: {exc!r}"[:300], allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("trl_two_process_worker.py")
# A guard against a hang (a process stuck in a collective), not a speed limit: both runs take about a minute of wall
# time on two idle cores (~25 s of CPU in all), but several times that on a machine shared with other jobs.
DEADLINE_S = 600


def _example():
    spec = importlib.util.spec_from_file_location("rapo_grpo_arith", ROOT / "examples" / "trl" / "rapo_grpo_arith.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two(tmp: Path, tag: str) -> list[dict]:
    """The worker on ranks 0 and 1 at once; returns their records, or fails with each process's output tail."""
    port, procs = _free_port(), []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            TRL_EXPERIMENTAL_SILENCE="1",
            PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        )
        log = open(tmp / f"{tag}{rank}.log", "w")  # noqa: SIM115 (closed below, once the process ended)
        args = [str(tmp / "run"), str(tmp / "warm.pt"), str(tmp / f"{tag}{rank}.pt")]
        procs.append((subprocess.Popen([sys.executable, str(WORKER), *args], env=env, stdout=log, stderr=log), log))
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=DEADLINE_S))
        except subprocess.TimeoutExpired:
            for other, _ in procs:
                other.kill()
            codes.append("timed out")
        log.close()
    if codes != [0, 0]:
        tails = [f"rank {r} ({c}):\n" + (tmp / f"{tag}{r}.log").read_text()[-3000:] for r, c in enumerate(codes)]
        pytest.fail(f"run {tag}: " + "\n".join(tails))
    return [torch.load(tmp / f"{tag}{rank}.pt", weights_only=False) for rank in range(2)]


def test_two_processes_share_one_buffer_checkpoint_it_and_resume_it_exactly(tmp_path):
    ex = _example()
    torch.set_num_threads(1)
    _, _, warm = ex.build_trainer(ex.parse_args([]), tmp_path / "warm")  # the example's SFT warm-up, once
    torch.save(warm, tmp_path / "warm.pt")
    records = _run_two(tmp_path, "r")
    a, b = [r["first"] for r in records], [r["resumed"] for r in records]
    assert [r["rank"] for r in a] == [0, 1] and all(r["world"] == 2 for r in a)
    assert a[0]["begin"] == a[1]["begin"]  # the same seed buffer
    for step in (1, 2):
        s0, s1 = a[0]["steps"][step], a[1]["steps"][step]
        assert s0["digest"] == s1["digest"], f"the processes' buffers differ after step {step}"
        assert s0["sent"] == s1["sent"]  # the same gathered steps, in process order
    sent = [a[0]["steps"][s]["sent"] for s in (1, 2)]
    assert all(sum(per_step[r] for per_step in sent) > 0 for r in range(2)), f"a process sent no step: {sent}"
    assert a[0]["steps"][1]["digest"] != a[0]["begin"][1], "the buffer did not grow"

    # the checkpoint of step 1 holds every process's steps of step 1
    from rapo_fast.demo.tasks import ChainArithmeticTask
    from rapo_fast.integrations.trl import HashedNgramEncoder, StepTraces
    from rapo_fast.integrations.trl_checkpoint import TRACES_DIR

    tok = ex.hf_tokenizer(ChainArithmeticTask().tokenizer())
    saved = StepTraces.load(tmp_path / "run" / "checkpoint-1" / TRACES_DIR, HashedNgramEncoder(), tok)
    assert _load_worker().digest(saved) == a[0]["steps"][1]["digest"]
    assert saved.num_onpolicy == sum(sent[0])

    # a resume from it: the buffer restored on both processes, then step 2 exactly as the uninterrupted run's
    for rank in range(2):
        assert b[rank]["begin"] == (1, a[rank]["steps"][1]["digest"]), f"rank {rank} did not restore the buffer"
        assert b[rank]["steps"][2] == a[rank]["steps"][2], f"rank {rank}'s resumed step differs"
    assert any(a[r]["steps"][2]["retrieved"] for r in range(2)), "no retrieval: the comparison would prove little"


def _load_worker():
    spec = importlib.util.spec_from_file_location("trl_two_process_worker", WORKER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
