"""Checkpoints with torch.distributed.checkpoint: each rank writes the tables it owns, the dense part once.

The tables and their optimizer state are torchrec's global entries (sparse/sharded_state.py): a checkpoint resumes
under another sharding plan or world size, except for row-wise Adagrad state under other column cuts (refused).

Layout: <root>/step_<N>/ (a DCP folder). A checkpoint is written into step_<N>.partial and renamed when every rank
has finished and rank 0 sees every file of it (a root on each node's own disk is refused), so a crash or a NaN stop
never leaves a half-written "latest" checkpoint; parameters or optimizer state holding NaN / inf on any rank stop
the run instead of being saved (and of pruning a good checkpoint).
"""

from __future__ import annotations

import logging
import re
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from fused_dlrm.config_checks import check_count
from fused_dlrm.dist.env import all_reduce_sum, of_every_rank, problem_text, raise_on_every_rank
from fused_dlrm.sparse.sharded_state import TablePieces

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """The run diverged: a NaN / inf loss, or parameters or optimizer state a checkpoint would hold."""


_STEP_DIR = re.compile(r"^step_(\d+)$")
_PARTIAL_DIR = re.compile(r"^step_\d+\.partial$")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


@contextmanager
def _without_process_group_warning(no_dist: bool = False):
    """DCP warns "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to save in a
    single process" at each call in a run of one process, and at _check_run's read on each rank alone (no_dist) in
    every run: both meant, and in a run of two ranks the words read as a launch gone wrong. The filter is
    process-wide while it is on (catch_warnings: the batch thread's warnings too), so it is on only for the calls
    that warn."""
    if dist.is_initialized() and not no_dist:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, embedding_optimizer) -> dict:
    """embedding_optimizer None: a model without one (the MoE Transformer); no entry for it is written or read."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "dense_optimizer": optim_state, "step": torch.zeros((), dtype=torch.int64)}
    if embedding_optimizer is not None:
        state["embedding_optimizer"] = embedding_optimizer.state_dict()
    return state


def _step_folders(root: str | Path) -> list[tuple[int, Path]]:
    """(N, folder) of every step_<N> folder under root, by step; a stray file of that name is none."""
    return sorted((int(m.group(1)), p) for p in Path(root).glob("step_*") if (m := _STEP_DIR.match(p.name))
                  and p.is_dir())


def latest_checkpoint(root: str | Path) -> Path | None:
    steps = _step_folders(root)
    return steps[-1][1] if steps else None


def last_good_checkpoint(root: Path, resumed_from: str | None) -> str:
    """What a NaN stop names: the newest checkpoint under root, else the one the run resumed from (a resume into
    a new directory has none of its own yet), else "none"."""
    latest = latest_checkpoint(root) if root.exists() else None
    if latest is not None:
        return str(latest)
    return f"{resumed_from} (this run resumed from it)" if resumed_from else "none"


def _on_main(work, what: str) -> None:
    """`work()` on rank 0 alone (the shared folder's layout), its outcome raised on every rank."""
    problem = None
    if _is_main():
        try:
            work()
        except Exception as error:  # noqa: BLE001: raised here, and named on every other rank
            problem = error
    raise_on_every_rank(problem, what)


def _tensors(value):
    if isinstance(value, ShardedTensor):  # the sharded tables' and their optimizer's: this rank's shards
        yield from (shard.tensor for shard in value.local_shards())
    elif isinstance(value, TablePieces):  # a world of one's cut table: its pieces, not a copy of it
        yield from value.pieces.values()
    elif torch.is_tensor(value):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _stop_if_nonfinite(state: dict, device: torch.device, root: Path, step: int, resumed_from: str | None) -> None:
    """Stop on every rank if any rank's parameters or optimizer state hold NaN / inf: the loss checked before a
    checkpoint was computed before the step's update, which may have diverged."""
    tensors = [t for t in _tensors(state) if t.is_floating_point() and t.numel()]
    bad = torch.zeros((), device=device)
    if tensors:  # each tensor's largest magnitude: NaN / inf exactly where it holds one (a sum of squares overflows)
        largest = torch._foreach_norm(tensors, float("inf"))
        bad += torch.stack([m.to(device, torch.float32) for m in largest]).isfinite().logical_not().any()
    if all_reduce_sum(bad).item():
        raise NonFiniteLossError(f"parameters or optimizer state became NaN or inf by step {step} (its update "
                                 f"diverged after the loss was checked); stopping without writing step_{step}. Last "
                                 f"good checkpoint: {last_good_checkpoint(root, resumed_from)}")


def _files_not_held(folder: Path) -> list[str]:
    """The files a DCP folder's metadata names that the folder lacks or holds shorter than the data in them: written
    by ranks that saw another folder at its path (a checkpoint_dir on each node's own disk)."""
    ends: dict[str, int] = {}
    for info in dcp.FileSystemReader(folder).read_metadata().storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    return sorted(name for name, end in ends.items()
                  if not (folder / name).is_file() or (folder / name).stat().st_size < end)


def check_keep_last(keep_last: int) -> None:
    """How many checkpoints a run keeps (trainer.keep_checkpoints): at least the one just saved."""
    check_count("trainer.keep_checkpoints", keep_last, 1, "a count >= 1 (the checkpoint just saved is always kept)")


def save_checkpoint(root: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    embedding_optimizer=None, keep_last: int = 2, global_batch_size: int | None = None,
                    resumed_from: str | None = None, lr_decay_steps: int | None = None) -> Path:
    """global_batch_size: the run's data.global_batch_size, lr_decay_steps: the steps its lr schedule decays over
    (None: no decay), each recorded for load_checkpoint's check; resumed_from: the run's trainer.resume_from (named
    by a NaN stop when root holds no checkpoint yet)."""
    check_keep_last(keep_last)
    root = Path(root)
    final, partial = root / f"step_{step}", root / f"step_{step}.partial"

    def start() -> None:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)

    def finish() -> None:
        unseen = _files_not_held(partial)
        if unseen:
            raise ValueError(f"{partial} lacks {_listed(unseen)} that other ranks wrote (each rank writes its files "
                             f"into the folder as its node sees it): trainer.checkpoint_dir must be one folder that "
                             f"every rank sees (a shared filesystem); left as a .partial folder, not a checkpoint")
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        for _, p in _step_folders(root)[:-keep_last]:
            shutil.rmtree(p)
        for p in root.glob("step_*.partial"):  # a crash's leftovers: never a checkpoint, and never pruned else
            if _PARTIAL_DIR.match(p.name) and p.is_dir():
                shutil.rmtree(p)
        log.info("checkpoint saved: %s", final)

    state = _state(model, optimizer, embedding_optimizer)
    _stop_if_nonfinite(state, next(model.parameters()).device, root, step, resumed_from)
    state["run"] = _run_record(optimizer, global_batch_size, lr_decay_steps)
    _on_main(start, f"could not start checkpoint {partial}")
    state["step"].fill_(step)
    with _without_process_group_warning():
        dcp.save(state, checkpoint_id=partial)
    _barrier()
    _on_main(finish, f"could not finish checkpoint {final}")
    return final


def _flat(prefix: str, value) -> dict:
    """A nested state's entries by their checkpoint keys (DCP's: the keys on the way joined by dots)."""
    if isinstance(value, dict):
        return {key: entry for name, item in value.items() for key, entry in _flat(f"{prefix}.{name}", item).items()}
    return {prefix: value}


def _optimizer_entries(state: dict) -> tuple[dict, dict]:
    """The embedding optimizer's and the dense optimizer's state entries of `state`, by their checkpoint keys."""
    tables = _flat("embedding_optimizer", state["embedding_optimizer"]) if "embedding_optimizer" in state else {}
    dense = {f"dense_optimizer.state.{param}.{name}": value
             for param, entries in state["dense_optimizer"].get("state", {}).items() for name, value in entries.items()}
    return tables, dense


# The entries a rank loads, by checkpoint key prefix, and what a checkpoint that lacks some (or holds some that no
# rank loads) was written for.
_ENTRY_KINDS = (
    ("model.", "model's", "it was written for another model, world size, model.tp_size or model.sequence_parallel "
                          "(the MoE experts' names, the TP projections' shard_<rank>_of_<tp_size>)"),
    ("embedding_optimizer.", "embedding optimizer's",
     "it was written with another embedding optimizer (model.embedding_optimizer.name)"),
    ("dense_optimizer.state.", "dense optimizer's", "it was written with another dense optimizer (DLRM: "
                                                    "trainer.dense_optimizer; the MoE Transformer: model.optimizer)"),
)


def _entries(state: dict) -> dict[str, tuple[list[int], torch.dtype] | None]:
    """The entries this rank loads, by checkpoint key: a tensor's shape and dtype, None for another value."""
    tables, dense = _optimizer_entries(state)
    entries = {f"model.{name}": value for name, value in state["model"].items()} | tables | dense
    return {key: (list(value.shape), value.dtype) if torch.is_tensor(value) else None
            for key, value in entries.items()}


def _listed(keys: list[str]) -> str:
    return f"{keys[:3]}{' ...' if len(keys) > 3 else ''}"


def _check_entries(path: Path, saved: dict, every: list[dict[str, tuple[list[int], torch.dtype] | None]]) -> None:
    """The checkpoint holds every entry that any rank loads (`every`: each rank's `_entries`), with its shape (the
    model's with its dtype too: DCP would cast fp32 tables into fp16 ones), and no model entry or optimizer state
    that no rank loads (another sharding plan's tables, Adam's moments under SGD): DCP would name one key on one
    rank, deep in a traceback of its own exception type, or drop them without a word. Every rank checks every
    rank's entries, so all of them raise the same error."""
    ranks: dict[str, list[int]] = {}  # entry -> the ranks that load it
    tensors: dict[str, tuple[list[int], torch.dtype] | None] = {}
    for rank, entries in enumerate(every):
        for key, tensor in entries.items():
            ranks.setdefault(key, []).append(rank)
            tensors.setdefault(key, tensor)
    for prefix, whose, written in _ENTRY_KINDS:
        wanted = [key for key in ranks if key.startswith(prefix)]
        missing = [key for key in wanted if key not in saved]
        extra = sorted(key for key in saved if key.startswith(prefix) and key not in ranks)
        found = []
        if missing:
            on = sorted({rank for key in missing for rank in ranks[key]})
            found.append(f"holds no {_listed(missing)} ({len(missing)} of the {whose} {len(wanted)} entries"
                         f"{f', loaded by rank(s) {on}' if len(every) > 1 else ''})")
        if extra:  # in their place, where another sharding plan cut the tables otherwise
            found.append(f"holds {_listed(extra)}, state this run does not keep")
        if found:
            raise ValueError(f"checkpoint {path} {' and '.join(found)}: {written}")
    held = {key: tensor for key, tensor in tensors.items() if tensor is not None and hasattr(saved[key], "size")}
    wrong = {key: f"{key} {list(saved[key].size)} (this run: {shape})" for key, (shape, _) in held.items()
             if list(saved[key].size) != shape}
    sizes = [text for key, text in wrong.items() if not key.startswith("embedding_optimizer.")]
    if sizes:
        raise ValueError(f"checkpoint {path} holds {_listed(sizes)}: it was written for other sizes (DLRM: "
                         "model.num_rows, model.embedding_dim, data.num_dense, the arches; the MoE Transformer: "
                         "model.d_model, model.ffn, model.num_experts, ...)")
    dtypes = [f"{key} {saved[key].properties.dtype} (this run: {dtype})" for key, (_, dtype) in held.items()
              if key.startswith("model.") and saved[key].properties.dtype != dtype]
    if dtypes:  # the MoE Transformer's weights are fp32 at either model.precision
        raise ValueError(f"checkpoint {path} holds {_listed(dtypes)}: it was written for tables of another dtype; "
                         "resume with its model.data_type (DLRM)")
    if wrong:  # the tables themselves reshard (model entries of the same shapes under any plan): not this state
        raise ValueError(f"checkpoint {path} holds {_listed(list(wrong.values()))}: row-wise Adagrad state written "
                         "for other column shards of these tables (torchrec's layout: an accumulator per row of each "
                         "column shard, [rows x column shards]), which cannot move to other columns; resume with the "
                         "checkpoint's column shards (DLRM: model.column_shards; row blocks, placement and world "
                         "size may differ)")


def _run_record(optimizer: torch.optim.Optimizer, global_batch_size: int | None,
                lr_decay_steps: int | None = None) -> dict:
    """What a checkpoint records of its run besides tensors (DCP keeps these as pickled values)."""
    record = {"dense_optimizer": type(optimizer).__name__}
    if global_batch_size is not None:
        record["global_batch_size"] = global_batch_size
    if lr_decay_steps is not None:
        record["lr_decay_steps"] = lr_decay_steps
    return record


def _check_run(path: Path, saved: dict, optimizer: torch.optim.Optimizer, global_batch_size: int | None,
               lr_decay_over_max_steps: int | None = None) -> None:
    """The checkpoint's run record (`_run_record`; older checkpoints hold none) against this run: Adam and AdamW
    keep state of the same names, which the entry checks cannot tell apart; data read from files resumes by step
    count, which another global batch size would map to other lines; an lr decaying over trainer.max_steps
    (lr_decay_over_max_steps: this run's) would jump at the resume where that differs from the steps the
    checkpoint's run decayed over. Read on each rank alone (no_dist): no collective before every rank knows that
    every rank can resume."""
    record = {key.removeprefix("run."): None for key in saved if key.startswith("run.")}
    if not record:
        return
    try:
        with _without_process_group_warning(no_dist=True):
            dcp.load({"run": record}, checkpoint_id=path, no_dist=True)
    except CheckpointException as error:  # this rank's own read (no_dist): its failure, under DCP's rank 0
        raise _unreadable(path, "; ".join(problem_text(exc) for exc, _ in error.failures.values())) from error
    mine = _run_record(optimizer, global_batch_size)
    if record.get("dense_optimizer", mine["dense_optimizer"]) != mine["dense_optimizer"]:
        raise ValueError(f"checkpoint {path} was written with the dense optimizer {record['dense_optimizer']}, this "
                         f"run's is {mine['dense_optimizer']}: it was written with another dense optimizer (DLRM: "
                         "trainer.dense_optimizer; the MoE Transformer: model.optimizer)")
    if global_batch_size is not None and record.get("global_batch_size", global_batch_size) != global_batch_size:
        raise ValueError(f"checkpoint {path} was taken at data.global_batch_size={record['global_batch_size']}, this "
                         f"run's is {global_batch_size}: data read from files resumes at the checkpoint's step "
                         f"count, which another batch size would place at other lines; resume with "
                         f"data.global_batch_size={record['global_batch_size']}")
    decayed = record.get("lr_decay_steps")
    if lr_decay_over_max_steps is not None and decayed is not None and decayed != lr_decay_over_max_steps:
        step = int(_STEP_DIR.match(path.name).group(1))
        raise ValueError(f"checkpoint {path} decays the lr over {decayed} steps, this run over trainer.max_steps="
                         f"{lr_decay_over_max_steps} (model.lr_schedule.decay_steps null): the lr of step {step + 1} "
                         f"would jump from the checkpoint's schedule to this one's; set model.lr_schedule."
                         f"decay_steps={decayed} to continue it, or ={lr_decay_over_max_steps} to stretch it over "
                         f"this run")


def _keep_configured_options(optimizer: torch.optim.Optimizer, configured: list[dict]) -> None:
    """Put this run's hyperparameters back into the param groups that loading replaced with the checkpoint's: a
    resumed run trains with its config (lr, weight decay, ...), as the embedding optimizer does. A group an lr
    scheduler ran (torch.optim.lr_scheduler) holds its configured lr as initial_lr, `lr` being its last step's:
    that is the one compared, and dropped (this run's scheduler, made after loading, sets its own)."""
    changed = []
    for group, options in zip(optimizer.param_groups, configured):
        saved = dict(group)
        if "initial_lr" in group and "initial_lr" not in options:
            saved["lr"] = group.pop("initial_lr")
        changed += [f"{key}={value!r} (checkpoint: {saved.get(key)!r})" for key, value in options.items()
                    if key in saved and saved[key] != value]
        group.update(options)
    if changed:
        log.info("resume: the dense optimizer keeps this run's %s", ", ".join(dict.fromkeys(changed)))


def _step_folder(path: Path) -> Path:
    """`path` if a step_<N> folder, else the latest one under it."""
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if _STEP_DIR.match(path.name):
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise FileNotFoundError(f"no step_<N> checkpoint under {path}")
    return found


def _unreadable(path: Path, failures: str) -> ValueError:
    """The error of a checkpoint whose metadata or shards cannot be read, naming the checkpoint before it."""
    step = int(_STEP_DIR.match(path.name).group(1))
    earlier = [p.name for n, p in _step_folders(path.parent) if n < step]
    return ValueError(f"checkpoint {path} cannot be read ({failures}): a file of it is truncated or corrupt; resume "
                      f"from an earlier checkpoint ({earlier[-1] if earlier else 'none'} under {path.parent})")


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    embedding_optimizer=None, global_batch_size: int | None = None,
                    lr_decay_over_max_steps: int | None = None) -> int:
    """Load a step_<N> folder, or the latest one under a checkpoint root; returns the step it was taken at.
    global_batch_size: where the data resumes by step count over files, this run's: a checkpoint recording another
    is refused. lr_decay_over_max_steps: this run's trainer.max_steps where its lr decays over them (a decay_steps
    left null): a checkpoint whose run decayed over other steps is refused (its lr would jump)."""
    state = _state(model, optimizer, embedding_optimizer)
    # each rank loads its own tables (and experts) and their optimizer state: the checkpoint holds every rank's
    every = of_every_rank(_entries(state))
    given = path = Path(path)
    try:  # any failure, on any rank (a path one node lacks, unreadable metadata): the others would wait in DCP's
        path = _step_folder(path)  # collectives for it
        try:
            saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        except FileNotFoundError:  # names the file: no checkpoint there
            raise
        except Exception as error:  # noqa: BLE001: pickle's error names no file
            raise _unreadable(path, problem_text(error)) from error
        _check_entries(path, saved, every)
        _check_run(path, saved, optimizer, global_batch_size, lr_decay_over_max_steps)
        problem = None
    except Exception as error:  # noqa: BLE001: raised here, and named on every other rank
        problem = error
    every = of_every_rank((problem_text(problem), path.name))
    raise_on_every_rank(problem, f"cannot resume from {path}", [text for text, _ in every])
    folders: dict[str, list[int]] = {}
    for rank, (_, name) in enumerate(every):
        folders.setdefault(name, []).append(rank)
    if len(folders) > 1:  # a root whose copies differ between nodes: each would resume its own latest step
        raise ValueError(f"the ranks would resume from different checkpoints under {given}: "
                         f"{'; '.join(f'{name} on rank(s) {ranks}' for name, ranks in folders.items())}: give every "
                         "rank the same checkpoints, or resume from one step_<N> folder that all of them hold")
    for i, group in enumerate(state["dense_optimizer"].get("param_groups", [])):
        if f"dense_optimizer.param_groups.{i}.initial_lr" in saved:  # an lr scheduler's base: read to compare
            group["initial_lr"] = None  # (DCP reads the keys the state holds)
    try:
        # Tables sharded as torchrec's have an entry on every rank, a ShardedTensor without local shards where the
        # rank holds none of the table; torch's default flattening of sharded tensors drops such an entry, and its
        # load planner then takes the checkpoint for one older than torch 2.4 and misreads the dense optimizer's
        # param_groups ("Missing key ... dense_optimizer.param_groups"). Ours hold no nested ShardedTensor to flatten.
        with _without_process_group_warning():
            dcp.load(state, checkpoint_id=path, planner=DefaultLoadPlanner(flatten_sharded_tensors=False))
    except CheckpointException as error:  # raised on every rank: DCP gathers each rank's read failures
        raise _unreadable(path, "; ".join(f"rank {rank}: {problem_text(exc)}"
                                          for rank, (exc, _) in error.failures.items())) from error
    configured = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["dense_optimizer"])
    _keep_configured_options(optimizer, configured)
    if embedding_optimizer is not None:
        embedding_optimizer.load_state_dict(state["embedding_optimizer"])
    log.info("resumed from %s (step %d)", path, int(state["step"]))
    return int(state["step"])
