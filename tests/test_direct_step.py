"""trainer.direct_step on the CPU: a model the direct step refuses, and why (it needs the dense arches graphed:
GPUs, tests/test_direct_step_gpu.py); and the direct step's sequence itself over two gloo ranks with comm=bulk,
its CUDA graphs stood in for by the same computations run eagerly (the interaction's kernels in Triton's
interpreter): the loss curve and evaluations of the autograd step, every step taken directly, the dense gradients'
all-reduces waited for outside autograd; and steps where some ranks step directly and others by autograd (a rank's
graphs that its batches never fit; a file's short last batch), every rank's collectives in one order."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fused_dlrm.dist.alltoall as alltoall
import fused_dlrm.train.build as build
import fused_dlrm.train.direct_step as direct_step
from fused_dlrm.dist import DistEnv
from fused_dlrm.data import local_batch_bounds
from fused_dlrm.dist.env import of_every_rank
from fused_dlrm.models.arch_nodes import ArchNode, first_linear
from fused_dlrm.train.build import build_model
from fused_dlrm.train.direct_step import DirectDLRMStep, OverArchLossGraph, direct_step_refusal
from fused_dlrm.train.loop import train
from test_training import CPU, SMALL, _criteo_file, config
from graph_stand_in import EagerArchGraph
from world import run_world


def test_a_model_without_graphed_arches_is_refused_with_its_reason():
    model = build_model(config(*SMALL), CPU)
    assert "not graphed arch nodes" in direct_step_refusal(model)
    with pytest.raises(ValueError, match="not graphed arch nodes"):
        DirectDLRMStep(model, lambda: None, 1)


def test_a_model_in_eval_mode_or_graphed_in_it_is_refused():
    """The direct step replays its graphs for training steps (OverArchLossGraph captured in the model's mode when
    made): graphs of eval forwards would stand in for training ones."""
    model = build_model(config(*SMALL), CPU)
    for arch in (model.dense_arch, model.over_arch):
        arch.forward.graph = EagerArchGraph(arch.forward, torch.empty(64, first_linear(arch).in_features))
    assert "not graphed arch nodes" not in direct_step_refusal(model)
    model.eval()
    assert direct_step_refusal(model) == "the model is in eval mode, or its arch graphs were captured in it"
    model.train()
    model.over_arch.forward.graph.training = False
    assert direct_step_refusal(model) == "the model is in eval mode, or its arch graphs were captured in it"


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


def _stand_in_direct_step(rows: int) -> tuple[list, list]:
    """In this rank's process: the arch nodes' graphs stood in for at `rows` rows (build_model's graph batch: the
    rank's share of the global batch), the direct step's over arch + loss graph too. Returns the list each direct
    step appends to, and the order in which this rank issues the step's collectives of other groups than the input
    dist's: the arch nodes' all-reduces (their own group) and the output dist's all-to-alls (the collection's
    group). On NCCL, communicators must see their operations in one order on every rank (a kernel waiting in one can
    keep another from running), whatever the step each rank takes."""
    make_nodes = build.dense_arch_nodes

    def nodes_with_stand_in_graphs(model, grad_allreduce, graph_batch, *rest):
        model = make_nodes(model, grad_allreduce, graph_batch, *rest)
        for arch, needs_grad in ((model.dense_arch, False), (model.over_arch, True)):
            sample = torch.empty(rows, first_linear(arch).in_features).requires_grad_(needs_grad)
            arch.forward.graph = EagerArchGraph(arch.forward, sample)
        return model
    build.dense_arch_nodes = nodes_with_stand_in_graphs
    direct_step.OverArchLossGraph = _EagerOverArchLoss
    taken, issued = [], []
    step = DirectDLRMStep.step
    DirectDLRMStep.step = lambda self, batch: taken.append(1) or step(self, batch)
    hand_gradients, all_to_all = ArchNode.hand_gradients, alltoall._all_to_all
    ArchNode.hand_gradients = lambda node: issued.append(type(node.arch).__name__) or hand_gradients(node)
    alltoall._all_to_all = lambda x, send, recv, group: (group is None and issued.append("all-to-all")
                                                         or all_to_all(x, send, recv, group))
    return taken, issued


def _one_order(issued: list[str]) -> None:
    """Every rank issued the collectives of `issued` in one order (else: the first place they differ)."""
    every = of_every_rank(issued)
    first = next((i for i, ops in enumerate(zip(*every)) if len(set(ops)) > 1), None)
    assert first is None and len({len(theirs) for theirs in every}) == 1, (
        first, [theirs[first - 2 if first else 0:][:6] for theirs in every])


def _losses(result) -> torch.Tensor:
    return torch.tensor([loss for _, loss in result.losses], dtype=torch.float64)


def _same_run(direct, autograd) -> None:
    """The direct step's losses and evaluations are the autograd step's (the direct step's interaction is the
    Triton kernel, interpreted; autograd's on the CPU the torch reference)."""
    assert [s for s, _ in direct.losses] == [s for s, _ in autograd.losses]
    torch.testing.assert_close(_losses(direct), _losses(autograd), rtol=1e-4, atol=1e-6)
    assert len(direct.evals) == len(autograd.evals) > 0
    for got, want in zip(direct.evals, autograd.evals):
        assert got.keys() == want.keys() and all(abs(got[k] - want[k]) < 1e-4 for k in want), (got, want)


def _bulk_direct_step_trains_as_autograd(rank: int, world: int, tmp: str, sharding: list[str],
                                         last_rank_autograd: bool) -> None:
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    rows = BATCH // world  # split evenly
    direct_ranks = world - 1 if last_rank_autograd else world
    if rank >= direct_ranks:  # graphs its batches do not fit: this rank's steps are autograd's, its peers' direct
        rows += 1
    taken, issued = _stand_in_direct_step(rows)
    common = SMALL + sharding + [f"data.global_batch_size={BATCH}", "trainer.max_steps=12", "trainer.log_every=1",
                                 "trainer.eval_every=6", "trainer.checkpoint_every=0"]
    autograd = train(config(*common, "trainer.direct_step=false"), env, Path(tmp) / f"autograd{rank}")
    assert taken == []
    issued.clear()
    direct = train(config(*common), env, Path(tmp) / f"direct{rank}")
    assert len(taken) == (12 if rank < direct_ranks else 0)
    _one_order(issued)
    # the dense arch's all-reduce overlaps the backward's all-to-all where every rank steps directly
    backward = ["DenseArch", "all-to-all"] if direct_ranks == world else ["all-to-all", "DenseArch"]
    assert issued[:4] == ["all-to-all", "OverArch", *backward], issued[:4]
    _same_run(direct, autograd)
    assert len(direct.evals) == 2


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


def _short_last_batch_trains_as_autograd(rank: int, world: int, tmp: str) -> None:
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    start, stop = local_batch_bounds(17, rank, world)  # build_model's graph batch: 9 and 8 samples
    taken, issued = _stand_in_direct_step(stop - start)
    path = _criteo_file(Path(tmp) / "day_0.tsv", 67)  # every rank writes the same lines
    common = ["data=criteo", "data.global_batch_size=17", "data.num_workers=0", "data.eval_batches=2",
              f"data.train.paths=[{path}]", f"data.eval.paths=[{path}]", "model.num_rows=100",
              "trainer.max_steps=null", "trainer.epochs=2", "trainer.log_every=1", "trainer.eval_every=3",
              "trainer.checkpoint_every=3", "trainer.keep_checkpoints=3", "trainer.progress=false"]
    autograd = train(config(*common, "trainer.direct_step=false"), env, Path(tmp) / "autograd")
    issued.clear()
    direct = train(config(*common), env, Path(tmp) / "direct")
    assert direct.step == 8 and len(taken) == (6 if rank == 0 else 8)  # steps 4 and 8: 8 + 8 samples
    _one_order(issued)
    _same_run(direct, autograd)
    # resumed mid-epoch, before the short batch: the direct run's own continuation
    resumed = train(config(*common, f"trainer.resume_from={Path(tmp) / 'direct' / 'checkpoints' / 'step_3'}"), env,
                    Path(tmp) / "resumed")
    want = [(s, loss) for s, loss in direct.losses if s > 3]
    assert [s for s, _ in resumed.losses] == [s for s, _ in want]
    torch.testing.assert_close(_losses(resumed), _losses(direct)[-len(want):], rtol=1e-5, atol=1e-6)


def test_two_ranks_a_files_short_last_batch_mixes_the_steps_as_autograd_orders_them(tmp_path):
    """A file's last global batch is short: 16 samples of 17 split 8 and 8, where the graphs hold 9 and 8 rows, so
    rank 1 steps directly and rank 0 by autograd; with evaluations between steps, two epochs and a resume
    mid-epoch: the losses and evaluations of the autograd run, each rank's collectives in one order."""
    run_world(2, _short_last_batch_trains_as_autograd, str(tmp_path), timeout=600)
