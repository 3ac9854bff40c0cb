"""Tensor parallelism: the TP linears (bulk or fused communication) and the quantized all-reduce."""

from fused_dlrm.tp.linear import ColumnParallelLinear, RowParallelLinear, tp_groups
from fused_dlrm.tp.quantized_allreduce import (GRAD_ALLREDUCE_CODECS, QuantizedHookState, block_offsets, chooser,
                                               flat_buffer, quantized_all_reduce, quantized_allreduce_hook)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "tp_groups", "GRAD_ALLREDUCE_CODECS", "QuantizedHookState",
           "block_offsets", "chooser", "flat_buffer", "quantized_all_reduce", "quantized_allreduce_hook"]
