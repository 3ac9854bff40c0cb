"""Embedding optimizers fused into backward: exact SGD and exact row-wise Adagrad.

"Exact" as in fbgemm's EXACT_SGD / EXACT_ROWWISE_ADAGRAD: the gradients of every occurrence of a row in the batch
are summed first, then each touched row is updated once. Rows the batch did not touch keep weight and state.
Row-wise Adagrad keeps one accumulator per row: m += mean(g^2) over the row; w -= lr * g / (sqrt(m) + eps).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

OPTIMIZERS = ("sgd", "rowwise_adagrad")


@dataclass(frozen=True)
class EmbeddingOptimizerConfig:
    name: str = "rowwise_adagrad"
    lr: float = 0.01
    eps: float = 1e-8  # fbgemm's default

    def __post_init__(self):
        if self.name not in OPTIMIZERS:
            raise ValueError(f"unknown embedding optimizer {self.name!r}: expected one of {OPTIMIZERS}")
        if self.lr <= 0:
            raise ValueError(f"embedding optimizer lr must be > 0, got {self.lr}")


def sum_duplicate_rows(rows: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(unique rows, summed gradient of each) from per-occurrence rows [N] and gradients [N, D]."""
    unique, inverse = torch.unique(rows, return_inverse=True)
    summed = grads.new_zeros((unique.numel(), grads.shape[1])).index_add_(0, inverse, grads)
    return unique, summed


class EmbeddingOptimizer:
    """Optimizer state of the tables one rank owns, and the update its lookup's backward applies."""

    def __init__(self, config: EmbeddingOptimizerConfig, weights: dict[str, torch.Tensor]):
        self.config = config
        self.weights = weights
        self.momentum: dict[str, torch.Tensor] = {}
        if config.name == "rowwise_adagrad":
            self.momentum = {
                name: torch.zeros(w.shape[0], dtype=torch.float32, device=w.device) for name, w in weights.items()
            }

    @torch.no_grad()
    def step(self, table: str, rows: torch.Tensor, grads: torch.Tensor) -> None:
        """Apply the gradient of one table: `grads[i]` is the gradient of one occurrence of row `rows[i]`."""
        if rows.numel() == 0:
            return
        weight = self.weights[table]
        unique, g = sum_duplicate_rows(rows, grads.float())
        lr = self.config.lr
        if self.config.name == "sgd":
            weight.index_add_(0, unique, g.to(weight.dtype), alpha=-lr)
            return
        momentum = self.momentum[table]
        m = momentum[unique] + g.pow(2).mean(dim=1)
        momentum[unique] = m
        step = g * (lr / (m.sqrt() + self.config.eps)).unsqueeze(1)
        weight.index_add_(0, unique, step.to(weight.dtype), alpha=-1.0)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{name}.momentum": m for name, m in self.momentum.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        expected = set(self.state_dict())
        if set(state) != expected:
            raise KeyError(f"embedding optimizer state has keys {sorted(state)}, expected {sorted(expected)}")
        for name, m in self.momentum.items():
            m.copy_(state[f"{name}.momentum"])
