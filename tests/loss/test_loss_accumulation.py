"""Gradient accumulation and data-parallel splits (docs/pitfalls.md #8): with `global_num_tokens` set to the global
normaliser, the losses and gradients of micro-batches / shards sum to the loss and gradient of one big batch, for every
aggregation mode, padded and flat inputs, the logits path (slices of one leaf) and the hidden path (a shared lm_head
weight). The normaliser is computed here from the masks the way a trainer would (or an all_reduce of the local
counts, which is what the tensor form stands in for). Not here: per-option semantics (test_loss_options.py).
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close_verbose
from helpers.loss_cases import AGG_MODES, FULL, make_batch

import rapo_fast

OPTION_SETS = {
    "rapo": dict(shaping_m=0.05, eps_low=0.28, eps_high=0.28),
    "full-gspo": dict(FULL, importance_sampling_level="sequence"),
}


def _global_norm(agg, d, opts, width):
    lm = d["loss_mask"]
    active = lm & ~d["retrieved_mask"] if opts.get("offpolicy_train", "none") == "none" else lm
    if agg == "token-mean":
        return int(active.sum())
    if agg == "seq-mean-token-sum-norm":
        return width
    if "cu_seqlens" in d:
        cu = d["cu_seqlens"].tolist()
        return sum(int(active[a:b].any()) for a, b in zip(cu[:-1], cu[1:]))
    return int(active.any(1).sum())


def _slice_padded(d, rows):
    return {k: (v if k in ("weight", "bias") else v[rows]) for k, v in d.items()}


def _slice_flat(d, s0, s1):
    cu = d["cu_seqlens"]
    a, b = int(cu[s0]), int(cu[s1])
    out = {}
    for k, v in d.items():
        if k in ("weight", "bias"):
            out[k] = v
        elif k == "cu_seqlens":
            out[k] = cu[s0 : s1 + 1] - a
        elif k == "advantages" and v.shape[0] == cu.numel() - 1:
            out[k] = v[s0:s1]
        else:
            out[k] = v[a:b]
    return out


def _leaves(d):
    keys = [k for k in ("logits", "hidden", "weight", "bias") if k in d]
    for k in keys:
        d[k] = d[k].detach().clone().requires_grad_(True)
    return keys


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("opt_name", list(OPTION_SETS))
@pytest.mark.parametrize("path", ["logits", "hidden"])
def test_padded_micro_batches_sum_to_big_batch(agg, opt_name, path):
    opts = dict(OPTION_SETS[opt_name], loss_agg=agg)
    d = make_batch(5, 4, 9, H=6 if path == "hidden" else None, masked_rows=(2,), per_seq_adv=True)
    leaves = _leaves(d)
    big = rapo_fast.rapo_loss(**d, **opts)
    big_grads = torch.autograd.grad(big, [d[k] for k in leaves])

    g = _global_norm(agg, d, opts, width=4)
    total = 0.0
    for rows in (slice(0, 2), slice(2, 3), slice(3, 5)):  # uneven micro-batches, one all-masked row alone
        mb = _slice_padded(d, rows)
        total = total + rapo_fast.rapo_loss(**mb, **opts, global_num_tokens=g)
    acc_grads = torch.autograd.grad(total, [d[k] for k in leaves])
    assert_close_verbose(total, big, atol=1e-6, name="loss")
    for k, a, b in zip(leaves, acc_grads, big_grads):
        assert_close_verbose(a, b, atol=1e-6, name=f"grad {k}")


@pytest.mark.parametrize("agg", AGG_MODES)
def test_flat_shards_sum_to_big_batch(agg):
    opts = dict(OPTION_SETS["full-gspo"], loss_agg=agg)
    lens = [3, 6, 1, 0, 4, 5]
    d = make_batch(seg_lens=lens, V=7, masked_rows=(2,), per_seq_adv=agg != "token-mean")
    leaves = _leaves(d)
    big = rapo_fast.rapo_loss(**d, **opts)
    (big_g,) = torch.autograd.grad(big, [d[k] for k in leaves])
    # the global normaliser as a tensor, as an all_reduce over ranks would give it
    g = torch.tensor(float(_global_norm(agg, d, opts, width=max(lens))))
    shards = [(0, 2), (2, 4), (4, 6)]
    losses = [rapo_fast.rapo_loss(**_slice_flat(d, a, b), **opts, global_num_tokens=g) for a, b in shards]
    total = sum(losses)
    (acc_g,) = torch.autograd.grad(total, [d[k] for k in leaves])
    assert_close_verbose(total, big, atol=1e-6, name="loss")
    assert_close_verbose(acc_g, big_g, atol=1e-6, name="grad logits")


def test_without_global_normaliser_the_mean_of_shards_differs():
    """Why the option exists: uneven token counts make the average of per-shard means a different objective."""
    d = make_batch(4, 6, 5)
    d["loss_mask"][:2, 1:] = False  # shard 0 has far fewer tokens than shard 1
    big = rapo_fast.rapo_loss(**d)
    halves = [rapo_fast.rapo_loss(**_slice_padded(d, s)) for s in (slice(0, 2), slice(2, 4))]
    assert abs(float((halves[0] + halves[1]) / 2 - big)) > 1e-3
