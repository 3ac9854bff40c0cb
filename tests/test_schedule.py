"""TrainingRun's bookkeeping that needs no model: the metrics log, a run's start, the loss check naming the step a
NaN / inf loss first appeared at, the fused ops' error words read before results are kept."""

from __future__ import annotations

import logging
import math
import tempfile
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from fused_dlrm.dist import DistEnv
from fused_dlrm.train.checkpoint import NonFiniteLossError
from fused_dlrm.train.schedule import MetricsLog, TrainingRun
from world import run_world


def test_a_metrics_log_that_cannot_be_written_warns_once(tmp_path, caplog):
    (tmp_path / "metrics.jsonl").mkdir()  # as a full disk or a read-only run directory: open() fails
    metrics = MetricsLog(tmp_path, is_main=True)
    with caplog.at_level(logging.WARNING):
        metrics.record({"step": 1, "loss": 0.5})  # no error: rank 0 alone would raise, its peers wait
        metrics.record({"step": 2, "loss": 0.4})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(f"cannot write {tmp_path / 'metrics.jsonl'}"), warnings


def test_a_run_that_starts_at_or_past_max_steps_says_so(tmp_path, caplog):
    """A resume from a checkpoint at or past trainer.max_steps trains no step: it said nothing, logged "resumed
    from ... (step 30)" and an evaluation, and ended as a run would."""
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)
    for start, max_steps, warned in ((30, 20, True), (20, 20, True), (19, 20, False), (30, None, False)):
        trainer = OmegaConf.create({"log_every": 5, "eval_every": 0, "checkpoint_every": 0, "max_steps": max_steps,
                                    "progress": False, "resume_from": None})
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            TrainingRun(trainer, env, tmp_path, tmp_path / "checkpoints", start, items="samples", items_per_step=1,
                        log_fields=lambda interval: ({"loss": 0.0}, ""), evaluate=lambda step: {},
                        save=lambda step: None, log=logging.getLogger(__name__))
        expected = [f"the run starts at step {start}, at or past trainer.max_steps={max_steps}: it trains no step "
                    "(only evaluates); raise trainer.max_steps to train on"] if warned else []
        assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == expected


def one_process_run(run_dir: Path, log_every: int, intervals: list | None = None) -> TrainingRun:
    """A run of one process from step 0, logging every `log_every` steps (each Interval into `intervals`), without
    checkpoints or evaluations."""
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)
    trainer = OmegaConf.create({"log_every": log_every, "eval_every": 0, "checkpoint_every": 0, "max_steps": None,
                                "progress": False, "resume_from": None})
    kept = [] if intervals is None else intervals
    return TrainingRun(trainer, env, run_dir, run_dir / "checkpoints", 0, items="samples", items_per_step=1,
                       log_fields=lambda interval: kept.append(interval) or ({"loss": interval.losses[0]}, ""),
                       evaluate=lambda step: {}, save=lambda step: None, log=logging.getLogger(__name__))


def step_terms(rank: int, step: int) -> list[float]:
    """Two loss terms of a rank's step: fresh random numbers, the same wherever they are made."""
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return (torch.rand(2, generator=generator, dtype=torch.float64) * 3 + 0.1).tolist()


def _nan_from_step(rank: int, world: int, start: int, checkpoint_every: int, nan_step: int, nan_ranks: list[int]):
    """A run from `start` (a resume mid-interval where start % 4 != 0), logging every 4 steps, its checkpoints
    ending intervals early, whose loss on `nan_ranks` is NaN from `nan_step` on: every interval before is logged as
    the mean of the steps' terms over ranks, and the check after names `nan_step` on every rank."""
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"),
                  backend="gloo" if world > 1 else None)
    trainer = OmegaConf.create({"log_every": 4, "eval_every": 0, "checkpoint_every": checkpoint_every,
                                "max_steps": None, "progress": False, "resume_from": None, "keep_checkpoints": 1})
    intervals, saved = [], []
    with tempfile.TemporaryDirectory() as tmp:
        run = TrainingRun(trainer, env, Path(tmp), Path(tmp) / "checkpoints", start, items="samples",
                          items_per_step=1, loss_terms=2, log=logging.getLogger(__name__), evaluate=lambda step: {},
                          log_fields=lambda interval: intervals.append(interval) or ({"loss": interval.losses[0]}, ""),
                          save=saved.append)
        with pytest.raises(NonFiniteLossError, match=rf"^loss became NaN or inf at step {nan_step}; stopping\. "
                                                     r"Last good checkpoint: none$"):
            for step in range(start + 1, nan_step + 8):
                a, b = step_terms(rank, step)
                loss = float("nan") if step >= nan_step and rank in nan_ranks else a + 0.25 * b
                run.end_step(torch.tensor(loss, dtype=torch.float32), [torch.tensor(a), torch.tensor(b)])
                run.after_step()
    first = start + 1
    for interval in intervals:
        steps = [(r, s) for r in range(world) for s in range(first, interval.step + 1)]
        means = [math.fsum(step_terms(r, s)[i] for r, s in steps) / len(steps) for i in (0, 1)]
        assert all(abs(got - want) <= 1e-6 * want for got, want in zip(interval.losses, means, strict=True)), \
            (interval.step, interval.losses, means)
        first = interval.step + 1
    assert first <= nan_step < first + 4  # the interval that stops holds the NaN step
    return [interval.step for interval in intervals], saved


def test_a_nan_loss_is_named_by_its_step_in_intervals_shortened_by_a_resume_and_checkpoints():
    """The loss was checked per interval and a NaN named the interval ("between steps 9 and 12"): the step it first
    appeared at is named, in intervals that a resume mid-interval and checkpoints cut short."""
    logged, saved = _nan_from_step(0, 1, start=5, checkpoint_every=3, nan_step=10, nan_ranks=[0])
    assert logged == [6, 8, 9] and saved == [6, 9]


def _nan_on_rank_1(rank, world):
    logged, _ = _nan_from_step(rank, world, start=0, checkpoint_every=0, nan_step=6, nan_ranks=[1])
    assert logged == [4]


def test_a_nan_loss_of_one_rank_is_named_by_its_step_on_every_rank():
    run_world(2, _nan_on_rank_1, timeout=300)


def test_more_steps_than_log_every_without_a_check_is_a_clear_error(tmp_path):
    """The run keeps one row per step of the interval: a loop that skips after_step is told so."""
    run = one_process_run(tmp_path, log_every=2)
    for _ in range(2):
        run.end_step(torch.tensor(0.5))
    with pytest.raises(RuntimeError, match=r"^TrainingRun\.end_step: more than trainer\.log_every=2 steps since the "
                                           r"last loss check: call after_step after every end_step$"):
        run.end_step(torch.tensor(0.5))


def test_a_log_interval_past_the_runs_steps_holds_only_the_steps_taken(tmp_path):
    """trainer.log_every far past the steps a run takes (its loss logged at the end only), as before the rows per
    step: their allocation at the start, log_every rows, failed (here 13 TB; 10**6 steps took seconds and memory).
    The steps' mean is logged at the end, and a NaN is named by its step past the first rows."""
    intervals = []
    run = one_process_run(tmp_path / "finite", 2**40, intervals)
    losses = torch.tensor([step_terms(0, step)[0] for step in range(1, 38)], dtype=torch.float32)
    for loss in losses:
        run.end_step(loss)
        run.after_step()
    run.finish()
    mean = math.fsum(losses.tolist()) / len(losses)
    assert [interval.step for interval in intervals] == [37]
    assert abs(intervals[0].losses[0] - mean) <= 1e-6 * mean, (intervals[0].losses, mean)
    run = one_process_run(tmp_path / "nan", 2**40)
    with pytest.raises(NonFiniteLossError, match=r"^loss became NaN or inf at step 29; stopping\. "):
        for step, loss in enumerate(losses, 1):
            run.end_step(torch.tensor(float("nan")) if step >= 29 else loss)
            run.after_step()
        run.finish()


def _checkpoint_after_a_lost_wait(rank, world):
    """Rank 1's fused op recorded a timeout in a call its host has not read yet (GPUs read every few calls)."""
    from test_peer_flags import as_on_a_gpu, record_a_timeout
    from fused_dlrm.kernels.peer_flags import PeerErrors, PeerWaitTimeout

    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    errors = as_on_a_gpu(PeerErrors(env.device, rank=rank, what="exchange"))
    errors.after_wait()  # call 1: its word copied (clean)
    if rank == 1:
        record_a_timeout(errors, peer=0, slot=2, epoch=7)  # call 2's wait gave up
    errors.after_wait()  # call 2: not copied (every check_every-th call is)
    saved = []
    trainer = OmegaConf.create({"log_every": 2, "eval_every": 0, "checkpoint_every": 2, "max_steps": None,
                                "progress": False, "resume_from": None, "keep_checkpoints": 1})
    with tempfile.TemporaryDirectory() as tmp:
        run = TrainingRun(trainer, env, Path(tmp), Path(tmp) / "checkpoints", 0, items="samples", items_per_step=1,
                          log_fields=lambda interval: ({"loss": interval.losses[0]}, ""), evaluate=lambda step: {},
                          save=saved.append, log=logging.getLogger(__name__))
        for _ in range(2):
            run.end_step(torch.tensor(0.5))
        expected = ((PeerWaitTimeout, r"^exchange: rank 1 timed out at step 7 waiting for rank 0, slice 2") if rank
                    else (ValueError, r"^rank 0: rank\(s\) \[1\] found an error recorded by a fused op: "
                                      r"PeerWaitTimeout: exchange: rank 1 timed out at step 7"))
        with pytest.raises(expected[0], match=expected[1]):
            run.after_step()  # step 2: a checkpoint is due
    assert saved == []  # on neither rank: the lost call's results are not kept


def test_a_fused_ops_unread_error_stops_every_rank_before_a_checkpoint():
    run_world(2, _checkpoint_after_a_lost_wait, timeout=300)


def test_a_run_without_checkpoints_reads_the_error_words_at_its_end(tmp_path, monkeypatch):
    read = []
    monkeypatch.setattr("fused_dlrm.train.schedule.check_every_error_word", lambda: read.append(True))
    run = one_process_run(tmp_path, log_every=5)
    run.end_step(torch.tensor(0.5))
    run.finish()
    assert read == [True]


def _rank_1_refused(rank: int, world: int, root: str, checkpoints: Path, expected: str) -> None:
    """A run of checkpoints into `checkpoints` (this rank's view) refused at its start: `expected` on rank 1, named
    on rank 0."""
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    trainer = OmegaConf.create({"log_every": 4, "eval_every": 0, "checkpoint_every": 5, "max_steps": 20,
                                "progress": False, "resume_from": None, "keep_checkpoints": 1})
    with pytest.raises(ValueError, match=expected if rank == 1 else rf"^rank 0: rank\(s\) \[1\] .*{expected}"):
        TrainingRun(trainer, env, Path(root, f"run_{rank}"), checkpoints, 0, items="samples", items_per_step=1,
                    log_fields=lambda interval: ({"loss": interval.losses[0]}, ""), evaluate=lambda step: {},
                    save=lambda step: None, log=logging.getLogger(__name__))


def _a_later_checkpoint_one_rank_sees(rank: int, world: int, root: str) -> None:
    checkpoints = Path(root, f"rank_{rank}")  # as a checkpoint_dir on each node's disk: rank 1's holds step_50
    (checkpoints / ("step_50" if rank == 1 else "")).mkdir(parents=True)
    _rank_1_refused(rank, world, root, checkpoints,
                    r"checkpoint_dir \S+rank_1 already holds step_50, after this run's start at step 0")


def test_a_later_checkpoint_that_one_rank_sees_stops_every_rank(tmp_path):
    """A checkpoint_dir holding a checkpoint after the run's start is refused (the run's pruning would delete it):
    on every rank, also where only one rank's view of the folder holds it (the others would go on into the first
    step's collectives and wait there for it)."""
    run_world(2, _a_later_checkpoint_one_rank_sees, str(tmp_path), timeout=120)


def _a_checkpoint_dir_one_rank_cannot_write(rank: int, world: int, root: str) -> None:
    Path(root, "a_file").write_text("not a folder")
    # rank 1's checkpoint_dir below a file (as a read-only or full disk on its node): it cannot write its files
    _rank_1_refused(rank, world, root, Path(root, "a_file" if rank == 1 else "shared", "checkpoints"),
                    r"trainer.checkpoint_dir \S+a_file/checkpoints cannot be written \(NotADirectoryError")


def test_a_checkpoint_dir_that_cannot_be_written_stops_every_rank_at_the_start(tmp_path):
    """Each rank writes its own files of every checkpoint: a checkpoint_dir that one rank cannot write stopped the
    run at its first checkpoint (trainer.checkpoint_every steps of training, or the whole run and its final
    evaluation, lost); it is tried on every rank before the first step."""
    run_world(2, _a_checkpoint_dir_one_rank_cannot_write, str(tmp_path), timeout=120)
