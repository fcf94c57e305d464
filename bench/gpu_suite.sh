#!/usr/bin/env bash
# Thin wrapper: runs the two GPU validation calls (bench/gpu/call1_headline.py, then
# bench/gpu/call2_anchors.py) in order into OUTDIR/call1/ and OUTDIR/call2/, on a GPU machine reached
# without the device tool. Through the device tool each call is its own command (docs/gpu_validation.md;
# `python bench/gpu/validate.py --dry-run` prints both, with their budgets and rows).
#   bash bench/gpu_suite.sh OUTDIR            (under 17 minutes; --dry-run as OUTDIR lists the plan instead)
# Wheels: put the ones from tools/fetch_gpu_wheels.sh in .carry/wheels; call 1 installs them (--no-index --no-deps).
set -uo pipefail
OUT="${1:?usage: bench/gpu_suite.sh OUTDIR | --dry-run}"
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ "$OUT" = "--dry-run" ]; then
  exec "$PY" bench/gpu/validate.py --dry-run
fi
rc=0
"$PY" bench/gpu/call1_headline.py --out "$OUT/call1" || rc=1
mkdir -p .carry/ext && cp "$OUT"/call1/_C*.so .carry/ext/ 2>/dev/null
"$PY" bench/gpu/call2_anchors.py --out "$OUT/call2" || rc=1
exit $rc
