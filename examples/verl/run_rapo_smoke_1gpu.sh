#!/usr/bin/env bash
# The 1-GPU smoke of the recipe: the paper's config (config/rapo_trainer.yaml) with the small overrides of
# config/recipe/smoke_1gpu.yaml (Qwen2.5-0.5B-Instruct, 2 steps, 2 prompts x G = 4, vLLM TP 1, n_gpus_per_node=1).
# Checks that the job runs end to end on one GPU; not a training run. Needs what run_rapo_qwen2_5_7b.sh needs except
# the retrieval server and the data: by default the search tool's local BM25 backend reads smoke/corpus.jsonl, and the
# parquet data and the step buffer are made from smoke/ the first time (prepare_data.py, verl-build-buffer).
# Console logging; RAPO_WANDB=1 adds wandb (WANDB_API_KEY, or WANDB_MODE=offline). Extra hydra overrides pass through.
set -euo pipefail
RECIPE_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export RAPO_RECIPE_DIR="$RECIPE_DIR"
export RAPO_DATA_DIR="${RAPO_DATA_DIR:-$HOME/data/rapo_smoke}"
export RAPO_MODEL_PATH="${RAPO_MODEL_PATH:-Qwen/Qwen2.5-0.5B-Instruct}"
export RAPO_STEP_BUFFER_DIR="${RAPO_STEP_BUFFER_DIR:-$RAPO_DATA_DIR/step_buffer}"
export RAPO_SEARCH_BACKEND="${RAPO_SEARCH_BACKEND:-local}"
export RAPO_SEARCH_CORPUS="${RAPO_SEARCH_CORPUS:-$RECIPE_DIR/smoke/corpus.jsonl}"
if [ ! -f "$RAPO_DATA_DIR/train.parquet" ]; then
  python3 "$RECIPE_DIR/prepare_data.py" --train "$RECIPE_DIR/smoke/questions.jsonl" \
    --val "$RECIPE_DIR/smoke/questions.jsonl" --out "$RAPO_DATA_DIR"
fi
if [ ! -f "$RAPO_STEP_BUFFER_DIR/CURRENT" ]; then
  rapo-fast verl-build-buffer --jsonl "$RECIPE_DIR/smoke/traces.jsonl" --out "$RAPO_STEP_BUFFER_DIR" \
    --tokenizer "$RAPO_MODEL_PATH" --encoder "${RAPO_ENCODER:-hashed}" --top-k 5
fi
LOGGER=()
if [ "${RAPO_WANDB:-0}" = "1" ]; then LOGGER=("trainer.logger=[console,wandb]"); fi
source "$RECIPE_DIR/ray_env.sh"
exec python3 -m verl.trainer.main_ppo --config-path="$RECIPE_DIR/config" --config-name=rapo_trainer \
  +recipe=smoke_1gpu "${LOGGER[@]}" "${RAPO_RAY_ENV[@]}" "$@"
