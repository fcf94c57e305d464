"""The build itself: the extension loads, reports its backends, and, wherever nvcc is on PATH (every machine of this
project, CI included), its CUDA backend was compiled for the default architectures, so CI proves every .cu file builds.
Not a test of any op."""

import os
import shutil

import pytest

import rapo_fast
from rapo_fast._ext import build_info


def test_extension_loads_with_cpu_backend():
    info = build_info()
    assert info["extension"], info["extension_error"]
    assert info["cpu"]


@pytest.mark.skipif(
    shutil.which("nvcc") is None or os.environ.get("RAPO_FAST_CUDA") == "0", reason="no nvcc, or CUDA build skipped"
)
def test_cuda_backend_compiled_when_nvcc_present():
    info = build_info()
    assert info["cuda"], "nvcc is on PATH but the CUDA backend was not built"
    expected = os.environ.get("RAPO_FAST_CUDA_ARCHS", "80;90a").split(";")
    assert info["cuda_archs"] == expected


def test_public_api_resolves():
    for name in rapo_fast.__all__:
        assert getattr(rapo_fast, name) is not None, name
