"""Triton kernels of the fused expert-parallel exchange (dispatch + GEMM 1, GEMM 2 + combine)."""
