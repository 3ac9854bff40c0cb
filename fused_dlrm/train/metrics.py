"""Evaluation metrics of a click-through-rate model: AUC and log loss (torchmetrics; summed over all ranks)."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torchmetrics import MeanMetric
from torchmetrics.classification import BinaryAUROC

from fused_dlrm.dist.env import all_reduce_sum
from fused_dlrm.train.checkpoint import NonFiniteLossError

log = logging.getLogger(__name__)


class CTRMetrics:
    """AUC and log loss over every rank's samples.

    Outputs that are NaN or inf stop the run (NonFiniteLossError, on every rank): torchmetrics would drop NaN from
    the log loss with a warning and rank them into an AUC that looks plausible. Samples of one class have no AUC:
    0.5 (no signal, as torchrec's AUC metric scores them), with a warning; torchmetrics says 0.0. The AUC ranks
    float64 probabilities (logits 1e-4 apart distinct up to ~27; float32's tie above ~16.6): 8 bytes kept a sample."""

    def __init__(self, device: torch.device):
        self.auc = BinaryAUROC().to(device)
        self.log_loss = MeanMetric().to(device)
        self.counts = torch.zeros(3, dtype=torch.float64, device=device)  # samples, positives, NaN / inf outputs

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        # float64: float32 rounds the probability of every logit above ~16.6 to 1.0, tying them in the AUC's ranking
        self.auc.update(torch.sigmoid(logits.double()), labels.long())
        self.log_loss.update(F.binary_cross_entropy_with_logits(logits, labels, reduction="none"))
        self.counts[0] += labels.numel()
        self.counts[1] += labels.sum()
        self.counts[2] += logits.isfinite().logical_not().sum()

    def compute(self, step: int) -> dict[str, float]:
        """Gathers from every rank (collectives: all ranks must call it); `step` names the evaluation."""
        samples, positives, nonfinite = (round(c) for c in all_reduce_sum(self.counts.clone()).tolist())
        self.counts.zero_()
        try:
            if nonfinite:  # the world's counts: every rank raises, before the metrics' own collectives
                raise NonFiniteLossError(f"{nonfinite} of the {samples} evaluation outputs at step {step} are NaN or "
                                         "inf (parameters diverged after the loss was last checked, or NaN / inf input "
                                         "features); stopping")
            if 0 < positives < samples:
                auc = float(self.auc.compute())
            else:  # the same on every rank, which all skip the AUC's gather
                log.warning("all %d evaluation samples at step %d are %s: AUC needs both classes, scored 0.5 (no "
                            "signal)", samples, step, "positive" if positives else "negative")
                auc = 0.5
            return {"auc": auc, "log_loss": float(self.log_loss.compute())}
        finally:  # the next evaluation starts afresh
            self.auc.reset()
            self.log_loss.reset()
