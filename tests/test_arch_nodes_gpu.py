"""The dense arches' nodes replayed as CUDA graphs (trainer.cuda_graphs) train as the eager nodes do. ONE GPU
(skipped without one): training at world 1 (and resumed from a checkpoint), and two gloo processes that share the
GPU (the graphed backward's flat gradients, all-reduced outside the graphs, are DDP's); with each codec, every
parameter's gradient within its own blocks' bound (one shared GPU, or two over NCCL: the fused kernel)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchrec.models.dlrm import DenseArch, OverArch

from fused_dlrm.dist import DistEnv
from fused_dlrm.models.arch_nodes import ArchGraph, ArchNode, dense_arch_nodes
from fused_dlrm.train.direct_step import OverArchLossGraph
from fused_dlrm.train.loop import train
from test_arch_nodes import _each_parameter_within_its_own_bound
from test_training import SMALL, config
from world import ONE_GPU, TWO_RANK_BACKENDS, run_world

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
GPU = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cuda", 0), backend=None)


@pytest.mark.parametrize("direct_step", [False, True])
def test_training_with_graphed_arches_follows_the_eager_loss_curve(tmp_path, monkeypatch, direct_step):
    """Autograd's step replays both arches' graphs; the direct step the dense arch's and the over arch's with the
    loss (OverArchLossGraph). The eager nodes (no graphs) take autograd's step either way."""
    replays, over_loss_replays = [], []
    replay, over_loss_replay = ArchGraph.forward, OverArchLossGraph.run
    monkeypatch.setattr(ArchGraph, "forward", lambda self, x: replays.append(x.shape[0]) or replay(self, x))
    monkeypatch.setattr(OverArchLossGraph, "run", lambda self, labels, scale: over_loss_replays.append(1)
                        or over_loss_replay(self, labels, scale))
    common = SMALL + ["trainer.device=cuda", "trainer.max_steps=12", "trainer.log_every=1", "trainer.eval_every=6",
                      "trainer.checkpoint_every=0", f"trainer.direct_step={str(direct_step).lower()}"]
    eager = train(config(*common, "trainer.cuda_graphs=false"), GPU, tmp_path / "eager")
    assert replays == [] and over_loss_replays == []
    graphed = train(config(*common, "trainer.cuda_graphs=true"), GPU, tmp_path / "graphed")
    # per training step; evaluation calls the arches themselves
    assert (len(replays), len(over_loss_replays)) == ((12, 12) if direct_step else (2 * 12, 0))
    losses = lambda r: torch.tensor([loss for _, loss in r.losses], dtype=torch.float64)
    torch.testing.assert_close(losses(graphed), losses(eager), rtol=1e-5, atol=1e-6)
    for got, want in zip(graphed.evals, eager.evals):
        assert got.keys() == want.keys() and all(abs(got[k] - want[k]) < 1e-5 for k in want), (got, want)


def test_resume_with_graphs_continues_the_exact_loss_curve(tmp_path):
    """Loading a checkpoint copies into the parameters and optimizer state in place: the graphs captured at build
    read the loaded values (had it replaced the tensors, the resumed curve would follow stale weights)."""
    common = SMALL + ["trainer.device=cuda", "trainer.max_steps=30", "trainer.eval_every=0",
                      "trainer.checkpoint_every=10", "trainer.log_every=1", "trainer.cuda_graphs=true"]
    full = train(config(*common), GPU, tmp_path / "full")
    resumed = train(config(*common, f"trainer.resume_from={tmp_path / 'full' / 'checkpoints' / 'step_20'}"), GPU,
                    tmp_path / "resumed")
    want = [loss for step, loss in full.losses if step > 20]
    assert len(want) == 10 and [loss for _, loss in resumed.losses] == pytest.approx(want, rel=1e-6)


class _Arches(nn.Module):
    def __init__(self, device: torch.device):
        super().__init__()
        torch.manual_seed(0)
        self.dense_arch = DenseArch(13, [64, 16], device)
        self.over_arch = OverArch(16 + 40, [32, 16, 1], device)


def _step(arches: nn.Module, dense: torch.Tensor, pooled: torch.Tensor, labels: torch.Tensor) -> None:
    """The arches' part of a DLRM step: the interaction stands in as a concatenation with a leaf that needs grad."""
    x = torch.cat([arches.dense_arch(dense), pooled], dim=1)
    loss = F.binary_cross_entropy_with_logits(arches.over_arch(x).squeeze(-1), labels)
    loss.backward()


def _graphed_nodes_average_like_ddp(rank: int, world: int) -> None:
    device = torch.device("cuda", 0)  # both processes on the one GPU (ONE_GPU); gloo all-reduces the CUDA gradients
    batch = 24
    ddp = _Arches(device)
    ddp.dense_arch = nn.parallel.DistributedDataParallel(ddp.dense_arch)
    ddp.over_arch = nn.parallel.DistributedDataParallel(ddp.over_arch)
    models = [(arches, torch.optim.Adam(arches.parameters(), lr=1e-2))
              for arches in (ddp, dense_arch_nodes(_Arches(device), graph_batch=batch))]
    gen = torch.Generator(device).manual_seed(100 + rank)  # each rank its own data
    for _ in range(4):
        dense = torch.randn(batch, 13, device=device, generator=gen)
        pooled = torch.randn(batch, 40, device=device, generator=gen, requires_grad=True)
        labels = torch.rand(batch, device=device, generator=gen).round()
        grads = []
        for arches, optimizer in models:
            optimizer.zero_grad(set_to_none=True)
            leaf = pooled.detach().requires_grad_()
            _step(arches, dense, leaf, labels)
            grads.append([leaf.grad] + [p.grad.clone() for p in arches.parameters()])
            optimizer.step()
        for got, want in zip(grads[1], grads[0]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    # the all-reduced gradients kept the ranks' parameters equal
    flat = torch.cat([p.detach().flatten() for p in models[1][0].parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    torch.distributed.all_gather(gathered, flat)
    torch.testing.assert_close(gathered[1], gathered[0], rtol=0, atol=0)
    node = models[1][0].over_arch.forward
    assert isinstance(node, ArchNode) and node.graph is not None


def test_graphed_nodes_average_the_gradients_as_ddp_does():
    run_world(2, _graphed_nodes_average_like_ddp, backend=ONE_GPU)


@pytest.mark.parametrize("backend", TWO_RANK_BACKENDS)
def test_graphed_nodes_keep_each_parameters_gradient_within_its_own_blocks_bound(backend):
    """Every codec, the graphed backward writing the padded flat buffer: on 2 GPUs the fused kernel (NCCL), on one
    shared GPU the bulk twin's Triton codecs (gloo)."""
    run_world(2, _each_parameter_within_its_own_bound, True, backend=backend)
