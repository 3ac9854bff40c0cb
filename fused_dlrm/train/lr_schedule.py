"""Learning-rate schedules: a factor of the configured lr for the step after `done` steps, a function of the step
alone (a resumed run continues it), set by torch's LambdaLR (`scheduled`, which the MoE loop uses too).

DLRM's (model.lr_schedule) is MLPerf's, as torchrec's dlrm_main applies it (its LRPolicyScheduler, from the MLPerf
DLRM reference): a linear warm-up, a hold, then a polynomial (power 2) decay to 0, one factor for the dense
optimizer's lr and every table's embedding lr (`DLRMLRSchedule`).
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
from omegaconf import DictConfig
from torch.optim.lr_scheduler import LambdaLR

from fused_dlrm.config_checks import check_count


def scheduled(optimizer: torch.optim.Optimizer, factor: Callable[[int], float], done: int) -> LambdaLR:
    """A LambdaLR setting each group's lr to its lr now (this run's configured one: a resume keeps it,
    checkpoint._keep_configured_options) x factor(done), the next step's, and on at each of its .step()s. Made after
    a checkpoint is loaded (LambdaLR needs the base, initial_lr, where done > 0) and before the optimizer's step is
    taken for the loop (LambdaLR wraps optimizer.step to count its calls)."""
    for group in optimizer.param_groups:
        group["initial_lr"] = group["lr"]
    return LambdaLR(optimizer, factor, last_epoch=done - 1)  # its first step() sets factor(done)


def mlperf_lr_factor(warmup_steps: int, decay_start: int, decay_steps: int, done: int) -> float:
    """MLPerf DLRM's factor of the step n = done + 1 (LRPolicyScheduler's _step_count): n / warmup_steps while
    n < warmup_steps, then 1, and with decay_steps ((decay_steps - (n - decay_start)) / decay_steps)^2 from
    n = decay_start on, 0 from n = decay_start + decay_steps. The reference's quirks are left out: it holds the last
    warm-up step's (warmup_steps - 1) / warmup_steps until the decay, and after the decay its last step's lr
    (at least 1e-7) where this reaches 0."""
    n = done + 1
    if n < warmup_steps:
        return n / warmup_steps
    if decay_steps and n >= decay_start:
        return ((decay_steps - min(n - decay_start, decay_steps)) / decay_steps) ** 2
    return 1.0


def dlrm_lr_factor(schedule: DictConfig) -> Callable[[int], float] | None:
    """model.lr_schedule, checked, as LambdaLR's lr_lambda (`mlperf_lr_factor`); None where it is off (no warm-up,
    no decay: the configured lr throughout, the optimizers left untouched)."""
    warmup, start, decay = schedule.warmup_steps, schedule.decay_start, schedule.decay_steps
    check_count("model.lr_schedule.warmup_steps", warmup, 0, "a step count >= 0 (0: no warm-up)")
    check_count("model.lr_schedule.decay_start", start, 0, "a step count >= 0")
    check_count("model.lr_schedule.decay_steps", decay, 0, "a step count >= 0 (0: no decay)")
    if decay and start < warmup:  # the lr would fall back to the decay's start from part-way through the warm-up
        raise ValueError(f"model.lr_schedule.decay_start={start} is before the warm-up's end at model.lr_schedule."
                         f"warmup_steps={warmup}: the decay must start at or after it")
    if not warmup and not decay:
        return None
    return partial(mlperf_lr_factor, warmup, start, decay)


class DLRMLRSchedule:
    """One lr factor for both of DLRM's optimizers, as torchrec's dlrm_main schedules its dense optimizer and the
    fused (embedding) one together: the dense optimizer through `scheduled`, and every table's embedding lr through
    the collection's fused optimizer (sharded_state.FusedTableOptimizer, torchrec's path for an LR scheduler): each
    param group's lr set to its configured lr x the factor, its step() carrying it to its tables (their next
    backward's update; the GPU path copies the changed settings to the device, no recompile or host sync).

    Build it after loading a checkpoint (the fused optimizer keeps no param groups in it, as torchrec's KeyedOptimizer
    by default: its lrs are this run's) and before the loop takes the dense optimizer's step; `step()` after each
    training step."""

    def __init__(self, factor: Callable[[int], float], dense_optimizer: torch.optim.Optimizer, table_optimizer,
                 done: int):
        """table_optimizer: the collection's fused optimizer (sharded_state.FusedTableOptimizer)."""
        self.factor = factor
        self.dense_scheduler = scheduled(dense_optimizer, factor, done)
        self.table_optimizer = table_optimizer
        self.table_lrs = [group["lr"] for group in table_optimizer.param_groups]  # the configured ones
        self.table_factor: float | None = None  # the factor the tables' lrs last took
        self._set_table_lrs(done)

    def step(self) -> None:
        """The next step's lr, in both optimizers."""
        self.dense_scheduler.step()
        self._set_table_lrs(self.dense_scheduler.last_epoch)

    def _set_table_lrs(self, done: int) -> None:
        factor = self.factor(done)
        if factor == self.table_factor:  # the hold, the end: no per-table update on the host at every step
            return
        self.table_factor = factor
        for group, lr in zip(self.table_optimizer.param_groups, self.table_lrs, strict=True):
            group["lr"] = lr * factor
        self.table_optimizer.step()  # only carries the groups' lr to the tables: their update runs in the backward

    def dense_lr(self, done: int) -> float:
        """The dense optimizer's lr (its one group's) for the step after `done` steps."""
        return self.dense_scheduler.base_lrs[0] * self.factor(done)
