"""TrainingRun's bookkeeping that needs no model: the metrics log."""

from __future__ import annotations

import logging

from fused_dlrm.train.schedule import MetricsLog


def test_a_metrics_log_that_cannot_be_written_warns_once(tmp_path, caplog):
    (tmp_path / "metrics.jsonl").mkdir()  # as a full disk or a read-only run directory: open() fails
    metrics = MetricsLog(tmp_path, is_main=True)
    with caplog.at_level(logging.WARNING):
        metrics.record({"step": 1, "loss": 0.5})  # no error: rank 0 alone would raise, its peers wait
        metrics.record({"step": 2, "loss": 0.4})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(f"cannot write {tmp_path / 'metrics.jsonl'}"), warnings
