#!/usr/bin/env bash
# One command for a GPU machine (no network): build rapo_fast from source, run `pytest -m gpu`, run every benchmark's
# GPU grid, and leave logs + CSVs in OUTDIR (never in bench/results/: copy rows there by hand, or rerun with --record),
# printing a short table last. Not a test runner for the CPU suite (.ci/run).
#   bash bench/gpu_suite.sh OUTDIR [WHEELS_DIR]
# WHEELS_DIR (default .carry/wheels, filled here by tools/fetch_gpu_wheels.sh) holds pure-Python wheels the GPU image
# lacks (liger-kernel, trl); they are installed with --no-index --no-deps. Each later capability adds its step below.
set -uo pipefail
OUT="${1:?usage: bench/gpu_suite.sh OUTDIR [WHEELS_DIR]}"
WHEELS="${2:-.carry/wheels}"
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
summary="$OUT/summary.txt"
: >"$summary"
note() { echo "$*" | tee -a "$summary"; }

note "gpu_suite: $(date -u +%FT%TZ) commit $(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /' | tee -a "$summary"

if [ -d "$WHEELS" ]; then
  "$PY" -m pip install --no-index --no-deps "$WHEELS"/*.whl >"$OUT/wheels.log" 2>&1 \
    && note "wheels: installed $(ls "$WHEELS" | wc -l) from $WHEELS" || note "wheels: install FAILED (see wheels.log)"
fi

start=$(date +%s)
# The image's torch/triton/pybind11/cmake/ninja are used as they are: no build isolation, no dependency resolution.
if MAX_JOBS="${MAX_JOBS:-16}" RAPO_FAST_CUDA=1 "$PY" -m pip install --no-build-isolation --no-deps -e . \
    >"$OUT/build.log" 2>&1; then
  note "build: ok in $(( $(date +%s) - start )) s; $("$PY" -c 'import json,rapo_fast; i=rapo_fast.build_info(); print(json.dumps({k:i[k] for k in ("cuda","cuda_archs","torch","triton")}))')"
else
  note "build: FAILED (see build.log)"; tail -30 "$OUT/build.log"; exit 1
fi

"$PY" -m pytest -m gpu -q -p no:cacheprovider --junitxml="$OUT/pytest_gpu.xml" >"$OUT/pytest_gpu.log" 2>&1
note "pytest -m gpu: $(tail -1 "$OUT/pytest_gpu.log")"

run_bench() {  # name, then the bench's arguments
  local name="$1"; shift
  local t0=$(date +%s)
  if "$PY" "bench/bench_${name}.py" --gpu --out "$OUT" "$@" >"$OUT/bench_${name}.log" 2>&1; then
    note "bench $name: ok ($(( $(date +%s) - t0 )) s)"
  else
    note "bench $name: FAILED or disagreeing providers ($(( $(date +%s) - t0 )) s; see bench_${name}.log)"
  fi
}
[ -f bench/bench_loss.py ] && run_bench loss
[ -f bench/bench_token_logprobs.py ] && run_bench token_logprobs
[ -f bench/bench_retrieval.py ] && run_bench retrieval
[ -f bench/bench_kv_splice.py ] && run_bench kv_splice

# Short table last: every CSV row of this run, a few columns.
"$PY" - "$OUT" <<'PYEOF' | tee -a "$summary"
import csv, sys, pathlib
out = pathlib.Path(sys.argv[1])
cols = ["provider", "mode", "N", "H", "V", "C", "D", "Q", "k", "median_ms", "peak_mem_mb", "pct_of_copy_bw", "status"]
for f in sorted(out.glob("*.csv")):
    rows = list(csv.DictReader(f.open()))
    print(f"== {f.name} ({len(rows)} rows)")
    for r in rows:
        print("  " + " ".join(f"{c}={r[c]}" for c in cols if r.get(c) not in (None, "")))
PYEOF
