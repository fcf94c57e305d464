"""Experiments built on rapo_fast's public API, outside the installed package: each folder has its own README.md."""
