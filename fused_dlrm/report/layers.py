"""What a report times: the communicating layers of a model, each runnable in the bulk and the fused mode.

A `CommLayer` is one communicating layer with the real shapes of the model being trained: its name, a
description of its shapes, the bytes this rank sends, and per mode (bulk, fused) the callables of its passes
(forward, forward+backward) or a sentence saying why the mode does not exist here. The model-specific builders
(report/dlrm.py, report/moe.py) make them from the composed config; report/measure.py times them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from fused_dlrm.dist import DistEnv
from fused_dlrm.tp import block_offsets, quantized_all_reduce
from fused_dlrm.tp.quantized_allreduce import wire_bytes

PASSES = ("fwd", "fwd_bwd")  # forward only (no autograd), forward + backward
Mode = dict[str, Callable[[], object]]  # pass name -> one run of it; a pass the layer lacks is absent
STEP = "training step (whole model)"  # the name of the row that times a whole training step


@dataclass
class CommLayer:
    name: str
    shapes: str
    bytes_sent: dict[str, int]  # pass -> bytes this rank sends to other ranks in one run of that pass
    bulk: Mode | str  # str: why there is no such mode here
    fused: Mode | str
    count: int = 1  # how many such layers the model has (the MoE layers share their shapes)
    notes: list[str] = field(default_factory=list)
    fused_bytes_sent: dict[str, int] | None = None  # the fused mode's, where it sends other bytes (a codec's
    #                                                 encoded messages, the MoE exchanges by token); None: bytes_sent


def bytes_of(layer: CommLayer, mode: str) -> dict[str, int]:
    """The bytes per pass that `layer` sends in `mode` (bulk or fused)."""
    return layer.fused_bytes_sent if mode == "fused" and layer.fused_bytes_sent is not None else layer.bytes_sent


def counted(n: int, one: str, many: str) -> str:
    """ "1 table", "2 tables": a count in a layer's shapes, in words."""
    return f"{n} {one if n == 1 else many}"


def no_fused_path(env: DistEnv) -> str | None:
    """Why this machine has no fused path at all, or None: the fused kernels need CUDA GPUs and a process group
    (symmetric memory over NVLink)."""
    if env.device.type != "cuda":
        return "no fused path on this machine (CPU)"
    if env.world_size == 1:
        return "no fused path in one process (run under torchrun on 2+ GPUs)"
    return None


def fused_or_reason(reason: str | None, build: Callable[[], Mode]) -> Mode | str:
    return reason if reason else build()


def forward_backward(forward: Callable[[], torch.Tensor], grad: torch.Tensor) -> Callable[[], None]:
    """One forward + backward of `forward`'s output with a fixed upstream gradient."""
    return lambda: forward().backward(grad)


def no_grad(fn: Callable[[], object]) -> Callable[[], object]:
    def run():
        with torch.no_grad():
            return fn()
    return run


def grad_allreduce_layer(numels: Sequence[int], codec: str, env: DistEnv, reason: str | None,
                         allocation_timeout_s: float, group: dist.ProcessGroup | None = None,
                         name: str = "gradient all-reduce") -> CommLayer:
    """The all-reduce of the replicated (data-parallel) gradients (of parameters of `numels` values) over `group`
    (None: the world), as one flat fp32 buffer laid out as training lays it (`fused_dlrm.tp.block_offsets`: a
    codec's pads each parameter to a block): plain NCCL / gloo (bulk) against the configured comm.grad_allreduce
    codec (fused column, when one is configured; its workspace waits the configured comm.allocation_timeout_s for
    the peers at an allocation).

    Bytes: a ring all-reduce sends 2 (ranks - 1) / ranks of the buffer from every rank; the codec's, its encoded
    chunks (`fused_dlrm.tp.quantized_allreduce.wire_bytes`)."""
    ranks = dist.get_world_size(group) if dist.is_initialized() else 1
    num_params = sum(numels)  # the plain layout: back to back
    flat = torch.randn(num_params, device=env.device)
    over = "" if group is None else f" over {counted(ranks, 'rank', 'ranks')}"
    shapes = f"{num_params:,} fp32 values (flat){over}"
    sent = {"fwd_bwd": 2 * (ranks - 1) * num_params * 4 // ranks}
    if ranks == 1:
        one = "one process: nothing to all-reduce" if env.world_size == 1 else "one rank in the group"
        return CommLayer(name, shapes, sent, one, one)

    def plain():
        out = flat.clone()
        dist.all_reduce(out, group=group)
        return out

    if reason is None and codec in ("nccl", "none"):
        reason = "comm.grad_allreduce=nccl: no codec configured (set fp16 | fp8 | q8 | q6 | q4 to compare one)"
    padded = block_offsets(numels, codec)[-1]  # a codec's layout: each parameter from a block boundary

    def fused_ops():
        x = torch.randn(padded, device=env.device)
        return {"fwd_bwd": lambda: quantized_all_reduce(x, codec, group=group, mean=True,
                                                        allocation_timeout_s=allocation_timeout_s)}
    fused = fused_or_reason(reason, fused_ops)
    layer = CommLayer(name, shapes, sent, {"fwd_bwd": plain}, fused)
    if not isinstance(fused, str):
        layer.fused_bytes_sent = {"fwd_bwd": wire_bytes(padded, ranks, codec)}
        layer.notes.append(f"fused column: the {codec} quantized two-shot all-reduce (fused_dlrm.tp)")
    return layer
