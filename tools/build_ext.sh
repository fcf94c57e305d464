#!/usr/bin/env bash
# Incremental rebuild of rapo_fast/_C*.so for development (the same CMake build `pip install -e .` runs, in a kept
# build folder). Serialised with flock because several people/agents may rebuild the same .so at once.
set -euo pipefail
cd "$(dirname "$0")/.."
exec 9>/tmp/rapo_fast_build.lock
flock 9
cmake -S . -B build/cmake -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_LIBRARY_OUTPUT_DIRECTORY="$PWD/rapo_fast" \
  -Dpybind11_DIR="$(python -m pybind11 --cmakedir)" -DPython_EXECUTABLE="$(command -v python)" \
  -DRAPO_FAST_CUDA="${RAPO_FAST_CUDA:-AUTO}" -DRAPO_FAST_CUDA_ARCHS="${RAPO_FAST_CUDA_ARCHS:-80;90a}" >/dev/null
cmake --build build/cmake -j "${MAX_JOBS:-2}"
