"""RAPO's `rapo/*` step figures (rapo_fast/integrations/verl/metrics.py) on hand-made agent-loop rows: the rollout,
advantage and buffer figures have the values counted by hand (the buffer's over a primary and its replica, and the
queue length and search time of an in-process actor's step), and the wrapped v1 `_compute_advantage` merges what was
recorded during it into verl's metrics dict (and nothing for a job without RAPO's fields). The figures of a real run:
tests/integrations/verl_e2e. Skipped without verl.
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("verl")
pytest.importorskip("datasets", reason="verl imports datasets (its absence must skip, not break collection)")

from rapo_fast.integrations.verl import metrics  # noqa: E402


def _row(hybrid, calls=0, scores=(), latency=(), skipped=None, spans=(), obs=(), validate=False, f=0.0, h=0):
    skipped = skipped or {}
    return {
        "rapo_hybrid": hybrid,
        "rapo_num_retrievals": len(scores) - skipped.get("too_long", 0) - skipped.get("no_room", 0),
        "rapo_retrieve_calls": calls,
        **{f"rapo_skipped_{r}": skipped.get(r, 0) for r in ("no_result", "too_long", "no_room")},
        "rapo_retrieval_scores": list(scores),
        "rapo_retrieve_latency_s": list(latency),
        "rapo_retrieve_in_flight": [0] * len(latency),
        "rapo_step_spans": [list(s) for s in spans],
        "rapo_step_obs_end": list(obs),
        "rapo_validate": validate,
        "rapo_f_ret": f,
        "rapo_h_before": [1.0] * h,
    }


def test_rollout_figures_counted_by_hand():
    rows = [
        _row(
            True,
            calls=3,
            scores=(0.5, 0.9),
            latency=(0.01, 0.03, 0.02),
            skipped={"no_result": 1, "no_room": 1},
            spans=((0, 6), (13, 19), (26, 32)),
            obs=(13, 26, 32),
            f=0.2,
            h=1,
        ),
        _row(False, spans=((0, 6), (13, 19)), obs=(13, 19)),
        {"other_loop": 1},  # a row of another agent loop: ignored
    ]
    m = metrics.rollout_metrics(rows, rewards=[1.0, 1.0, 1.0])
    p = "rapo/rollout/"
    assert m[p + "trajectories"] == 2 and m[p + "hybrid_frac"] == 0.5
    assert m[p + "retrievals_per_traj"] == 0.5 and m[p + "retrievals_per_hybrid_traj"] == 1.0
    assert m[p + "retrieve_calls"] == 3 and m[p + "skipped_no_result"] == 1 and m[p + "skipped_no_room"] == 1
    assert m[p + "skipped_too_long"] == 0 and m[p + "retrieved_frac"] == pytest.approx(0.1)
    assert m[p + "retrieval_score/mean"] == pytest.approx(0.7) and m[p + "retrieval_score/max"] == 0.9
    assert m[p + "search_latency_ms/mean"] == pytest.approx(20.0) and m[p + "scored_retrievals_per_traj"] == 0.5
    assert m[p + "growth_steps"] == 3  # tool steps of successful rows: 2 + 1 (the answer steps are not steps)
    assert metrics.rollout_metrics(rows, rewards=[0.0, 1.0, 0.0])[p + "growth_steps"] == 1
    assert metrics.rollout_metrics([{"other_loop": 1}]) == {}


def test_advantage_and_buffer_figures():
    m = metrics.advantage_metrics([0.5, 0.0, -0.5, 0.0], [1.0, 0.0, -1.0, 0.0], [True, False, True, False])
    assert m["rapo/adv/z_nonzero_frac/hybrid"] == 1.0 and m["rapo/adv/z_nonzero_frac/non_hybrid"] == 0.0
    assert m["rapo/adv/a_ret_nonzero_frac"] == 0.5 and m["rapo/adv/a_ret/max"] == 1.0
    assert m["rapo/adv/z/mean"] == 0.0 and m["rapo/adv/z/std"] == pytest.approx(0.125**0.5)  # population std
    shards = [{"size": 3, "steps_added": 2, "device": "cpu"}, {"size": 4, "steps_added": 1, "device": "cpu"}]
    b = metrics.buffer_metrics(shards)
    p = "rapo/buffer/"
    assert b == {p + "shards": 2.0, p + "replicas": 0.0, p + "size": 7.0, p + "steps_added": 3.0}
    step = {"pending": 1, "pending_max": 4, "step_queries": 2, "search_ms_sum": 10.0, "search_ms_max": 6.0}
    replica = {"size": 3, "steps_added": 2, "queries": 5, "pending": 0, "pending_max": 7, "step_queries": 3}
    replica |= {"search_ms_sum": 6.0, "search_ms_max": 2.0, "role": "replica"}
    b = metrics.buffer_metrics([{**shards[0], **step, "queries": 2, "role": "primary"}, replica])
    assert b == {
        **{p + "shards": 1.0, p + "replicas": 1.0, p + "size": 3.0, p + "steps_added": 2.0},  # held: the primary's
        **{p + "queries": 7.0, p + "step_queries": 5.0, p + "pending": 1.0},  # summed over the actors
        **{p + "pending_max": 7.0, p + "search_ms/max": 6.0, p + "search_ms/mean": 16.0 / 5},  # peaks; per query
    }
    assert p + "search_ms/mean" not in metrics.buffer_metrics([{"step_queries": 0, "search_ms_max": 0.0}])


def test_the_buffer_actors_queue_length_and_search_time():
    """Five retrieves reach an in-process actor at once (its 2 s window gathers them): five waited together, one
    search (made to take >= 30 ms) answered all 15 queries, its duration, not the window's wait, is each query's search
    time; the next step's window starts empty."""
    import time

    from rapo_fast.demo.tiny_policy import WordTokenizer
    from rapo_fast.integrations.verl.buffer_actor import StepBufferActor
    from rapo_fast.integrations.verl.buffer_client import StepBufferClient

    words = [f"w{i}" for i in range(50)]
    actor = StepBufferActor(None, WordTokenizer(words), "hashed:16", capacity=8, window_s=2.0)
    search = actor.traces.search
    actor.traces.search = lambda *a: time.sleep(0.03) or search(*a)
    keys = StepBufferClient(["h"], "hashed:16").encode([" ".join(words[i : i + 5]) for i in range(15)])

    async def step():
        await actor.add_steps(keys[:8], words[:8], list(range(8)))
        await asyncio.gather(*(actor.retrieve(keys[i : i + 3]) for i in range(0, 15, 3)))
        return metrics.buffer_metrics([await actor.stats()]), metrics.buffer_metrics([await actor.stats()])

    first, second = asyncio.run(step())
    p = "rapo/buffer/"
    assert first[p + "requests"] == 5 and first[p + "search_calls"] == 1 and first[p + "step_queries"] == 15
    assert first[p + "pending_max"] == 5 and first[p + "pending"] == 0
    assert 30 <= first[p + "search_ms/mean"] == first[p + "search_ms/max"] < 2000
    assert second[p + "step_queries"] == 0 and second[p + "pending_max"] == 0 and second[p + "queries"] == 15
    assert p + "search_ms/mean" not in second and p + "search_ms/max" not in second


def test_wrapped_compute_advantage_merges_the_recorded_figures(monkeypatch):
    monkeypatch.setattr(metrics, "_buffer_stats", lambda config: {"rapo/buffer/size": 5.0})

    class Trainer:
        config = {"rapo": {"onpolicy_reward_threshold": 0.5}}

        def _compute_advantage(self, batch, metrics_dict):
            if batch == "rapo":
                metrics.record_rows([_row(True, spans=((0, 6), (13, 19)), obs=(13, 19))], [1.0])
                metrics.record({"rapo/adv/z/mean": 0.25})
            metrics_dict["verl/own"] = 1.0
            return batch

    wrapped = metrics._wrap_compute_advantage(Trainer._compute_advantage)
    assert metrics._wrap_compute_advantage(wrapped) is wrapped
    got: dict = {}
    assert wrapped(Trainer(), "rapo", got) == "rapo"
    assert got["verl/own"] == 1.0 and got["rapo/adv/z/mean"] == 0.25 and got["rapo/buffer/size"] == 5.0
    assert got["rapo/rollout/growth_steps"] == 1.0 and got["rapo/rollout/hybrid_frac"] == 1.0
    plain: dict = {}
    wrapped(Trainer(), "grpo", plain)  # a job without RAPO: verl's figures only
    assert plain == {"verl/own": 1.0}


def test_registered_on_verls_v1_trainer():
    import verl  # noqa: F401  (loads the plugin)
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    assert getattr(PPOTrainer._compute_advantage, "_rapo_wrapped", False)
