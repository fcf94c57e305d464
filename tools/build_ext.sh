#!/usr/bin/env bash
# Incremental rebuild of rapo_fast/_C*.so for development (the same CMake build `pip install -e .` runs, in a kept
# build folder). Serialised with flock because several people/agents may rebuild the same .so at once.
# Environment: RAPO_FAST_CUDA (AUTO | 1 | 0) and RAPO_FAST_CUDA_ARCHS as for setup.py; MAX_JOBS (default 2);
# BUILD_DIR (default build/cmake) and OUT_DIR (default rapo_fast/) to build elsewhere, e.g. into a scratch folder
# while the installed .so stays in use; PYBIND11_DIR when pybind11 is not importable by `python`.
# The .so is linked in the build folder and then renamed into OUT_DIR, so a process loading it never sees half a file.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir="${BUILD_DIR:-build/cmake}"
case "$build_dir" in /*) ;; *) build_dir="$PWD/$build_dir" ;; esac  # absolute: CMake gets it below
out_dir="${OUT_DIR:-$PWD/rapo_fast}"
pybind11_dir="${PYBIND11_DIR:-$(python -m pybind11 --cmakedir)}"
exec 9>/tmp/rapo_fast_build.lock
flock 9
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_LIBRARY_OUTPUT_DIRECTORY="$build_dir/lib" \
  -Dpybind11_DIR="$pybind11_dir" -DPython_EXECUTABLE="$(command -v python)" \
  -DRAPO_FAST_CUDA="${RAPO_FAST_CUDA:-AUTO}" -DRAPO_FAST_CUDA_ARCHS="${RAPO_FAST_CUDA_ARCHS:-80;90a}" >/dev/null
cmake --build "$build_dir" -j "${MAX_JOBS:-2}"
mkdir -p "$out_dir"
for so in "$build_dir"/lib/_C*.so; do
  cp "$so" "$out_dir/.$(basename "$so").tmp"
  mv -f "$out_dir/.$(basename "$so").tmp" "$out_dir/$(basename "$so")"
done
