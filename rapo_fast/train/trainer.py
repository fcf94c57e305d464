"""RAPOTrainer: the thin RL trainer, the training step of docs/training.md section 1 as a loop of replaceable callables.

What this is: `RAPOTrainer` (its step, metrics log and checkpoint/resume) and `train`, the one training loop (which
checkpoints on SIGTERM), which callers hook into with TrainerCallback objects (rapo_fast/train/callbacks.py) rather
than writing their own loop around `step`.
What this is not: a distributed trainer or a serving engine; the configuration lives in rapo_fast/train/config.py,
I/O helpers in rapo_fast/train/io.py. Importing it never imports rapo_fast.demo.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from rapo_fast._checks import check_bool, check_instance, check_int
from rapo_fast.loss.options import LossOptions
from rapo_fast.rollouts.batch import KIND_GEN, KIND_RET, RolloutBatch
from rapo_fast.train.callbacks import TrainerCallback
from rapo_fast.train.config import TrainerConfig
from rapo_fast.train.hf_model import final_hidden_buckets, lm_head_weight, scored_positions
from rapo_fast.train.io import MetricsLogger, load_checkpoint, save_checkpoint

__all__ = [
    "RAPOTrainer",
    "TrainerConfig",
    "default_rewards",
    "retrieval_rewards",
    "Retrieval",
    "step_loss_options",
    "onpolicy_steps",
    "hard_attribution",
]


def default_rewards(env, problems: Sequence, batch: RolloutBatch) -> torch.Tensor:
    """Outcome rewards [B] fp32 from the environment's verifier."""
    return torch.tensor([float(env.verify(problems[int(i)], c)) for i, c in zip(batch.prompt_index, batch.completions)])


class Retrieval(NamedTuple):
    """One row of RolloutBatch.retrievals [R, 5], by name: the trajectory (row), the step_spans indices of the steps
    before and after the retrieval (step_after -1: none after it), the payload id and the retrieved token count."""

    row: int
    step_before: int
    step_after: int
    payload: int
    tokens: int


def retrieval_rewards(batch: RolloutBatch, step_ent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per trajectory Z [B] (mean of tanh(2 H_delta) H_before over its retrievals, 0 without) and the number of
    retrievals with a step before and after them [B]. step_ent [S]: entropy of each step of batch.step_spans."""
    from rapo_fast.loss.advantages import retrieval_reward

    per_row: list[list[Retrieval]] = [[] for _ in range(batch.batch_size)]
    for r in map(Retrieval._make, batch.retrievals.tolist()):
        if r.step_before >= 0 and r.step_after >= 0:  # scored: a step on each side to compare
            per_row[r.row].append(r)
    hb = torch.full((len(per_row), max([1, *map(len, per_row)])), float("nan"), dtype=torch.float32)
    ha = hb.clone()
    for row, rets in enumerate(per_row):
        for j, r in enumerate(rets):
            hb[row, j], ha[row, j] = step_ent[r.step_before], step_ent[r.step_after]
    return retrieval_reward(hb, ha), torch.tensor([len(rets) for rets in per_row], dtype=torch.int64)


def onpolicy_steps(batch: RolloutBatch, rewards: torch.Tensor, tokenizer) -> tuple[list[str], list[str], list[int]]:
    """(histories, steps, group ids) of the generated tool steps of the successful trajectories (reward > 0.5), the
    answer step and whole off-policy trajectories left out: what StepTraces.add_steps takes."""
    hist, steps, groups = [], [], []
    off = batch.offpolicy_rows.tolist()
    for (row, start, end), obs_end in zip(batch.step_spans.tolist(), batch.step_obs_end.tolist()):
        if rewards[row] <= 0.5 or obs_end == end:  # failed trajectory, or the answer step (not a tool step)
            continue
        if off[row]:  # a whole off-policy trajectory (strategy "offpolicy_traj"): the source's steps, not ours
            continue
        ids = batch.input_ids[row]
        hist.append(tokenizer.decode(ids[:start]))
        steps.append(tokenizer.decode(ids[start:obs_end]))
        groups.append(int(batch.group_ids[row]))
    return hist, steps, groups


def mini_batch_rows(group_ids: torch.Tensor, groups_per_mini_batch: int | None) -> list[torch.Tensor]:
    """Row indices of each PPO mini-batch: groups_per_mini_batch whole prompt groups each, in first-appearance order
    (None: one of every row), as verl's actor splits by ppo_mini_batch_size prompts: a group's rows stay together."""
    gid = group_ids.reshape(-1)
    if groups_per_mini_batch is None:
        return [torch.arange(gid.numel())]
    order = list(dict.fromkeys(gid.tolist()))  # unique, first-appearance order
    chunks = [order[i : i + groups_per_mini_batch] for i in range(0, len(order), groups_per_mini_batch)]
    return [torch.nonzero(torch.isin(gid, torch.tensor(c, dtype=gid.dtype))).reshape(-1) for c in chunks]


def hard_attribution(batch: RolloutBatch, adv: torch.Tensor) -> torch.Tensor:
    """ARPO hard attribution: per token [B, T-1] (shifted coordinates), a sampled token shared by several branches
    (same origin id) gets the mean advantage of the branches holding it; other tokens keep their row's advantage."""
    origin = batch.shifted()["origin"]
    out = adv[:, None].expand_as(origin).clone().float()
    ok = origin >= 0
    if not ok.any():
        return out
    ids, inv = torch.unique(origin[ok], return_inverse=True)
    s = torch.zeros(len(ids)).index_add_(0, inv, out[ok])
    n = torch.zeros(len(ids)).index_add_(0, inv, torch.ones_like(out[ok]))
    out[ok] = (s / n)[inv]
    return out


class LossTensors(NamedTuple):
    """One update's tensors, rows selectable (`select`): the model's input [B, T] and the loss's per-token tensors of
    the shifted batch [B, T-1] under rapo_loss's argument names (advantages [B], or [B, T-1] with hard attribution;
    behav_logp None unless truncated IS applies, step_loss_options)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    old_logp: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    retrieved_mask: torch.Tensor
    response_mask: torch.Tensor
    behav_logp: torch.Tensor | None

    def select(self, rows: torch.Tensor | None) -> LossTensors:
        """These rows (None: all, no copy)."""
        return self if rows is None else LossTensors(*(None if v is None else v[rows] for v in self))

    def packed(self, hidden: torch.Tensor, opts: LossOptions) -> dict[str, Any]:
        """The loss_fn's tensor keywords, packed (docs/training.md, "The loss contract"): of each row [B, T-1] and of
        hidden [B, T-1, H] the scored positions (scored_positions), rows one after another, with cu_seqlens. Under
        seq-mean-token-sum-norm the padded width T-1 is global_num_tokens (the flat form would take the longest row's).
        Per-row advantages [B] go in per token: a flat [S] vector would read as per token whenever S equals N."""
        keep = scored_positions(self.attention_mask)
        per_token = self._asdict()
        del per_token["input_ids"], per_token["attention_mask"]
        adv = self.advantages
        per_token["advantages"] = adv if adv.dim() == 2 else adv[:, None].expand(keep.shape)
        dev = hidden.device
        cu = torch.zeros(keep.shape[0] + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(keep.sum(1).cpu(), 0)
        out = {k: v[keep.to(v.device)].to(dev) for k, v in per_token.items() if v is not None}
        g = hidden.shape[1] if opts.loss_agg == "seq-mean-token-sum-norm" else None
        return dict(out, hidden=hidden[keep.to(dev)], cu_seqlens=cu.to(dev), global_num_tokens=g)


def step_loss_options(config: TrainerConfig, batch: RolloutBatch) -> LossOptions:
    """The one LossOptions of a step's loss calls: config.loss at the sampling temperature, with metrics. Truncated IS
    (tis_cap, with the rollout's behaviour log-probs) applies in splice mode to a batch with retrieved tokens only,
    where the sampling policy saw spliced K/V (docs/kv_splice.md); elsewhere the behaviour log-probs are the policy's
    own and tis_cap is None."""
    spliced = config.rollout.mode == "splice" and bool((batch.kinds == KIND_RET).any())
    off = {} if spliced else {"tis_cap": None}
    return config.loss.replace(temperature=config.rollout.temperature or 1.0, return_metrics=True, **off)


@contextlib.contextmanager
def _sigterm_flag(active: bool) -> Iterator[list]:
    """A list that a SIGTERM appends to while active, in place of SIGTERM's disposition, which is restored on exit.
    Only the main thread can handle signals (elsewhere nothing changes); an ignored SIGTERM stays ignored."""
    got: list = []
    previous = signal.getsignal(signal.SIGTERM)
    if not active or threading.current_thread() is not threading.main_thread() or previous in (signal.SIG_IGN, None):
        yield got
        return
    signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        yield got
    finally:
        signal.signal(signal.SIGTERM, previous)


class RAPOTrainer:
    """model (HF causal LM), tokenizer, env (task: `execute`, `verify`), buffer (a StepTraces or None), config
    (TrainerConfig), problems (the training prompts). Stages are replaceable callables (rollout_fn, reward_fn,
    advantage_fn, loss_fn: docs/training.md section 1). Every loss_fn (rapo_loss by default, a partial of it, your
    own) gets the same call: the rows packed with cu_seqlens and the step's LossOptions as `options` (docs/training.md,
    "The loss contract"). task_sampler: `step -> (env, problems)`, called before every step with its 0-based index,
    replaces both for that step (e.g. fresh facts per step); None: `prompts_per_step` problems drawn from `problems`,
    in `env`."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        env,
        buffer,
        config: TrainerConfig,
        problems: Sequence,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        rollout_fn: Callable | None = None,
        reward_fn: Callable | None = None,
        advantage_fn: Callable | None = None,
        loss_fn: Callable | None = None,
        offpolicy=None,
        task_sampler: Callable[[int], tuple[Any, Sequence]] | None = None,
    ):
        check_instance("RAPOTrainer: config", config, TrainerConfig, "a TrainerConfig").validate()
        ro = config.rollout
        retrieves = ro.strategy == "hybrid" and ro.hybrid.n_hybrid > 0
        if retrieves and buffer is None:
            raise ValueError("RAPOTrainer: buffer: expected a StepTraces (strategy='hybrid', n_hybrid > 0), got None")
        if ro.mode == "splice" and (buffer is None or getattr(buffer, "kv_store", None) is None) and retrieves:
            raise ValueError("RAPOTrainer: buffer: expected a StepTraces(kv_store=...) (mode='splice'), got none")
        if not problems:
            raise ValueError("RAPOTrainer: problems: expected at least one training prompt, got none")
        if task_sampler is not None and not callable(task_sampler):
            raise TypeError(
                f"RAPOTrainer: task_sampler: expected a callable or None, got {type(task_sampler).__name__}"
            )
        if ro.strategy == "offpolicy_traj" and offpolicy is None:
            raise ValueError(
                "RAPOTrainer: offpolicy: expected a rapo_fast.rollouts.offpolicy.OffPolicyTrajectories (from the JSONL "
                "the step buffer is built from) with strategy='offpolicy_traj', got None"
            )
        from rapo_fast.loss.advantages import rapo_advantages
        from rapo_fast.loss.policy_loss import rapo_loss
        from rapo_fast.rollouts.loop import rollout

        self.model, self.tokenizer, self.env, self.buffer, self.config = model, tokenizer, env, buffer, config
        self.offpolicy, self.task_sampler = offpolicy, task_sampler
        self.problems = list(problems)
        self.optimizer = optimizer or torch.optim.AdamW(
            model.parameters(), lr=config.optim.lr, weight_decay=config.optim.weight_decay
        )
        self.rollout_fn = rollout_fn or rollout
        self.reward_fn = reward_fn or default_rewards
        self.advantage_fn = advantage_fn or rapo_advantages
        self.loss_fn = loss_fn or rapo_loss
        self.step_count = 0
        self.py_rng = random.Random(config.seed)
        self.gen = torch.Generator().manual_seed(config.seed)
        self.logger = MetricsLogger(config.logging.log_csv, config.logging.tensorboard_dir)

    def sample_problems(self) -> list:
        """This step's problems; with a task_sampler, also this step's env."""
        if self.task_sampler is not None:
            self.env, problems = self.task_sampler(self.step_count)
            return list(problems)
        k = min(self.config.prompts_per_step, len(self.problems))
        return self.py_rng.sample(self.problems, k)

    def step(self) -> dict[str, float]:
        """One RL step; returns (and logs) its metrics: reward, success_rate (all rollouts), success_rate_onpolicy
        (rollouts neither hybrid nor off-policy), tokens_generated (tokens the policy sampled), retrieval_rate
        (hybrid rollouts with >= 1 retrieval), retrievals_per_traj, f_ret, retrieval_reward (mean Z over trajectories
        with a scored retrieval), loss, entropy, the loss's clip/ratio/TIS metrics, tokens_per_s (response tokens per
        rollout second), onpolicy_steps_added / onpolicy_steps_dropped (with add_onpolicy_steps: the successful
        tool steps the buffer stored / did not store, e.g. when pinned off-policy steps fill it) and seconds per phase
        (t_rollout excludes t_retrieval and t_splice; t_logprob, t_loss (forward + backward), t_optimizer, t_buffer)."""
        cfg, t0 = self.config, time.perf_counter()
        problems = self.sample_problems()
        if (
            cfg.rollout.mode == "splice"
            and self.buffer is not None
            and self.step_count % cfg.buffer.refresh_kv_every == 0
        ):
            self.buffer.refresh_kv()
        t_kv = time.perf_counter()
        batch: RolloutBatch = self.rollout_fn(
            self.model,
            self.tokenizer,
            self.env,
            problems,
            cfg.rollout,
            traces=self.buffer,
            offpolicy=self.offpolicy,
            generator=self.gen,
        )
        t_roll = time.perf_counter()
        rewards = self.reward_fn(self.env, problems, batch).float()
        metrics = self._update(batch, rewards)
        t_upd = time.perf_counter()
        n_added = n_dropped = 0
        if cfg.buffer.add_onpolicy_steps and self.buffer is not None:
            n_added, n_dropped = self._add_onpolicy(batch, rewards)
        self.step_count += 1
        t_end = time.perf_counter()
        n_tok = int(batch.response_mask.sum())
        n_ret = batch.num_retrievals()
        onpol = ~batch.hybrid & ~batch.offpolicy_rows  # rollouts that saw neither a retrieved step nor a whole trace
        metrics.update(
            step=self.step_count,
            reward=float(rewards.mean()),
            success_rate=float((rewards > 0.5).float().mean()),
            success_rate_onpolicy=float((rewards > 0.5).float()[onpol].mean()) if onpol.any() else float("nan"),
            tokens_generated=int((batch.kinds == KIND_GEN).sum()),
            retrieval_rate=float((n_ret > 0).float()[batch.hybrid].mean()) if batch.hybrid.any() else 0.0,
            retrievals_per_traj=float(n_ret.float().mean()),
            f_ret=float(batch.retrieved_fraction().mean()),
            tokens_per_s=n_tok / max(t_roll - t_kv, 1e-9),
            onpolicy_steps_added=n_added,
            onpolicy_steps_dropped=n_dropped,
            t_rollout=t_roll - t_kv - batch.timings.get("retrieval", 0.0) - batch.timings.get("splice", 0.0),
            t_retrieval=batch.timings.get("retrieval", 0.0),
            t_splice=batch.timings.get("splice", 0.0) + (t_kv - t0),
            t_buffer=t_end - t_upd,
            t_step=t_end - t0,
        )
        self.logger.log(metrics)
        # the last step's rollouts and the problems their prompt_index points into, for callbacks that read them
        self.last_batch, self.last_problems = batch, problems
        return metrics

    def _update(self, batch: RolloutBatch, rewards: torch.Tensor) -> dict[str, float]:
        """The learning half of a step: score, advantages, the loss's tensors and options, the optimiser steps, and
        their metrics (docs/training.md section 1, steps 5 to 8)."""
        t0 = time.perf_counter()
        s, old_logp, ent = self._old_logprobs(batch)
        adv, z, n_scored = self._advantages(batch, rewards, ent)
        t1 = time.perf_counter()
        opts = step_loss_options(self.config, batch)
        names = ("input_ids", "attention_mask", "targets", "loss_mask", "retrieved_mask", "response_mask")
        behav = s["behav_logp"] if opts.tis_cap is not None else None
        tensors = LossTensors(**{k: s[k] for k in names}, old_logp=old_logp, advantages=adv, behav_logp=behav)
        loss_val, lm, t_opt = self._optimise(tensors, opts, batch.group_ids)
        t2 = time.perf_counter()
        has_ret = n_scored > 0
        out = {
            "loss": loss_val,
            "retrieval_reward": float(z[has_ret].mean()) if has_ret.any() else float("nan"),
            "entropy": float(ent[s["loss_mask"]].mean()) if s["loss_mask"].any() else 0.0,
            "adv_abs_mean": float(adv.abs().mean()),
            "t_logprob": t1 - t0,
            "t_loss": t2 - t1 - t_opt,
            "t_optimizer": t_opt,
        }
        keys = ("clip_frac_low", "clip_frac_high", "ratio_mean", "approx_kl", "tis_weight_mean")
        return out | {k: lm[k] for k in keys if k in lm}

    def _old_logprobs(self, batch: RolloutBatch) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        """The shifted batch, and its old log-probs and entropies [B, T-1] (no grad, at the sampling temperature): at
        the scored positions only (packed); the others, which score padding and are never read, stay 0."""
        from rapo_fast.loss.logprobs import token_logprobs

        s = batch.shifted()
        dev = next(self.model.parameters()).device
        with torch.no_grad():
            h = final_hidden_buckets(self.model, s["input_ids"].to(dev), s["attention_mask"].to(dev))[:, :-1]
            keep = scored_positions(s["attention_mask"])
            lp, en = token_logprobs(
                hidden=h[keep.to(dev)],
                weight=lm_head_weight(self.model),
                targets=s["targets"][keep].to(dev),
                temperature=self.config.rollout.temperature or 1.0,
                return_entropy=True,
            )
        old_logp, ent = torch.zeros(keep.shape), torch.zeros(keep.shape)
        old_logp[keep], ent[keep] = lp.float().cpu(), en.float().cpu()
        return s, old_logp, ent

    def _advantages(
        self, batch: RolloutBatch, rewards: torch.Tensor, ent: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(advantages [B], or [B, T-1] with hard attribution; Z [B]; scored retrievals per row [B])."""
        from rapo_fast.loss.advantages import step_entropy

        step_ent = step_entropy(ent, batch.step_spans_shifted()) if batch.step_spans.numel() else torch.zeros(0)
        z, n_scored = retrieval_rewards(batch, step_ent)
        # ret_norm only when asked: a replaced advantage_fn keeps the 4-argument call it was written for
        av = self.config.advantages
        extra = {} if av.ret_norm == "group" else {"ret_norm": av.ret_norm, "retrieved": n_scored > 0}
        adv = self.advantage_fn(rewards, batch.group_ids, z, av.ret_coef, **extra).float()
        if self.config.rollout.strategy == "arpo" and av.advantage_attribution == "hard":
            adv = hard_attribution(batch, adv)
        return adv, z, n_scored

    def _optimise(
        self, tensors: LossTensors, opts: LossOptions, group_ids: torch.Tensor
    ) -> tuple[float, dict[str, float], float]:
        """optim.updates_per_step passes of optimiser steps over the mini-batches; returns (the last step's loss, the
        loss metrics' means over the steps, seconds in the optimiser)."""
        op = self.config.optim
        self.model.train()
        # one mini-batch of every row (the default) uses the tensors as they are: no gather of [B, T] copies
        parts = mini_batch_rows(group_ids, op.mini_batch_groups) if op.mini_batch_groups else [None]
        loss_val, sums, n_updates, t_opt = 0.0, {}, 0, 0.0
        for _ in range(op.updates_per_step):
            for rows in parts:
                loss, lm = self._mini_batch_loss(tensors.select(rows), opts)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                t_o = time.perf_counter()
                if op.max_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), op.max_grad_norm)
                self.optimizer.step()
                t_opt += time.perf_counter() - t_o
                loss_val, n_updates = float(loss.detach()), n_updates + 1
                for k, v in lm.scalars().items():
                    sums[k] = sums.get(k, 0.0) + float(v)
        return loss_val, {k: v / n_updates for k, v in sums.items()}, t_opt

    def _mini_batch_loss(self, t: LossTensors, opts: LossOptions):
        """loss_fn on one mini-batch (rows of the shifted batch), with gradients: hidden states recomputed with the
        current weights, old log-probs and advantages those of the whole rollout batch before its first update. The
        loss contract (docs/training.md): the rows packed, the step's LossOptions as `options`."""
        dev = next(self.model.parameters()).device
        h = final_hidden_buckets(self.model, t.input_ids.to(dev), t.attention_mask.to(dev))[:, :-1]
        return self.loss_fn(weight=lm_head_weight(self.model), **t.packed(h, opts), options=opts)

    def _add_onpolicy(self, batch: RolloutBatch, rewards: torch.Tensor) -> tuple[int, int]:
        """The successful trajectories' generated tool steps go into the buffer under their prompt's group id; returns
        (steps the buffer stored, steps it dropped): a buffer whose every slot holds a pinned off-policy step keeps
        none of them (StepTraces.add_steps)."""
        hist, steps, groups = onpolicy_steps(batch, rewards, self.tokenizer)
        _, slots = self.buffer.add_steps(hist, steps, groups, return_slots=True)
        stored = int((slots >= 0).sum())
        return stored, len(steps) - stored

    def train(
        self,
        num_steps: int,
        *,
        progress: bool = True,
        callback: Callable[[dict], Any] | None = None,
        callbacks: Sequence[TrainerCallback] = (),
        desc: str = "rl",
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_on_sigterm: bool = True,
    ) -> list[dict]:
        """Run up to `num_steps` RL steps (`step()`); returns their metrics, one dict per step run.

        callbacks: TrainerCallback objects (rapo_fast.train.callbacks, e.g. EvalCallback for an evaluation inside
        the loop): called before the first step, after every step (they may add metrics and return True to stop
        training) and at the end; their progress_fields() join the progress bar. callback: a plain function called
        with each step's metrics (cannot stop training). progress: a tqdm bar named `desc` showing the training
        success rate, the retrieval rate and the callbacks' fields (plain lines when stderr is not a terminal).

        SIGTERM (a scheduler preempting the job): with `checkpoint_dir` given and `checkpoint_on_sigterm` (the
        default), while train runs in the main thread a SIGTERM lets the step in progress finish, saves a checkpoint
        into checkpoint_dir (save_checkpoint), then meets SIGTERM's previous disposition (the default ends the process
        by SIGTERM; a handler of yours runs, and if it returns, training stops as after a callback's stop).
        checkpoint_on_sigterm=False, no checkpoint_dir, or an ignored SIGTERM: SIGTERM is left alone.
        """
        num_steps = check_int("train: num_steps", num_steps, lo=0)
        check_instance("train: checkpoint_dir", checkpoint_dir, (str, os.PathLike, type(None)), "a path or None")
        check_bool("train: checkpoint_on_sigterm", checkpoint_on_sigterm)
        callbacks = [
            check_instance("train: callbacks", cb, TrainerCallback, "TrainerCallback objects") for cb in callbacks
        ]
        history: list[dict] = []
        try:
            # every callback sees each event, even after one of them asked to stop (hence lists, not any(generator))
            stop = any([cb.on_train_begin(self, num_steps) for cb in callbacks])
            bar = None
            if progress:
                from rapo_fast.train.progress import progress_bar

                bar = progress_bar(num_steps, desc)
            with _sigterm_flag(checkpoint_dir is not None and checkpoint_on_sigterm) as term:
                try:
                    self._loop(num_steps, history, stop, callback, callbacks, bar, term)
                finally:
                    if bar is not None:
                        bar.close()
                if term:
                    self.save_checkpoint(checkpoint_dir)
            if term:
                signal.raise_signal(signal.SIGTERM)  # its previous disposition is back: the default ends the process
            for cb in callbacks:
                cb.on_train_end(self, history)
        finally:
            self.logger.close()  # TensorBoard's writer (a thread, a file), on error too; a later step opens a new one
        return history

    def _loop(self, num_steps, history, stop, callback, callbacks, bar, term) -> None:
        """train's steps: until num_steps ran, a callback stopped, or a SIGTERM came (`term`, from _sigterm_flag)."""
        while not stop and not term and len(history) < num_steps:
            m = self.step()
            history.append(m)
            if callback is not None:
                callback(m)
            stop = any([cb.on_step_end(self, self.step_count, m) for cb in callbacks])
            if bar is not None:
                fields = {"success": f"{m['success_rate']:.2f}", "ret": f"{m['retrieval_rate']:.2f}"}
                for cb in callbacks:
                    fields.update(cb.progress_fields())
                bar.set_postfix(fields)
                bar.update(1)

    def save_checkpoint(self, directory: str | Path) -> Path:
        return save_checkpoint(self, directory)

    def load_checkpoint(self, directory: str | Path) -> None:
        load_checkpoint(self, directory)
