"""trainer.direct_step on the CPU: a model the direct step refuses, and why (it needs the dense arches graphed:
GPUs, tests/test_direct_step_gpu.py); and the direct step's sequence itself over two gloo ranks with comm=bulk,
its CUDA graphs stood in for by the same computations run eagerly (the interaction's kernels in Triton's
interpreter): the loss curve and evaluations of the autograd step, every step taken directly, the dense gradients'
all-reduces waited for outside autograd."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fused_dlrm.dist.alltoall as alltoall
import fused_dlrm.train.build as build
import fused_dlrm.train.direct_step as direct_step
from fused_dlrm.dist import DistEnv
from fused_dlrm.dist.env import of_every_rank
from fused_dlrm.models.arch_nodes import ArchNode, first_linear
from fused_dlrm.train.build import build_model
from fused_dlrm.train.direct_step import DirectDLRMStep, OverArchLossGraph, direct_step_refusal
from fused_dlrm.train.loop import train
from test_training import CPU, SMALL, config
from graph_stand_in import EagerArchGraph
from world import run_world


def test_a_model_without_graphed_arches_is_refused_with_its_reason():
    model = build_model(config(*SMALL), CPU)
    assert "not graphed arch nodes" in direct_step_refusal(model)
    with pytest.raises(ValueError, match="not graphed arch nodes"):
        DirectDLRMStep(model, lambda: None, 1)


class _EagerOverArchLoss(OverArchLossGraph):
    """OverArchLossGraph's interface over its computation run eagerly at every call."""

    def __init__(self, node: ArchNode, rows: int):
        self.node = node
        self.input = torch.empty(rows, first_linear(node.arch).in_features, requires_grad=True)
        self.labels, self.scale = torch.empty(rows), torch.ones(())

    def run(self, labels: torch.Tensor, scale: float) -> None:
        self.labels.copy_(labels)
        self.scale.fill_(scale)
        self.loss, self.grad_input = self._forward_backward()


# The global batch: the direct step's interaction kernels run a program per sample in the interpreter (SMALL's 128
# samples made this test minutes long).
BATCH = 32


def _bulk_direct_step_trains_as_autograd(rank: int, world: int, tmp: str, sharding: list[str],
                                         last_rank_autograd: bool) -> None:
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    rows = BATCH // world  # split evenly
    direct_ranks = world - 1 if last_rank_autograd else world
    if rank >= direct_ranks:  # graphs its batches do not fit: this rank's steps are autograd's, its peers' direct
        rows += 1
    make_nodes = build.dense_arch_nodes

    def nodes_with_stand_in_graphs(model, grad_allreduce, graph_batch, *rest):
        model = make_nodes(model, grad_allreduce, graph_batch, *rest)
        for arch, needs_grad in ((model.dense_arch, False), (model.over_arch, True)):
            sample = torch.empty(rows, first_linear(arch).in_features).requires_grad_(needs_grad)
            arch.forward.graph = EagerArchGraph(arch.forward, sample)
        return model
    build.dense_arch_nodes = nodes_with_stand_in_graphs
    direct_step.OverArchLossGraph = _EagerOverArchLoss
    taken = []
    step = DirectDLRMStep.step
    DirectDLRMStep.step = lambda self, batch: taken.append(1) or step(self, batch)
    # The order in which this rank issues the step's collectives of other groups than the input dist's: the arch
    # nodes' all-reduces (their own group) and the output dist's all-to-alls (the collection's group). On NCCL,
    # communicators must see their operations in one order on every rank (a kernel waiting in one can keep another
    # from running), whatever the step each rank takes.
    issued = []
    hand_gradients, all_to_all = ArchNode.hand_gradients, alltoall._all_to_all
    ArchNode.hand_gradients = lambda node: issued.append(type(node.arch).__name__) or hand_gradients(node)
    alltoall._all_to_all = lambda x, send, recv, group: (group is None and issued.append("all-to-all")
                                                         or all_to_all(x, send, recv, group))
    common = SMALL + sharding + [f"data.global_batch_size={BATCH}", "trainer.max_steps=12", "trainer.log_every=1",
                                 "trainer.eval_every=6", "trainer.checkpoint_every=0"]
    autograd = train(config(*common, "trainer.direct_step=false"), env, Path(tmp) / f"autograd{rank}")
    assert taken == []
    issued.clear()
    direct = train(config(*common), env, Path(tmp) / f"direct{rank}")
    assert len(taken) == (12 if rank < direct_ranks else 0)
    every = of_every_rank(issued)
    assert all(theirs == every[0] for theirs in every), [theirs[:8] for theirs in every]
    # the dense arch's all-reduce overlaps the backward's all-to-all where every rank steps directly
    backward = ["DenseArch", "all-to-all"] if direct_ranks == world else ["all-to-all", "DenseArch"]
    assert issued[:4] == ["all-to-all", "OverArch", *backward], issued[:4]
    # the direct step's interaction is the Triton kernel (interpreted), autograd's on the CPU the torch reference
    losses = lambda r: torch.tensor([loss for _, loss in r.losses], dtype=torch.float64)  # noqa: E731
    torch.testing.assert_close(losses(direct), losses(autograd), rtol=1e-4, atol=1e-6)
    assert len(direct.evals) == 2
    for got, want in zip(direct.evals, autograd.evals):
        assert got.keys() == want.keys() and all(abs(got[k] - want[k]) < 1e-4 for k in want), (got, want)


@pytest.mark.parametrize("sharding, last_rank_autograd", [([], False), (["model.row_shards=2", "model.pooling=mean"], False),
                                                        ([], True), (["comm.grad_allreduce=fp16"], True)],
                         ids=["table-wise", "row-wise", "ranks-mixed", "ranks-mixed-codec"])
def test_two_ranks_bulk_direct_step_trains_as_the_autograd_step(tmp_path, sharding, last_rank_autograd):
    """row-wise: every table's rows in two blocks, one per rank, mean-pooled (each sample's parts summed, then
    divided by its bag size after the exchange). ranks-mixed: one rank's batches do not fit its graphs (a short
    last batch splits unevenly), so in the same step its peer runs the direct step and it autograd's, which
    reaches the dense arch's all-reduce after the output dist's backward all-to-all: the direct step then takes
    that order too (NCCL wants every communicator's operations in one order on every rank: gloo's threads would
    hide a mix). ranks-mixed-codec: the dense gradients' all-reduce quantized, a call in line on the host (gloo):
    the direct step takes autograd's order for it (else both ranks hang)."""
    run_world(2, _bulk_direct_step_trains_as_autograd, str(tmp_path), sharding, last_rank_autograd, timeout=600)
