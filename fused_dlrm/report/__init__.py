"""Per-layer speedup report: every communicating layer of the configured model, with its real shapes, timed in the
bulk and the fused mode -> report.md / report.json / report.png in the run directory.

`python train.py ... report=true` writes it after training; `python -m fused_dlrm.report <overrides>` without.
report.json records, besides machine, commit and versions, the command line's overrides (as Hydra's
.hydra/overrides.yaml: without Hydra's own hydra.*) and the config they composed, resolved: the report is re-run by
`python -m fused_dlrm.report <its overrides>`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf

from fused_dlrm.dist import DistEnv
from fused_dlrm.dist.env import check_rank_0_can_write
from fused_dlrm.report.measure import measure
from fused_dlrm.report.render import environment, markdown, write_json, write_png
from fused_dlrm.tp.quantized_allreduce import check_grad_allreduce

log = logging.getLogger(__name__)

MODES_TEXT = ("bulk = comm=bulk with a plain all-reduce of the replicated gradients; fused = comm=fused with the "
              "configured comm.grad_allreduce. The MoE Transformer's tensor-parallel projections: tp_comm=bulk in "
              "bulk; in fused, tp_comm=fused in bf16 (its kernels' dtype), else bulk.")


def _layers(cfg: DictConfig, env: DistEnv, run_dir: Path):
    """The model's communicating layers (imported per model: the MoE builder needs the moe package)."""
    if cfg.model.name == "dlrm":
        from fused_dlrm.report.dlrm import dlrm_layers
        return dlrm_layers(cfg, env, run_dir)
    if cfg.model.name == "moe_transformer":
        from fused_dlrm.report.moe import moe_layers
        return moe_layers(cfg, env, run_dir)
    raise ValueError(f"no report for model.name {cfg.model.name!r}: expected dlrm or moe_transformer")


def _as_typed(overrides: Sequence[str] | ListConfig) -> list[str]:
    """The overrides as typed, as Hydra's .hydra/overrides.yaml keeps them: Hydra's record is a ListConfig, whose
    `${hydra:runtime.output_dir}` would resolve to this run's directory, not the next one's."""
    return OmegaConf.to_container(overrides) if isinstance(overrides, ListConfig) else list(overrides)


def write_report(cfg: DictConfig, env: DistEnv, run_dir: Path, overrides: Sequence[str] | ListConfig) -> dict:
    """Measure on every rank (a collective); rank 0 writes the three files. `overrides`: those of the command line
    that composed cfg (Hydra's task overrides), recorded with it. Returns the report (every rank)."""
    run_dir = Path(run_dir)
    check_rank_0_can_write(run_dir, f"the report into {run_dir}", directory=True)  # not after the timings
    # the fused column's codec: where no fused column is built (the CPU, one process) nothing else would read it
    check_grad_allreduce(cfg.comm.grad_allreduce)
    # resolved before the timings, on every rank (an interpolation that fails, fails on all of them)
    config = OmegaConf.to_container(cfg, resolve=True)
    report = {"model": cfg.model.name, "modes": MODES_TEXT, "environment": environment(env),
              "overrides": _as_typed(overrides), "config": config, **measure(_layers(cfg, env, run_dir), env)}
    if env.is_main:
        write_json(report, run_dir / "report.json")
        table = markdown(report)
        (run_dir / "report.md").write_text(table)
        no_picture = write_png(report, run_dir / "report.png")
        if no_picture:
            log.warning("report.png not written: %s", no_picture)
        log.info("report written to %s\n%s", run_dir, table)
    return report
