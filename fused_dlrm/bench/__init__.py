"""Benchmarks (run under torchrun on GPUs): `python -m fused_dlrm.bench embedding`."""
