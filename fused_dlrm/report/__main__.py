"""python -m fused_dlrm.report <hydra overrides>: the per-layer report without training.

Composes the run's config from the repository's conf/ with the same overrides train.py takes (model=..., comm=...,
data.global_batch_size=..., hydra.run.dir=...), in one process or under torchrun, and writes report.md,
report.json and report.png into the run directory (default: outputs/<launch time>, as train.py). Unlike train.py's
it holds no .hydra/ directory: report.json records the overrides (without hydra.*) and the composed config, resolved
(`${hydra:runtime.output_dir}` as in train.py's run: the run directory).
"""

from __future__ import annotations

import logging
import os
import sys

from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf, open_dict

from fused_dlrm.dist import destroy_distributed, init_distributed
from fused_dlrm.report import write_report
from fused_dlrm.train.build import compose_config
from fused_dlrm.train.rundir import agree_on_run_dir


def main(overrides: list[str]) -> None:
    full = compose_config(overrides, return_hydra_config=True)
    cfg = OmegaConf.masked_copy(full, [k for k in full if k != "hydra"])
    logging.basicConfig(level=logging.INFO, force=True, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    env = init_distributed(cfg.trainer.device, cfg.comm.backend, tf32=cfg.trainer.tf32)
    if not env.is_main:
        logging.getLogger().setLevel(logging.WARNING)
    try:
        run_dir = agree_on_run_dir(os.path.abspath(full.hydra.run.dir))  # absolute, as Hydra's runtime.output_dir
        # as in Hydra's run of train.py, `${hydra:runtime.output_dir}` in an override resolves (to this run
        # directory) while the report runs; then the process's HydraConfig is as before (a caller composing again)
        with open_dict(full):
            full.hydra.runtime.output_dir = str(run_dir)
        hydra_config, before = HydraConfig.instance(), HydraConfig.instance().cfg
        hydra_config.set_config(full)
        try:
            write_report(cfg, env, run_dir, full.hydra.overrides.task)
        finally:
            hydra_config.cfg = before
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1:])
