"""The `rapo-fast` command line refuses every bad flag with argparse's one-line error and exit code 2, for every
subcommand, before any work starts: once `info --garbage` exited 0, `demo --device cuda` without CUDA, `--device tpu`
and `--out FILE/x` gave tracebacks, `bench retrieval --repeats -3` failed with "no median for empty data", and
`--repeats 0` / `--threads 0` were accepted. `bench|info --help` exits 0, names the subcommand in the usage line, lists
the benchmarks and describes every option; `--version` and `info` report the versions. Not here: what the demo or a
benchmark computes (tests/demo, tests/bench).
"""

from __future__ import annotations

import re
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


def _help(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 0, argv
    return capsys.readouterr().out


def test_bench_help_lists_every_benchmark(capsys):
    out = _help(capsys, ["bench", "--help"])
    assert out.startswith("usage: rapo-fast bench")
    for name in cli.BENCHES:
        assert re.search(rf"^\s+{name}\b", out, re.M), (name, out)


@pytest.mark.parametrize("name", sorted(cli.BENCHES))
def test_each_bench_help_names_itself_and_describes_every_option(capsys, name):
    out = _help(capsys, ["bench", name, "--help"])
    assert out.startswith(f"usage: rapo-fast bench {name} "), out.splitlines()[0]
    assert "--out DIR" in out and "--record" in out and "--quick" in out
    assert not re.search(r"\b(item|issue) \d", out), out  # no internal item or issue numbers
    options = out.split("options:", 1)[1]
    # every option line ("  --flag [METAVAR]") is followed on the same line or the next by words of help
    lines = options.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^  (-[^\s,]+(?:, -[^\s,]+)?)(?: [A-Z{][^ ]*)?(.*)$", line)
        if m:
            text = m.group(2).strip() or (lines[i + 1].strip() if i + 1 < len(lines) else "")
            assert text and not text.startswith("-"), (name, line)


def test_info_help(capsys):
    out = _help(capsys, ["info", "--help"])
    assert out.startswith("usage: rapo-fast info")
    assert "JSON" in out


def test_version_flag_prints_the_package_version(capsys):
    import rapo_fast

    assert _help(capsys, ["--version"]).strip() == f"rapo-fast {rapo_fast.__version__}"


def test_info_reports_version_commit_and_library_versions(capsys):
    import json

    import rapo_fast

    assert cli.main(["info"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["rapo_fast"] == rapo_fast.__version__
    assert "commit" in info and (info["commit"] is None or len(info["commit"]) >= 7)
    for key in ("python", "platform", "torch", "transformers", "trl", "extension", "cuda_available"):
        assert key in info, key
