"""Evaluation metrics of a click-through-rate model: AUC and log loss (torchmetrics; summed over all ranks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchmetrics import MeanMetric
from torchmetrics.classification import BinaryAUROC


class CTRMetrics:
    def __init__(self, device: torch.device):
        self.auc = BinaryAUROC().to(device)
        self.log_loss = MeanMetric().to(device)

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        self.auc.update(torch.sigmoid(logits), labels.long())
        self.log_loss.update(F.binary_cross_entropy_with_logits(logits, labels, reduction="none"))

    def compute(self) -> dict[str, float]:
        """Gathers from every rank (a collective: all ranks must call it)."""
        out = {"auc": float(self.auc.compute()), "log_loss": float(self.log_loss.compute())}
        self.auc.reset()
        self.log_loss.reset()
        return out
