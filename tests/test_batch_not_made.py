"""A batch that one rank could not make (a malformed line in its slice of a Criteo file) raises on every rank at
that batch, in every loop mode and in evaluation: that rank its own error (file and line), the others one naming
it; none waits in the input dist for a batch that never comes (run_world's timeout fails the test instead)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fused_dlrm.dist import DistEnv
from fused_dlrm.sparse.input_dist import BulkInputDist
from fused_dlrm.train.loop import train
from test_training import SMALL, config
from world import ONE_GPU, run_world

GLOBAL_BATCH = 16  # rank 1's slice of each global batch: its lines 8..15
BAD_BATCH = 2
BAD_LINE = BAD_BATCH * GLOBAL_BATCH + 11 + 1  # 1-based: the 12th line of global batch 2, in rank 1's slice

MODES = {  # the loop's ways of distributing a batch's input (loop.py's docstring)
    "batch_thread": [],
    "side_stream": ["trainer.input_dist_on_thread=false"],  # the bad batch's header exchanged a step ahead
    "side_stream_no_header_ahead": ["trainer.input_dist_on_thread=false", "trainer.header_ahead=false"],
    "in_forward": ["trainer.prefetch_input_dist=false"],
    "no_thread_side_stream": ["trainer.batches_ahead=0"],
    "no_thread_in_forward": ["trainer.batches_ahead=0", "trainer.prefetch_input_dist=false"],
}


def criteo_file(path: Path, lines: int, bad_line: int | None) -> Path:
    """`lines` random Criteo lines; line `bad_line` (1-based) with a label of 7."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i in range(1, lines + 1):
        dense = [str(int(x)) if x > 0 else "" for x in torch.randint(-1, 50, (13,), generator=gen)]
        cats = [f"{int(x):08x}" if x % 7 else "" for x in torch.randint(0, 2**31, (26,), generator=gen)]
        rows.append("\t".join(["7" if i == bad_line else str(i % 2)] + dense + cats))
    path.write_text("\n".join(rows) + "\n")
    return path


def _train_with_a_bad_line(rank: int, world: int, tmp: str, overrides: list[str], raises: bool,
                           device: str = "cpu") -> None:
    on = torch.device(device)
    env = DistEnv(rank=rank, world_size=world, local_rank=rank if on.type == "cpu" else on.index, device=on,
                  backend="gloo")
    cfg = config("data=criteo", f"data.global_batch_size={GLOBAL_BATCH}", "data.eval_batches=2", "model.num_rows=100",
                 "trainer.eval_every=0", "trainer.checkpoint_every=0", "trainer.log_every=1",
                 "trainer.progress=false", *overrides)
    bad = re.escape(f"{tmp}/bad.tsv:{BAD_LINE}: malformed Criteo line: label must be 0 or 1, got '7'")
    if not raises:
        assert train(cfg, env, Path(tmp) / f"run{rank}").step == cfg.trainer.max_steps
        return
    with pytest.raises(ValueError if rank == 1 else RuntimeError,
                       match=bad if rank == 1 else r"rank 0: rank\(s\) \[1\] could not make their batch \(their error"):
        train(cfg, env, Path(tmp) / f"run{rank}")
    # Both stay up until both raised (a rank whose peer has exited learns of it from the broken connection): a rank
    # still waiting in the input dist would leave the other here until run_world's timeout.
    dist.barrier()


def _paths(tmp_path: Path, bad_in: str) -> list[str]:
    good = criteo_file(tmp_path / "good.tsv", 8 * GLOBAL_BATCH, None)
    bad = criteo_file(tmp_path / "bad.tsv", 8 * GLOBAL_BATCH, BAD_LINE)
    train_file, eval_file = (bad, good) if bad_in == "train" else (good, bad)
    return [f"data.train.paths=[{train_file}]", f"data.eval.paths=[{eval_file}]"]


@pytest.mark.parametrize("mode", MODES)
def test_every_rank_raises_at_the_batch_one_rank_could_not_make(tmp_path, mode):
    """Steps 0 and 1 train; batch 2 raises on both ranks."""
    run_world(2, _train_with_a_bad_line, str(tmp_path), [*_paths(tmp_path, "train"), "trainer.max_steps=6",
                                                         *MODES[mode]], True, timeout=180)


@pytest.mark.parametrize("mode", MODES)
def test_the_step_before_the_batch_ends_as_any_step_does(tmp_path, mode):
    """Step 2, the last before the bad batch, has its loss checked and logged and its checkpoint written before every
    rank raises: a resume from it loses no step. (Where the next batch is distributed ahead, the error came when
    it was fetched, after step 2 but before step 2's cadence: the checkpoint before a bad line was lost.)"""
    checkpoints = tmp_path / "checkpoints"
    run_world(2, _train_with_a_bad_line, str(tmp_path), [*_paths(tmp_path, "train"), "trainer.max_steps=6",
                                                         f"trainer.checkpoint_every={BAD_BATCH}",
                                                         f"trainer.checkpoint_dir={checkpoints}", *MODES[mode]], True,
              timeout=180)
    assert sorted(p.name for p in checkpoints.iterdir()) == [f"step_{BAD_BATCH}"]
    logged = [json.loads(line)["step"] for line in (tmp_path / "run0" / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, BAD_BATCH + 1))


@pytest.mark.parametrize("mode", ["batch_thread", "side_stream"])
def test_a_batch_past_the_last_step_raises_nowhere(tmp_path, mode):
    """The bad batch is the one after the last step: made ahead (by the thread, or its header exchanged a step
    ahead) but never trained on, on any rank: every rank ends the run normally."""
    run_world(2, _train_with_a_bad_line, str(tmp_path), [*_paths(tmp_path, "train"), f"trainer.max_steps={BAD_BATCH}",
                                                         *MODES[mode]], False, timeout=180)


def test_evaluation_raises_on_every_rank(tmp_path):
    """The evaluation's batch 2 is bad: the evaluation at step 1 raises on both ranks."""
    run_world(2, _train_with_a_bad_line, str(tmp_path), [*_paths(tmp_path, "eval"), "trainer.max_steps=4",
                                                         "trainer.eval_every=1", "data.eval_batches=3"], True,
              timeout=180)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("mode", ["batch_thread", "side_stream", "in_forward"])
def test_every_rank_raises_on_gpu_streams(tmp_path, mode):
    """The same on a GPU (two ranks sharing it: tests/world.py's ONE_GPU): the "no batch" header made on the batch
    thread's stream, the side stream or the main one."""
    run_world(2, _train_with_a_bad_line, str(tmp_path), [*_paths(tmp_path, "train"), "trainer.max_steps=6",
                                                         *MODES[mode]], True, "cuda:0", backend=ONE_GPU, timeout=240)


def _train_without_a_file(rank: int, world: int, tmp: str, split: str) -> None:
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    lacking = f"{tmp}/good.tsv" if rank == 0 else f"{tmp}/not_on_this_node.tsv"  # a file one node's disk lacks
    paths = {s: lacking if s == split else f"{tmp}/good.tsv" for s in ("train", "eval")}
    cfg = config("data=criteo", f"data.global_batch_size={GLOBAL_BATCH}", "data.eval_batches=1", "model.num_rows=100",
                 "trainer.max_steps=2", "trainer.checkpoint_every=0", "trainer.progress=false",
                 f"data.train.paths=[{paths['train']}]", f"data.eval.paths=[{paths['eval']}]")
    missing = re.escape(f"Criteo file not found: {tmp}/not_on_this_node.tsv")
    with pytest.raises(FileNotFoundError if rank == 1 else ValueError,
                       match=missing if rank == 1 else rf"rank 0: rank\(s\) \[1\] cannot make their data\.{split} "
                                                       rf"dataset: FileNotFoundError: {missing}"):
        train(cfg, env, Path(tmp) / f"run{rank}")
    dist.barrier()  # as above: both raised, neither waits in a collective the other never joins


@pytest.mark.parametrize("split", ["train", "eval"])
def test_a_data_file_one_node_lacks_stops_every_rank_at_start_up(tmp_path, split):
    criteo_file(tmp_path / "good.tsv", 4 * GLOBAL_BATCH, None)
    run_world(2, _train_without_a_file, str(tmp_path), split, timeout=120)


@pytest.mark.parametrize("mode", ["side_stream", "no_thread_side_stream"])
def test_an_error_that_may_be_this_ranks_alone_skips_the_step_befores_cadence(tmp_path, monkeypatch, mode):
    """Only a bad batch's error, which the headers raise on every rank alike, lets the step before end with its
    cadence first (its collectives joined by every rank): any other error fetching the next batch (here the input
    dist's start failing on this rank alone) is raised at once, without that step's checkpoint."""
    calls = 0
    start = BulkInputDist.start

    def failing_start(self, *args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 4:  # a batch fetched ahead, after a step: both modes prefetch in the loop
            error = RuntimeError("this rank's own failure")
            error.raised_on_every_rank = every_rank
            raise error
        return start(self, *args, **kwargs)

    monkeypatch.setattr(BulkInputDist, "start", failing_start)
    cpu = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)
    saved = {}
    for every_rank in (False, True):
        calls, checkpoints = 0, tmp_path / f"checkpoints_{every_rank}"
        cfg = config(*SMALL, "trainer.max_steps=8", "trainer.checkpoint_every=1", "trainer.eval_every=0",
                     f"trainer.checkpoint_dir={checkpoints}", *MODES[mode])
        with pytest.raises(RuntimeError, match="this rank's own failure"):
            train(cfg, cpu, tmp_path / f"run_{every_rank}")
        saved[every_rank] = sorted(int(p.name.removeprefix("step_")) for p in checkpoints.iterdir())
    assert saved[False] and saved[True] == [*saved[False], saved[False][-1] + 1], saved
