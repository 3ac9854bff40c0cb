"""Checkpoints with torch.distributed.checkpoint: each rank writes the tables it owns, the dense part once.

Layout: <root>/step_<N>/ (a DCP folder). A checkpoint is written into step_<N>.partial and renamed when every rank
has finished, so a crash or a NaN stop never leaves a half-written "latest" checkpoint.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

log = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"^step_(\d+)$")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, embedding_optimizer) -> dict:
    """embedding_optimizer None: a model without one (the MoE Transformer); no entry for it is written or read."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "dense_optimizer": optim_state, "step": torch.zeros((), dtype=torch.int64)}
    if embedding_optimizer is not None:
        state["embedding_optimizer"] = embedding_optimizer.state_dict()
    return state


def latest_checkpoint(root: str | Path) -> Path | None:
    steps = [(int(m.group(1)), p) for p in Path(root).glob("step_*") if (m := _STEP_DIR.match(p.name))]
    return max(steps)[1] if steps else None


def save_checkpoint(root: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    embedding_optimizer=None, keep_last: int = 2) -> Path:
    root = Path(root)
    final, partial = root / f"step_{step}", root / f"step_{step}.partial"
    if _is_main():
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    _barrier()
    state = _state(model, optimizer, embedding_optimizer)
    state["step"].fill_(step)
    dcp.save(state, checkpoint_id=partial)
    _barrier()
    if _is_main():
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        old = sorted((int(m.group(1)), p) for p in root.glob("step_*") if (m := _STEP_DIR.match(p.name)))
        for _, p in old[:-keep_last]:
            shutil.rmtree(p)
        log.info("checkpoint saved: %s", final)
    _barrier()
    return final


def _check_entries(path: Path, state: dict) -> None:
    """Every entry this run loads is in the checkpoint, with its shape: DCP would name one key only, deep in a
    traceback of its own exception type."""
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    wanted = {f"model.{name}": value for name, value in state["model"].items()}
    tables = {f"embedding_optimizer.{name}": value for name, value in state.get("embedding_optimizer", {}).items()}
    missing = [key for key in wanted if key not in saved]
    if missing:
        raise ValueError(f"checkpoint {path} holds no {missing[:3]}{' ...' if len(missing) > 3 else ''} "
                         f"({len(missing)} of the model's {len(wanted)} entries): it was written for another "
                         "model, world size (the MoE experts' names) or sharding of the tables (model.column_shards, "
                         "model.row_shards)")
    missing = [key for key in tables if key not in saved]
    if missing:
        raise ValueError(f"checkpoint {path} holds no {missing[:2]}{' ...' if len(missing) > 2 else ''}: it was "
                         "written with another embedding optimizer (model.embedding_optimizer.name)")
    wanted.update(tables)
    wrong = [f"{key} {list(saved[key].size)} (this run: {list(value.shape)})" for key, value in wanted.items()
             if torch.is_tensor(value) and hasattr(saved[key], "size") and list(saved[key].size) != list(value.shape)]
    if wrong:
        raise ValueError(f"checkpoint {path} holds {wrong[:3]}{' ...' if len(wrong) > 3 else ''}: it was written for "
                         "other sizes (DLRM: model.num_rows, model.embedding_dim, data.num_dense, the arches; the MoE "
                         "Transformer: model.d_model, model.ffn, model.num_experts, ...)")


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    embedding_optimizer=None) -> int:
    """Load a step_<N> folder, or the latest one under a checkpoint root; returns the step it was taken at."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if not _STEP_DIR.match(path.name):
        found = latest_checkpoint(path)
        if found is None:
            raise FileNotFoundError(f"no step_<N> checkpoint under {path}")
        path = found
    state = _state(model, optimizer, embedding_optimizer)
    _check_entries(path, state)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["dense_optimizer"])
    if embedding_optimizer is not None:
        embedding_optimizer.load_state_dict(state["embedding_optimizer"])
    log.info("resumed from %s (step %d)", path, int(state["step"]))
    return int(state["step"])
