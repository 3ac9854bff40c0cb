"""TrainingRun's bookkeeping that needs no model: the metrics log, a run's start."""

from __future__ import annotations

import logging

import torch
from omegaconf import OmegaConf

from fused_dlrm.dist import DistEnv
from fused_dlrm.train.schedule import MetricsLog, TrainingRun


def test_a_metrics_log_that_cannot_be_written_warns_once(tmp_path, caplog):
    (tmp_path / "metrics.jsonl").mkdir()  # as a full disk or a read-only run directory: open() fails
    metrics = MetricsLog(tmp_path, is_main=True)
    with caplog.at_level(logging.WARNING):
        metrics.record({"step": 1, "loss": 0.5})  # no error: rank 0 alone would raise, its peers wait
        metrics.record({"step": 2, "loss": 0.4})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(f"cannot write {tmp_path / 'metrics.jsonl'}"), warnings


def test_a_run_that_starts_at_or_past_max_steps_says_so(tmp_path, caplog):
    """A resume from a checkpoint at or past trainer.max_steps trains no step: it said nothing, logged "resumed
    from ... (step 30)" and an evaluation, and ended as a run would."""
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)
    for start, max_steps, warned in ((30, 20, True), (20, 20, True), (19, 20, False), (30, None, False)):
        trainer = OmegaConf.create({"log_every": 5, "eval_every": 0, "checkpoint_every": 0, "max_steps": max_steps,
                                    "progress": False, "resume_from": None})
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            TrainingRun(trainer, env, tmp_path, tmp_path / "checkpoints", start, items="samples", items_per_step=1,
                        log_fields=lambda interval: ({"loss": 0.0}, ""), evaluate=lambda step: {},
                        save=lambda step: None, log=logging.getLogger(__name__))
        expected = [f"the run starts at step {start}, at or past trainer.max_steps={max_steps}: it trains no step "
                    "(only evaluates); raise trainer.max_steps to train on"] if warned else []
        assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == expected
