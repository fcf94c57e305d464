"""rapo_fast: custom kernels for retrieval-augmented RL of LLM agents (RAPO, ARPO).

This module is the public API and nothing else: every public name is re-exported here, resolved lazily on first use
so that `import rapo_fast` stays cheap (no Triton, no extension load until needed). Everything not listed in
`__all__` is private. See README.md for the status of each path and docs/ for the design and contracts.
"""

from __future__ import annotations

import importlib
from typing import Any

from rapo_fast import _source_tree

__version__ = "0.1.0"

# From a checkout without an install (PYTHONPATH only, as on the GPU validation machine), `rapo_fast.kernels` must
# still resolve to the repository's kernels/ folder (rapo_fast/_source_tree.py says why and how).
_source_tree.install()

# public name -> module that defines it
_PUBLIC: dict[str, str] = {
    # fused log-prob and policy loss
    "token_logprobs": "rapo_fast.loss.logprobs",
    "rapo_loss": "rapo_fast.loss.policy_loss",
    "RAPOLoss": "rapo_fast.loss.policy_loss",
    "presets": "rapo_fast.loss.presets",
    "step_entropy": "rapo_fast.loss.advantages",
    "retrieval_reward": "rapo_fast.loss.advantages",
    "rapo_advantages": "rapo_fast.loss.advantages",
    # step buffer and retrieval
    "StepBuffer": "rapo_fast.retrieval.buffer",
    "ShardedStepBuffer": "rapo_fast.retrieval.sharded",
    # KV splicing
    "StepKVStore": "rapo_fast.kv.store",
    "splice_kv": "rapo_fast.kv.splice",
    "RopeSpec": "rapo_fast.kv.rope",
    # rollout, trainer
    "StepTraces": "rapo_fast.retrieval.step_traces",
    "rollout": "rapo_fast.rollouts.loop",
    "RolloutConfig": "rapo_fast.rollouts.config",
    "RAPOTrainer": "rapo_fast.train.trainer",
    "TrainerConfig": "rapo_fast.train.config",
    # build facts
    "build_info": "rapo_fast._ext",
}

__all__ = sorted(_PUBLIC) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'rapo_fast' has no attribute {name!r}")
    mod = importlib.import_module(module)
    # `presets` is a module of dicts; the others are attributes of their module.
    value = mod if name == "presets" and not hasattr(mod, "presets") else getattr(mod, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
