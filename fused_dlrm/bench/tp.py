"""Benchmark of the tensor-parallel operators: each fused op against its bulk twin, measured in one run.

`torchrun --nproc_per_node=2 --standalone -m fused_dlrm.bench tp [--quick] [--out FILE]`. Sections, each a module
of fused_dlrm.bench with `run(quick) -> list[dict]` (rows: op, shape, dtype, bulk_us, fused_us, baseline_name,
baseline_us, speedup, sol_pct): gemm_allreduce (GEMV/GEMM + AllReduce), allgather_gemm (AllGather + GEMM),
allreduce (quantized AllReduce); an unknown section name is refused before anything runs. Rank 0 prints one
table and writes the rows (with the machine, commit and versions) as JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from fused_dlrm.bench import allgather_gemm, allreduce, gemm_allreduce, init_gpu_world, named_twice
from fused_dlrm.dist.env import check_rank_0_can_write
from fused_dlrm.report.render import environment

SECTIONS = {"gemm_allreduce": gemm_allreduce, "allgather_gemm": allgather_gemm, "allreduce": allreduce}


def _us(value: float | None) -> str:
    return f"{value:9.1f}" if value is not None else f"{'-':>9}"


def print_table(rows: list[dict]) -> None:
    print(f"{'op':26} {'shape':32} {'dtype':5} {'bulk us':>9} {'fused us':>9} {'speedup':>7} {'%SOL':>5}  "
          f"baseline")
    for r in rows:
        baseline = f"{r['baseline_name']} {r['baseline_us']:.1f} us" if r["baseline_us"] is not None else "-"
        print(f"{r['op']:26} {r['shape']:32} {r['dtype']:5} {_us(r['bulk_us'])} {_us(r['fused_us'])} "
              f"{r['speedup']:6.2f}x {r['sol_pct']:4.0f}%  {baseline}")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m fused_dlrm.bench tp")
    parser.add_argument("--quick", action="store_true", help="fewer shapes per section")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {list(SECTIONS)}")
    args = parser.parse_args(argv)
    sections = args.sections.split(",")
    unknown = [name for name in sections if name not in SECTIONS]
    if unknown:
        parser.error(f"--sections: unknown {unknown}; the sections: {list(SECTIONS)}")
    if (twice := named_twice(sections)) is not None:
        parser.error(f"--sections: {twice} named twice")
    env = init_gpu_world("python -m fused_dlrm.bench tp")
    if args.out:  # now, not after the timings
        check_rank_0_can_write(Path(args.out), f"--out {args.out}")
    rows = [row for name in sections for row in SECTIONS[name].run(args.quick)]
    if dist.get_rank() == 0:
        print(f"{torch.cuda.get_device_name()} x{dist.get_world_size()}, torch {torch.__version__}")
        print_table(rows)
        if args.out:
            meta = {"device": torch.cuda.get_device_name(), "world_size": dist.get_world_size(),
                    "torch": torch.__version__}
            with open(args.out, "w") as f:
                json.dump({"environment": environment(env), "meta": meta, "rows": rows}, f, indent=1)
    dist.destroy_process_group()
