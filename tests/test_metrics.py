"""The evaluation's metrics (train/metrics.py): AUC and log loss over every rank's samples, against a reference
computed here; outputs that are NaN or inf stop the run on every rank; samples of one class have no AUC."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from fused_dlrm.train.checkpoint import NonFiniteLossError
from fused_dlrm.train.metrics import CTRMetrics
from world import run_world

CPU = torch.device("cpu")


def reference_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """The probability that a positive outscores a negative, a tie counting half (Mann-Whitney)."""
    positive, negative = scores[labels == 1], scores[labels == 0]
    above = (positive[:, None] > negative[None, :]).double().sum()
    ties = (positive[:, None] == negative[None, :]).double().sum()
    return float((above + ties / 2) / (positive.numel() * negative.numel()))


def samples(seed: int, n: int = 53) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits with ties (small integers) and labels of both classes."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, (n,), generator=gen).float(), torch.bernoulli(torch.full((n,), 0.4), generator=gen)


def _metrics_of_every_rank(rank: int, world: int, seed: int, nonfinite_on: int | None) -> None:
    logits, labels = samples(seed)
    bounds = [0, 7, 53]  # uneven: 7 samples on rank 0, 46 on rank 1
    metrics = CTRMetrics(CPU)
    for start in range(bounds[rank], bounds[rank + 1], 5):  # batches of 5 and a short one
        stop = min(start + 5, bounds[rank + 1])
        batch = logits[start:stop].clone()
        if rank == nonfinite_on and start == bounds[rank]:
            batch[0] = float("nan")
        metrics.update(batch, labels[start:stop])
    if nonfinite_on is not None:
        with pytest.raises(NonFiniteLossError, match=r"1 of the 53 evaluation outputs at step 7 are NaN or inf"):
            metrics.compute(step=7)
        return
    scores = metrics.compute(step=7)
    assert scores["auc"] == pytest.approx(reference_auc(logits, labels), abs=1e-6)
    assert scores["log_loss"] == pytest.approx(F.binary_cross_entropy_with_logits(logits, labels).item(), rel=1e-6)


def test_two_ranks_score_all_samples():
    """Each rank's AUC and log loss are those of both ranks' samples, uneven in number."""
    run_world(2, _metrics_of_every_rank, 0, None)


def test_nonfinite_outputs_on_one_rank_stop_every_rank():
    """A NaN logit on one rank (torchmetrics dropped it from the log loss with a warning and ranked it into the AUC,
    reporting plausible numbers) raises on both ranks, counted over the world."""
    run_world(2, _metrics_of_every_rank, 1, 1, timeout=120)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_outputs_raise(value):
    logits, labels = samples(2)
    logits[[3, 10]] = value
    metrics = CTRMetrics(CPU)
    metrics.update(logits, labels)
    with pytest.raises(NonFiniteLossError, match=r"2 of the 53 evaluation outputs at step 3 are NaN or inf"):
        metrics.compute(step=3)


@pytest.mark.parametrize("label", [0.0, 1.0])
def test_samples_of_one_class_have_no_auc(label, caplog):
    """AUC needs both classes: samples of one are scored 0.5 (no signal, torchrec's AUC metric's value) with a
    warning; torchmetrics said 0.0, a model ranking every pair wrong."""
    logits, _ = samples(3)
    metrics = CTRMetrics(CPU)
    metrics.update(logits, torch.full_like(logits, label))
    with caplog.at_level(logging.WARNING, logger="fused_dlrm.train.metrics"):
        scores = metrics.compute(step=5)
    assert scores["auc"] == 0.5
    assert scores["log_loss"] == pytest.approx(F.binary_cross_entropy_with_logits(
        logits, torch.full_like(logits, label)).item(), rel=1e-6)
    assert f"all 53 evaluation samples at step 5 are {'positive' if label else 'negative'}" in caplog.text
    # compute() starts the next evaluation afresh
    logits, labels = samples(4)
    metrics.update(logits, labels)
    assert metrics.compute(step=6)["auc"] == pytest.approx(reference_auc(logits, labels), abs=1e-6)


def test_confident_outputs_are_ranked_by_their_logits():
    """Logits of 17 to 27 all round to a probability of 1.0 in float32, which tied every pair of them in the AUC
    (0.71 for a ranking that is right 9 times in 10 below); their float64 probabilities keep them apart."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.cat([17 + 10 * torch.rand(40, generator=gen), torch.randn(13, generator=gen) * 8])
    labels = torch.bernoulli(torch.sigmoid((logits - 22) / 2), generator=gen)
    labels[[0, 1, 40]] = torch.tensor([0.0, 1.0, 0.0])  # both classes among the confident ones and the others
    assert torch.sigmoid(logits[:40]).eq(1.0).all()  # float32's probabilities tie them all
    metrics = CTRMetrics(CPU)
    metrics.update(logits[:30], labels[:30])
    metrics.update(logits[30:], labels[30:])
    scores = metrics.compute(step=1)
    assert scores["auc"] == pytest.approx(reference_auc(logits, labels), abs=1e-6)
    assert scores["auc"] != pytest.approx(reference_auc(torch.sigmoid(logits), labels), abs=1e-3)
