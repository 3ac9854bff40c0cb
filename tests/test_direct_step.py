"""trainer.direct_step on the CPU: a model the direct step refuses, and why (it needs the dense arches graphed:
GPUs, tests/test_direct_step_gpu.py); and the direct step's sequence itself over two gloo ranks with comm=bulk,
its CUDA graphs stood in for by the same computations run eagerly (the interaction's kernels in Triton's
interpreter): the loss curve and evaluations of the autograd step, every step taken directly, the dense gradients'
all-reduces waited for outside autograd."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fused_dlrm.train.build as build
import fused_dlrm.train.direct_step as direct_step
from fused_dlrm.dist import DistEnv
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
    common = SMALL + sharding + [f"data.global_batch_size={BATCH}", "trainer.max_steps=12", "trainer.log_every=1",
                                 "trainer.eval_every=6", "trainer.checkpoint_every=0"]
    autograd = train(config(*common, "trainer.direct_step=false"), env, Path(tmp) / f"autograd{rank}")
    assert taken == []
    direct = train(config(*common), env, Path(tmp) / f"direct{rank}")
    assert len(taken) == (12 if rank < direct_ranks else 0)
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
    last batch splits unevenly), so in the same step its peer runs the direct step and it autograd's, whose
    collectives come in another order (the dense arch's all-reduce after the output dist's backward all-to-all):
    the arch nodes' own group keeps the two from meeting. ranks-mixed-codec: the dense gradients' all-reduce
    quantized, a call in line on the host (gloo) that its own group does not keep apart: the direct step takes
    autograd's order for it (else both ranks hang)."""
    run_world(2, _bulk_direct_step_trains_as_autograd, str(tmp_path), sharding, last_rank_autograd, timeout=600)
