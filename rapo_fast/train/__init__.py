"""The training part: the single-machine RAPO trainer, its config, checkpoints and metrics, and SFT warm-up.

Not here: multi-machine training (use verl with rapo_fast.integrations.verl). This package re-exports nothing.
"""
