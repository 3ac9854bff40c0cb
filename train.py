"""Train a model: `python train.py model=dlrm` (or model=moe_transformer), or under
`torchrun --nproc_per_node=N train.py ...`. With report=true the per-layer bulk-vs-fused report (fused_dlrm.report)
is written into the run directory after training: the trained model's memory is released by then, and the
report's timings cannot disturb the training's own step times. Its report.json records the overrides and config (as
.hydra/ does)."""

import gc
import importlib
import logging

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from fused_dlrm.dist import destroy_distributed, init_distributed
from fused_dlrm.report import write_report
from fused_dlrm.train.config_keys import check_config_keys
from fused_dlrm.train.rundir import agree_on_run_dir, register_resolvers

register_resolvers()

# cfg.model.name -> the module whose train(cfg, env, run_dir) runs it
TRAINERS = {"dlrm": "fused_dlrm.train.loop", "moe_transformer": "moe.train"}


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    if cfg.model.name not in TRAINERS:
        raise ValueError(f"unknown model.name {cfg.model.name!r}: expected one of {sorted(TRAINERS)}")
    train = importlib.import_module(TRAINERS[cfg.model.name]).train
    # before init_distributed reads trainer.tf32 (`trainer.tf32=no`: a string); every rank alike, as the config is.
    # The model's train checks it again: tests and scripts call it directly.
    check_config_keys(cfg)
    env = init_distributed(cfg.trainer.device, cfg.comm.backend, tf32=cfg.trainer.tf32)
    if not env.is_main:  # one console is enough; every rank still writes its own log file
        for handler in logging.getLogger().handlers:
            if type(handler) is logging.StreamHandler:
                handler.setLevel(logging.WARNING)
    try:
        hydra_cfg = HydraConfig.get()
        run_dir = agree_on_run_dir(hydra_cfg.runtime.output_dir)
        train(cfg, env, run_dir)
        if cfg.report:
            # the trained model is freed before the report builds its own: DLRM's dense arches and their ArchNodes
            # (models/arch_nodes.py: arch.forward is the node, which holds the arch) form cycles only gc frees
            gc.collect()
            write_report(cfg, env, run_dir, hydra_cfg.overrides.task)
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
