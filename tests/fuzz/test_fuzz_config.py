"""Property tests of `TrainerConfig` and of the command line's argument parsing (`rapo_fast.cli.main`) (hypothesis;
budget in tests/helpers/strategies.py).

Properties: a config of valid field values validates and round-trips through dict, JSON and YAML unchanged; one bad
field value (NaN/inf, out of range, a bool or str for a number, an unknown loss key) raises a ValueError/TypeError
naming the field; `info` with any extra arguments exits with code 2, never a traceback. Not here: the trainer itself
(tests/train/), the fixed list of bad command lines (tests/test_cli.py).
"""

from __future__ import annotations

import math
import re

import pytest
from helpers.strategies import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from rapo_fast import TrainerConfig
from rapo_fast.cli import main as cli_main

NAN, INF = math.nan, math.inf
# field (dotted) -> valid values (defaults of the other fields keep the combination valid)
GOOD = {
    "rollout.group_size": [16, 8],
    "rollout.hybrid.retrieve_prob": [0.0, 0.5, 1.0],
    "rollout.temperature": [1.0, 0.5],
    "optim.lr": [1e-3, 0.0],
    "optim.weight_decay": [0.0, 0.01],
    "optim.max_grad_norm": [None, 1.0],
    "advantages.ret_coef": [0.2, 0.0],
    "rollout.arpo.alpha": [0.5, 1.0],
    "rollout.mode": ["exact", "splice"],
    "seed": [0, 123],
    "optim.updates_per_step": [1, 2],
    "rollout.arpo.rule": ["paper", "released"],
    "rollout.arpo.topk": [1, 10],
    "optim.mini_batch_groups": [None, 1, 3],
}
# field -> values each of which must be refused naming the field (every kind of bad value, several of each)
BAD = {
    "optim.lr": [NAN, INF, -1.0, "1e-3", True],
    "rollout.temperature": [NAN, INF, 0.0, -1.0, None],
    "rollout.hybrid.retrieve_prob": [NAN, 1.5, -0.1, INF],
    "advantages.ret_coef": [NAN, INF, -INF],
    "optim.max_grad_norm": [NAN, INF, -1.0],
    "rollout.arpo.alpha": [NAN, 2.0, -0.5],
    "rollout.arpo.beta": [NAN, INF],
    "optim.weight_decay": [NAN, INF, -1.0],
    "loss.tis_cap": [0.0, NAN, -1.0],
    "rollout.hybrid.n_hybrid": [True, -1, 17, 2.0],
    "seed": [True, 1.5, "0", None],
    "rollout.group_size": [0, -1, True, 2.5],
    "rollout.exclude_own_group": ["yes", 1],
    "rollout.strategy": ["", "HYBRID", None],
    "rollout.mode": ["fast", 0],
    "loss": [{"not_an_option": 1}, {"beta": 0.1}, "RAPO"],
}


@fuzz_settings(30)
@given(data=st.data())
def test_valid_config_validates_and_round_trips(data):
    names = data.draw(st.lists(st.sampled_from(sorted(GOOD)), unique=True, max_size=4))
    cfg = TrainerConfig().replace({n: data.draw(st.sampled_from(GOOD[n])) for n in names}).validate()
    assert TrainerConfig.from_dict(cfg.to_dict()) == cfg
    assert TrainerConfig.from_json(cfg.to_json()) == cfg
    assert TrainerConfig.from_yaml(cfg.to_yaml()) == cfg


@fuzz_settings(60)
@given(field=st.sampled_from(sorted(BAD)), data=st.data())
def test_bad_field_is_refused_with_its_name(field, data):
    value = data.draw(st.sampled_from(BAD[field]))
    others = data.draw(st.lists(st.sampled_from(sorted(set(GOOD) - {field})), unique=True, max_size=3))
    kw = {n: data.draw(st.sampled_from(GOOD[n])) for n in others}  # valid neighbours must not mask the bad field
    with pytest.raises((ValueError, TypeError), match=re.escape(field)):
        TrainerConfig().replace({**kw, field: value}).validate()


def _exit_code(argv: list[str]) -> int:
    try:
        return int(cli_main(argv) or 0)
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else 2 if code else 0


@fuzz_settings(30)
@given(flags=st.lists(st.sampled_from(["--x", "-q", "--help=1", "7", "--", "-", "info"]), min_size=1, max_size=3))
def test_info_with_any_extra_argument_exits_2(flags, capsys):
    code = _exit_code(["info", *flags])
    err = capsys.readouterr().err
    assert code == 2, (flags, code)
    assert "Traceback" not in err
