"""The registered search op `rapo_fast::retrieval_search`: calls the compiled CPU or CUDA backend of rapo_fast._C on
already-validated tensors, with a fake implementation so that a search traces under torch.compile.

`backend` ("auto" | "cpu" | "cuda" | "triton") picks the implementation as rapo_fast/retrieval/backends.py says; an
explicit backend that cannot run on the tensors raises ValueError.
What this is not: argument validation (rapo_fast/retrieval/buffer.py validates before calling; called directly, the op
still checks ranks, dtypes and devices) or the buffer itself.
Written without `from __future__ import annotations` because torch.library infers the op schema from the annotations.
"""

from typing import Optional

import torch

from rapo_fast._checks import KERNEL_FLOAT_DTYPES, check_optional_tensor, check_same_device, check_tensor
from rapo_fast._constants import CPU_ISA_AUTO, MAX_K, METRIC_CODES
from rapo_fast._dispatch import register_op
from rapo_fast._ext import DTYPE_CODES, dlpack, require_backend, stream_of
from rapo_fast.retrieval.backends import resolve_backend
from rapo_fast.retrieval.triton_search import triton_search

__all__ = ["MAX_K", "METRIC_CODES", "retrieval_search"]  # MAX_K, METRIC_CODES: from rapo_fast/_constants.py


def _check_op_inputs(keys, key_aux, groups, queries, exclude, centre) -> None:
    """Ranks, dtypes and devices, with the op's own messages (the extension checks every tensor again where it takes
    its pointer, and every extent): the op can be called directly, without StepBuffer's validation."""
    check_tensor("keys", keys, ndim=2, dtypes=KERNEL_FLOAT_DTYPES)
    check_tensor("queries", queries, ndim=2, dtypes=(keys.dtype,))
    for name, t, dt in (("key_aux", key_aux, torch.float32), ("groups", groups, torch.int64)):
        check_tensor(name, t, ndim=1, dtypes=(dt,))
    check_optional_tensor("exclude", exclude, ndim=1, dtypes=(torch.int64,))
    check_optional_tensor("centre", centre, shape=(queries.shape[1],), dtypes=(torch.float32,))
    check_same_device(queries=queries, keys=keys, key_aux=key_aux, groups=groups, exclude=exclude, centre=centre)


def _readable_rows(t: torch.Tensor) -> torch.Tensor:
    """t [N, D] in a layout the backends read (unit inner stride, rows that do not overlap: row stride >= D when
    N > 1), else a dense copy. Expanded (stride-0) views, overlapping as_strided views and column-strided views are
    copied; padded rows (row stride > D) are read in place."""
    n, d = t.shape
    if t.stride(-1) == 1 and (n <= 1 or t.stride(0) >= d):
        return t
    return t.contiguous()


def _search_impl(
    keys: torch.Tensor,
    key_aux: torch.Tensor,
    groups: torch.Tensor,
    queries: torch.Tensor,
    exclude: Optional[torch.Tensor],
    k: int,
    metric: int,
    min_score: float,
    centre: Optional[torch.Tensor] = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [C, D] (fp32/fp16/bf16, rows contiguous), key_aux [C] fp32, groups [C] int64, queries [Q, D] in the keys'
    dtype, exclude [Q] int64 or None, centre [D] fp32 or None (l2 on CPU: keys and queries are centred on it, key_aux
    unread), backend "auto" | "cpu" | "cuda" | "triton" -> (scores [Q, k] fp32, slots [Q, k] int64)."""
    _check_op_inputs(keys, key_aux, groups, queries, exclude, centre)
    # Every layout a caller can hand in is normalised here, before either backend sees it: an expanded query view
    # (stride 0 along Q, e.g. one history searched against several groups) used to reach the extension and be refused
    # as "a row stride is smaller than D", an error about no argument the caller gave.
    keys, queries = _readable_rows(keys), _readable_rows(queries)
    key_aux, groups = key_aux.contiguous(), groups.contiguous()
    exclude = None if exclude is None else exclude.contiguous()
    centre = None if centre is None else centre.contiguous()
    device = queries.device
    Q, D = queries.shape
    C = keys.shape[0]
    # backend "auto": CUDA tensors take the Triton kernel or the CUDA backend, per the crossover table or
    # RAPO_FAST_RETRIEVAL_BACKEND (rapo_fast/retrieval/triton_search.py; docs/retrieval.md, "Triton path"), CPU tensors
    # the C++ backend. An explicit backend is checked to run on these tensors (rapo_fast/retrieval/backends.py).
    if resolve_backend(backend, device, Q, C, D, keys.dtype, k, metric) == "triton":
        return triton_search(keys, key_aux, groups, queries, exclude, k, metric, min_score, centre)
    ext = require_backend(device)
    scores = torch.empty(Q, k, dtype=torch.float32, device=device)
    slots = torch.empty(Q, k, dtype=torch.int64, device=device)
    # Tensors cross as DLPack; the extension checks each where it takes its pointer (csrc/retrieval_bindings.cpp).
    tensors = dict(keys=keys, key_aux=key_aux, groups=groups, queries=queries, exclude=exclude, centre=centre)
    tensors.update(out_scores=scores, out_slots=slots)
    args = {name: dlpack(t) for name, t in tensors.items()}
    scalars = dict(k=k, metric=metric, min_score=float(min_score))
    if device.type == "cpu":
        ext.retrieval_search_cpu(**args, **scalars, num_threads=torch.get_num_threads(), isa=CPU_ISA_AUTO)
    else:
        dev = device.index if device.index is not None else torch.cuda.current_device()
        n_splits = int(ext.retrieval_cuda_splits(Q=Q, C=C, k=k, device=dev, D=D, dtype=DTYPE_CODES[keys.dtype]))
        ws_scores = torch.empty(n_splits, Q, k, dtype=torch.float32, device=device)
        ws_slots = torch.empty(n_splits, Q, k, dtype=torch.int32, device=device)
        ext.retrieval_search_cuda(
            **args,
            ws_scores=dlpack(ws_scores),
            ws_slots=dlpack(ws_slots),
            **scalars,
            device=dev,
            stream=stream_of(device),
        )
    return scores, slots


def _search_fake(keys, key_aux, groups, queries, exclude, k, metric, min_score, centre=None, backend="auto"):
    Q = queries.shape[0]
    return (
        queries.new_empty((Q, k), dtype=torch.float32),
        queries.new_empty((Q, k), dtype=torch.int64),
    )


retrieval_search = register_op("retrieval_search", _search_impl, fake=_search_fake, eager_direct=True)
