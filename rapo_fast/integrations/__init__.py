"""Adapters that plug rapo_fast's fused loss into other trainers (TRL, verl). Import the submodule you need."""
