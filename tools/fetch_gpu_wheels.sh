#!/usr/bin/env bash
# Download, on a machine with PyPI access, the pure-Python wheels that bench/gpu_suite.sh installs on the GPU machine
# (which has no network and whose image lacks them). Into .carry/wheels (git-ignored; name it in the device tool's carry).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .carry/wheels
pip download --no-deps --only-binary=:all: --python-version 3.12 -d .carry/wheels liger-kernel trl
ls -la .carry/wheels
