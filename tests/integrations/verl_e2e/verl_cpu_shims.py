"""Test-side shims that let verl 0.9.1's own `python -m verl.trainer.main_ppo` run on a CPU-only machine.

What it is: a module verl imports in every process through `VERL_USE_EXTERNAL_MODULES=verl_cpu_shims` (verl/__init__.py
imports it before the `verl.plugins` entry points, so before rapo_fast's plugin). It fills verl 0.9.1's CPU gaps:
- a "cpu" platform (verl registers only nvidia/huawei/amd: plugin/platform/platform_manager.py), set as the platform;
  it reports Ray's "GPU" resource, so the job runs on logical GPUs (`ray_init.num_gpus`);
- the FSDP engine registered for device "cpu" (verl registers it for cuda/npu only: workers/engine/fsdp/
  transformer_impl.py);
- a gloo-only process group: verl asks for "cpu:gloo,<device>:<backend>", which torch refuses as "cpu:gloo,cpu:gloo"
  (utils/distributed.py);
- an "hf" rollout backend (verl has none without vLLM/SGLang: workers/rollout/base.py, replica.py): one Ray server
  actor per replica generating with transformers, token in / token out, and a worker-side adapter that receives
  verl's weight sync and pushes the weights to its server (`extra_fields["global_steps"]` = the synced step).
What it is not: part of rapo_fast (nothing here is RAPO's), a fast or faithful inference engine (no batching, no
KV cache, sampling only: temperature / top-k / top-p), or usable for anything but tests.
"""

from __future__ import annotations

import os
import types
from contextlib import contextmanager

import torch

# -- the "cpu" platform ---------------------------------------------------------------------------------------------


def _noop(*_a, **_k):
    return None


class _CPUDeviceModule(types.SimpleNamespace):
    """What verl calls on `get_torch_device()`: torch.cpu where it has the function, no-ops (or zeros) otherwise."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name, _noop)

    @staticmethod
    def mem_get_info(*_a):
        return (64 << 30, 64 << 30)

    memory_allocated = memory_reserved = max_memory_allocated = max_memory_reserved = staticmethod(lambda *_a: 0)
    is_available = staticmethod(lambda: True)
    device_count = staticmethod(lambda: 1)
    current_device = staticmethod(lambda: "cpu")
    get_device_name = staticmethod(lambda *_a: "cpu")
    get_rng_state = staticmethod(lambda *_a: torch.get_rng_state())
    set_rng_state = staticmethod(lambda state, *_a: torch.set_rng_state(state))


_DEVICE_MODULE = _CPUDeviceModule()


def _register_platform() -> None:
    from verl.plugin.platform import platform_manager
    from verl.plugin.platform.platform_base import PlatformBase

    @platform_manager.PlatformRegistry.register(platform="cpu")
    class PlatformCPU(PlatformBase):
        device_name = property(lambda self: "cpu")
        vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: _DEVICE_MODULE)

        def is_available(self):
            return True

        def current_device(self):  # verl moves tensors with .to(get_device_id()): an int would mean cuda:<int>
            return "cpu"

        def device_count(self):
            return 1

        def set_device(self, device_index):
            return None

        def synchronize(self, device_index=None):
            return None

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        def manual_seed_all(self, seed):
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings):
            return None

        def empty_cache(self):
            return None

        def get_device_capability(self, device_index=0):
            return None, None

        def communication_backend_name(self):
            return "gloo"

        def visible_devices_envvar(self):
            return "CUDA_VISIBLE_DEVICES"

        @contextmanager
        def nvtx_range(self, msg):
            yield

        def profiler_start(self):
            return None

        def profiler_stop(self):
            return None

        def ray_resource_name(self):  # Ray's logical GPUs stand for the devices (ray_init.num_gpus)
            return "GPU"

        def ray_noset_envvars(self):
            return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

        def is_ipc_supported(self):
            return False

        def cudart(self):
            return None

    platform_manager.set_platform(PlatformCPU())


def _register_fsdp_engine() -> None:
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device="cpu")(FSDPEngineWithLMHead)


def _gloo_only_process_groups() -> None:
    """torch refuses a backend string naming the cpu device twice ("cpu:gloo,cpu:gloo"): make it plain "gloo"."""
    import torch.distributed as dist

    original = dist.init_process_group
    if getattr(original, "_cpu_shim", False):
        return

    def init_process_group(*args, backend=None, **kwargs):
        if isinstance(backend, str) and "," in backend and all(p.endswith(":gloo") for p in backend.split(",")):
            backend = "gloo"
        return original(*args, backend=backend, **kwargs)

    init_process_group._cpu_shim = True
    dist.init_process_group = init_process_group


# -- the "hf" rollout backend ---------------------------------------------------------------------------------------

SERVER_PREFIX = "hf_rollout_server_"


class HFServer:
    """One replica's token-in / token-out server: a transformers causal LM on the CPU, sampled one token at a time
    with a full forward (tiny test models only). Log-probs are of the temperature-scaled distribution (vLLM's
    `processed_logprobs`)."""

    def __init__(self, config, model_config, replica_rank: int):
        from transformers import AutoModelForCausalLM

        self.config, self.replica_rank = config, replica_rank
        path = model_config.local_path if hasattr(model_config, "local_path") else model_config["path"]
        self.model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
        self.eos = self.model.config.eos_token_id
        gen = getattr(self.model, "generation_config", None)
        if gen is not None and gen.eos_token_id is not None:
            self.eos = gen.eos_token_id
        self.eos = set(self.eos if isinstance(self.eos, list) else [self.eos])
        self.global_steps = None
        self.weight_updates = 0

    async def update_weights(self, state: dict, global_steps):
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        if unexpected:
            raise KeyError(f"hf rollout server: unexpected weights {unexpected}")
        self.global_steps = global_steps
        self.weight_updates += 1

    async def generate(self, prompt_ids, sampling_params, request_id, **_):
        from verl.workers.rollout.replica import TokenOutput

        params = dict(sampling_params)
        prompt_ids = list(prompt_ids)
        budget = self.config.prompt_length + self.config.response_length - len(prompt_ids)
        max_new = max(1, min(params.get("max_tokens", self.config.response_length), budget))
        temperature = float(params.get("temperature", 1.0) or 1.0)
        top_k, top_p = int(params.get("top_k", -1) or -1), float(params.get("top_p", 1.0) or 1.0)
        gen = torch.Generator().manual_seed(hash(request_id) & 0x7FFFFFFF)
        ids, out, lps = torch.tensor([prompt_ids]), [], []
        for _ in range(max_new):
            with torch.no_grad():
                logits = self.model(ids).logits[0, -1].float()
            logp = torch.log_softmax(logits / temperature, -1)
            probs = logp.exp()
            if top_k > 0:
                probs[probs < torch.topk(probs, top_k).values[-1]] = 0
            if top_p < 1.0:
                sorted_p, order = probs.sort(descending=True)
                drop = sorted_p.cumsum(0) - sorted_p > top_p
                probs[order[drop]] = 0
            tok = int(torch.multinomial(probs / probs.sum(), 1, generator=gen))
            out.append(tok)
            lps.append(float(logp[tok]))
            ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
            if tok in self.eos:
                break
        return TokenOutput(
            token_ids=out,
            log_probs=lps if params.get("logprobs") else None,
            stop_reason="completed",
            extra_fields={"global_steps": self.global_steps},
        )

    async def stats(self):
        return {"weight_updates": self.weight_updates, "global_steps": self.global_steps}

    # The control surface verl's replicas and checkpoint manager call: nothing to free or pause here.
    async def wake_up(self, *a, **k):
        return None

    sleep = clear_kv_cache = release_kv_cache = resume_kv_cache = resume_generation = wake_up
    start_profile = stop_profile = set_global_steps = wait_for_requests_to_drain = wake_up

    async def abort_all_requests(self, *a, **k):
        return {}


def _rollout_classes():
    import ray
    from verl.workers.rollout.base import BaseRollout
    from verl.workers.rollout.replica import RolloutReplica

    class HFReplica(RolloutReplica):
        """One HFServer actor per replica (rollout TP 1), named so the workers' adapters find it."""

        def rollout_worker_use_gpu(self) -> bool:
            return False

        async def launch_servers(self):
            name = f"{SERVER_PREFIX}{self.replica_rank}{self.name_suffix}"
            server = (
                ray.remote(HFServer)
                .options(name=name, num_cpus=0, max_concurrency=self.max_concurrency)
                .remote(self.config, self.model_config, self.replica_rank)
            )
            await server.stats.remote()  # constructed (the model is loaded) before the first request
            self.servers = [server]
            self._server_handle = server
            self._server_address = f"hf-replica-{self.replica_rank}{self.name_suffix}"

    class HFServerAdapter(BaseRollout):
        """The actor worker's rollout: receives verl's weight sync (full tensors, every rank iterates the generator
        because FSDP gathers them collectively) and pushes them to its replica's server."""

        def __init__(self, config, model_config, device_mesh, replica_rank: int = -1):
            super().__init__(config, model_config, device_mesh)
            world = self.config.tensor_model_parallel_size * self.config.data_parallel_size
            rank = int(os.environ["RANK"])
            self.replica_rank = rank // world if replica_rank == -1 else replica_rank
            self._leader = rank % world == 0
            self._server = None

        async def resume(self, tags):
            return None

        async def release(self):
            return None

        async def update_weights(self, weights, wire_format="named_tensors", **kwargs):
            state = {}
            if hasattr(weights, "__aiter__"):
                async for name, tensor in weights:
                    state[name] = tensor.detach().to("cpu", copy=True)
            else:
                for name, tensor in weights:
                    state[name] = tensor.detach().to("cpu", copy=True)
            if self._leader:
                if self._server is None:
                    self._server = ray.get_actor(f"{SERVER_PREFIX}{self.replica_rank}")
                await self._server.update_weights.remote(state, kwargs.get("global_steps"))

    return HFReplica, HFServerAdapter


def _register_rollout() -> None:
    from verl.workers.rollout import base, replica

    replica.RolloutReplicaRegistry.register("hf", lambda: _rollout_classes()[0])
    base._ROLLOUT_REGISTRY[("hf", "async")] = f"{__name__}.HFServerAdapter"


def __getattr__(name):  # verl's get_rollout_class imports the adapter by name, after ray is up
    if name == "HFServerAdapter":
        return _rollout_classes()[1]
    raise AttributeError(name)


def install() -> None:
    _register_platform()
    _register_fsdp_engine()
    _gloo_only_process_groups()
    _register_rollout()


install()
