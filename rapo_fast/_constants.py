"""The one definition of the constants that Python, the Triton kernels and the C++/CUDA extension share.

What this is: plain ints and floats, with no torch and no extension import, so that rapo_fast imports (and the
generator runs) without a compiled extension. csrc/include/rapo/constants.h is GENERATED from this file by
`python tools/gen_constants.py`; docs/extension.md, "Shared constants", says how each copy is made and tested.
What this is not: tuning parameters (tile sizes, the Triton/CUDA crossovers) or limits private to one backend (those
stay next to their code).
"""

from __future__ import annotations

# Retrieval metrics (RetrievalSearchParams::metric; every score larger-is-better, rapo_fast/reference/retrieval.py).
METRIC_IP = 0
METRIC_COSINE = 1
METRIC_L2 = 2
METRIC_CODES = {"ip": METRIC_IP, "cosine": METRIC_COSINE, "l2": METRIC_L2}

# Dtype codes of tensors crossing into the extension (torch dtype name -> code: rapo_fast/_ext.py DTYPE_CODES).
DTYPE_F32 = 0
DTYPE_F16 = 1
DTYPE_BF16 = 2
DTYPE_I64 = 3
DTYPE_I32 = 4
DTYPE_U8 = 5
DTYPE_BOOL = 6
DTYPE_NAMES = {
    "float32": DTYPE_F32,
    "float16": DTYPE_F16,
    "bfloat16": DTYPE_BF16,
    "int64": DTYPE_I64,
    "int32": DTYPE_I32,
    "uint8": DTYPE_U8,
    "bool": DTYPE_BOOL,
}

# Search limits: results per query, and stored keys (slot ids are int32 in the kernels).
MAX_K = 1024
MAX_KEYS = 2**31 - 1
# cosine: aux = 1 / max(|x|, COSINE_EPS), so a zero vector scores 0 against everything.
COSINE_EPS = 1e-12

# CPU retrieval micro-kernels (the `isa` argument of _C.retrieval_search_cpu; AUTO: the best this CPU supports).
CPU_ISA_AUTO = -1
CPU_ISA_SCALAR = 0
CPU_ISA_AVX2 = 1
CPU_ISA_AVX512 = 2

# int64 fields of one KV-splice request row: (pool offset, tokens, destination row, destination slot, rope delta).
KV_REQUEST_FIELDS = 5

# Triton search only (not in the header): the int64 candidate key of an empty place, below every eligible key
# (-FLT_MAX encodes to about -9.187e18; this is -9.223e18). rapo_fast/kernels/retrieval/search.py and triton_search.py.
TRITON_EMPTY_KEY = -0x7FFFFFFFFFFFFFFF

# The generated header's contents (tools/gen_constants.py). Enums: (C++ type, scoped, ((enumerator, Python name),
# ...)). Scalars: (C++ type, C++ name, Python name). Every entry is also reported by the extension under its Python
# name.
CXX_ENUMS = (
    (
        "RetrievalMetric",
        False,
        (("kMetricIP", "METRIC_IP"), ("kMetricCosine", "METRIC_COSINE"), ("kMetricL2", "METRIC_L2")),
    ),
    (
        "DType",
        True,
        (
            ("F32", "DTYPE_F32"),
            ("F16", "DTYPE_F16"),
            ("BF16", "DTYPE_BF16"),
            ("I64", "DTYPE_I64"),
            ("I32", "DTYPE_I32"),
            ("U8", "DTYPE_U8"),
            ("Bool", "DTYPE_BOOL"),
        ),
    ),
)
CXX_SCALARS = (
    ("int", "kRetrievalMaxK", "MAX_K"),
    ("int64_t", "kRetrievalMaxKeys", "MAX_KEYS"),
    ("float", "kCosineEps", "COSINE_EPS"),
    ("int", "kIsaAuto", "CPU_ISA_AUTO"),
    ("int", "kIsaScalar", "CPU_ISA_SCALAR"),
    ("int", "kIsaAvx2", "CPU_ISA_AVX2"),
    ("int", "kIsaAvx512", "CPU_ISA_AVX512"),
    ("int", "kKVRequestFields", "KV_REQUEST_FIELDS"),
)


def header_names() -> tuple[str, ...]:
    """Python names of every constant the header declares (and the extension reports), in header order."""
    enums = tuple(py for _t, _s, members in CXX_ENUMS for _c, py in members)
    return enums + tuple(py for _t, _c, py in CXX_SCALARS)
