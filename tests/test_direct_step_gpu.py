"""trainer.direct_step (fused_dlrm/train/direct_step.py) trains as the autograd step does: train.py's DLRM loop, the
step called directly against autograd's, same seed, in both comm modes and three shardings (table-, column- and
row-wise), and with the nvshmem transport: the same losses and evaluations, and every training step taken by the
direct one. ONE GPU at world 1, and two ranks on two GPUs (NCCL; each skipped without its GPUs), or sharing one GPU
(gloo). nvshmem on two GPUs only (torch's NVSHMEM rendezvous refuses a world of one, and a GPU per rank is
NVSHMEM's). Two ranks resumed from a checkpoint continue the uninterrupted run, in both comm modes. On the CPU:
tests/test_direct_step.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fused_dlrm.dist import DistEnv
from fused_dlrm.train.direct_step import DirectDLRMStep
from fused_dlrm.train.loop import train
from test_training import SMALL, config
from world import TWO_GPUS, TWO_RANK_BACKENDS, run_world


# Table-wise; column-wise (at world 2 a feature's 16 columns on two owners: the interaction's gradient blocks would
# straddle them, so the exchange pushes); row-wise and mean-pooled (each sample's block parts summed after the
# exchange, then divided by its bag size).
SHARDINGS = {"table-wise": [], "column-wise": ["model.column_shards=2"],
             "row-wise": ["model.row_shards=2", "model.pooling=mean"]}


def _trains_as_autograd(rank: int, world: int, tmp: str, sharding: str, transport: str = "p2p") -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    env = DistEnv(rank=rank, world_size=world, local_rank=device.index, device=device, backend=dist.get_backend())
    taken, pushes = [], []
    step = DirectDLRMStep.step

    def counted_step(self, batch):  # and who pushed d S: whether the kernel said it would, and who did
        taken.append(1)
        counts = {} if self.sparse.fused is None else self.sparse.fused.backward_pushes
        before = dict(counts)
        loss = step(self, batch)
        pushes.append((self.kernel_pushes, *(counts.get(k, 0) - before.get(k, 0) for k in ("consumer", "exchange"))))
        return loss
    DirectDLRMStep.step = counted_step
    for comm in ("fused", "bulk"):
        taken.clear()
        pushes.clear()
        common = SMALL + SHARDINGS[sharding] + ["trainer.device=cuda", f"comm={comm}", "trainer.max_steps=16",
                                                "trainer.log_every=1", "trainer.eval_every=8",
                                                "trainer.checkpoint_every=0"]
        common += [f"comm.transport={transport}"] if comm == "fused" else []
        autograd = train(config(*common, "trainer.direct_step=false"), env, Path(tmp) / f"autograd_{comm}{rank}")
        assert taken == []
        direct = train(config(*common), env, Path(tmp) / f"direct_{comm}{rank}")
        assert len(taken) == 16, comm
        # the interaction's kernel pushes d S into the owners' buffers (a row-wise feature's to every block's part)
        # unless a gradient block would straddle two owners or the transport is nvshmem; then the exchange pushes
        # (column-wise at world 1: both shards of a feature on the one rank, side by side)
        expected = comm == "fused" and transport == "p2p" and (sharding != "column-wise" or world == 1)
        pushed_by = (int(expected), int(comm == "fused" and not expected))  # (the kernel, the exchange)
        assert set(pushes) == {(expected, *pushed_by)}, (comm, sharding, world, set(pushes))
        losses = lambda r: torch.tensor([loss for _, loss in r.losses], dtype=torch.float64)  # noqa: E731
        torch.testing.assert_close(losses(direct), losses(autograd), rtol=1e-5, atol=1e-6)
        assert len(direct.evals) == 2
        for got, want in zip(direct.evals, autograd.evals):
            assert got.keys() == want.keys() and all(abs(got[k] - want[k]) < 1e-5 for k in want), (comm, got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_one_gpu_trains_as_the_autograd_step(tmp_path, sharding):
    run_world(1, _trains_as_autograd, str(tmp_path), sharding, backend="nccl")


@pytest.mark.parametrize("backend", TWO_RANK_BACKENDS)
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_two_ranks_train_as_the_autograd_step(tmp_path, sharding, backend):
    run_world(2, _trains_as_autograd, str(tmp_path), sharding, backend=backend)


@TWO_GPUS
@pytest.mark.parametrize("sharding", ["table-wise", "row-wise"])
def test_two_gpus_nvshmem_train_as_the_autograd_step(tmp_path, sharding):
    run_world(2, _trains_as_autograd, str(tmp_path), sharding, "nvshmem", backend="nccl")


def _resume_is_exact(rank: int, world: int, tmp: str) -> None:
    """A run resumed from its step-10 checkpoint continues the uninterrupted run's losses and evaluations, in both
    comm modes (the fused exchange's tables and Adagrad state loaded in place, the graphs' buffers kept)."""
    device = torch.device("cuda", torch.cuda.current_device())
    env = DistEnv(rank=rank, world_size=world, local_rank=device.index, device=device, backend=dist.get_backend())
    for comm in ("fused", "bulk"):
        common = SMALL + ["trainer.device=cuda", f"comm={comm}", "trainer.max_steps=20", "trainer.log_every=1",
                          "trainer.eval_every=5", "trainer.checkpoint_every=10",
                          "data.global_batch_size=101"]  # uneven local batches: 51 and 50
        full = train(config(*common), env, Path(tmp) / f"full_{comm}")
        resumed = train(config(*common, f"trainer.resume_from={tmp}/full_{comm}/checkpoints/step_10"), env,
                        Path(tmp) / f"resumed_{comm}")
        want = [(step, loss) for step, loss in full.losses if step > 10]
        assert [s for s, _ in resumed.losses] == [s for s, _ in want], comm
        # the world-1 graphed resume's tolerance (tests/test_arch_nodes_gpu.py): the GPU's reductions may reorder
        assert [loss for _, loss in resumed.losses] == pytest.approx([loss for _, loss in want], rel=1e-6), comm
        assert [e["step"] for e in resumed.evals] == [15, 20], comm
        for got, wanted in zip(resumed.evals, full.evals[-2:]):
            assert got == pytest.approx(wanted, rel=1e-6), comm


@pytest.mark.parametrize("backend", TWO_RANK_BACKENDS)
def test_two_ranks_resume_exactly_in_both_comm_modes(tmp_path, backend):
    run_world(2, _resume_is_exact, str(tmp_path), backend=backend)
