"""One run directory for all ranks of a launch.

Hydra names the run directory after the time each process starts; under torchrun the ranks start a moment apart
and could pick different names. The `launch_time` resolver uses the torchrun agent's start time instead (every
local rank has the agent as parent), and `agree_on_run_dir` makes rank 0's choice final for all ranks.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch.distributed as dist
from omegaconf import OmegaConf


def _process_start_time(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    start_ticks = int(fields[19])  # field 22 of stat(5); fields here start at field 3
    with open("/proc/stat") as f:
        boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    return boot + start_ticks / os.sysconf("SC_CLK_TCK")


def launch_time() -> str:
    start = time.time()
    if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun
        try:
            start = _process_start_time(os.getppid())
        except (OSError, ValueError, StopIteration):
            pass
    return time.strftime("%Y-%m-%d/%H-%M-%S", time.localtime(start))


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("launch_time"):
        OmegaConf.register_new_resolver("launch_time", launch_time, use_cache=True)


def agree_on_run_dir(path: str | Path) -> Path:
    if dist.is_initialized() and dist.get_world_size() > 1:
        chosen = [str(path)]
        dist.broadcast_object_list(chosen, src=0)
        path = chosen[0]
    return Path(path)
