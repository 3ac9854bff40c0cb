"""The tensor-parallel projections of a model as report layers: each kind of ColumnParallelLinear /
RowParallelLinear (the same module name in every block, e.g. `attn.qkv`) timed once with its real shapes and
counted as often as the model has it, bulk (torch.distributed collectives) against fused (the same layer with
comm="fused": the GEMM + all-reduce kernel, its reduce-scatter form, all-gather + GEMM).

What crosses, per pass (tp ranks, B: the bytes of the whole TP group's rows of the layer's input (column) or
output (row) in the compute dtype; ring collectives):
- column-parallel, replicated input: nothing forward; backward, the input gradient's all-reduce: 2 (tp-1)/tp B;
- column-parallel, sequence-sharded input: the rows' all-gather, (tp-1)/tp B; backward the gradient's
  reduce-scatter, as much again;
- row-parallel, replicated output: the output's all-reduce, 2 (tp-1)/tp B; nothing backward;
- row-parallel, sequence-sharded output: the reduce-scatter, (tp-1)/tp B; backward the all-gather, as much again.
"""

from __future__ import annotations

import re
from collections import Counter

import torch
from torch import nn

from fused_dlrm.report.layers import CommLayer, Mode, forward_backward, no_grad
from fused_dlrm.tp.linear import ColumnParallelLinear, RowParallelLinear, TPLinear

_COMMS = {  # (column?, sequence_sharded) -> what the layer communicates
    (True, False): "backward: the input gradient's all-reduce",
    (True, True): "all-gather of the rows before the GEMM; backward: reduce-scatter",
    (False, False): "all-reduce of the output",
    (False, True): "reduce-scatter of the output rows; backward: all-gather",
}


def _kind(name: str) -> str:
    """The module name without its block index: blocks.3.attn.qkv -> attn.qkv."""
    return re.sub(r"^blocks\.\d+\.", "", name)


def _modes(layer: TPLinear, rows: int, grad: torch.Tensor, compute_dtype: torch.dtype | None, seed: int) -> Mode:
    """The layer's passes on `rows` random input rows of its width (requiring a gradient, as in the model: the
    column-parallel backward's collective is the input gradient's), under autocast as the model runs it."""
    weight = layer.weight
    generator = torch.Generator(device=weight.device).manual_seed(seed)
    x = torch.randn(rows, weight.shape[1], device=weight.device, generator=generator).requires_grad_()

    def forward():
        with torch.autocast(weight.device.type, dtype=compute_dtype, enabled=compute_dtype is not None):
            return layer(x)
    return {"fwd": no_grad(forward), "fwd_bwd": forward_backward(forward, grad)}


def tp_layers(bulk: nn.Module, fused: nn.Module | str, tokens: int, compute_dtype: torch.dtype | None
              ) -> list[CommLayer]:
    """One CommLayer per kind of TP projection in `bulk` (fused: the same model with comm="fused" projections, or
    why there is none here); `tokens`: the rows a rank's model passes through its blocks (under sequence
    parallelism its part of them). Nothing without tensor parallelism."""
    linears = {name: m for name, m in bulk.named_modules() if isinstance(m, TPLinear) and m.tp_size > 1}
    counts = Counter(_kind(name) for name in linears)
    fused_modules = {} if isinstance(fused, str) else dict(fused.named_modules())
    itemsize = (compute_dtype or torch.float32).itemsize
    layers, seen = [], set()
    for name, layer in linears.items():
        kind = _kind(name)
        if kind in seen:
            continue
        seen.add(kind)
        column, sharded, tp = isinstance(layer, ColumnParallelLinear), layer.sequence_sharded, layer.tp_size
        out_features, in_features = layer.weight.shape  # this rank's shard
        # input rows: a sequence-sharded column-parallel layer takes this rank's rows, a row-parallel one all of
        # the group's (the column-parallel output); output rows: the other way round
        group_rows = tokens * tp if sharded else tokens
        in_rows = tokens if column else group_rows
        out_rows = group_rows if column else tokens
        crossing = group_rows * (in_features if column else out_features) * itemsize  # B of the docstring
        one_way = (tp - 1) * crossing // tp
        sent = ({"fwd": one_way, "fwd_bwd": 2 * one_way} if sharded else
                {"fwd": 0, "fwd_bwd": 2 * one_way} if column else {"fwd": 2 * one_way, "fwd_bwd": 2 * one_way})
        generator = torch.Generator(device=layer.weight.device).manual_seed(3000 + len(layers))
        grad = torch.randn(out_rows, out_features, device=layer.weight.device, generator=generator)
        seed = 4000 + len(layers)  # the same input in both modes
        fused_modes = fused if isinstance(fused, str) else _modes(fused_modules[name], in_rows, grad, compute_dtype,
                                                                  seed)
        dtype = str(compute_dtype or torch.float32).removeprefix("torch.")
        layers.append(CommLayer(
            f"TP {kind} ({'column' if column else 'row'}-parallel; {_COMMS[column, sharded]})",
            f"[{in_rows}, {in_features}] -> [{out_rows}, {out_features}] {dtype} on each of {tp} ranks",
            sent, _modes(layer, in_rows, grad, compute_dtype, seed), fused_modes, count=counts[kind]))
    return layers
