"""DLRM's dense arches (bottom MLP, over arch) as one autograd node each, their gradients averaged over ranks without
DDP; on GPUs (`trainer.cuda_graphs`) each node's forward and backward replay CUDA graphs.

Why: a DLRM step on GPUs is bound by the host (docs/benchmarks.md). Under plain autograd every dense parameter has
an AccumulateGrad node (~20-40 us of host each, 15 at the paper config, all run before the interaction's backward
can be launched), DDP adds its forward's Python and a hook per parameter, and torch.cuda.make_graphed_callables'
replays still hand each parameter's gradient through autograd. An `ArchNode` replaces `arch.forward`: a training
call is one node each way, whose backward writes the parameters' gradients into one flat buffer (the parameters'
`.grad` are views of it, set once; with a codec each starts at a 32-value block, tp.flat_buffer) and starts one
all-reduce of that buffer; autograd's final callback (DDP's mechanism too) makes the stream wait for it, so the
gradients are averaged when backward returns. They are DDP's:
scaled by 1/world before a sum (a `comm.grad_allreduce` codec: that codec's mean, as the DDP hook did).

The backward *sets* the gradients (no accumulation over several backwards: one per optimizer step, as the
training loop does); a second backward of a node in one backward pass (two forwards summed into one loss, which
DDP would sum) raises instead of dropping the first one's gradients. Whether a call is the node is DDP's rule too:
grad mode, not train() / eval(): in eval mode with grad on, a backward's gradients are averaged all the same;
without grad (evaluation: train/loop.py's evaluate), or with no parameter needing a gradient, the arch itself runs.
On GPUs `capture` records the node's forward (the arch) and backward (the gradients into the flat buffer, and their
scale) as two CUDA graphs at the rank's training batch size, in the arch's mode then; calls of another shape, dtype,
requires_grad or mode (an eval forward may differ: dropout, batch norm) run the same node eagerly, as does a forward
while the graph's last one still awaits its backward (a replay would rewrite the activations that backward reads).
Parameters must keep their storage (the graphs read it): the optimizer and checkpoint loading update in place.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from fused_dlrm.dist.symmetric import ALLOCATION_TIMEOUT_S
from fused_dlrm.kernels.graphed_calls import Lease, held
from fused_dlrm.kernels.launch import capture_graph
from fused_dlrm.tp import quantized_all_reduce
from fused_dlrm.tp.quantized_allreduce import check_grad_allreduce, flat_buffer, padding_views


class ArchNode:
    """`arch.forward` as one autograd node whose backward sets the parameters' gradients, averaged over `group`
    with `grad_allreduce` ("nccl": a plain all-reduce; or a codec of fused_dlrm.tp's quantized all-reduce, whose
    fused kernel's symmetric workspace waits `allocation_timeout_s` for the peers at an allocation)."""

    def __init__(self, arch: nn.Module, group: dist.ProcessGroup | None = None, grad_allreduce: str = "nccl",
                 allocation_timeout_s: float = ALLOCATION_TIMEOUT_S):
        self.arch, self.eager = arch, arch.forward  # the class's forward, bound: `arch.forward` is this node next
        named = [(name, p) for name, p in arch.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(f"{type(arch).__name__} has no parameter that needs a gradient")
        self.names, self.params = [name for name, _ in named], [p for _, p in named]
        check_grad_allreduce(grad_allreduce)
        self.group, self.codec, self.allocation_timeout_s = group, grad_allreduce, allocation_timeout_s
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        # a codec's: each parameter from a block boundary (its own blocks' scales; the gaps zeroed at each reduce)
        self.flat, self.grads = flat_buffer(self.params, grad_allreduce)
        self.gaps = padding_views(self.flat, [p.numel() for p in self.params], grad_allreduce)
        first = self.params[0]
        # plain all-reduce: a sum of gradients scaled first (DDP's order); a codec averages itself (mean=True)
        self.scale = 1.0 / self.world if self.world > 1 and grad_allreduce == "nccl" else 1.0
        self.anchor = torch.empty(0, device=first.device, requires_grad=True)  # makes the output need a gradient
        self.graph: ArchGraph | None = None
        self._replay: weakref.ref | None = None  # the graph's last forward's Lease, until its backward
        self._backward_pass = -1  # the autograd pass (graph task) of the latest backward
        if self.world > 1:  # DDP's start: every rank from rank 0's parameters
            src = dist.get_global_rank(group, 0) if group is not None else 0
            for p in self.params:
                dist.broadcast(p.data, src, group=group)
        arch.forward = self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # DDP's rule (grad mode, in eval mode too); frozen parameters leave nothing to set or average
        if torch.is_grad_enabled():
            frozen = [name for name, p in zip(self.names, self.params) if not p.requires_grad]
            if not frozen:
                return _ArchFunction.apply(x, self.anchor, self)
            if len(frozen) < len(self.params):  # its backward would ask autograd for a frozen one's gradient
                raise RuntimeError(f"{type(self.arch).__name__}'s node: parameters {frozen} were frozen after it "
                                   f"was built, the others not: freeze all of its parameters or none (it sets and "
                                   f"averages the gradients of those it was built with, as DDP does), or build it "
                                   f"again")
        return self.eager(x)

    def capture(self, sample: torch.Tensor) -> None:
        """Record this node's forward and backward as CUDA graphs for inputs shaped like `sample` (its dtype,
        device and requires_grad too), in the arch's present mode (train or eval)."""
        self.graph = ArchGraph(self, sample)

    def run_forward(self, x: torch.Tensor):
        """(output, what the backward needs): the graph's replay when x fits it and no earlier replay awaits its
        backward, else the arch under autograd."""
        if self.graph is not None and self.graph.fits(x) and not held(self._replay):
            lease = Lease()  # held by the autograd node: dropped unused, it frees the graph too
            self._replay = weakref.ref(lease)
            return self.graph.forward(x), lease
        with torch.enable_grad():
            leaf = x.detach().requires_grad_(x.requires_grad)
            out = self.eager(leaf)
        return out.detach(), (leaf, out)

    def run_backward(self, saved, grad: torch.Tensor) -> torch.Tensor | None:
        """The input's gradient (None when the input needs none); the parameters' gradients set and averaged."""
        backward_pass = torch._C._current_graph_task_id()
        if backward_pass == self._backward_pass:  # the first one's gradients would be overwritten, not summed
            raise RuntimeError(
                f"{type(self.arch).__name__}'s node: its backward ran twice in one backward pass (two forwards "
                "before one backward): it sets the arch's gradients in one buffer at each backward, so one "
                "forward's would be lost (and, on GPUs, overwritten while their all-reduce reads them); run one "
                "backward per forward")
        self._backward_pass = backward_pass
        if isinstance(saved, Lease):
            grad_x = self.graph.backward(grad)
            saved.release()
        else:
            leaf, out = saved
            grad_x = self.gradients(out, leaf, grad)
        work = self.hand_gradients()
        if work is not None:  # runs when the whole backward is done, on the caller's streams: they wait for it
            torch.autograd.Variable._execution_engine.queue_callback(work.wait)
        return grad_x

    def gradients(self, out: torch.Tensor, leaf: torch.Tensor, grad: torch.Tensor) -> torch.Tensor | None:
        """Backward through the arch: the parameters' gradients (times `scale`) into the flat buffer, and the
        input's gradient (None when `leaf` needs none). What the backward graph records."""
        inputs = ([leaf] if leaf.requires_grad else []) + self.params
        grads = torch.autograd.grad(out, inputs, grad)
        torch._foreach_copy_(self.grads, grads[-len(self.params):])  # one launch on GPUs, as a cat was
        if self.scale != 1.0:
            self.flat.mul_(self.scale)
        return grads[0] if leaf.requires_grad else None

    def hand_gradients(self) -> dist.Work | None:
        """Once the flat buffer holds this backward's gradients: the parameters' `.grad` set to its views and its
        average over the ranks started; returns the all-reduce to wait for before the gradients are read (a plain
        one's; a codec's is enqueued on the current stream, or synchronous: None)."""
        for p, g in zip(self.params, self.grads):
            if p.grad is not g:  # None after zero_grad(set_to_none=True)
                p.grad = g
        if self.world == 1:
            return None
        if self.codec != "nccl":
            if self.gaps:  # NaN where a non-finite block of an earlier backward held them (tp.padding_views)
                torch._foreach_zero_(self.gaps)
            quantized_all_reduce(self.flat, self.codec, self.group, mean=True, out=self.flat,
                                 allocation_timeout_s=self.allocation_timeout_s)
            return None
        return dist.all_reduce(self.flat, group=self.group, async_op=True)


class _ArchFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, anchor: torch.Tensor, node: ArchNode) -> torch.Tensor:
        out, ctx.saved = node.run_forward(x)
        ctx.node = node
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        saved, ctx.saved = ctx.saved, None
        return ctx.node.run_backward(saved, grad), None, None


def warm_up(fn: Callable[[], object], device: torch.device, times: int = 3) -> None:
    """Run fn a few times before its capture (cuBLAS workspaces, autograd's lazy set-up), on a side stream as
    torch.cuda.make_graphed_callables does. A node's fn writes only its flat buffer, which every backward
    overwrites."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(times):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)


def first_linear(arch: nn.Module) -> nn.Linear:
    return next(m for m in arch.modules() if isinstance(m, nn.Linear))


class ArchGraph:
    """An ArchNode's forward and backward as two CUDA graphs over static buffers (a memory pool of their own).

    A replay copies the input (or the output's gradient) into the static buffer and returns a detached alias of
    the graph's output: valid until the node's next replay (a step's backward runs before the next forward)."""

    def __init__(self, node: ArchNode, sample: torch.Tensor):
        self.node, self.training = node, node.arch.training  # the mode whose forward the graphs hold
        self.input = sample.detach().clone().requires_grad_(sample.requires_grad)

        def forward_backward() -> None:
            with torch.enable_grad():
                out = node.eager(self.input)
            node.gradients(out, self.input, torch.ones_like(out))
        warm_up(forward_backward, sample.device)
        outputs = []

        def record_forward() -> None:
            with torch.enable_grad():
                outputs.append(node.eager(self.input))
        pool = torch.cuda.graph_pool_handle()
        self.forward_graph = capture_graph(record_forward, pool)
        self.output = outputs.pop()
        self.grad_output = torch.empty_like(self.output)
        self.backward_graph = capture_graph(
            lambda: outputs.append(node.gradients(self.output, self.input, self.grad_output)), pool)
        self.grad_input = outputs.pop()

    def fits(self, x: torch.Tensor) -> bool:
        """Whether a call on x in the arch's present mode is the captured one's."""
        s = self.input
        return (x.shape == s.shape and x.dtype == s.dtype and x.device == s.device
                and x.requires_grad == s.requires_grad and self.node.arch.training == self.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.input.detach().copy_(x)
        self.forward_graph.replay()
        return self.output.detach()

    def backward(self, grad: torch.Tensor) -> torch.Tensor | None:
        if grad is not self.grad_output:  # a kernel may have stored the gradient there itself
            self.grad_output.copy_(grad)
        self.backward_graph.replay()
        return None if self.grad_input is None else self.grad_input.detach()


def dense_arch_nodes(model: nn.Module, grad_allreduce: str = "nccl", graph_batch: int | None = None,
                     allocation_timeout_s: float = ALLOCATION_TIMEOUT_S) -> nn.Module:
    """model.dense_arch and model.over_arch (torchrec's DLRM arches) as ArchNodes over a group of their own (every
    rank, made here on every rank), in place; with `graph_batch` (GPUs), each captured at that many rows (the over
    arch's input needs a gradient: it comes from the embeddings; the dense features do not); a rank without
    samples (0) runs them eagerly.

    Their own group: a step called directly (train/direct_step.py) starts the dense arch's all-reduce before the
    output dist's backward all-to-all, which it can then run beside (one communicator runs its operations one after
    the other); autograd's comes after it. Every rank still issues the step's collectives in one order (NCCL's
    rule for several communicators): in a step where some ranks take the direct step and others autograd's (a
    short last batch split unevenly: one rank's batch fits its graphs, its peer's does not), the direct step's
    comes after the all-to-all too, as does a codec's (a call in line) in every step."""
    arches = (model.dense_arch, model.over_arch)
    if any(isinstance(a, nn.parallel.DistributedDataParallel) for a in arches):
        raise ValueError("the dense arches are in DDP already: ArchNodes average their gradients themselves")
    group = dist.new_group() if dist.is_initialized() and dist.get_world_size() > 1 else None
    nodes = [ArchNode(a, group, grad_allreduce, allocation_timeout_s) for a in arches]
    if graph_batch:
        weight = nodes[0].params[0]
        rng = torch.Generator(weight.device).manual_seed(0)  # the global generator's stream stays the same
        for node, needs_grad in zip(nodes, (False, True)):
            in_features = first_linear(node.arch).in_features
            node.capture(torch.randn(graph_batch, in_features, generator=rng, device=weight.device,
                                     dtype=weight.dtype).requires_grad_(needs_grad))
    return model


def sets_every_gradient(model: nn.Module, params: list[nn.Parameter]) -> bool:
    """Whether the model's ArchNodes set every one of `params`' gradients whole at each backward: then a training
    loop stepping these needs no zero_grad (~0.1 ms of host per step)."""
    set_by_nodes = {id(p) for m in model.modules() if isinstance(m.__dict__.get("forward"), ArchNode)
                    for p in m.forward.params}
    return all(id(p) in set_by_nodes for p in params)
