"""The registered search op `rapo_fast::retrieval_search`: calls the compiled CPU or CUDA backend of rapo_fast._C on
already-validated tensors, with a fake implementation so that a search traces under torch.compile.

What this is not: argument validation (rapo_fast/retrieval/buffer.py validates before calling) or the buffer itself.
Written without `from __future__ import annotations` because torch.library infers the op schema from the annotations.
"""

from typing import Optional

import torch

from rapo_fast._dispatch import register_op
from rapo_fast._ext import DTYPE_CODES, make_params, require_backend, stream_of

METRIC_CODES = {"ip": 0, "cosine": 1, "l2": 2}
MAX_K = 1024


def _ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None or t.numel() == 0 else int(t.data_ptr())


def _search_impl(
    keys: torch.Tensor,
    key_aux: torch.Tensor,
    groups: torch.Tensor,
    queries: torch.Tensor,
    exclude: Optional[torch.Tensor],
    k: int,
    metric: int,
    min_score: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [C, D] (fp32/fp16/bf16, rows contiguous), key_aux [C] fp32, groups [C] int64, queries [Q, D] in the keys'
    dtype, exclude [Q] int64 or None -> (scores [Q, k] fp32, slots [Q, k] int64)."""
    device = queries.device
    ext = require_backend(device)
    Q, D = queries.shape
    C = keys.shape[0]
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    queries = queries if queries.stride(-1) == 1 else queries.contiguous()
    key_aux = key_aux.contiguous()
    groups = groups.contiguous()
    exclude = None if exclude is None else exclude.contiguous()
    scores = torch.empty(Q, k, dtype=torch.float32, device=device)
    slots = torch.empty(Q, k, dtype=torch.int64, device=device)
    params = make_params(
        ext.RetrievalSearchParams,
        keys=_ptr(keys),
        key_row_stride=keys.stride(0) if C else D,
        key_dtype=DTYPE_CODES[keys.dtype],
        key_aux=_ptr(key_aux),
        groups=_ptr(groups),
        C=C,
        D=D,
        queries=_ptr(queries),
        query_row_stride=queries.stride(0) if Q else D,
        Q=Q,
        exclude=_ptr(exclude),
        k=k,
        metric=metric,
        min_score=float(min_score),
        out_scores=_ptr(scores),
        out_slots=_ptr(slots),
    )
    if device.type == "cpu":
        ext.retrieval_search_cpu(params, num_threads=torch.get_num_threads(), isa=-1)
    else:
        dev = device.index if device.index is not None else torch.cuda.current_device()
        n_splits = int(ext.retrieval_cuda_splits(Q=Q, C=C, k=k, device=dev))
        ws_scores = torch.empty(n_splits, Q, k, dtype=torch.float32, device=device)
        ws_slots = torch.empty(n_splits, Q, k, dtype=torch.int32, device=device)
        ext.retrieval_search_cuda(
            params,
            ws_scores=_ptr(ws_scores),
            ws_slots=_ptr(ws_slots),
            n_splits=n_splits,
            device=dev,
            stream=stream_of(device),
        )
    return scores, slots


def _search_fake(keys, key_aux, groups, queries, exclude, k, metric, min_score):
    Q = queries.shape[0]
    return (
        queries.new_empty((Q, k), dtype=torch.float32),
        queries.new_empty((Q, k), dtype=torch.int64),
    )


retrieval_search = register_op("retrieval_search", _search_impl, fake=_search_fake)
