"""Every touch of verl's internals by rapo_fast's verl plugin, in one module, behind a version gate.

What it is: INTERNALS (each verl name the plugin touches, with why), `get`, `patch`, `replace`/`restore` and
`validate_flag` (the only routes by which the other plugin modules reach verl), `check_version` (the gate plugin.py
runs before registering; RAPO_FAST_VERL_UNCHECKED=1 makes it a warning) and `missing(row)`.
What it is not: the plugin's logic, nor ray (the step buffer uses ray's public API), nor verl's public config keys.
Importing it imports no verl: `get`/`patch` import the module of the row they are given.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "SUPPORTED_RANGE",
    "UNCHECKED_ENV",
    "Internal",
    "INTERNALS",
    "installed_version",
    "version_supported",
    "check_version",
    "get",
    "patch",
    "replace",
    "restore",
    "validate_flag",
    "missing",
]

# 0.9.1 is the pinned version and the only one the tests run on. 0.9.0 lacks verl/trainer/ppo/checkpoint_callback.py
# (the checkpoint hook the step buffer is saved through); 0.8.0 also lacks the `verl.plugins` entry points, the v1
# trainer and continuous_token's MergeResult: verl's minor releases move these internals, so the next minor is out.
SUPPORTED_MIN, SUPPORTED_BELOW = (0, 9, 1), (0, 10)
SUPPORTED_RANGE = ">=0.9.1,<0.10"
UNCHECKED_ENV = "RAPO_FAST_VERL_UNCHECKED"
KINDS = ("import", "attribute", "patch", "override", "frame-local", "field", "registry")

# The names the frame walk and the data routes read (their rows are in INTERNALS).
RUN_AGENT_LOOP, TRAJECTORY_LOCAL, VALIDATE_KEY = "_run_agent_loop", "trajectory", "validate"
UID_KEY = "uid"  # the non-tensor field the G copies of a prompt share
SESSION_KEY = "session_id"  # v1 agent-loop worker: each copy's index in [0, n), passed to the loop's run()
EXTRA_FIELDS_KEY = "extra_fields"  # v1 trainer: an agent loop's extra_fields, one dict per sample
TOOL_EXTRA_FIELDS_KEY = "tool_extra_fields"  # a reward manager's view of the agent loop's extra_fields
PROMPT_LEN_KEY, RESPONSE_LEN_KEY, REWARD_SCORE_KEY = "prompt_len", "response_len", "reward_score"
TQ_TRAIN_PARTITION = "train"  # the v1 trainer's TransferQueue partition of the training batch


@dataclass(frozen=True)
class Internal:
    """One verl internal: `target` is "module:qualname" (qualname empty: the module itself); `detail` is the attribute,
    data key, local variable or entry-point group read on it (kinds "attribute", "field", "frame-local", a module's
    "registry"); `optional` rows may be absent (the plugin then skips that route, e.g. no transfer_queue)."""

    kind: str
    target: str
    why: str
    detail: str = ""
    optional: bool = False

    @property
    def name(self) -> str:
        return f"{self.target}[{self.detail}]" if self.detail else self.target


_AL = "verl.experimental.agent_loop.agent_loop"
_TAL = "verl.experimental.agent_loop.tool_agent_loop"
_CA = "verl.trainer.ppo.core_algos"
_RM = "verl.experimental.reward_loop.reward_manager"
_EW = "verl.workers.engine_workers"


def _rows(kind: str, target: str, details: tuple[str, ...], why: str) -> tuple[Internal, ...]:
    return tuple(Internal(kind, target, why, d) for d in details)


INTERNALS: tuple[Internal, ...] = (
    # plugin loading and the gate
    Internal("registry", "verl:", "`import verl` loads this entry-point group: plugin.py is ours", "verl.plugins"),
    Internal("attribute", "verl:", "the gate's version when verl's package metadata is missing", "__version__"),
    # the agent loop (agent_loop.py)
    Internal("import", f"{_TAL}:ToolAgentLoop", "RAPOToolAgentLoop subclasses verl's multi-turn tool loop"),
    Internal("import", f"{_TAL}:AgentState", "the tool-state handler's result, compared with GENERATING"),
    Internal("attribute", f"{_TAL}:AgentState", "retrieve only when the loop goes on generating", "GENERATING"),
    Internal("override", f"{_TAL}:ToolAgentLoop.run", "sets RAPO's per-run state, adds the rapo_* extra_fields"),
    Internal("override", f"{_TAL}:ToolAgentLoop.ct_merge_assistant_token", "records each assistant turn's span"),
    Internal("override", f"{_TAL}:ToolAgentLoop._handle_processing_tools_state", "the step boundary: retrieval"),
    *_rows(
        "attribute",
        f"{_TAL}:ToolAgentLoop",
        ("config", "rollout_config", "tokenizer", "loop", "response_length"),
        "read by the subclass: the rapo section, rollout.n, history decoding, executor, room left",
    ),
    *_rows(
        "attribute",
        f"{_TAL}:AgentData",
        ("prompt_ids", "response_mask", "response_logprobs"),
        "a retrieved segment is appended to the running tokens with mask 0 and log-prob 0",
    ),
    Internal(
        "attribute",
        "verl.utils.tokenizer.continuous_token:MergeResult",
        "an assistant turn's length",
        "appended_token_count",
    ),
    *_rows(
        "attribute",
        f"{_AL}:AgentLoopOutput",
        ("extra_fields", "response_ids", "response_mask", "response_logprobs"),
        "the rapo_* fields are computed on the final response and added",
    ),
    Internal(
        "frame-local",
        f"{_AL}:AgentLoopWorker.{RUN_AGENT_LOOP}",
        "holds the batch's validate flag, which verl passes to no agent loop (validate_flag walks up to it)",
        TRAJECTORY_LOCAL,
    ),
    Internal("field", f"{_AL}:get_trajectory_info", "the trajectory key of meta_info['validate']", VALIDATE_KEY),
    Internal("field", "verl.trainer.ppo.ray_trainer:", "the G copies' shared uid keys the member counter", UID_KEY),
    Internal("registry", f"{_AL}:register", "registers the agent loop 'rapo_tool_agent'"),
    # the loss (actor_loss.py, policy_loss.py, logprobs.py)
    Internal("patch", f"{_EW}:ppo_loss", "wrapped so the micro-batch's retrieved mask reaches the policy loss"),
    Internal("patch", f"{_EW}:distillation_ppo_loss", "wrapped like ppo_loss", optional=True),
    Internal("import", "verl.workers.utils.losses:ppo_loss", "rapo_ppo_loss's default base loss"),
    Internal(
        "field",
        "verl.workers.utils.padding:no_padding_2_padding",
        "response lengths counted as verl counts them",
        "responses",
    ),
    Internal(
        "field",
        "verl.trainer.ppo.v1.agent_loop_tq:",
        "v1 trainer: one extra_fields dict per sample",
        EXTRA_FIELDS_KEY,
        optional=True,
    ),
    Internal(
        "field",
        "verl.trainer.ppo.v1.agent_loop_tq:",
        "v1 worker: each copy's index among the prompt's n copies is the member number (else the uid counter)",
        SESSION_KEY,
        optional=True,
    ),
    Internal("registry", f"{_CA}:register_policy_loss", "registers the policy losses 'rapo', 'rapo_no_dual_clip'"),
    Internal(
        "attribute",
        "verl.workers.config.actor:ActorConfig",
        "the loss's global normalisers (dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)",
        "global_batch_info",
    ),
    Internal(
        "patch",
        "verl.utils.experimental.torch_functional:FusedLinearForPPO",
        "opt-in (RAPO_FAST_VERL_FUSED_LOGPROBS=1): verl's fused actor forward runs rapo_fast's kernel",
    ),
    Internal(
        "patch",
        "verl.models.transformers.monkey_patch:is_trl_available",
        "trl >= 1.16 lacks the value-head class verl's monkey patch imports when trl exists (trl_clash.py)",
    ),
    # the advantage estimator (advantage.py)
    Internal("import", f"{_CA}:compute_grpo_outcome_advantage", "A_acc is verl's GRPO advantage, called"),
    Internal("registry", f"{_CA}:register_adv_est", "registers the advantage estimator 'rapo'"),
    Internal("registry", f"{_CA}:ADV_ESTIMATOR_REGISTRY", "read and popped: registering again is idempotent"),
    Internal(
        "patch",
        "verl.trainer.ppo.ray_trainer:compute_advantage",
        "legacy trainer: non_tensor_batch made visible to 'rapo'",
        optional=True,
    ),
    Internal("patch", "verl.trainer.ppo.v1.utils:compute_advantage", "v1 trainer: as above", optional=True),
    Internal(
        "patch",
        "verl.trainer.ppo.v1.trainer_base:compute_advantage_for_multi_trajectories",
        "v1 trainer: extra_fields read from TransferQueue for 'rapo'",
        optional=True,
    ),
    Internal(
        "import",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer",
        "v1 trainer: RAPO's rapo/* figures merged into each step's metrics (metrics.py)",
        optional=True,
    ),
    Internal(
        "override",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer._compute_advantage",
        "wrapped: takes the step's metrics dict, which it updates with the rapo/* figures",
        optional=True,
    ),
    Internal("import", "transfer_queue:kv_batch_get", "v1 trainer: reads the batch's extra_fields", optional=True),
    Internal(
        "field",
        "verl.trainer.ppo.v1.trainer_base:",
        "the training batch's TransferQueue partition",
        TQ_TRAIN_PARTITION,
        optional=True,
    ),
    # the buffer growth (buffer_growth.py) and the buffer's setup (buffer_setup.py)
    Internal("import", f"{_RM}.base:RewardManagerBase", "RapoRewardManager subclasses it"),
    Internal("override", f"{_RM}.base:RewardManagerBase.run_single", "the inner manager's score, then the growth"),
    Internal("attribute", f"{_RM}.base:RewardManagerBase", "decodes the steps it adds", "tokenizer"),
    Internal("import", f"{_RM}:get_reward_manager_cls", "builds the inner reward manager"),
    Internal("registry", f"{_RM}.registry:register", "registers the reward manager 'rapo'"),
    Internal("registry", f"{_RM}.registry:REWARD_MANAGER", "read: registering again is idempotent"),
    *_rows(
        "field",
        f"{_AL}:AgentLoopWorker._compute_score",
        (TOOL_EXTRA_FIELDS_KEY, PROMPT_LEN_KEY, RESPONSE_LEN_KEY),
        "what run_single gets: the loop's extra_fields and the token counts",
    ),
    Internal("field", f"{_RM}.naive:NaiveRewardManager.run_single", "the inner score", REWARD_SCORE_KEY),
    Internal("import", "verl.utils.checkpoint.checkpoint_manager:find_latest_ckpt_path", "the step resumed from"),
    Internal("import", "verl.trainer.ppo.reward:resolve_reward_manager_cls", "checks the job's reward manager"),
    Internal(
        "registry",
        "verl.trainer.ppo.checkpoint_callback:build_checkpoint_callback",
        "builds the class named "
        "by trainer.checkpoint_callback_class (StepBufferCheckpointCallback) and calls its on_save",
    ),
)
_BY_TARGET = {(r.target, r.kind): r for r in INTERNALS if not r.detail}


def installed_version() -> str:
    """The installed verl's version: its package metadata, else the `__version__` of an imported verl. Raises
    ImportError when there is neither."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("verl")
    except PackageNotFoundError:
        v = getattr(sys.modules.get("verl"), "__version__", None)
        if isinstance(v, str):
            return v
        raise ImportError(
            f"rapo_fast's verl plugin: verl is not installed (supported: verl{SUPPORTED_RANGE}): pip install -e "
            '".[verl]" in a checkout (rapo-fast[verl]), with the constraint of README "RAPO on verl"'
        ) from None


def version_supported(version: str) -> bool:
    """Whether `version` is in SUPPORTED_RANGE, compared by its release numbers (a pre-, post- or dev-release of
    0.9.2 counts as 0.9.2); False for a version string that does not start with numbers."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    if m is None:
        return False
    release = tuple(int(p) for p in m.group(1).split("."))
    return SUPPORTED_MIN <= release and release[: len(SUPPORTED_BELOW)] < SUPPORTED_BELOW


def check_version(version: str | None = None) -> str:
    """The gate plugin.py runs first: returns the installed verl's version (or `version`) when it is in
    SUPPORTED_RANGE; otherwise raises RuntimeError naming it and the range, or, with RAPO_FAST_VERL_UNCHECKED=1,
    warns and returns it. Raises ImportError when verl is not installed."""
    v = installed_version() if version is None else version
    if version_supported(v):
        return v
    msg = (
        f"rapo_fast's verl plugin supports verl{SUPPORTED_RANGE}, but verl {v} is installed: it reaches into verl "
        f"internals (rapo_fast.integrations.verl.verl_compat.INTERNALS) that other versions may lack or change. "
        f"Install verl==0.9.1, or set {UNCHECKED_ENV}=1 to load the plugin anyway (untested)."
    )
    if os.environ.get(UNCHECKED_ENV, "") == "1":
        warnings.warn(msg + f" Loading anyway: {UNCHECKED_ENV}=1.", RuntimeWarning, stacklevel=2)
        return v
    raise RuntimeError(msg)


def _row(target: str, kinds: tuple[str, ...]) -> Internal:
    for kind in kinds:
        row = _BY_TARGET.get((target, kind))
        if row is not None:
            return row
    raise KeyError(f"verl_compat: {target!r} is not in INTERNALS as one of {kinds}: list it there first")


def _resolve(target: str) -> Any:
    module, _, qualname = target.partition(":")
    obj = importlib.import_module(module)
    for part in filter(None, qualname.split(".")):
        obj = getattr(obj, part)
    return obj


def get(target: str) -> Any:
    """The verl object `target` ("module:qualname", a row of INTERNALS of kind import, registry or patch), imported
    now. Raises KeyError for a target not in the table, ImportError/AttributeError when verl lacks it."""
    return _resolve(_row(target, ("import", "registry", "patch")).target)


def patch(target: str, wrap: Callable[[Any], Any]) -> bool:
    """Replace the module attribute `target` (a "patch" row) by `wrap(current value)`; returns whether it did. A
    missing attribute is left alone (False); a module that cannot be imported raises, unless the row is optional."""
    row = _row(target, ("patch",))
    module, _, attr = row.target.partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError:
        if row.optional:
            return False
        raise
    if not hasattr(mod, attr):
        return False
    setattr(mod, attr, wrap(getattr(mod, attr)))
    return True


def replace(target: str, new: Any) -> None:
    """Put `new` at the module attribute `target` (a "patch" row), keeping verl's own value for `restore`
    (idempotent)."""
    module, _, attr = _row(target, ("patch",)).target.partition(":")
    mod = importlib.import_module(module)
    if getattr(mod, attr) is not new:
        setattr(mod, f"_verl_{attr}", getattr(mod, attr))
        setattr(mod, attr, new)


def restore(target: str) -> None:
    """Put verl's own value of `target` back (no-op when `replace` did not replace it)."""
    module, _, attr = _row(target, ("patch",)).target.partition(":")
    mod = importlib.import_module(module)
    original = getattr(mod, f"_verl_{attr}", None)
    if original is not None:
        setattr(mod, attr, original)


def validate_flag() -> bool | None:
    """Whether verl's AgentLoopWorker._run_agent_loop up the call stack runs a validation batch (its `trajectory`
    argument holds the batch's meta_info["validate"]; verl 0.9.1 passes it to no agent loop), or None outside it."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == RUN_AGENT_LOOP:
            traj = frame.f_locals.get(TRAJECTORY_LOCAL)
            if isinstance(traj, Mapping) and VALIDATE_KEY in traj:
                return bool(traj[VALIDATE_KEY])
        frame = frame.f_back
    return None


def _source(obj: Any) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _has_attribute(cls: Any, name: str) -> bool:
    """An attribute of verl class `cls`: a class attribute, an annotated field, or set as self.<name> in its code."""
    if hasattr(cls, name):
        return True
    mro = [c for c in getattr(cls, "__mro__", (cls,)) if c is not object]
    if any(name in getattr(c, "__annotations__", {}) for c in mro):
        return True
    pattern = re.compile(rf"\bself\.{re.escape(name)}\s*(:[^=\n]*)?=")
    return any(pattern.search(_source(c)) for c in mro)


def missing(row: Internal) -> str | None:
    """None when `row` exists in the installed verl, else what is missing. Raises ImportError when the row's module
    cannot be imported (the caller decides: an optional row may be absent)."""
    module, _, qualname = row.target.partition(":")
    importlib.import_module(module)
    try:
        obj = _resolve(row.target)
    except AttributeError as e:
        return f"{row.target}: {e}"
    if row.kind == "override" and not callable(obj):
        return f"{row.target}: not a method"
    if row.kind == "frame-local":
        code = getattr(inspect.unwrap(obj), "__code__", None)
        if code is None or row.detail not in code.co_varnames:
            return f"{row.target}: no local variable {row.detail!r}"
    if row.kind == "attribute" and not _has_attribute(obj, row.detail):
        return f"{row.target}: no attribute {row.detail!r}"
    if row.kind in ("field", "registry") and row.detail:
        text = _source(obj)
        if f'"{row.detail}"' not in text and f"'{row.detail}'" not in text:
            return f"{row.target}: the key {row.detail!r} is not in its source"
    return None
