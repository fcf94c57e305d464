"""The `rapo-fast` command line refuses every bad flag with argparse's one-line error and exit code 2, for every
subcommand, before any work starts: once `info --garbage` exited 0, `demo --device cuda` without CUDA, `--device tpu`
and `--out FILE/x` gave tracebacks, `bench retrieval --repeats -3` failed with "no median for empty data", and
`--repeats 0` / `--threads 0` were accepted. Not here: what the demo or a benchmark computes (tests/demo,
tests/bench).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from rapo_fast import cli


@pytest.fixture
def a_file(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("not a folder")
    return f


def _bad_argvs(a_file, tmp_path):
    out = ["--out", str(tmp_path / "o")]
    no_cuda = [] if torch.cuda.is_available() else [["demo", "--device", "cuda"], ["bench", "kv", "--gpu", *out]]
    return no_cuda + [
        [],
        ["--garbage"],
        ["info", "--garbage"],
        ["info", "extra"],
        ["demo", "--garbage"],
        ["demo", "--device", "tpu"],
        ["demo", "--device", "cuda:x"],
        ["demo", "--device", f"cuda:{max(torch.cuda.device_count(), 1) + 7}"],
        ["demo", "--out", str(a_file / "x")],
        ["demo", "--out", str(a_file)],
        ["demo", "--threads", "0"],
        ["demo", "--lr", "inf"],
        ["demo", "--lr", "nan"],
        ["demo", "--seed", "-1"],
        ["demo", "--sft-target", "nan"],
        ["demo", "--rl-steps", "-1"],
        ["bench"],
        ["bench", "nope"],
        ["nonsense"],
        ["bench", "retrieval", "--quick", "--metric", "cos", *out],
        ["bench", "retrieval", "--quick", "--repeats", "-3", *out],
        ["bench", "retrieval", "--quick", "--repeats", "0", *out],
        ["bench", "retrieval", "--quick", "--repeats", "two", *out],
        ["bench", "retrieval", "--quick", "--threads", "0", *out],
        ["bench", "retrieval", "--quick", "--out", str(a_file / "x")],
        ["bench", "loss", "--quick", "--out", str(a_file / "x")],
        ["bench", "loss", "--quick", "--record"],
        ["bench", "loss", "--quick", "--rep-ms", "0", *out],
        ["bench", "loss", "--quick", "--shape", "-4,8,16", *out],
        ["bench", "logprobs", "--quick", "--out", str(a_file)],
        ["bench", "logprobs", "--quick", "--garbage"],
        ["bench", "kv", "--quick", "--out", str(a_file / "x")],
    ]


def test_every_bad_flag_is_a_usage_error(a_file, tmp_path, capsys):
    for argv in _bad_argvs(a_file, tmp_path):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2, f"{argv}: exit code {e.value.code}, stderr {err!r}"
        assert "Traceback" not in err and "error:" in err.strip().splitlines()[-1], f"{argv}: {err!r}"


def test_info_garbage_exits_2_as_a_process():
    r = subprocess.run(
        [sys.executable, "-m", "rapo_fast.cli", "info", "--garbage"], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 2, r
    assert r.stderr.strip().splitlines()[-1].startswith("rapo-fast: error:"), r.stderr


def test_version_flag_prints_the_package_version(capsys):
    import rapo_fast

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"rapo-fast {rapo_fast.__version__}"


def test_info_reports_version_commit_and_library_versions(capsys):
    import json

    import rapo_fast

    assert cli.main(["info"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["rapo_fast"] == rapo_fast.__version__
    assert "commit" in info and (info["commit"] is None or len(info["commit"]) >= 7)
    for key in ("python", "platform", "torch", "transformers", "trl", "extension", "cuda_available"):
        assert key in info, key
