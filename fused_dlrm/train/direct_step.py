"""DLRM's training step called directly, without autograd around the dense part (`trainer.direct_step`; GPUs, the
dense arches graphed, the pairwise interaction's kernels).

With the dense arches as nodes replaying CUDA graphs (models/arch_nodes.py), much of what is left of a step's host
time is autograd's own: the loss's nodes, the interaction's and the exchange's Python Functions, the hand-offs
between the loop's thread and the engine's (each waiting for the GIL that the batch thread also takes;
docs/benchmarks.md, 2026-12-01). The dense part of the step has fixed shapes and buffers, so it is written out as
the sequence it is, each piece writing where the next one reads:

    dense arch forward (its node's graph)     dense features -> the bottom MLP's output (the graph's own)
    sparse forward                            bags -> pooled [B, F * D]
    interaction forward (kernel)              -> the input of the over arch's graph
    over arch + loss, forward and backward    one CUDA graph (OverArchLossGraph): the loss, the over arch's
                                              gradients (its node's flat buffer), the interaction output's gradient
    interaction backward (kernel)             d dense into the dense graph's gradient input, and d S
    dense arch backward (its node's graph)    the bottom MLP's gradients
    sparse backward                           d S to the tables' owners, then the embedding update
    then the two all-reduces of the dense gradients (each started once its arch's gradients are made; the dense
    arch's after the sparse backward where it is a quantized codec's, or where a peer takes train_step in this
    step: see DirectDLRMStep) and the dense optimizer's step.

The sparse part is the collection's: with comm=fused (p2p) the interaction's backward kernel stores d S straight
into the owners' symmetric gradient buffers with the exchange's flags (GradientPush's protocol) and the exchange's
backward waits for them and updates the tables, no autograd at all. With row-wise tables the exchange's row is
wider (each row block's part of a feature at columns of its own; a sample's parts are summed after it, RowBlockSum):
the kernel then stores each feature's d S at every block's part (a mean-pooled one's divided by the bag size), the
blocks' sum's backward on the way. Where the kernel cannot store it (the nvshmem transport, whose puts it does not
make, or a gradient block of the kernel that would straddle two owners) d S is made locally, a row-wise table's
wide-row gradient made from it (RowBlockSum.wide_gradient), and the exchange pushes the result. With
comm=bulk the lookup, the all-to-all, the row blocks' sum and their backward stay autograd's (their outputs are new
tensors each step), d S handed to them. The arithmetic is loop.train_step's, op for op. Calls that do not fit the
graphs (another local batch size) take train_step; evaluation calls the model as ever.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torchrec.datasets.utils import Batch

from fused_dlrm.dist.env import of_every_rank
from fused_dlrm.kernels.launch import capture_graph
from fused_dlrm.kernels.pairwise_interaction import kernels_refuse, launch_backward, launch_forward, push_block
from fused_dlrm.models.arch_nodes import ArchNode, first_linear, warm_up
from fused_dlrm.models.dlrm import PairwiseInteractionArch, dlrm_loss
from fused_dlrm.sparse.sharded_ebc import ShardedEmbeddingBagCollection, torchrec_gradient_scale


def direct_step_refusal(model: nn.Module) -> str:
    """Why DirectDLRMStep cannot run this model's training steps, or "" when it can."""
    sparse_arch = model.sparse_arch
    sparse = sparse_arch.embedding_bag_collection
    if not isinstance(sparse, ShardedEmbeddingBagCollection):
        return f"the embeddings are {type(sparse).__name__}, not the project's sharded collection"
    nodes = (model.dense_arch.__dict__.get("forward"), model.over_arch.__dict__.get("forward"))
    if not all(isinstance(n, ArchNode) and n.graph is not None for n in nodes):
        return "the dense arches are not graphed arch nodes (the CPU, or trainer.cuda_graphs=false)"
    if not (model.training and all(n.graph.training for n in nodes)):  # it replays them for training steps
        return "the model is in eval mode, or its arch graphs were captured in it"
    if not isinstance(model.inter_arch, PairwiseInteractionArch):
        return f"the interaction is {type(model.inter_arch).__name__}, not PairwiseInteractionArch"
    num_features, dim = sparse_arch.F, sparse_arch.D
    dims = [t.embedding_dim for t in sparse.embedding_bag_configs() for _ in t.feature_names]
    if sparse.feature_names != sparse_arch.sparse_feature_names or any(d != dim for d in dims):
        return "the pooled output is not [B, F, D] in the arch's feature order"
    rows, device = nodes[0].graph.input.shape[0], nodes[0].graph.input.device
    return kernels_refuse(torch.empty(rows, dim, device=device), torch.empty(rows, num_features, dim, device=device))


class OverArchLossGraph:
    """The over arch and the loss, forward and backward, as one CUDA graph over static buffers: in, `input` (the
    interaction's output, which its kernel stores there), the labels and the loss's scale; out, `loss`, the over
    arch's gradients (its node's flat buffer, times the node's scale) and `grad_input`."""

    def __init__(self, node: ArchNode, rows: int):
        self.node = node
        weight = node.params[0]
        gen = torch.Generator(weight.device).manual_seed(0)  # the global generator's stream stays the same
        self.input = torch.randn(rows, first_linear(node.arch).in_features, generator=gen, device=weight.device,
                                 dtype=weight.dtype).requires_grad_()
        self.labels = torch.rand(rows, generator=gen, device=weight.device).round()
        self.scale = torch.ones((), device=weight.device)
        self._scale = 1.0  # the scale's value, on the host
        warm_up(self._forward_backward, weight.device)
        outputs = []
        self.graph = capture_graph(lambda: outputs.append(self._forward_backward()))
        self.loss, self.grad_input = outputs.pop()

    def _forward_backward(self) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.enable_grad():
            loss = dlrm_loss(self.node.eager(self.input).squeeze(-1), self.labels, self.scale)
        return loss.detach(), self.node.gradients(loss, self.input, None)

    def run(self, labels: torch.Tensor, scale: float) -> None:
        """One replay on these labels (the input already stored) with the loss times `scale`."""
        self.labels.copy_(labels)
        if scale != self._scale:
            self.scale.fill_(scale)
            self._scale = scale
        self.graph.replay()


class DirectDLRMStep:
    """loop.train_step, written out (see the module docstring): `takes(batch)` says whether a batch fits its
    graphs, `step(batch)` runs one step on it (forward, backward with the embedding update, the dense optimizer's
    `optimizer_step`) and returns the loss (the graph's own: read it before the next step).

    The dense arch's gradients are averaged before the sparse backward's exchanges with a plain all-reduce (async,
    over the arch nodes' own group: it overlaps them), after them with a quantized codec, whose all-reduce runs in
    line (gloo: on the host; NCCL: a kernel on this stream that waits for its peers: in the other order the ranks
    would each wait for the other's exchange). Every rank issues its collectives in one order: in a step where a
    peer's batch does not fit its graphs (a short last batch split unevenly), that peer takes train_step, whose
    autograd reaches the dense arch's backward after the sparse one, so this step's all-reduce then comes after the
    exchanges too. Which step each rank takes is known on every rank from the batch's header (every rank's batch
    size) and every rank's graph rows, exchanged once here: NCCL needs the operations of its communicators in one
    order on every rank (a kernel waiting in one can keep another's from running: a hang)."""

    def __init__(self, model: nn.Module, optimizer_step: Callable[[], None], world_size: int):
        reason = direct_step_refusal(model)
        if reason:
            raise ValueError(f"the direct DLRM step cannot run this model: {reason}")
        self.model, self.optimizer_step, self.world_size = model, optimizer_step, world_size
        self.sparse = model.sparse_arch.embedding_bag_collection
        self.dense = model.dense_arch.forward
        rows = self.dense.graph.input.shape[0]
        self.rows_of_rank = of_every_rank(rows)  # a batch fits every rank's graphs: each takes it (class docstring)
        self.over = OverArchLossGraph(model.over_arch.forward, rows)
        self.shape = (self.dense.graph.input.shape[0], model.sparse_arch.F, model.sparse_arch.D)
        self.push_block = push_block(torch.float32, self.shape[2])  # the pushing backward's column blocks
        exchange, self.row_block_sum = self.sparse.fused, self.sparse.row_block_sum
        # Whether the interaction's backward kernel stores d S into the owners' buffers (else the exchange pushes:
        # always with nvshmem, whose puts the kernel does not make).
        self.kernel_pushes = (exchange is not None and not exchange.nvshmem
                              and exchange.push_blocks(self.shape[2], self.push_block) is not None
                              and (self.row_block_sum is None or self.row_block_sum.pushable(self.shape[2])))

    def takes(self, batch: Batch) -> bool:
        return self.model.training and batch.dense_features.shape[0] == self.shape[0]

    def step(self, batch: Batch) -> torch.Tensor:
        dense_graph, over, exchange = self.dense.graph, self.over, self.sparse.fused
        bags = self.sparse.bags_of(batch.sparse_features)
        # the dense arch's plain all-reduce ahead of the exchanges only where no peer takes autograd's order
        dense_average_first = self.dense.codec == "nccl" and bags.batch_sizes == self.rows_of_rank
        embedded_dense = dense_graph.forward(batch.dense_features)
        scale = torchrec_gradient_scale(self.world_size)
        if exchange is None:
            with torch.enable_grad():  # the lookup, the all-to-all and the row blocks' sum: autograd's backward
                pooled = self.sparse.pooled(bags)
        else:
            pooled = exchange.finish(bags, exchange.start(bags))
            if self.row_block_sum is not None:  # row-wise: the wide row's blocks summed
                pooled = self.row_block_sum.sum_blocks(pooled, bags.pooling_divisors)
        sparse = pooled.detach().contiguous().view(self.shape)
        launch_forward(embedded_dense, sparse, over.input)
        over.run(batch.labels, self.world_size / bags.global_batch)
        over_average = over.node.hand_gradients()
        if self.kernel_pushes:  # d S pushed to the owners by the interaction's kernel
            destinations = exchange.gradient_destinations(bags, scale, self.shape[2], self.push_block)
            if self.row_block_sum is not None:  # each block's part receives the sample's d S (a mean's divided)
                destinations = self.row_block_sum.fan_out(destinations, bags.pooling_divisors, self.shape[2])
            launch_backward(over.grad_input, embedded_dense, sparse, dense_graph.grad_output, None, destinations)
            epoch, pusher = destinations.epoch, "consumer"
        else:
            grad_sparse = torch.empty_like(sparse)
            launch_backward(over.grad_input, embedded_dense, sparse, dense_graph.grad_output, grad_sparse, None)
            if exchange is not None:
                # the exchange pushes its own output's gradient (row-wise: the wide row's), ahead of the dense
                # backward as the kernel's push is
                grad = grad_sparse.view_as(pooled)
                if self.row_block_sum is not None:
                    grad = self.row_block_sum.wide_gradient(grad, bags.pooling_divisors)
                epoch, pusher = exchange.start_backward(bags, grad, scale), "exchange"
        dense_graph.backward(dense_graph.grad_output)
        dense_average = self.dense.hand_gradients() if dense_average_first else None
        if exchange is None:
            pooled.backward(grad_sparse.view_as(pooled))
        else:
            exchange.finish_backward(bags, epoch)
            exchange.backward_pushes[pusher] += 1
        if not dense_average_first:
            dense_average = self.dense.hand_gradients()
        for work in (over_average, dense_average):
            if work is not None:
                work.wait()
        self.optimizer_step()
        return over.loss
