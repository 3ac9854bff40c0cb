"""DLRM's dense arches (bottom MLP, over arch) forward and backward replayed as CUDA graphs (`trainer.cuda_graphs`).

A DLRM step on GPUs is bound by the host (docs/benchmarks.md): the two MLPs are ~30 kernels each way, launched one
by one by Python and the autograd engine (~1 ms of host time per step at the paper config on an H200 host).
`torch.cuda.make_graphed_callables` captures each arch's forward and its backward once, at the rank's training
batch size; a step then replays one graph per arch each way, its input copied into the graph's static input.

Captured before DDP wraps the arches (partial-network capture): the graphed backward hands the parameters their
gradients, DDP's hooks on them all-reduce as before, outside the graphs. Any other call runs the eager forward:
another batch size or dtype, evaluation (eval mode or no grad), an input whose requires_grad differs from the
capture's. Parameters must keep their storage (the graphs read it): the optimizer and checkpoint loading update
them in place.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torchrec.models.dlrm import DLRM


class GraphedForward:
    """An arch's `forward`: its graphed callable for training calls shaped like the capture's sample, the eager
    forward for everything else."""

    def __init__(self, arch: nn.Module, graphed: Callable, eager: Callable, sample: torch.Tensor):
        self.arch, self.graphed, self.eager = arch, graphed, eager
        self.shape, self.dtype, self.device, self.requires_grad = (sample.shape, sample.dtype, sample.device,
                                                                   sample.requires_grad)

    def replays(self, x: torch.Tensor) -> bool:
        return (self.arch.training and torch.is_grad_enabled() and x.shape == self.shape and x.dtype == self.dtype
                and x.device == self.device and x.requires_grad == self.requires_grad)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.graphed(x) if self.replays(x) else self.eager(x)


def first_linear(arch: nn.Module) -> nn.Linear:
    return next(m for m in arch.modules() if isinstance(m, nn.Linear))


def graph_dense_arches(model: DLRM, batch_size: int) -> None:
    """Capture model.dense_arch and model.over_arch (not yet in DDP) at `batch_size` rows, in place: their
    `forward` becomes a GraphedForward. The over arch's input needs a gradient (it comes from the embeddings),
    the dense features do not."""
    arches = (model.dense_arch, model.over_arch)
    if any(isinstance(a, nn.parallel.DistributedDataParallel) for a in arches):
        raise ValueError("capture the dense arches before DDP wraps them (its hooks must not be captured)")
    weight = first_linear(model.dense_arch).weight
    rng = torch.Generator(weight.device).manual_seed(0)  # the global generator's stream stays the same
    samples = tuple(torch.randn(batch_size, first_linear(a).in_features, generator=rng, device=weight.device,
                                dtype=weight.dtype).requires_grad_(needs_grad)
                    for a, needs_grad in zip(arches, (False, True)))
    eager = [a.forward for a in arches]  # the class's forward, bound: make_graphed_callables replaces the attribute
    torch.cuda.make_graphed_callables(arches, tuple((s,) for s in samples))  # one memory pool, in the live order
    for arch, forward, sample in zip(arches, eager, samples):
        arch.forward = GraphedForward(arch, arch.forward, forward, sample)
