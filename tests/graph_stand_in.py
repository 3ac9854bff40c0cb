"""Stand-ins for captured CUDA graphs, for CPU tests.

For fused_dlrm.kernels.graphed_calls and its users: `capture(fn, inputs)` runs fn once on copies of the inputs
(standing for the capture, whose work the first replay does); every later `replay()` runs fn again on those copies
and writes its outputs into the first call's, as a graph rewrites its own tensors.

For the arch nodes (fused_dlrm.models.arch_nodes): `EagerArchGraph`, ArchGraph's interface over the node's eager
computation."""

from __future__ import annotations

import dataclasses

import torch

from fused_dlrm.models.arch_nodes import ArchGraph, ArchNode


class StandInGraph:
    def __init__(self, fn, inputs, outputs, log):
        self.fn, self.inputs, self.outputs, self.log = fn, inputs, outputs, log
        self.pending = True  # the capture's run holds the first replay's results

    def replay(self):
        self.log.append("replay")
        if self.pending:
            self.pending = False
            return
        _write_into(self.outputs, self.fn(*self.inputs))


def stand_in_capture(log: list):
    """A replacement for graphed_calls._capture that appends "capture" and "replay" to `log`."""
    def capture(fn, inputs):
        log.append("capture")
        own = tuple(t.clone() for t in inputs)
        outputs = fn(*own)
        return StandInGraph(fn, own, outputs, log), own, outputs
    return capture


def _write_into(old, new):
    if isinstance(old, torch.Tensor):
        if old is not new:
            old.copy_(new)
    elif isinstance(old, (list, tuple)):
        for o, n in zip(old, new):
            _write_into(o, n)
    elif dataclasses.is_dataclass(old):  # its fields and what its cached properties hold
        for name, value in vars(old).items():
            _write_into(value, vars(new)[name])


class EagerArchGraph(ArchGraph):
    """An ArchNode's graph (`fits` calls shaped like `input`, in the arch's mode when made; forward; the output's
    gradient buffer; backward) run eagerly, each call logged in `calls`."""

    def __init__(self, node: ArchNode, input: torch.Tensor):
        self.node, self.input, self.calls = node, input, []
        self.training = node.arch.training

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append("forward")
        with torch.enable_grad():
            self.leaf = x.detach().requires_grad_(self.input.requires_grad)
            self.output = self.node.eager(self.leaf)
        self.grad_output = torch.empty_like(self.output)
        return self.output.detach()

    def backward(self, grad: torch.Tensor) -> torch.Tensor | None:
        self.calls.append("backward")
        return self.node.gradients(self.output, self.leaf, grad)
