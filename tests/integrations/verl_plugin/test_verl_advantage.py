"""The "rapo" advantage estimator (rapo_fast/integrations/verl/advantage.py) with verl 0.9.1.

Real verl code on the path: the estimator registry (register_adv_est / get_adv_estimator_fn), verl's
`compute_advantage` (verl/trainer/ppo/ray_trainer.py, the legacy trainer's entry, wrapped by `register()`), v1's
`compute_advantage_for_multi_trajectories` (verl/trainer/ppo/v1/utils.py, as trainer_base binds it after
`register()`), and verl's `compute_grpo_outcome_advantage`, the reference for the no-retrieval case. Driven around
it: TransferQueue (its `kv_batch_get` is replaced by a dict of TensorDicts built with verl's own
list_of_dict_to_tensordict, as the v1 agent loop stores samples) and the rollout that produces the fields.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("datasets", reason="verl imports datasets (its absence must skip, not break collection)")

from omegaconf import OmegaConf  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.trainer.ppo import ray_trainer as rt  # noqa: E402

from rapo_fast.integrations.verl import advantage as adv_mod  # noqa: E402
from rapo_fast.loss.advantages import rapo_advantages, retrieval_reward  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _registered():
    adv_mod.register()
    adv_mod.register()  # idempotent


def _obj(rows):
    out = np.empty(len(rows), dtype=object)
    out[:] = rows
    return out


def _batch(seed: int, retrieval: bool = True):
    """3 groups of 4 (uids "a", "b", "c"), binary-ish outcome rewards at the last response token, ragged responses;
    with retrieval, rows of groups "a" and "b" carry step entropies before/after 0..2 retrievals ("c" none)."""
    g = torch.Generator().manual_seed(seed)
    B, T = 12, 7
    uids = _obj(["a"] * 4 + ["b"] * 4 + ["c"] * 4)
    lens = torch.randint(2, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lens[:, None]).float()
    scores = torch.randint(0, 2, (B,), generator=g).float() + 0.1 * torch.rand(B, generator=g)
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), lens - 1] = scores
    h_before, h_after = [[] for _ in range(B)], [[] for _ in range(B)]
    if retrieval:
        for i in range(8):
            n = int(torch.randint(0, 3, (1,), generator=g))
            h_before[i] = (0.2 + torch.rand(n, generator=g)).tolist()
            h_after[i] = (0.2 + torch.rand(n, generator=g)).tolist()
        h_before[1], h_after[1] = [0.9, 0.0], [0.3, 0.5]  # H_b = 0 contributes 0
    return dict(rewards=rewards, mask=mask, uids=uids, scores=scores, hb=h_before, ha=h_after)


def _dataproto(b, fields: bool = True):
    non_tensors = {"uid": b["uids"]}
    if fields:
        non_tensors.update(rapo_h_before=_obj(b["hb"]), rapo_h_after=_obj(b["ha"]))
    return DataProto.from_dict(
        tensors={"token_level_rewards": b["rewards"].clone(), "response_mask": b["mask"]}, non_tensors=non_tensors
    )


def _algo(**kw):
    return OmegaConf.create({"adv_estimator": "rapo", "norm_adv_by_std_in_grpo": True, "gamma": 1.0, "lam": 1.0, **kw})


def _grpo(b, norm=True):
    out, _ = core_algos.compute_grpo_outcome_advantage(
        b["rewards"].clone(), b["mask"], b["uids"], norm_adv_by_std_in_grpo=norm
    )
    return out


def _want(b, a=0.2, ret_norm="group"):
    """rapo_fast's helpers: Z = retrieval_reward (NaN-padded [B, R]), A = rapo_advantages(outcome, groups, Z, a) with
    ret_norm (for "retrieved", the rows with a non-empty rapo_h_before list)."""
    B = len(b["hb"])
    R = max(1, max(len(h) for h in b["hb"]))
    hb = torch.full((B, R), float("nan"), dtype=torch.float64)
    ha = hb.clone()
    for i, (x, y) in enumerate(zip(b["hb"], b["ha"])):
        hb[i, : len(x)] = torch.tensor(x, dtype=torch.float64)
        ha[i, : len(y)] = torch.tensor(y, dtype=torch.float64)
    groups = torch.tensor([{"a": 0, "b": 1, "c": 2}[u] for u in b["uids"]])
    z = retrieval_reward(hb, ha)
    retrieved = torch.tensor([len(h) > 0 for h in b["hb"]])
    extra = {} if ret_norm == "group" else {"ret_norm": ret_norm, "retrieved": retrieved}
    return rapo_advantages(b["rewards"].sum(-1).double(), groups, z, a=a, **extra).float()[:, None] * b["mask"]


def test_registered_in_verl():
    assert core_algos.get_adv_estimator_fn("rapo") is adv_mod.compute_rapo_outcome_advantage
    assert getattr(rt.compute_advantage, "_rapo_wrapped", False)


@pytest.mark.parametrize("fields", [False, True])
def test_no_retrieval_is_exactly_grpo(fields):
    """Through verl's compute_advantage: "rapo" on a batch without retrieval == verl's GRPO, bit for bit."""
    b = _batch(seed=0, retrieval=False)
    got = rt.compute_advantage(_dataproto(b, fields), adv_estimator="rapo", config=_algo()).batch["advantages"]
    want = rt.compute_advantage(_dataproto(b, False), adv_estimator="grpo", config=_algo()).batch["advantages"]
    assert torch.equal(got, want)
    # called the way verl calls a registered estimator (no batch fields at all)
    fn = core_algos.get_adv_estimator_fn("rapo")
    got2, ret2 = fn(token_level_rewards=b["rewards"].clone(), response_mask=b["mask"], index=b["uids"], config=_algo())
    assert torch.equal(got2, _grpo(b)) and torch.equal(ret2, got2)


def test_dr_grpo_flag_is_followed():
    b = _batch(seed=1, retrieval=False)
    got = rt.compute_advantage(_dataproto(b), adv_estimator="rapo", config=_algo(norm_adv_by_std_in_grpo=False)).batch[
        "advantages"
    ]
    assert torch.equal(got, _grpo(b, norm=False))


@pytest.mark.parametrize("a", [0.2, 0.5])
def test_retrieval_equals_rapo_fast_helpers(a):
    """With retrieval, through verl's compute_advantage (legacy trainer route: non_tensor_batch): the advantages
    equal rapo_fast.loss.advantages.rapo_advantages of the outcome scores and retrieval_reward; the group without
    retrieval keeps GRPO's advantages exactly."""
    b = _batch(seed=2)
    got = rt.compute_advantage(_dataproto(b), adv_estimator="rapo", config=_algo(rapo_ret_coef=a)).batch["advantages"]
    want = _want(b, a)
    assert torch.allclose(got, want, atol=2e-6, rtol=1e-5), (got - want).abs().max()
    grpo = _grpo(b)
    assert torch.equal(got[8:], grpo[8:])  # group "c": no retrieval, A_ret = 0
    assert not torch.allclose(got[:8], grpo[:8])


def test_ret_norm_retrieved_equals_rapo_fast_helpers():
    """algorithm.rapo_ret_norm="retrieved": A_ret is normalised over the rows with a scored retrieval
    only, as rapo_advantages(ret_norm="retrieved"); a row without one keeps GRPO's advantage exactly, also in a group
    where others retrieved. "group" is the default and differs from it on this batch."""
    b = _batch(seed=2)
    no_ret = [i for i, h in enumerate(b["hb"]) if not h]
    assert any(i < 8 for i in no_ret)  # a row without retrieval in a group with retrievals ("a" or "b")

    def run(**kw):
        return rt.compute_advantage(_dataproto(b), adv_estimator="rapo", config=_algo(**kw)).batch["advantages"]

    got = run(rapo_ret_norm="retrieved")
    want = _want(b, ret_norm="retrieved")
    assert torch.allclose(got, want, atol=2e-6, rtol=1e-5), (got - want).abs().max()
    assert torch.equal(got[no_ret], _grpo(b)[no_ret])
    group = run(rapo_ret_norm="group")
    assert torch.equal(group, run()) and not torch.allclose(got, group)


@pytest.mark.parametrize(("value", "exc"), [("all", ValueError), ("Group", ValueError), (1, TypeError)])
def test_bad_ret_norm_raises_before_any_work(value, exc):
    b = _batch(seed=2, retrieval=False)  # refused even when there is nothing to normalise
    with pytest.raises(exc, match="rapo_ret_norm"):
        adv_mod.compute_rapo_outcome_advantage(b["rewards"], b["mask"], b["uids"], config=_algo(rapo_ret_norm=value))


def test_v1_route_reads_extra_fields_from_transfer_queue(monkeypatch):
    """v1 trainer: compute_advantage_for_multi_trajectories (as trainer_base binds it) gets the rows' extra_fields
    from TransferQueue (a stand-in kv_batch_get holding verl-built TensorDicts) and gives the same advantages."""
    trainer_base = pytest.importorskip("verl.trainer.ppo.v1.trainer_base")
    import transfer_queue
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    adv_mod.register()  # trainer_base is imported now: wrap its name too
    b = _batch(seed=3)
    keys = [f"{u}_{i}_0" for i, u in enumerate(b["uids"])]
    store = {
        k: {"extra_fields": {"rapo_h_before": hb, "rapo_h_after": ha, "other": 1}}
        for k, hb, ha in zip(keys, b["hb"], b["ha"])
    }
    calls = []

    def kv_batch_get(keys, partition_id, select_fields=None):
        calls.append((partition_id, select_fields))
        return list_of_dict_to_tensordict([{f: store[k][f] for f in select_fields} for k in keys])

    monkeypatch.setattr(transfer_queue, "kv_batch_get", kv_batch_get)
    data = _dataproto(b, fields=False)  # v1's _compute_advantage builds a DataProto without the extra fields
    out = trainer_base.compute_advantage_for_multi_trajectories(
        data, batch_keys=keys, adv_estimator="rapo", num_repeat=4, config=_algo()
    )
    assert calls == [("train", ["extra_fields"])]
    assert torch.allclose(out.batch["advantages"], _want(b), atol=2e-6, rtol=1e-5)


def test_bad_fields_raise():
    b = _batch(seed=4)
    b["ha"][0] = b["ha"][0] + [0.5]
    with pytest.raises(ValueError, match="rapo_h_before"):
        rt.compute_advantage(_dataproto(b), adv_estimator="rapo", config=_algo())
    nt = {"uid": b["uids"], "rapo_h_before": _obj(b["hb"])}
    with pytest.raises(ValueError, match="both"):
        adv_mod.compute_rapo_outcome_advantage(b["rewards"], b["mask"], b["uids"], non_tensor_batch=nt)
    with pytest.raises(ValueError, match="token_level_rewards"):
        adv_mod.compute_rapo_outcome_advantage(b["rewards"][0], b["mask"][0], b["uids"])
