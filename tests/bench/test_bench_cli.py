"""`rapo-fast bench|info --help`: exit 0, name the subcommand in the usage line, list the benchmarks, describe every
option (no option left without a help text). Not a run of any benchmark (tests/bench/test_bench_*.py do that)."""

from __future__ import annotations

import re

import pytest

from rapo_fast import cli


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
