#!/usr/bin/env bash
# Download, on a machine with PyPI access, every Python wheel the GPU tests and benches need that the GPU image lacks
# (the image has torch, triton, transformers, accelerate, pandas, pyarrow, xxhash, huggingface-hub ...; see
# docs/gpu_validation.md), into .carry/wheels (git-ignored; name it in the device tool's `carry`). The stages
# (bench/gpu/) install them there with `pip install --no-index --no-deps`.
# What is fetched and why: trl (tests/integrations/test_integration_trl.py) imports datasets at `import trl`, and
# datasets imports dill and multiprocess; liger-kernel is the loss bench's Liger provider and cut-cross-entropy
# (Apple's Cut Cross-Entropy, 23 KB, pure Python + Triton) its `cce` provider (both import torch and triton only).
# One pinned version of each: two versions of one package stop a --no-deps install.
# Not a general installer: it fetches for CPython 3.12 on manylinux x86_64 (the GPU image), not for this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-.carry/wheels}"
mkdir -p "$dest"
rm -f "$dest"/*.whl
plats=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  plats+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plats[@]}" \
  -d "$dest" trl==1.16.0 liger-kernel==0.8.5 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
  cut-cross-entropy==25.1.1
ls -l "$dest"
total=$(du -cb "$dest"/*.whl | tail -1 | cut -f1)
echo "fetch_gpu_wheels: $(ls "$dest"/*.whl | wc -l) wheels, $total bytes in $dest (the device tool carries 64 MiB in all)"
if [ "$total" -gt $((48 * 1024 * 1024)) ]; then
  echo "fetch_gpu_wheels: over 48 MiB, leaving too little of the 64 MiB carry for the working tree" >&2
  exit 1
fi
