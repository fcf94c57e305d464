#!/usr/bin/env bash
# RAPO on verl, the paper's setting, on one node of 8 GPUs (README "RAPO on verl"; every knob is in
# config/rapo_trainer.yaml and agent_loops.yaml). Needs: rapo_fast installed with the verl extra and vLLM
# (`pip install "verl[vllm]==0.9.1"` on the GPU machine), the parquet data (prepare_data.py), the step buffer built
# once (build_step_buffer.sh), and a retrieval server for the search tool at RAPO_SEARCH_URL (or, without one,
# RAPO_SEARCH_BACKEND=local and RAPO_SEARCH_CORPUS=corpus.jsonl: BM25 in the process, examples/verl/local_search.py).
# Logs to the console and wandb (project rapo): WANDB_API_KEY, or WANDB_MODE=offline, or `trainer.logger=[console]`.
# Extra hydra overrides pass through, e.g. `trainer.nnodes=2` or `actor_rollout_ref.rollout.n=8`. The 1-GPU smoke of
# this recipe: run_rapo_smoke_1gpu.sh.
set -euo pipefail
RECIPE_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export RAPO_RECIPE_DIR="$RECIPE_DIR"
export RAPO_DATA_DIR="${RAPO_DATA_DIR:-$HOME/data/rapo}"
export RAPO_MODEL_PATH="${RAPO_MODEL_PATH:-Qwen/Qwen2.5-7B-Instruct}"
export RAPO_STEP_BUFFER_DIR="${RAPO_STEP_BUFFER_DIR:-$HOME/data/rapo/step_buffer}"
export RAPO_SEARCH_URL="${RAPO_SEARCH_URL:-http://127.0.0.1:8000/retrieve}"
source "$RECIPE_DIR/ray_env.sh"  # the RAPO_* variables above reach every Ray worker, on every node
exec python3 -m verl.trainer.main_ppo --config-path="$RECIPE_DIR/config" --config-name=rapo_trainer "${RAPO_RAY_ENV[@]}" "$@"
