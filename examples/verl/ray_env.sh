# Sourced by the launch scripts (not run): sets RAPO_RAY_ENV to hydra overrides that hand the recipe's RAPO_*
# variables to every Ray worker through verl's ray_kwargs.ray_init.runtime_env.env_vars.
# Why: on a cluster started with `ray start`, workers (the TaskRunner that resolves the config's ${oc.env:...}, the
# agent-loop workers that run the search tool) get the environment of their node's `ray start`, not the launching
# shell's; without this the config silently falls back to its defaults there (docs/verl.md, multi-node). On one node
# (Ray started by the job itself) it changes nothing. Secrets (WANDB_API_KEY) are not forwarded: verl prints its config.
RAPO_RAY_ENV=()
for _rapo_var in RAPO_RECIPE_DIR RAPO_DATA_DIR RAPO_MODEL_PATH RAPO_STEP_BUFFER_DIR RAPO_ENCODER RAPO_SEARCH_BACKEND \
  RAPO_SEARCH_URL RAPO_SEARCH_CORPUS RAPO_SEARCH_TOPK WANDB_MODE WANDB_DIR; do
  if [ -n "${!_rapo_var:-}" ]; then
    RAPO_RAY_ENV+=("+ray_kwargs.ray_init.runtime_env.env_vars.${_rapo_var}='${!_rapo_var}'")
  fi
done
unset _rapo_var
