"""Build script: packages rapo_fast (+ kernels/ as rapo_fast.kernels) and builds the rapo_fast._C extension with CMake.

Not a place for logic beyond the build: which backends get compiled is decided in CMakeLists.txt from these switches
(flash-attn style): RAPO_FAST_CUDA=0 skips CUDA, RAPO_FAST_CUDA_ARCHS overrides the architectures (default "80;90a"),
MAX_JOBS bounds the parallel compile jobs.
"""

import os
import subprocess
import sys
from pathlib import Path

import pybind11
from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent.resolve()


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        out_dir = Path(self.get_ext_fullpath(ext.name)).parent.resolve()
        build_temp = Path(self.build_temp) / ext.name
        build_temp.mkdir(parents=True, exist_ok=True)
        cfg = "Debug" if os.environ.get("RAPO_FAST_DEBUG") == "1" else "Release"
        args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DCMAKE_BUILD_TYPE={cfg}",
            f"-DRAPO_FAST_CUDA={os.environ.get('RAPO_FAST_CUDA', 'AUTO')}",
            f"-DRAPO_FAST_CUDA_ARCHS={os.environ.get('RAPO_FAST_CUDA_ARCHS', '80;90a')}",
            "-G",
            "Ninja",
        ]
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 2))
        subprocess.run(["cmake", str(ROOT), *args], cwd=build_temp, check=True)
        subprocess.run(["cmake", "--build", ".", "-j", jobs], cwd=build_temp, check=True)


setup(
    # every subpackage of rapo_fast/, plus kernels/ (and its subpackages) installed as rapo_fast.kernels
    packages=find_packages(include=["rapo_fast", "rapo_fast.*"])
    + ["rapo_fast.kernels"]
    + [f"rapo_fast.kernels.{p}" for p in find_packages("kernels")],
    package_dir={"rapo_fast": "rapo_fast", "rapo_fast.kernels": "kernels"},
    # PEP 561: the marker that tells type checkers to read rapo_fast's inline type hints (it covers the subpackages)
    package_data={"rapo_fast": ["py.typed"]},
    ext_modules=[CMakeExtension("rapo_fast._C")],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
)
