"""Triton kernels; each file holds a kernel, its pure-torch reference and its launcher."""
