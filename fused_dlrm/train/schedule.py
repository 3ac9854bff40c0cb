"""When a training loop checks its loss, writes checkpoints and evaluates (shared by every model's loop).

The loss is always checked (reduced over ranks, NaN/inf stops the run) before a checkpoint is written, so a
checkpoint never holds a diverged model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from omegaconf import DictConfig

from fused_dlrm.train.checkpoint import latest_checkpoint


class NonFiniteLossError(RuntimeError):
    pass


def stop_if_nonfinite(nonfinite_steps: float, first_step: int, last_step: int, checkpoint_dir: Path) -> None:
    """Stop the run, naming the step range and the last good checkpoint, if any step's loss was NaN or inf."""
    if nonfinite_steps > 0:
        last = latest_checkpoint(checkpoint_dir) if checkpoint_dir.exists() else None
        raise NonFiniteLossError(f"loss became NaN or inf between steps {first_step} and {last_step}; stopping. "
                                 f"Last good checkpoint: {last or 'none'}")


class MetricsLog:
    """metrics.jsonl in the run directory: one JSON object per line, written by rank 0 only."""

    def __init__(self, run_dir: Path, is_main: bool):
        self.path, self.is_main = run_dir / "metrics.jsonl", is_main
        if is_main:
            run_dir.mkdir(parents=True, exist_ok=True)

    def record(self, entry: dict) -> None:
        if self.is_main:
            with self.path.open("a") as f:
                f.write(json.dumps(entry) + "\n")


def after_step(step: int, trainer: DictConfig, check_loss: Callable, checkpoint: Callable, run_eval: Callable) -> None:
    saving = bool(trainer.checkpoint_every) and step % trainer.checkpoint_every == 0
    if step % trainer.log_every == 0 or saving:
        check_loss()
    if saving:
        checkpoint()
    if trainer.eval_every and step % trainer.eval_every == 0:
        run_eval()


def at_end(step: int, trainer: DictConfig, unchecked_steps: int, last_eval_step: int | None, saved_step: int,
           check_loss: Callable, checkpoint: Callable, run_eval: Callable) -> None:
    """The last loss check, a final evaluation and a final checkpoint, unless the last step already did them."""
    if unchecked_steps:
        check_loss()
    if last_eval_step != step:
        run_eval()
    if trainer.checkpoint_every and saved_step != step:
        checkpoint()
