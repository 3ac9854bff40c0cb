"""Benchmark of the sharded embedding forward (and forward+backward), after input distribution.

Under torchrun on GPUs:
`torchrun --nproc_per_node=2 -m fused_dlrm.bench embedding [--quick] [--num-programs N] [--out FILE]`.
Each rank owns `tables_per_gpu` fp32 tables of 100k rows; bags of every feature for the whole global batch are
already on their owner (the input all-to-all is outside the timed region). Variants, timed in the same run:
  torch: F.embedding_bag per table + NCCL all_to_all_single + permute (forward only: torch's backward would
         build dense [rows, dim] gradients)
  bulk:  the project's lookup kernel + NCCL all-to-all (backward: NCCL + row gradients + exact SGD)
  fused: the lookup kernel storing into peers' symmetric memory with ready flags (backward: gradient push);
         --transport p2p (stores through peer pointers) or nvshmem (NVSHMEM puts)
  lookup: the lookup kernel alone, the bulk path's compute (its gathered-row rate against fbgemm's TBE)
Times are medians of single calls, the ranks' GPUs lined up before each with the call already enqueued
(bench/timing.py, start="device": the call's device time); the forward also lined up by a host barrier only
(as before 11-26: a rank whose host leaves the barrier later delays the other's collective) and (b2b) per call
over 20 calls back to back (host launch time included).
Before anything is timed, the bulk and fused forwards are checked against the torch reference (on a poisoned
output); before the forward+backward is timed, one forward+backward of fused against one of bulk (each table's
update, table by table: bench/checks.py, check_table_updates).
Speed of light = max(gathered row bytes / device copy bandwidth, bytes sent to peers / peer write bandwidth),
both bandwidths measured in this run.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchrec import EmbeddingBagConfig

from fused_dlrm.bench import init_gpu_world
from fused_dlrm.bench.checks import check_against_bulk, check_table_updates
from fused_dlrm.bench.timing import hbm_bandwidth, peer_bandwidth, per_call_us, time_ms
from fused_dlrm.dist.alltoall import all_to_all_v
from fused_dlrm.dist.env import check_rank_0_can_write
from fused_dlrm.dist.symmetric import use_nvshmem_backend
from fused_dlrm.report.render import environment
from fused_dlrm.sparse.fused_all_to_all import FusedCommConfig, build_fused_exchange
from fused_dlrm.sparse.input_dist import OwnedBags
from fused_dlrm.kernels.pooled_embedding import FeatureTable
from fused_dlrm.sparse.lookup import PooledEmbeddingLookup, init_table
from fused_dlrm.sparse.optimizer import EmbeddingOptimizerConfig
from fused_dlrm.sparse.output_dist import BulkOutputDist
from fused_dlrm.sparse.plan import FeatureSlice


@dataclass(frozen=True)
class Config:
    global_batch: int
    tables_per_gpu: int
    dim: int
    pooling: int
    rows: int = 100_000

    @property
    def name(self) -> str:
        return f"B={self.global_batch} T/GPU={self.tables_per_gpu} D={self.dim} L={self.pooling}"


CONFIGS = [Config(2048, 64, 256, 10), Config(4096, 64, 256, 10), Config(2048, 64, 256, 70), Config(8192, 32, 128, 20)]


def make_bags(cfg: Config, rank: int, world: int, device: torch.device) -> OwnedBags:
    """Bags of this rank's tables for the whole global batch: lengths ~ U[1, 2L), uniform rows."""
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    lengths = torch.randint(1, 2 * cfg.pooling, (cfg.tables_per_gpu, cfg.global_batch), device=device,
                            generator=gen)
    counts = lengths.sum(dim=1).tolist()
    values = torch.randint(0, cfg.rows, (sum(counts),), device=device, generator=gen)
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    base, extra = divmod(cfg.global_batch, world)
    sizes = [base + (r < extra) for r in range(world)]
    return OwnedBags(features=[f"r{rank}_f{i}" for i in range(cfg.tables_per_gpu)], values=values, lengths=lengths,
                     weights=None, feature_value_offsets=offsets, batch_sizes=sizes)


def run_config(cfg: Config, rank: int, world: int, hbm: float, peer: float, iters: int,
               comm: FusedCommConfig) -> dict:
    device = torch.device("cuda", torch.cuda.current_device())
    features_of_rank = [[f"r{r}_f{i}" for i in range(cfg.tables_per_gpu)] for r in range(world)]
    tables = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=cfg.dim, num_embeddings=cfg.rows, feature_names=[f])
              for feats in features_of_rank for f in feats]
    mine = [t for t in tables if t.feature_names[0] in features_of_rank[rank]]
    weights = {t.name: init_table(t, i, device) for i, t in enumerate(mine)}
    sgd = EmbeddingOptimizerConfig("sgd", lr=1e-3)
    lookup = PooledEmbeddingLookup(mine, weights, sgd, device)
    bags = make_bags(cfg, rank, world, device)
    dims_of_rank = [[cfg.dim] * cfg.tables_per_gpu for _ in range(world)]
    bulk_dist = BulkOutputDist(dims_of_rank, list(range(world * cfg.tables_per_gpu * cfg.dim)))
    slices = [[FeatureSlice(f, f"t_{f}", (r * cfg.tables_per_gpu + i) * cfg.dim, cfg.dim) for i, f in enumerate(feats)]
              for r, feats in enumerate(features_of_rank)]  # the output row: rank 0's tables, then rank 1's, ...
    fused = build_fused_exchange(lookup, slices, comm, None, device)
    local_batch = bags.batch_sizes[rank]
    grad = torch.randn(local_batch, world * cfg.tables_per_gpu * cfg.dim, device=device)

    def torch_reference():
        pooled = torch.cat([_embedding_bag(bags, i, weights[t.name]) for i, t in enumerate(mine)], dim=1)
        received = all_to_all_v(pooled, bags.batch_sizes, [local_batch] * world)
        return received.view(world, local_batch, -1).permute(1, 0, 2).reshape(local_batch, -1)

    def bulk():
        return bulk_dist(lookup(bags), bags.batch_sizes)

    def fused_forward():
        return fused(bags)

    # Correctness first, on a poisoned output: all three agree (fp32, summation order aside).
    expected = torch_reference()
    fused.ws.buffer("pooled", 2 * max(bags.batch_sizes) * fused.row_len, torch.float32).local.fill_(float("nan"))
    dist.barrier()
    with torch.no_grad():
        for name, fn in (("bulk", bulk), ("fused", fused_forward)):
            check_against_bulk(f"{cfg.name}: {name}", fn(), expected, 1e-5, "the torch reference")
    fused.errors.check(block=True)

    result = {"config": cfg.name, **cfg.__dict__, "world_size": world, "num_programs": fused.num_programs}
    with torch.no_grad():
        result["fwd_ms"] = {name: time_ms(fn, iters=iters, start="device") for name, fn in
                            (("torch", torch_reference), ("bulk", bulk), ("fused", fused_forward),
                             ("lookup", lambda: lookup.pool(bags)))}
        result["fwd_host_start_ms"] = {name: time_ms(fn, iters=iters) for name, fn in
                                       (("bulk", bulk), ("fused", fused_forward))}
        # Back to back: what a run of calls costs per call, host launches included, without a start per call.
        result["fwd_b2b_ms"] = {name: per_call_us(fn, warmup=2, iters=10) / 1e3 for name, fn in
                                (("bulk", bulk), ("fused", fused_forward), ("lookup", lambda: lookup.pool(bags)))}

    def train_step(fn):
        return lambda: fn().backward(grad)

    # The backward checked before it is timed as well: one step of each updates every table alike (fp32,
    # summation order aside), checked table by table (all tables' copies were ~26 GB at the first config).
    check_table_updates(f"{cfg.name}: fused forward+backward's update", weights, train_step(fused_forward),
                        train_step(bulk), 1e-5)

    result["fwd_bwd_ms"] = {name: time_ms(train_step(fn), iters=iters, start="device") for name, fn in
                            (("bulk", bulk), ("fused", fused_forward))}
    fused.errors.check(block=True)

    gathered = bags.values.numel() * cfg.dim * 4
    sent = (cfg.global_batch - local_batch) * cfg.tables_per_gpu * cfg.dim * 4
    sol_ms = max(gathered / hbm, sent / peer if peer else 0.0) * 1e3
    result["sol_ms"] = sol_ms
    result["gathered_GBps"] = {k: gathered / (v * 1e-3) / 1e9 for k, v in result["fwd_ms"].items()}
    result["pct_sol"] = {k: 100 * sol_ms / v for k, v in result["fwd_ms"].items()}
    return result


def sweep_lookup(cfg: Config, rank: int, world: int) -> list[dict]:
    """Time the lookup kernel alone over tile shapes and program counts (to pick FeatureTable's defaults)."""
    device = torch.device("cuda", torch.cuda.current_device())
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=cfg.dim, num_embeddings=cfg.rows, feature_names=[f"f{i}"])
              for i in range(cfg.tables_per_gpu)]
    weights = {t.name: init_table(t, i, device) for i, t in enumerate(tables)}
    lookup = PooledEmbeddingLookup(tables, weights, EmbeddingOptimizerConfig("sgd"), device)
    bags = make_bags(cfg, rank, world, device)
    bags.features = [f"f{i}" for i in range(cfg.tables_per_gpu)]
    gathered = bags.values.numel() * cfg.dim * 4
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows = []
    for block_len in (2, 4, 8):
        for budget in (512, 1024, 2048):
            for warps in (1, 2):
                for per_sm in (16, 32):
                    lookup._kernel_features = FeatureTable(
                        list(weights.values()), [i * cfg.dim for i in range(cfg.tables_per_gpu)],
                        [False] * cfg.tables_per_gpu, device, block_rows=max(1, budget // (block_len * cfg.dim)),
                        block_len=block_len, num_warps=warps)
                    lookup.kernel_programs = per_sm * sms
                    lookup._kernel_launches.clear()  # launches bind the features and program count
                    with torch.no_grad():
                        ms = time_ms(lambda: lookup.pool(bags), warmup=3, iters=10)
                    rows.append({"block_len": block_len, "budget": budget, "num_warps": warps, "per_sm": per_sm,
                                 "ms": ms, "GBps": gathered / (ms * 1e-3) / 1e9})
    return rows


def _embedding_bag(bags: OwnedBags, f: int, weight: torch.Tensor) -> torch.Tensor:
    values, lengths, _ = bags.feature_bags(f)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=values.device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return F.embedding_bag(values, weight, offsets, mode="sum", include_last_offset=True)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m fused_dlrm.bench embedding")
    parser.add_argument("--quick", action="store_true", help="first config only, fewer iterations")
    parser.add_argument("--sweep", action="store_true", help="time lookup tile shapes on the first config")
    parser.add_argument("--transport", default="p2p", choices=["p2p", "nvshmem"], help="of the fused variant")
    parser.add_argument("--num-programs", type=int, default=None,
                        help="the fused variant's persistent programs (comm.num_programs; default 32 per SM)")
    parser.add_argument("--out", default="bench_embedding.json")
    args = parser.parse_args(argv)
    comm = FusedCommConfig(transport=args.transport, num_programs=args.num_programs)  # refuses a bad count now
    env = init_gpu_world("python -m fused_dlrm.bench embedding")
    check_rank_0_can_write(Path(args.out), f"--out {args.out}")  # now, not after the timings
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.transport == "nvshmem":
        use_nvshmem_backend()  # before the peer-bandwidth probe allocates symmetric memory
    if args.sweep:
        rows = sweep_lookup(CONFIGS[0], rank, world)
        if rank == 0:
            for r in sorted(rows, key=lambda r: r["ms"])[:12]:
                print(r)
            with open(args.out, "w") as f:
                json.dump({"environment": environment(env), "rows": rows}, f, indent=1)
        dist.destroy_process_group()
        return
    # Under NVSHMEM, torch's peer views (get_buffer) cannot be copied into: no peer probe, SOL from HBM only.
    hbm, peer = hbm_bandwidth(), peer_bandwidth() if args.transport == "p2p" else None
    configs = CONFIGS[:1] if args.quick else CONFIGS
    results = [run_config(c, rank, world, hbm, peer, 20 if args.quick else 50, comm) for c in configs]
    if rank == 0:
        meta = {"device": torch.cuda.get_device_name(), "world_size": world, "torch": torch.__version__,
                "transport": args.transport, "num_programs": results[0]["num_programs"],
                "hbm_TBps": hbm / 1e12, "peer_GBps": peer / 1e9 if peer else None}
        with open(args.out, "w") as f:
            json.dump({"environment": environment(env), "meta": meta, "results": results}, f, indent=1)
        peer_text = f"{peer / 1e9:.0f} GB/s" if peer else "n/a (SOL from HBM only)"
        print(f"{meta['device']} x{world}  fused transport {args.transport}, {meta['num_programs']} programs  "
              f"copy {hbm / 1e12:.2f} TB/s  peer write {peer_text}")
        print(f"{'config':34} {'torch':>8} {'bulk':>8} {'fused':>8} {'SOL':>7} {'fused%SOL':>9} "
              f"{'fused GB/s':>10} {'lookup':>7} {'GB/s':>5} | {'fb bulk':>8} {'fb fused':>8} {'speedup':>7} | "
              f"host start: {'bulk':>6} {'fused':>6} | b2b: {'bulk':>6} {'fused':>6} {'lookup':>6}")
        for r in results:
            fw, fb, hs, b2b = r["fwd_ms"], r["fwd_bwd_ms"], r["fwd_host_start_ms"], r["fwd_b2b_ms"]
            print(f"{r['config']:34} {fw['torch']:8.3f} {fw['bulk']:8.3f} {fw['fused']:8.3f} {r['sol_ms']:7.3f} "
                  f"{r['pct_sol']['fused']:8.0f}% {r['gathered_GBps']['fused']:10.0f} {fw['lookup']:7.3f} "
                  f"{r['gathered_GBps']['lookup']:5.0f} | {fb['bulk']:8.3f} {fb['fused']:8.3f} "
                  f"{fb['bulk'] / fb['fused']:6.2f}x | "
                  f"            {hs['bulk']:6.3f} {hs['fused']:6.3f} |      {b2b['bulk']:6.3f} {b2b['fused']:6.3f} "
                  f"{b2b['lookup']:6.3f}")
    dist.destroy_process_group()
