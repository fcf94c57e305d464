"""The Table-1 experiment: a miniature of the RAPO paper's Table 1 on a synthetic knowledge base, run with
`python -m experiments.table1` (README.md beside this file: how to run it, what each recorded run showed).

What this is: an experiment built on rapo_fast's public API only (tests/test_public_api.py checks it).
What this is not: part of the installed package, or a library others import.
"""
