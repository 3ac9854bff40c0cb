"""When a training loop checks its loss, writes checkpoints and evaluates (shared by every model's loop).

The loss is always checked (reduced over ranks, NaN/inf stops the run) before a checkpoint is written, so a
checkpoint never holds a diverged model.
"""

from __future__ import annotations

from typing import Callable

from omegaconf import DictConfig


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
