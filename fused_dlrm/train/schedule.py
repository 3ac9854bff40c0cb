"""The bookkeeping every model's training loop shares: `TrainingRun`.

A loop takes its steps and tells the run about each (`end_step`); the run counts steps, keeps each step's loss (and
gradient norm, where the loop measures one) on the device, and on the configured cadence (`after_step`) checks
them (reduced over ranks, NaN/inf stops the run, naming the step it first appeared at), logs the interval
(metrics.jsonl, log line, progress bar), writes a checkpoint and evaluates; `finish` does the last of each. What
differs between models comes in as three callbacks: the interval's log fields, the evaluation and the checkpoint.

The loss is always checked before a checkpoint is written, and the checkpoint checks the parameters and optimizer
state (the last step's update came after its loss), so a checkpoint never holds a diverged model. Before every
checkpoint and at the run's end every fused op's error word is read too (`check_fused_ops`): on GPUs a wait that
gave up in the last few calls would otherwise surface only at a later call, which may never come.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from omegaconf import DictConfig
from tqdm import tqdm

from fused_dlrm.dist import DistEnv, all_reduce_sum
from fused_dlrm.dist.env import problem_text, raise_on_every_rank, write_problem
from fused_dlrm.kernels.peer_flags import PEER_ERRORS, check_every_error_word
from fused_dlrm.train.checkpoint import NonFiniteLossError, check_keep_last, last_good_checkpoint, latest_checkpoint
from fused_dlrm.config_checks import check_count

log = logging.getLogger(__name__)

def stop_if_nonfinite(rows: list[list[float]], first_step: int, checkpoint_dir: Path, resumed_from: str | None) -> None:
    """Stop the run, naming the step and the last good checkpoint, if a step's loss or gradient norm was NaN or inf.
    `rows`: the interval's steps from `first_step` on, each [..., total loss, gradient norm]. The first such step is
    named, its loss before its norm (a NaN loss makes the norm NaN too); a norm's NaN / inf comes before the losses
    of the steps after it, which clipping by it made NaN."""
    for step, row in enumerate(rows, first_step):
        for what, value in (("loss", row[-2]), ("gradient norm", row[-1])):
            if not math.isfinite(value):
                raise NonFiniteLossError(f"{what} became NaN or inf at step {step}; stopping. Last good checkpoint: "
                                         f"{last_good_checkpoint(checkpoint_dir, resumed_from)}")


def _later_checkpoint(checkpoint_dir: Path, step: int) -> ValueError | None:
    """A checkpoint in checkpoint_dir after a run's start at `step`, which its pruning would delete: refused."""
    later = latest_checkpoint(checkpoint_dir) if checkpoint_dir.exists() else None
    if later is None or int(later.name.split("_")[1]) <= step:
        return None
    return ValueError(f"trainer.checkpoint_dir {checkpoint_dir} already holds {later.name}, after this run's start at "
                      f"step {step}: resume from it (trainer.resume_from={checkpoint_dir}) or write into an empty "
                      f"directory")


def _unwritable(checkpoint_dir: Path) -> ValueError | None:
    """checkpoint_dir where this rank cannot write (each rank writes its own files of every checkpoint): found
    before the first step, not at the first checkpoint, whose steps (or the whole run and its evaluation) it lost."""
    problem = write_problem(checkpoint_dir, directory=True)
    if problem is None:
        return None
    return ValueError(f"trainer.checkpoint_dir {checkpoint_dir} cannot be written ({problem_text(problem)}): give "
                      f"one that every rank can write, or trainer.checkpoint_every=0 for no checkpoints")


def check_trainer(trainer: DictConfig) -> None:
    """The settings of cfg.trainer a `TrainingRun` reads, checked before training (not at the first checkpoint): a
    model's check_config runs them before anything is built, so that its report refuses them too."""
    # every step count is taken modulo log_every (the loss checked at it: an interval holds at most log_every
    # steps, one row each), eval_every and checkpoint_every
    check_count("trainer.log_every", trainer.log_every, 1, "a step count >= 1")
    for key, zero in (("eval_every", "the run's last evaluation only"), ("checkpoint_every", "no checkpoints")):
        if trainer[key] is not None:
            check_count(f"trainer.{key}", trainer[key], 0, f"a step count >= 0 (0 or null: {zero})")
    if trainer.max_steps is not None:
        check_count("trainer.max_steps", trainer.max_steps, 0, "a step count >= 0, or null (trainer.epochs ends "
                    "the run)")
    if trainer.checkpoint_every:
        check_keep_last(trainer.keep_checkpoints)


class MetricsLog:
    """metrics.jsonl in the run directory: one JSON object per line, written by rank 0 only. A write that fails
    (a full disk, permissions) is a warning, once: rank 0 raising alone would leave its peers waiting in the next
    collective, and the log lines hold the same numbers."""

    def __init__(self, run_dir: Path, is_main: bool):
        self.path, self.is_main, self.warned = run_dir / "metrics.jsonl", is_main, False
        if is_main:
            try:
                run_dir.mkdir(parents=True, exist_ok=True)
            except OSError:  # the first record's write fails too, and warns
                pass

    def record(self, entry: dict) -> None:
        if not self.is_main:
            return
        try:
            with self.path.open("a") as f:
                f.write(json.dumps(entry) + "\n")
        except OSError as error:
            if not self.warned:
                log.warning("cannot write %s (%s): training goes on; metrics are in the log lines only",
                            self.path, error)
                self.warned = True


@dataclass
class TrainResult:
    step: int = 0
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, mean loss over the log interval)
    evals: list[dict] = field(default_factory=list)


@dataclass
class Interval:
    """One log interval, its losses reduced over ranks: what a loop's `log_fields` turns into its log."""
    step: int            # the interval's last step
    losses: list[float]  # each loss term's mean per step and rank, in end_step's order
    step_ms: float       # mean wall time of a step
    rate: float          # samples (tokens, ...) per second over the interval's steps
    grad_norm: float | None  # the mean gradient norm of the steps that passed one to end_step (None: no step did)


# log_fields(interval) -> (metrics.jsonl fields, with "loss"; the log line after "step N ")
LogFields = Callable[[Interval], tuple[dict, str]]


class TrainingRun:
    """A training run's counters, progress bar, metrics log, interval timing and cadence.

    `trainer` is cfg.trainer (log_every, checkpoint_every, eval_every, max_steps, progress, resume_from); `step` the
    step it starts from (a resumed checkpoint's). `items`, `items_per_step`: what the rate counts ("samples", the
    global batch) for the progress bar. Callbacks: `log_fields` (above), `evaluate(step) -> fields` (logs its own line;
    the run keeps {"step", **fields} in result.evals and metrics.jsonl), `save(step)` (a checkpoint). `log`: the
    loop's logger, for the interval's line. `loss_terms`: how many terms each end_step passes.
    """

    def __init__(self, trainer: DictConfig, env: DistEnv, run_dir: Path, checkpoint_dir: Path, step: int, *,
                 items: str, items_per_step: int, log_fields: LogFields, evaluate: Callable[[int], dict],
                 save: Callable[[int], None], log: logging.Logger, loss_terms: int = 1):
        check_trainer(trainer)
        if trainer.checkpoint_every:  # raised on every rank: a rank's view of the folder may differ (a node's disk)
            raise_on_every_rank(_unwritable(checkpoint_dir) or _later_checkpoint(checkpoint_dir, step),
                                "cannot write checkpoints")
        if trainer.max_steps is not None and step >= trainer.max_steps:  # a resume at or past it: else silent
            log.warning("the run starts at step %d, at or past trainer.max_steps=%d: it trains no step (only "
                        "evaluates); raise trainer.max_steps to train on", step, trainer.max_steps)
        self.env, self.checkpoint_dir, self.resumed_from, self.log = env, checkpoint_dir, trainer.resume_from, log
        # plain ints: read every step, and a DictConfig attribute costs ~10 us of host time
        self.log_every, self.eval_every = trainer.log_every, trainer.eval_every
        self.checkpoint_every = trainer.checkpoint_every
        self.items, self.items_per_step = items, items_per_step
        self.log_fields, self.evaluate, self.save = log_fields, evaluate, save
        self.step = self.saved_step = step
        self.result = TrainResult(step=step)
        self.metrics = MetricsLog(run_dir, env.is_main)
        self.bar = tqdm(total=trainer.max_steps, initial=step, disable=not (env.is_main and trainer.progress),
                        desc="train")
        # One row per step of the interval, [each loss term, the total loss, the gradient norm passed (else 0)]:
        # the check names the step a NaN / inf first appeared at. An interval ends at the next multiple of
        # log_every (or earlier: a checkpoint, the run's end), so log_every rows hold it, however it starts; they
        # are made as intervals reach them (add_rows: a log_every past the run's steps costs nothing). Each row's
        # views are made once: end_step's one add per value then costs no indexing on the host.
        self.step_rows = torch.zeros(0, loss_terms + 2, device=env.device)
        self.step_losses, self.step_norms = [], []
        self.interval_start, self.interval_steps, self.interval_items = time.perf_counter(), 0, 0
        self.interval_norms = 0  # the interval's steps that passed a gradient norm

    def end_step(self, loss: torch.Tensor, terms: Sequence[torch.Tensor] | None = None,
                 items: int | None = None, grad_norm: torch.Tensor | None = None) -> None:
        """Count a step: its detached total loss (checked for NaN/inf) and the terms to log (default: the loss),
        written into the step's row on the device (no host sync; one op for a lone loss, which both entries take);
        `items`: what the rate counts in this step, where it is not items_per_step (a file's short last batch);
        `grad_norm`: its gradient norm, the same on every rank (logged as the interval's mean, checked for NaN/inf:
        moe/train.py's clipping by a NaN / inf norm writes NaN into the weights while the step's loss is finite)."""
        if self.interval_steps == len(self.step_losses):
            self.add_rows()
        self.step_losses[self.interval_steps] += loss if terms is None else torch.stack([*terms, loss])
        if grad_norm is not None:
            self.step_norms[self.interval_steps] += grad_norm
            self.interval_norms += 1
        self.step += 1
        self.interval_steps += 1
        self.interval_items += self.items_per_step if items is None else items
        self.bar.update(1)

    def add_rows(self) -> None:
        """Twice the rows (16 at first), up to log_every, the interval's so far copied on the device (no host sync)."""
        held = len(self.step_losses)
        if held == self.log_every:
            raise RuntimeError(f"TrainingRun.end_step: more than trainer.log_every={self.log_every} steps since the "
                               f"last loss check: call after_step after every end_step")
        rows = self.step_rows.new_zeros(min(max(2 * held, 16), self.log_every), self.step_rows.shape[1])
        rows[:held] = self.step_rows
        self.step_rows = rows
        self.step_losses = [row[:-1] for row in rows]
        self.step_norms = [row[-1] for row in rows]

    def after_step(self) -> None:
        """What this step's number calls for: a loss check (every log_every steps and before every checkpoint),
        a checkpoint, an evaluation."""
        step = self.step
        saving = bool(self.checkpoint_every) and step % self.checkpoint_every == 0
        evaluating = bool(self.eval_every) and step % self.eval_every == 0
        if step % self.log_every == 0 or saving:
            self.check_loss()
        elif evaluating and self.env.device.type == "cuda":  # the steps the GPU still runs belong to the interval
            torch.cuda.synchronize(self.env.device)
        start = time.perf_counter()
        if saving:
            self.checkpoint()
        if evaluating:
            self.run_eval()
        self.interval_start += time.perf_counter() - start  # the interval times steps, not checkpoints or evals

    def finish(self) -> TrainResult:
        """The last loss check, a final checkpoint and a final evaluation, unless the last step already did them
        (the checkpoint first: an evaluation that fails loses no training)."""
        if self.interval_steps:
            self.check_loss()
        if self.checkpoint_every and self.saved_step != self.step:
            self.checkpoint()  # the fused ops' error words read first
        else:
            self.check_fused_ops()
        if (self.result.evals[-1]["step"] if self.result.evals else None) != self.step:
            self.run_eval()
        self.bar.close()
        self.result.step = self.step
        return self.result

    def check_loss(self) -> float:
        """Reduce the interval's losses over ranks (one collective, one copy to the host); stop the run on NaN/inf,
        naming its step (before any checkpoint is written); log the interval."""
        step, steps, norms = self.step, self.interval_steps, self.interval_norms
        rows = all_reduce_sum(self.step_rows.clone()).tolist()  # those past the interval's steps hold zeros
        stop_if_nonfinite(rows[:steps], step - steps + 1, self.checkpoint_dir, self.resumed_from)
        total = [math.fsum(column) for column in zip(*rows)]
        seconds = time.perf_counter() - self.interval_start
        interval = Interval(step=step, losses=[v / max(steps * self.env.world_size, 1) for v in total[:-2]],
                            step_ms=1000 * seconds / max(steps, 1), rate=self.interval_items / seconds,
                            grad_norm=total[-1] / (norms * self.env.world_size) if norms else None)
        fields, line = self.log_fields(interval)
        self.step_rows.zero_()
        self.interval_start, self.interval_steps, self.interval_items = time.perf_counter(), 0, 0
        self.interval_norms = 0
        self.result.losses.append((step, fields["loss"]))
        self.metrics.record({"step": step, "steps": steps, **fields})  # steps: the interval's (step_times.py)
        self.bar.set_postfix({"loss": f"{fields['loss']:.4f}", f"{self.items}_s": f"{interval.rate:,.0f}"})
        self.log.info("step %d %s", step, line)
        return fields["loss"]

    def run_eval(self) -> None:
        """An evaluation: a NaN / inf result stops the run (the model's NonFiniteLossError, raised on every rank),
        named, as a NaN loss is, with the last good checkpoint."""
        try:
            fields = self.evaluate(self.step)
        except NonFiniteLossError as error:
            raise NonFiniteLossError(f"{error}. Last good checkpoint: "
                                     f"{last_good_checkpoint(self.checkpoint_dir, self.resumed_from)}") from None
        self.result.evals.append({"step": self.step, **fields})
        self.metrics.record(self.result.evals[-1])

    def check_fused_ops(self) -> None:
        """Raise on every rank if any fused op of this process recorded an error (a wait that gave up, a peer's
        unlike call, a refused input) in a call the host has not checked yet: before results are kept. One
        exchange of a word over the ranks (a checkpoint's cadence, not a step's)."""
        problem = None
        try:
            check_every_error_word()
        except PEER_ERRORS as error:
            problem = error
        raise_on_every_rank(problem, "found an error recorded by a fused op")

    def checkpoint(self) -> None:
        self.check_fused_ops()
        self.save(self.step)
        self.saved_step = self.step
