"""Concurrent interpreted launches: rapo_loss called from several threads under TRITON_INTERPRET=1 (the test setting
of the README and CI) gives, in every thread, the single-threaded loss and gradient.

Triton's interpreter patches `triton.language` process-wide for the length of each launch, so two launches running at
once break each other (an exception in most calls); rapo_fast._dispatch.device_guard, the context every launch runs
in, serialises interpreted launches with one lock. Not here: GPU launches (never serialised), the numerics
(test_loss.py).
"""

from __future__ import annotations

import threading

import pytest
import torch
from helpers.loss_cases import inputs_for, make_batch

import rapo_fast
from rapo_fast._dispatch import interpret_mode

THREADS, CALLS = 8, 2

pytestmark = pytest.mark.skipif(not interpret_mode(), reason="interpreted launches only (TRITON_INTERPRET=1)")


def _loss_and_grad(d):
    x, _ = inputs_for(d, torch.float32)
    loss = rapo_fast.rapo_loss(**x, entropy_coef=0.01)
    (g,) = torch.autograd.grad(loss, [x["logits"]])
    return loss.detach(), g


def test_threads_get_the_single_threaded_result():
    d = make_batch(2, 5, 33)
    want = _loss_and_grad(d)
    start = threading.Barrier(THREADS)
    results, errors = [], []

    def work():
        start.wait()  # every thread launches at once
        for _ in range(CALLS):
            try:
                results.append(_loss_and_grad(d))
            except Exception as exc:  # noqa: BLE001  (counted and reported below)
                errors.append(repr(exc))

    threads = [threading.Thread(target=work) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, f"{len(errors)} of {THREADS * CALLS} calls failed, first: {errors[0]}"
    assert len(results) == THREADS * CALLS
    for loss, g in results:
        assert torch.equal(loss, want[0]) and torch.equal(g, want[1])
