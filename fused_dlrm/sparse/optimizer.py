"""Embedding optimizers fused into backward: exact SGD and exact row-wise Adagrad, each table its own.

"Exact" as in fbgemm's EXACT_SGD / EXACT_ROWWISE_ADAGRAD: the gradients of every occurrence of a row in the batch
are summed first, then each touched row is updated once, in fp32, rounded to the table's dtype once. Rows the batch
did not touch keep weight and state.
Row-wise Adagrad keeps one accumulator per row: m += mean(g^2) over the row; w -= lr * g / (sqrt(m) + eps).
Each table has its own settings (optimizer, lr, eps), as torchrec's per-table fused params give them; one lookup
updates tables of different optimizers in the same launches (kernels/embedding_backward.py says how).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Sequence

import torch

OPTIMIZERS = ("sgd", "rowwise_adagrad")


@dataclass(frozen=True)
class EmbeddingOptimizerConfig:
    """One table's optimizer."""

    name: str = "rowwise_adagrad"
    lr: float = 0.01
    eps: float = 1e-8  # fbgemm's default

    def __post_init__(self):
        if self.name not in OPTIMIZERS:
            raise ValueError(f"unknown embedding optimizer {self.name!r}: expected one of {OPTIMIZERS}")
        # 0 is an lr (no update: an LR warm-up from 0, a decay to 0), as fbgemm's TBEs take it, and an eps; `not`:
        # NaN too (it would spoil every row a backward touches, as an infinite lr; an infinite eps freezes them)
        for setting, value in (("lr", self.lr), ("eps", self.eps)):
            if not 0 <= value < math.inf:
                raise ValueError(f"embedding optimizer {setting} must be >= 0, got {value} (a finite number)")


# One optimizer for every table, or each table's by name.
TableOptimizers = EmbeddingOptimizerConfig | Mapping[str, EmbeddingOptimizerConfig]


def per_table(optimizers: TableOptimizers, tables: Sequence[str]) -> dict[str, EmbeddingOptimizerConfig]:
    """Each table's optimizer: `optimizers` itself for every table, or its entry of each; a mapping must name
    exactly `tables`."""
    if isinstance(optimizers, EmbeddingOptimizerConfig):
        return dict.fromkeys(tables, optimizers)
    missing = [t for t in tables if t not in optimizers]
    unknown = [t for t in optimizers if t not in tables]
    problems = [f"no entry for tables {missing}"] if missing else []
    problems += [f"entries for unknown tables {unknown}"] if unknown else []
    if problems:
        raise ValueError(f"per-table embedding optimizers: {'; '.join(problems)} (the tables: {list(tables)})")
    return {t: optimizers[t] for t in tables}


def sum_duplicate_rows(rows: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(unique rows, summed gradient of each) from per-occurrence rows [N] and gradients [N, D]."""
    unique, inverse = torch.unique(rows, return_inverse=True)
    summed = grads.new_zeros((unique.numel(), grads.shape[1])).index_add_(0, inverse, grads)
    return unique, summed


class EmbeddingOptimizer:
    """Optimizer settings and state of the tables one rank owns, and the update its lookup's backward applies."""

    def __init__(self, optimizers: TableOptimizers, weights: dict[str, torch.Tensor],
                 momentum: dict[str, torch.Tensor] | None = None):
        """momentum: the row-wise Adagrad tables' accumulators (zeros; the sharded collection's, laid out for its
        state_dict), by table name; None: made here."""
        self.weights = weights
        self._configs = per_table(optimizers, list(weights))
        # Bumped by every change of a setting: the GPU path copies the settings to the device again only then.
        self.version = 0
        # Row-wise Adagrad's accumulators; an SGD table has none.
        adagrad = [name for name in weights if self._configs[name].name == "rowwise_adagrad"]
        if momentum is None:
            momentum = {name: torch.zeros(weights[name].shape[0], dtype=torch.float32, device=weights[name].device)
                        for name in adagrad}
        if sorted(momentum) != sorted(adagrad):
            raise ValueError(f"accumulators given for tables {sorted(momentum)}, the row-wise Adagrad ones are "
                             f"{sorted(adagrad)}")
        self.momentum: dict[str, torch.Tensor] = dict(momentum)

    @property
    def configs(self) -> Mapping[str, EmbeddingOptimizerConfig]:
        """Each table's settings (read-only: `update` changes them)."""
        return MappingProxyType(self._configs)

    def update(self, table: str, *, lr: float | None = None, eps: float | None = None) -> None:
        """A table's lr and / or eps from the next update on (its optimizer, and so its state, stays)."""
        changes = {key: value for key, value in (("lr", lr), ("eps", eps)) if value is not None}
        config = dataclasses.replace(self._configs[table], **changes)  # checks them
        if config != self._configs[table]:
            self._configs[table] = config
            self.version += 1

    @torch.no_grad()
    def step(self, table: str, rows: torch.Tensor, grads: torch.Tensor) -> None:
        """Apply the gradient of one table: `grads[i]` is the gradient of one occurrence of row `rows[i]`."""
        if rows.numel() == 0:
            return
        weight, config = self.weights[table], self._configs[table]
        unique, g = sum_duplicate_rows(rows, grads.float())
        if config.name == "sgd":
            step = g * config.lr
        else:
            momentum = self.momentum[table]
            m = momentum[unique] + g.pow(2).mean(dim=1)
            momentum[unique] = m
            step = g * (config.lr / (m.sqrt() + config.eps)).unsqueeze(1)
        # In fp32 from the row's value, rounded to an fp16 / bf16 table's dtype once (as the kernel, and fbgemm's
        # round-to-nearest): rounding the step first, then the sum, moved ~30% of the elements by an ulp.
        weight[unique] = (weight[unique].float() - step).to(weight.dtype)
