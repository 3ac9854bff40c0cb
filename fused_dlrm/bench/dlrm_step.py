"""The DLRM training step through torchrec's own stack: torchrec's sharder (the baseline) against the project's.

    torchrun --nproc_per_node=2 -m fused_dlrm.bench dlrm_step [--variants torchrec,bulk,fused] [--warmup N]
        [--steps N] [--batches N] [--arches torchrec|lean] [--out FILE] [train.py overrides ...]

One model for every variant: torchrec's DLRM in its DLRMTrain wrapper (BCE loss) around an EmbeddingBagCollection,
with torchrec's arches or (--arches lean) the same model with train.py's ViewSparseArch and PairwiseInteractionArch
(models/dlrm.py), shaped by the config train.py would compose from the same overrides (model=dlrm_paper,
and so its data group synthetic_paper, unless a model= override is given; shrink it with train.py's overrides,
e.g. model.num_rows=1000 data.num_sparse=8 data.global_batch_size=64).
Every variant is DistributedModelParallel over that model, stepped by torchrec's TrainPipelineSparseDist, with the
same table-wise placement (the project's plan, given to DMP), the same initial tables and dense weights, the same
embedding optimizer (model.embedding_optimizer, fused into backward), the same dense optimizer
(trainer.dense_optimizer, over DMP's data-parallel parameters) and the same batches (made once up front, by default
on the model's device (data.train.device=auto), then cycled):
  torchrec: torchrec's EmbeddingBagCollectionSharder, table-wise, FUSED kernel (fbgemm's TBE), the optimizer given
            by apply_optimizer_in_backward: the baseline. On GPUs it needs fbgemm-gpu's CUDA build.
  bulk:     the project's FusedEmbeddingBagCollectionSharder, comm="bulk".
  fused:    the same with comm="fused" (CUDA GPUs): the configured fused settings (comm=fused comm.num_programs=...),
            or FusedCommConfig's defaults when the config is comm=bulk.
A config train.py's training refuses is refused by the same checks (train/loop.py's check_config, build_train_data)
before any variant is built: the settings read here (data.steps_per_epoch, the fused settings) and, as the report
does, those only training reads (run length, cadence, batches ahead, comm.mode); not the eval data's (unread here).
A variant that cannot run here is named with the reason, in one line, and left out; nothing is estimated.
Per variant: warm-up steps, then timed steps (time_ms: ranks lined up before each step, CUDA events or the host
timer, the slowest rank's median), samples/s of the global batch, and the loss of every step over the global
batch (a non-finite loss is an error). Then a table with each variant's speedup over torchrec (torchrec's step
time / the variant's); --out also writes every number as JSON.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
from itertools import cycle, islice
from pathlib import Path
from typing import Callable

import fbgemm_gpu
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec import EmbeddingBagCollection
from torchrec.datasets.utils import Batch
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingPlan
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from fused_dlrm.bench import named_twice
from fused_dlrm.bench.timing import time_ms
from fused_dlrm.dist import DistEnv, all_reduce_sum, destroy_distributed, init_distributed
from fused_dlrm.dist.env import check_rank_0_can_write, raise_on_every_rank
from fused_dlrm.models.dlrm import with_lean_arches
from fused_dlrm.report.layers import no_fused_path
from fused_dlrm.report.measure import repeats, timing_method
from fused_dlrm.report.render import environment, write_json
from fused_dlrm.sparse import plan_sharding
from fused_dlrm.sparse.lookup import init_table
from fused_dlrm.sparse.sharded_ebc import table_seeds
from fused_dlrm.sparse.torchrec_sharder import FusedEmbeddingBagCollectionSharder, torchrec_in_backward_optimizer
from fused_dlrm.train.build import (batch_stream, compose_config, config_tables, embedding_optimizers, fused_comm,
                                   to_device)
from fused_dlrm.train.loop import build_train_data, check_config

VARIANTS = ("torchrec", "bulk", "fused")
BASELINE = "torchrec"
EBC_PATH = "model.sparse_arch.embedding_bag_collection"  # the collection's path in DLRMTrain: the plan's key


# ----------------------------------------------------------------------------------------------------------------
# Which variants can run here.


def fbgemm_cuda_kernels() -> bool:
    """Whether the installed fbgemm_gpu carries CUDA kernels: its CPU build (fbgemm-gpu-cpu) registers its
    operators for the CPU only, and torchrec's TBE fails on CUDA tensors only once a step runs."""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("fbgemm::bounds_check_indices", "CUDA")
    except RuntimeError:  # the operator is not registered at all
        return False


def torchrec_unavailable(device: torch.device, cuda_kernels: Callable[[], bool] | None = None) -> str | None:
    """Why torchrec's baseline cannot run on `device`, or None. cuda_kernels: the probe (fbgemm_cuda_kernels)."""
    if device.type != "cuda" or (cuda_kernels or fbgemm_cuda_kernels)():
        return None
    return (f"the torchrec baseline needs fbgemm-gpu (CUDA) and was not run: the installed fbgemm_gpu "
            f"{fbgemm_gpu.__version__} is its {getattr(fbgemm_gpu, '__variant__', 'unknown')} build, "
            "without CUDA kernels")


def unavailable(variant: str, env: DistEnv) -> str | None:
    """Why `variant` cannot run here, or None."""
    if variant == "torchrec":
        return torchrec_unavailable(env.device)
    if variant == "fused":
        return no_fused_path(env)
    return None


# ----------------------------------------------------------------------------------------------------------------
# The model, sharded by one variant, and its optimizers.


def build_model(cfg: DictConfig, device: torch.device, arches: str = "torchrec") -> DLRMTrain:
    """The unsharded model: every variant builds it alike (seeded dense arches); arches "lean": train.py's."""
    m = cfg.model
    torch.manual_seed(cfg.seed)
    # Tables on the meta device: DMP materialises only this rank's shards (all 128 paper tables are 13 GB).
    ebc = EmbeddingBagCollection(config_tables(cfg), device=torch.device("meta"))
    dlrm = DLRM(embedding_bag_collection=ebc, dense_in_features=cfg.data.num_dense,
                dense_arch_layer_sizes=list(m.dense_arch), over_arch_layer_sizes=list(m.over_arch),
                dense_device=device)
    return DLRMTrain(with_lean_arches(dlrm) if arches == "lean" else dlrm)


def shard(model: DLRMTrain, variant: str, cfg: DictConfig, env: DistEnv) -> DistributedModelParallel:
    """DMP over `model` with the variant's sharder; every variant gets the same table-wise placement."""
    if cfg.model.column_shards != 1 or cfg.model.row_shards != 1:  # init_tables copies whole tables
        raise ValueError(f"dlrm_step compares table-wise placements only, got model.column_shards="
                         f"{cfg.model.column_shards}, model.row_shards={cfg.model.row_shards}")
    ebc = model.model.sparse_arch.embedding_bag_collection
    optimizers = embedding_optimizers(cfg, ebc.embedding_bag_configs())
    if variant == "torchrec":
        for table, optimizer in optimizers.items():
            optimizer_class, kwargs = torchrec_in_backward_optimizer(optimizer)
            apply_optimizer_in_backward(optimizer_class, [ebc.embedding_bags[table].weight], kwargs)
        sharder = EmbeddingBagCollectionSharder()
    else:  # comm=fused: the configured fused settings (comm=fused ...), or their defaults
        comm = (fused_comm(cfg.comm) or "fused") if variant == "fused" else "bulk"
        sharder = FusedEmbeddingBagCollectionSharder(optimizers, comm=comm)
    shards = plan_sharding(ebc.embedding_bag_configs(), env.world_size).shards  # table-wise: one per table
    module_plan = construct_module_sharding_plan(
        ebc, {s.table: table_wise(rank=s.rank, compute_kernel="fused") for s in shards}, sharder=sharder,
        local_size=int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size)), world_size=env.world_size,
        device_type=env.device.type)
    return DistributedModelParallel(model, device=env.device, sharders=[sharder],
                                    plan=ShardingPlan({EBC_PATH: module_plan}))


def local_tables(dmp: DistributedModelParallel) -> dict[str, torch.Tensor]:
    """The tables this rank holds, whole (table-wise), by name; the tensors are the tables' storage."""
    prefix = f"{EBC_PATH}.embedding_bags."
    tables = {}
    for key, value in dmp.state_dict().items():
        if not key.startswith(prefix):
            continue
        if isinstance(value, ShardedTensor):  # torchrec's: every table, with no local shard where not owned
            shards = value.local_shards()
            if not shards:
                continue
            value = shards[0].tensor
        tables[key[len(prefix):].removesuffix(".weight")] = value
    return tables


def init_tables(dmp: DistributedModelParallel, cfg: DictConfig) -> None:
    """The same initial tables in every variant: the project's per-table initialisation (torchrec's sharded tables
    start from an init of their own)."""
    configs = {t.name: t for t in config_tables(cfg)}
    seeds = table_seeds(list(configs.values()), cfg.seed)
    with torch.no_grad():
        for name, weight in local_tables(dmp).items():
            weight.copy_(init_table(configs[name], seeds[name], weight.device))


def model_shapes(dmp: DistributedModelParallel, env: DistEnv) -> dict:
    """What the variant trains, counted on the sharded model over all ranks."""
    tables = local_tables(dmp)
    counts = torch.tensor([len(tables), sum(w.numel() for w in tables.values())], device=env.device)
    all_reduce_sum(counts)
    dense = sum(p.numel() for _, p in in_backward_optimizer_filter(dmp.named_parameters()))
    return {"tables": int(counts[0]), "embedding_parameters": int(counts[1]), "dense_parameters": dense}


def step_optimizer(dmp: DistributedModelParallel, cfg: DictConfig) -> CombinedOptimizer:
    """torchrec's pattern: the tables' fused optimizer (its update already ran in backward) and the configured
    dense optimizer over the parameters without an in-backward optimizer."""
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    dense_optimizer = KeyedOptimizerWrapper(dense, lambda params: instantiate(cfg.trainer.dense_optimizer,
                                                                              params=params))
    return CombinedOptimizer([dmp.fused_optimizer, dense_optimizer])


# ----------------------------------------------------------------------------------------------------------------
# Timing one variant.


def make_batches(cfg: DictConfig, env: DistEnv, count: int) -> list[Batch]:
    """This rank's slices of the first `count` global batches, on the device (made outside the timed steps)."""
    stream = batch_stream(build_train_data(cfg, env), 0, cfg.data.get("steps_per_epoch"))
    # raised on every rank: one rank's failure (a malformed line in its slice) would leave the others in DMP's
    # collectives
    try:
        batches, problem = [to_device(batch, env.device) for _, batch in islice(stream, count)], None
    except Exception as error:  # noqa: BLE001: raised here, and named on every other rank
        batches, problem = None, error
    raise_on_every_rank(problem, "could not make their batches")
    return batches


def global_losses(losses: list[torch.Tensor], local_batch: int, env: DistEnv) -> tuple[list[float], int]:
    """(each step's loss over the global batch, the global batch): DLRMTrain's local means, weighted by the ranks'
    batch sizes (uneven when the global batch does not divide)."""
    sums = torch.stack(losses).double().flatten() * local_batch
    totals = all_reduce_sum(torch.cat([sums, sums.new_tensor([local_batch])]).to(env.device))
    global_batch = int(totals[-1])
    return (totals[:-1] / global_batch).tolist(), global_batch


def run_variant(variant: str, cfg: DictConfig, env: DistEnv, batches: list[Batch], warmup: int, steps: int,
                arches: str) -> dict:
    dmp = shard(build_model(cfg, env.device, arches), variant, cfg, env)
    init_tables(dmp, cfg)
    pipeline = TrainPipelineSparseDist(dmp, step_optimizer(dmp, cfg), env.device)
    stream = cycle(batches)  # every variant starts from the first batch
    losses: list[torch.Tensor] = []

    def step() -> None:
        losses.append(pipeline.progress(stream)[0])  # DLRMTrain's (loss, logits, labels), detached

    step_ms = time_ms(step, warmup, steps, env.device)
    values, global_batch = global_losses(losses, batches[0].labels.numel(), env)
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    if bad:
        raise FloatingPointError(f"dlrm_step {variant}: the loss is {values[bad[0]]} at step {bad[0]}")
    return {"step_ms": step_ms, "samples_per_s": global_batch / step_ms * 1e3, "global_batch": global_batch,
            "warmup_steps": warmup, "timed_steps": steps, "steps_run": len(losses),
            "loss_first": values[0], "loss_last": values[-1], "losses": values, "model": model_shapes(dmp, env),
            "sharding": sharding(dmp, pipeline)}


def sharding(dmp: DistributedModelParallel, pipeline: TrainPipelineSparseDist) -> dict:
    """How the variant ran: DMP's plan for the collection, the sharded module, and what the pipeline pipelined
    (a module it cannot pipeline would run its input dist inside the forward instead, silently)."""
    plan = dmp.plan.get_plan_for_module(EBC_PATH)
    module = dmp.module.model.sparse_arch.embedding_bag_collection
    return {"module": type(module).__name__,
            "sharding_types": sorted({p.sharding_type for p in plan.values()}),
            "compute_kernels": sorted({p.compute_kernel for p in plan.values()}),
            "pipelined_modules": [type(m).__name__ for m in pipeline._pipelined_modules],
            # comm=fused: whose kernel pushed the tables' gradient back (the interaction's, or the exchange's)
            "backward_pushes": getattr(module, "backward_pushes", None)}


# ----------------------------------------------------------------------------------------------------------------
# The suite.


def describe(cfg: DictConfig) -> dict:
    m = cfg.model
    rows = m.num_rows if isinstance(m.num_rows, int) else list(m.num_rows)
    return {"model": m.name, "tables": cfg.data.num_sparse, "num_rows": rows, "embedding_dim": m.embedding_dim,
            "data_type": m.data_type, "pooling": m.pooling, "dense_arch": list(m.dense_arch),
            "over_arch": list(m.over_arch), "global_batch_size": cfg.data.global_batch_size,
            "num_dense": cfg.data.num_dense,
            "embedding_optimizer": OmegaConf.to_container(m.embedding_optimizer, resolve=True),
            "dense_optimizer": OmegaConf.to_container(cfg.trainer.dense_optimizer, resolve=True)}


def run_suite(cfg: DictConfig, env: DistEnv, variants: list[str], warmup: int, steps: int, num_batches: int,
              arches: str = "torchrec") -> dict:
    """Every rank runs every variant (they are collectives); the report is the same on all ranks."""
    reasons = {v: unavailable(v, env) for v in variants}
    for v, reason in reasons.items():
        if reason and env.is_main:
            print(f"dlrm_step: {v}: {reason}", flush=True)
    batches = make_batches(cfg, env, num_batches)
    results: dict[str, dict] = {}
    for v in variants:
        if reasons[v]:
            results[v] = {"unavailable": reasons[v]}
            continue
        if env.is_main:
            print(f"dlrm_step: {v}: {warmup} warm-up + {steps} timed steps", flush=True)
        results[v] = run_variant(v, cfg, env, batches, warmup, steps, arches)
        gc.collect()  # the variant's model (DDP holds reference cycles) goes before the next one is built
        if env.device.type == "cuda":
            torch.cuda.empty_cache()
    return suite_report(cfg, env, warmup, steps, arches, results)


def suite_report(cfg: DictConfig, env: DistEnv, warmup: int, steps: int, arches: str, results: dict) -> dict:
    """The variants' results (speedups over torchrec added) with what they ran on and how they were timed."""
    baseline = results.get(BASELINE, {}).get("step_ms")
    for r in results.values():
        if "step_ms" in r:
            r["speedup_vs_torchrec"] = baseline / r["step_ms"] if baseline else None
    return {"environment": environment(env),
            "fbgemm_gpu": {"version": fbgemm_gpu.__version__, "variant": getattr(fbgemm_gpu, "__variant__", None)},
            "config": {**describe(cfg), "arches": arches}, "timing": timing_method(env, warmup, steps),
            "variants": results}


def render_table(report: dict) -> str:
    c, t, machine = report["config"], report["timing"], report["environment"]["machine"]
    rows = c["num_rows"]
    rows = f"{rows:,}" if isinstance(rows, int) else f"{min(rows):,}..{max(rows):,}"
    lines = [f"DLRM training step, DistributedModelParallel + TrainPipelineSparseDist, {machine['world_size']} x "
             f"{machine['device']} ({machine['backend']}): {c['tables']} tables x {rows} rows x "
             f"D={c['embedding_dim']} {c['data_type']}, global batch {c['global_batch_size']}, {c['arches']} arches; "
             f"median of {t['iters']} steps after {t['warmup']} warm-up, slowest rank ({t['method']})",
             f"{'variant':10} {'step ms':>10} {'samples/s':>11} {'loss first':>11} {'loss last':>10} "
             f"{'vs torchrec':>12}"]
    for name, r in report["variants"].items():
        if "unavailable" in r:
            lines.append(f"{name:10} not run: {r['unavailable']}")
            continue
        ratio = r["speedup_vs_torchrec"]
        lines.append(f"{name:10} {r['step_ms']:10.3f} {r['samples_per_s']:11.0f} {r['loss_first']:11.5f} "
                     f"{r['loss_last']:10.5f} {f'{ratio:.2f}x' if ratio else 'n/a':>12}")
    for name, r in report["variants"].items():
        pushes = r.get("sharding", {}).get("backward_pushes")
        if pushes:
            lines.append(f"{name}: the tables' gradient pushed by the interaction's kernel in {pushes['consumer']} "
                         f"backwards, by the exchange's push kernel in {pushes['exchange']}")
    lines.append("vs torchrec: torchrec's step time / the variant's (above 1: faster than torchrec)")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="torchrun --nproc_per_node=N -m fused_dlrm.bench dlrm_step",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS))
    parser.add_argument("--warmup", type=int, help="untimed steps first (default: 10 on GPUs, 1 on the CPU)")
    parser.add_argument("--steps", type=int, help="timed steps (default: 50 on GPUs, 5 on the CPU)")
    parser.add_argument("--batches", type=int, default=8, help="distinct batches, made up front and cycled")
    parser.add_argument("--arches", choices=("torchrec", "lean"), default="torchrec",
                        help="torchrec's DLRM arches, or train.py's ViewSparseArch + PairwiseInteractionArch (same "
                             "model, less copying)")
    parser.add_argument("--out", help="write the report as JSON here (rank 0)")
    parser.add_argument("overrides", nargs="*", help="train.py's Hydra overrides, e.g. model.num_rows=1000")
    args = parser.parse_args(argv)
    args.variants = args.variants.split(",")
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or not args.variants:
        parser.error(f"unknown variants {unknown}; expected some of {list(VARIANTS)}")
    if (twice := named_twice(args.variants)) is not None:
        parser.error(f"--variants: {twice} named twice")
    if args.steps is not None and args.steps < 1 or args.warmup is not None and args.warmup < 0 or args.batches < 1:
        parser.error("--steps and --batches must be >= 1, --warmup >= 0")
    return args


def config(args: argparse.Namespace) -> DictConfig:
    """The config train.py would compose from the overrides; the paper model unless a model= override is given.
    Refused as training refuses it (check_config; the same on every rank, as the config is)."""
    overrides = list(args.overrides)
    if not any(o.startswith("model=") for o in overrides):
        overrides.insert(0, "model=dlrm_paper")
    cfg = compose_config(overrides)
    if cfg.model.name != "dlrm":
        raise SystemExit(f"dlrm_step times a DLRM; model {cfg.model.name!r} is not one")
    check_config(cfg)
    return cfg


def run(args: argparse.Namespace, cfg: DictConfig, env: DistEnv) -> dict:
    """The suite on an initialised world; rank 0 prints the table and writes --out. Returns the report."""
    if args.out:  # now, not after the timings
        check_rank_0_can_write(Path(args.out), f"--out {args.out}")
    default_warmup, default_steps = repeats(env)
    report = run_suite(cfg, env, args.variants, default_warmup if args.warmup is None else args.warmup,
                       default_steps if args.steps is None else args.steps, args.batches, args.arches)
    if env.is_main:
        print(render_table(report), flush=True)
        if args.out:
            write_json(report, Path(args.out))
    return report


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    cfg = config(args)
    env = init_distributed(cfg.trainer.device, cfg.comm.backend, tf32=cfg.trainer.tf32)
    try:
        if env.backend is None:
            raise SystemExit("dlrm_step needs a process group (DistributedModelParallel): run it under torchrun, "
                             "e.g. torchrun --nproc_per_node=2 -m fused_dlrm.bench dlrm_step")
        run(args, cfg, env)
    finally:
        destroy_distributed()
