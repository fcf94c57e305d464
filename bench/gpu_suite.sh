#!/usr/bin/env bash
# Thin wrapper: runs the four staged GPU validation scripts (bench/gpu/stage1..4) in order into OUTDIR/stageN/, for a
# GPU machine without the device tool's limits. It is NOT what to run through the device tool: there each stage is
# its own call (at most 10 minutes and 8 returned files per call; README.md "GPU validation" lists the calls).
#   bash bench/gpu_suite.sh OUTDIR            (about 30 minutes; --dry-run as OUTDIR lists the steps instead)
# Wheels: put the ones from tools/fetch_gpu_wheels.sh in .carry/wheels; each stage installs them (--no-index --no-deps).
set -uo pipefail
OUT="${1:?usage: bench/gpu_suite.sh OUTDIR | --dry-run}"
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
echo "gpu_suite: running bench/gpu/stage1..4 in order (each bounded by its own 8-minute budget)"
rc=0
for stage in stage1_build_test stage2_loss stage3_retrieval stage4_kv_train; do
  if [ "$OUT" = "--dry-run" ]; then
    "$PY" "bench/gpu/$stage.py" --dry-run || rc=1
  else
    "$PY" "bench/gpu/$stage.py" --out "$OUT/$stage" || rc=1
  fi
done
exit $rc
