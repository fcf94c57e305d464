"""The constants shared by Python, the Triton kernels and the C++/CUDA extension are defined once
(rapo_fast/_constants.py) and every copy agrees with it: the generated header csrc/include/rapo/constants.h (its
text is what tools/gen_constants.py writes, and its values, parsed on their own, are Python's), the built extension
(`_C.CONSTANTS` and its module attributes), the Triton kernel's constexpr globals, and the Python modules that
re-export them; and no literal copy of one is left in the library's sources (a scan with patterns that match the
copies this replaced).

What this is not: a test of what the constants mean (the op tests check behaviour).
"""

from __future__ import annotations

import importlib.util
import re
import struct
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEADER = ROOT / "csrc" / "include" / "rapo" / "constants.h"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_constants", ROOT / "tools" / "gen_constants.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_constants", mod)
    spec.loader.exec_module(mod)
    return mod


GEN = _generator()
K = GEN.load_constants()  # rapo_fast/_constants.py by path, as the generator reads it


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _cxx_to_python() -> dict[str, str]:
    names = {e: py for _t, _s, members in K.CXX_ENUMS for e, py in members}
    names.update({c: py for _t, c, py in K.CXX_SCALARS})
    return names


def parse_header(text: str) -> dict[str, float | int]:
    """Python name -> value of every enumerator and constexpr scalar in the header text, read with regular
    expressions only (independent of the generator)."""
    names, out = _cxx_to_python(), {}
    for body in re.findall(r"enum\s+(?:class\s+)?\w+\s*:\s*int\s*\{([^}]*)\}", text):
        for name, value in re.findall(r"(\w+)\s*=\s*(-?\d+)", body):
            out[names.get(name, name)] = int(value)
    for ctype, name, value in re.findall(r"constexpr\s+(int|int64_t|float|double)\s+(\w+)\s*=\s*([^;]+);", text):
        v = float(value.rstrip("f")) if ctype in ("float", "double") else int(value)
        out[names.get(name, name)] = _f32(v) if ctype == "float" else v
    return out


def test_header_is_what_the_generator_writes():
    assert HEADER.read_text() == GEN.render(K), "run python tools/gen_constants.py (the header is generated)"
    assert GEN.main(["--check"]) == 0


def test_header_values_equal_python():
    parsed = parse_header(HEADER.read_text())
    assert set(parsed) == set(K.header_names())
    for name, value in parsed.items():
        want = getattr(K, name)
        assert value == (_f32(want) if isinstance(want, float) else want), name


def test_extension_reports_python_values():
    from rapo_fast import _ext

    if not _ext.has_extension():
        pytest.skip(f"rapo_fast._C is not built ({_ext._IMPORT_ERROR!r})")
    C = _ext.extension()
    assert set(C.CONSTANTS) == set(K.header_names()), "a stale build? rebuild the extension"
    for name in K.header_names():
        want = getattr(K, name)
        want = _f32(want) if isinstance(want, float) else want  # float constants are C++ floats
        assert C.CONSTANTS[name] == want and getattr(C, name) == want, name
        assert type(C.CONSTANTS[name]) is type(want), name


def test_python_modules_use_the_shared_values():
    import torch

    from rapo_fast import _constants, _ext
    from rapo_fast.reference import retrieval as ref
    from rapo_fast.retrieval import io, op, triton_search

    assert vars(_constants).keys() >= {n for n in dir(K) if n.isupper()}
    assert op.METRIC_CODES is _constants.METRIC_CODES and op.MAX_K == _constants.MAX_K
    assert {str(dt).removeprefix("torch."): c for dt, c in _ext.DTYPE_CODES.items()} == _constants.DTYPE_NAMES
    assert _ext.DTYPE_CODES[torch.bfloat16] == _constants.DTYPE_BF16
    assert triton_search.SENTINEL == _constants.TRITON_EMPTY_KEY
    assert ref.COSINE_EPS == _constants.COSINE_EPS and io.MAX_CAPACITY == _constants.MAX_KEYS
    assert [_constants.METRIC_CODES[m] for m in ref.RETRIEVAL_METRICS] == [0, 1, 2]


def test_triton_kernel_constexprs_equal_python():
    pytest.importorskip("triton")
    from rapo_fast import _constants
    from rapo_fast.kernels.retrieval import search

    assert search.SENTINEL.value == _constants.TRITON_EMPTY_KEY
    assert search.METRIC_COSINE.value == _constants.METRIC_COSINE
    assert search.METRIC_L2.value == _constants.METRIC_L2


# Patterns of a literal copy of a shared constant, per language. Each matched a line of the sources before the
# constants were defined once (the samples below are those lines); a new match means a copy came back.
PY_COPIES = {
    "metric code table": r"METRIC_CODES\s*=\s*\{",
    "MAX_K value": r"\bMAX_K\s*=\s*\d",
    "metric code literal": r"\b(?:metric|METRIC)\s*[!=]=\s*[0-9]\b|metric not in \(0",
    "dtype code literal": r"torch\.(?:float32|float16|bfloat16|int64|int32|uint8|bool)\s*:\s*[0-6]\s*[,}]",
    "cosine eps literal": r"clamp_min\(1e-12\)|COSINE_EPS\s*=\s*1e",
    "empty key literal": r"-0x7FFFFFFFFFFFFFFF",
    "k limit literal": r"\bk\s*<=?\s*1024\b|\b1024\s*>=?\s*k\b",
    "request width literal": r"shape\[1\]\s*!=\s*5\b",
    "2^31 key limit": r"capacity\s*<\s*2\*\*31|MAX_CAPACITY\s*=\s*2",
}
CXX_COPIES = {
    "enum outside the header": r"^\s*enum\s+(?:class\s+)?(?:DType|RetrievalMetric)\b",
    "constant outside the header": r"\b(?:kCosineEps|kIsa\w+|kRetrievalMaxK|kKVRequestFields)\s*=",
    "k limit literal": r"\bk\s*>\s*1024\b",
    "metric code literal": r"\bmetric\s*(?:[<>]|[!=]=)\s*[0-9]\b",
    "dtype code literal": r"key_dtype\s*[<>]=?\s*[0-9]\b",
    "request width literal": r"\br\s*\*\s*5\b",
    "2^31 key limit": r"<<\s*31\)",
}
OLD_LINES = {  # lines of the sources before this file existed, one per pattern
    "py": [
        'METRIC_CODES = {"ip": 0, "cosine": 1, "l2": 2}',
        "MAX_K = 1024",
        "    if metric == 2 or dtype == torch.float32 or C > _MAX_C:",
        "    if METRIC == 1:",
        "_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}",
        "        qaux = 1.0 / sumsq.sqrt().clamp_min(1e-12)",
        "SENTINEL = tl.constexpr(-0x7FFFFFFFFFFFFFFF)",
        "    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 1024:",
        "    if requests.dtype != torch.int64 or requests.dim() != 2 or requests.shape[1] != 5:",
        "        if isinstance(capacity, bool) or not isinstance(capacity, int) or not 1 <= capacity < 2**31:",
    ],
    "cxx": [
        "enum class DType : int { F32 = 0, F16 = 1, BF16 = 2, I64 = 3, I32 = 4, U8 = 5, Bool = 6 };",
        "constexpr int kIsaScalar = 0;",
        '  if (a.k < 1 || a.k > 1024) throw std::invalid_argument(o + ": k must be in [1, 1024]");',
        "  if (a.metric < 0 || a.metric > 2) throw std::invalid_argument(o);",
        "  if (a.key_dtype < 0 || a.key_dtype > 2)",
        "  const int64_t* q = p.requests_host + r * 5;",
        '  if (a.C >= (int64_t(1) << 31)) throw std::invalid_argument(o + ": more than 2^31 - 1 keys");',
    ],
}


def _copies(text: str, patterns: dict[str, str]) -> list[str]:
    return [what for what, pat in patterns.items() if re.search(pat, text)]


def test_copy_patterns_catch_the_old_copies():
    for line in OLD_LINES["py"]:
        assert _copies(line, PY_COPIES), line
    for line in OLD_LINES["cxx"]:
        assert _copies(line, CXX_COPIES), line
    assert {w for line in OLD_LINES["py"] for w in _copies(line, PY_COPIES)} == set(PY_COPIES)
    assert {w for line in OLD_LINES["cxx"] for w in _copies(line, CXX_COPIES)} == set(CXX_COPIES)


def test_no_literal_copy_in_the_sources():
    sources = {"rapo_fast/_constants.py", "csrc/include/rapo/constants.h"}
    found = []
    files = list((ROOT / "rapo_fast").rglob("*.py"))
    files += [p for p in (ROOT / "csrc").rglob("*") if p.suffix in (".h", ".cpp", ".cu", ".cuh")]
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        if rel in sources:
            continue
        patterns = PY_COPIES if path.suffix == ".py" else CXX_COPIES
        for n, line in enumerate(path.read_text().splitlines(), 1):
            found += [f"{rel}:{n}: {what}: {line.strip()}" for what in _copies(line, patterns)]
    assert not found, "literal copies of rapo_fast/_constants.py:\n" + "\n".join(found)
