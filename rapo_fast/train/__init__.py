"""The training part: the single-machine RAPO trainer, its config, checkpoints and metrics, and SFT warm-up.

Holds: `trainer` (RAPOTrainer, the one training loop), `callbacks` (TrainerCallback hooks into that loop and
EvalCallback: evaluation inside it, early stop), `config` (TrainerConfig), `io` (checkpoints, metrics CSV),
`sft` (supervised warm-up and greedy evaluation), `hf_model` (lm_head weight and final hidden states of a HF causal
LM). Not here: multi-machine training (use verl with rapo_fast.integrations.verl). This package re-exports nothing.
"""
