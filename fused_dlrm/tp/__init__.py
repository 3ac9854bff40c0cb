"""Tensor-parallel communication: quantized all-reduce (bulk two-shot twin of a later fused kernel)."""

from fused_dlrm.tp.quantized_allreduce import (GRAD_ALLREDUCE_CODECS, QuantizedHookState, chooser,
                                               quantized_all_reduce, quantized_allreduce_hook)

__all__ = ["GRAD_ALLREDUCE_CODECS", "QuantizedHookState", "chooser", "quantized_all_reduce",
           "quantized_allreduce_hook"]
