"""The demo: RAPO vs GRPO on a synthetic chain-arithmetic tool task with a tiny Llama, on the CPU in minutes.

Holds: `main` (the `rapo-fast demo` command), `tiny_policy` (word tokenizer and tiny Llama builder), `tasks` (the
task, its verifier and a scripted off-policy solver). Nothing in the library imports from here; the demo uses the
library like any user would.
"""
