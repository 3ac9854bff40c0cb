"""Benchmark of the tensor-parallel operators: each fused op against its bulk twin, measured in one run.

`torchrun --nproc_per_node=2 --standalone -m fused_dlrm.bench tp [--quick] [--out FILE]`. Sections, each a module
of fused_dlrm.bench with `run(quick) -> list[dict]` (rows: op, shape, dtype, bulk_us, fused_us, baseline_name,
baseline_us, speedup, sol_pct): gemm_allreduce (GEMV/GEMM + AllReduce), allgather_gemm (AllGather + GEMM),
allreduce (quantized AllReduce). A section whose module is not there yet is reported as missing, not skipped
silently. Rank 0 prints one table and writes the rows (with the device and bandwidth notes) as JSON.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os

import torch
import torch.distributed as dist

SECTIONS = ("gemm_allreduce", "allgather_gemm", "allreduce")


def _section_rows(name: str, quick: bool) -> tuple[list[dict], str | None]:
    try:
        module = importlib.import_module(f"fused_dlrm.bench.{name}")
    except ModuleNotFoundError as error:
        if error.name != f"fused_dlrm.bench.{name}":
            raise
        return [], f"section {name}: no module fused_dlrm.bench.{name} yet"
    return module.run(quick), None


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
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    args = parser.parse_args(argv)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rows, missing = [], []
    for name in args.sections.split(","):
        section, note = _section_rows(name, args.quick)
        rows += section
        missing += [note] if note else []
    if dist.get_rank() == 0:
        print(f"{torch.cuda.get_device_name()} x{dist.get_world_size()}, torch {torch.__version__}")
        print_table(rows)
        for note in missing:
            print(note)
        if args.out:
            meta = {"device": torch.cuda.get_device_name(), "world_size": dist.get_world_size(),
                    "torch": torch.__version__, "missing": missing}
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
    dist.destroy_process_group()
