"""Compiled and Triton kernels with CPU references (arrives with the zeroth-order issue)."""
