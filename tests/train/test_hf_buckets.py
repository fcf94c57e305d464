"""Tests of the length buckets of rapo_fast.train.hf_model: length_buckets is a partition of the rows with the least
cost (against every partition into contiguous runs of the sorted rows), final_hidden_buckets gives final_hidden's
states and gradients at every attended position and 0 after a row's end, bad overhead. Not here: the trainer's use of
them (test_trainer.py)."""

import itertools
import random

import pytest
import torch

from rapo_fast.demo.tiny_policy import build_tiny_policy
from rapo_fast.train.hf_model import final_hidden, final_hidden_buckets, length_buckets


def _cost(buckets, lengths, overhead):
    return sum(len(b) * max(lengths[i] for i in b) + overhead for b in buckets)


def test_length_buckets_partition_with_the_least_cost():
    rng = random.Random(0)
    for _ in range(30):
        lengths = [rng.choice([3, 5, 20, 21, 60, 120]) for _ in range(rng.randint(1, 9))]
        overhead = rng.choice([0, 8, 64, 1000])
        got = length_buckets(lengths, overhead)
        assert sorted(i for b in got for i in b) == list(range(len(lengths)))
        flat = [i for b in got for i in b]
        assert [lengths[i] for i in flat] == sorted(lengths)  # buckets of the rows sorted by length
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        best = min(
            _cost([order[a:b] for a, b in zip((0, *cuts), (*cuts, len(order)))], lengths, overhead)
            for k in range(len(order))
            for cuts in itertools.combinations(range(1, len(order)), k)
        )
        assert _cost(got, lengths, overhead) == best
    assert length_buckets([], 64) == []
    assert length_buckets([4, 100], 0) == [[0], [1]] and length_buckets([4, 100], 10**6) == [[0, 1]]


def test_length_buckets_refuses_a_bad_overhead():
    with pytest.raises(ValueError, match=r"length_buckets: overhead: expected an int in \[0, .*\], got -1"):
        length_buckets([1, 2], -1)


def test_final_hidden_buckets_equals_final_hidden_on_attended_positions():
    torch.manual_seed(0)
    model = build_tiny_policy(40, hidden_size=32, num_heads=2, num_kv_heads=1, seed=0)
    lengths = [3, 17, 4, 30, 16, 5]
    T = max(lengths)
    ids = torch.randint(1, 40, (len(lengths), T))
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = ids * mask
    want = final_hidden(model, ids, mask)
    got = final_hidden_buckets(model, ids, mask, overhead=0)  # one bucket per distinct length
    m = mask.bool()
    torch.testing.assert_close(got[m], want[m], rtol=1e-5, atol=1e-5)
    assert got[~m].abs().max() == 0
    # gradients of a loss over the attended positions agree as well
    w = torch.randn(want.shape)
    g_want = torch.autograd.grad((want * w)[m].sum(), list(model.parameters()))
    g_got = torch.autograd.grad((got * w)[m].sum(), list(model.parameters()))
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
