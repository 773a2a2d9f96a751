"""Fused and compiled kernels for the GPU fast path; each has an eager reference it is tested against."""
