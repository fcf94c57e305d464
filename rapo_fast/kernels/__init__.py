"""Triton kernels of rapo_fast, installed as the subpackage `rapo_fast.kernels` (never as a top-level module).

Only `@triton.jit` code and the Triton helpers it shares live here; launchers and autograd live in rapo_fast/.
"""
