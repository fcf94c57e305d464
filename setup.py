"""Build script: packages rapo_fast and builds the rapo_fast._C extension with CMake.

Not a place for logic beyond the build: which backends get compiled is decided in CMakeLists.txt from these switches
(flash-attn style): RAPO_FAST_CUDA=0 skips CUDA, 1 requires it, AUTO compiles it when nvcc is found; unset, it is AUTO
where a GPU is visible and 0 elsewhere (`cuda_switch`). RAPO_FAST_CUDA_ARCHS overrides the architectures (default
"80;90a"), MAX_JOBS bounds the parallel compile jobs.
"""

import os
import subprocess
import sys
from pathlib import Path

import pybind11
from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent.resolve()


def gpu_visible() -> bool:
    """Whether this machine shows an NVIDIA GPU (a /dev/nvidia<N> device, or one listed by nvidia-smi -L)."""
    if any(Path("/dev").glob("nvidia[0-9]*")):
        return True
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return listed.returncode == 0 and "GPU" in listed.stdout


def cuda_switch(env, has_gpu=gpu_visible) -> str:
    """RAPO_FAST_CUDA for CMake: the variable when set; unset, AUTO where a GPU is visible, else 0. Compiling the CUDA
    backend takes about 3 minutes of every install on a machine with nvcc, and a machine without a GPU cannot run it;
    CI, which compiles it without running it, sets RAPO_FAST_CUDA=AUTO."""
    value = env.get("RAPO_FAST_CUDA", "").strip()
    if value:
        return value
    return "AUTO" if has_gpu() else "0"


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
            f"-DRAPO_FAST_CUDA={cuda_switch(os.environ)}",
            f"-DRAPO_FAST_CUDA_ARCHS={os.environ.get('RAPO_FAST_CUDA_ARCHS', '80;90a')}",
            "-G",
            "Ninja",
        ]
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 2))
        subprocess.run(["cmake", str(ROOT), *args], cwd=build_temp, check=True)
        subprocess.run(["cmake", "--build", ".", "-j", jobs], cwd=build_temp, check=True)


if __name__ == "__main__":  # setuptools runs this file as __main__; tests import cuda_switch without building
    setup(
        packages=find_packages(include=["rapo_fast", "rapo_fast.*"]),
        # PEP 561: the marker that tells type checkers to read rapo_fast's inline type hints (it covers the subpackages)
        package_data={"rapo_fast": ["py.typed"]},
        ext_modules=[CMakeExtension("rapo_fast._C")],
        cmdclass={"build_ext": CMakeBuild},
        zip_safe=False,
    )
