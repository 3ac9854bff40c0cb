"""GPU check of the all-gather primitives and AllGather + GEMM against their bulk twins (2 GPUs, NCCL; skipped
without them). Each op runs 1,000 times on the same flags and buffers, with fresh data, checked along the way
(and an all-gather of empty shards a few times: calls that exchange flags alone).
The primitives' result is also snapshotted right after the wait (before any collective orders the peer's copies),
which is where a flag raised before its data shows. The GEMM check runs every producer, dtype and tile config to
the end and then reports every one that failed.

CI has no GPU: this runs on the device machine.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fused_dlrm.dist.symmetric import CudaSymmetricWorkspace
from fused_dlrm.kernels.allgather import PRODUCERS, SymmetricAllGather
from fused_dlrm.kernels.allgather_gemm import (GEMM_PRODUCERS, GemmConfig, all_gather_matmul, all_gather_matmul_bulk,
                                               op_for)
from fused_dlrm.kernels.peer_flags import PeerRefusedInput, PeerWaitTimeout
from world import TWO_GPUS, run_world

pytestmark = TWO_GPUS

CALLS = 1000
SPINS = 2_000_000  # a lost flag fails the test in seconds instead of hanging it


def checked(step: int) -> bool:
    return step < 3 or step % 97 == 0 or step == CALLS - 1


def fresh(rank: int, step: int, shape, dtype, device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(1000 * step + rank)
    return torch.randn(shape, generator=gen, device=device).to(dtype)


def _primitives(rank: int, world: int) -> None:
    device = torch.device("cuda", rank)
    ws = CudaSymmetricWorkspace()
    failures = {}  # (dtype, producer) -> the first failure; every combination runs to the end
    for dtype in (torch.float16, torch.bfloat16):
        op = SymmetricAllGather(ws, 300, 257, dtype, chunk_rows=64, spin_limit=SPINS)  # last chunk: 44 rows
        expected = torch.empty(world * 300, 257, dtype=dtype, device=device)
        for step in range(CALLS):
            producer = PRODUCERS[step % len(PRODUCERS)]
            shard = fresh(rank, step, (300, 257), dtype, device)
            got = op(shard, producer)
            if checked(step):
                snapshot = got.clone()  # ordered after this rank's wait for the flags only
                dist.all_gather_into_tensor(expected, shard)
                for what, tensor in (("data read right after its flags", snapshot), ("data", got)):
                    if not torch.equal(tensor, expected):
                        failures.setdefault((dtype, producer), f"step {step}: {what} differs from NCCL")
        try:
            op.errors.check(block=True)
        except PeerWaitTimeout as timeout:
            failures[dtype, "timeout"] = str(timeout)
    empty = SymmetricAllGather(ws, 0, 257, torch.bfloat16, spin_limit=SPINS)  # shards of 0 rows: calls all the same
    for step in range(3 * len(PRODUCERS)):
        producer = PRODUCERS[step % len(PRODUCERS)]
        if empty(torch.empty(0, 257, dtype=torch.bfloat16, device=device), producer).shape != (0, 257):
            failures.setdefault(("empty", producer), f"step {step}: not a [0, 257] result")
    try:
        empty.errors.check(block=True)
    except PeerWaitTimeout as timeout:
        failures["empty", "timeout"] = str(timeout)
    assert not failures, f"rank {rank}: " + "; ".join(f"{d} {p}: {w}" for (d, p), w in failures.items())


def _matmul(rank: int, world: int) -> None:
    device = torch.device("cuda", rank)
    ws = CudaSymmetricWorkspace()
    rows, k, n = 1000, 512, 320  # rows not a multiple of the 128-row tile; 4 chunks of 256 (the last 232)
    configs = {"chunks of 256": GemmConfig(), "chunks of 192 (tiles straddle)": GemmConfig(chunk_rows=192),
               "pushers skip a round (the 16 local tiles go to the others)": GemmConfig(push_rounds=1)}
    failures = {}  # (config, dtype, producer) -> the first failure; every combination runs to the end
    for name, config in configs.items():
        for dtype in (torch.float16, torch.bfloat16):
            weight = (fresh(0, -1, (n, k), dtype, device) / k ** 0.5).t()  # a Linear's weight.t()
            for step in range(CALLS):
                producer = GEMM_PRODUCERS[step % len(GEMM_PRODUCERS)]
                x = fresh(rank, step, (rows, k), dtype, device)
                check = checked(step)  # the same steps on every rank: the bulk twin is a collective
                out = torch.full((world * rows, n), float("nan"), dtype=dtype, device=device)
                result = all_gather_matmul(x, weight, ws, producer, return_gathered=check, out=out, config=config)
                if check:
                    got, gathered = result
                    bulk, bulk_gathered = all_gather_matmul_bulk(x, weight)
                    error = float((got.float() - bulk.float()).norm() / bulk.float().norm())
                    exact = torch.equal(gathered, bulk_gathered)
                    if (not exact or not error < (1e-2 if dtype == torch.bfloat16 else 2e-3)) and (
                            (name, dtype, producer) not in failures):
                        failures[name, dtype, producer] = (f"step {step}: relative error {error:.3g}, gathered input "
                                                           f"{'exact' if exact else 'differs'}")
            try:
                op_for(ws, x, config).errors.check(block=True)
            except PeerWaitTimeout as timeout:
                failures[name, dtype, "timeout"] = str(timeout)
    assert not failures, f"rank {rank}: " + "; ".join(
        f"{name} {dtype} {producer}: {what}" for (name, dtype, producer), what in failures.items())


def _timeout(rank: int, world: int) -> None:
    device = torch.device("cuda", rank)
    x = fresh(rank, 0, (256, 128), torch.float16, device)
    weight = fresh(0, 1, (128, 64), torch.float16, device)
    for producer in GEMM_PRODUCERS:
        op = op_for(CudaSymmetricWorkspace(), x, GemmConfig(spin_limit=100_000))  # allocation is collective
        op.gather_for(producer)  # so is the copy engines' exchange, made on first use: both ranks make it here
        if rank == 0:  # rank 1 never calls: rank 0's wait for its call's signature times out instead of hanging
            op.finish(op.start(x, producer), x, weight, producer)
            with pytest.raises(PeerWaitTimeout, match=r"rank 0 timed out at step \d waiting for rank 1 to start the "
                                                      r"call"):
                op.errors.check(block=True)
        torch.cuda.synchronize()
        dist.barrier()


def _refused(rank: int, world: int) -> None:
    """Rank 1 refuses every third call (an fp32 shard; an unknown producer): it raises its ValueError, rank 0
    PeerRefusedInput naming rank 1 (at `check(block=True)`); every other call, on the same flags, equals NCCL's."""
    device = torch.device("cuda", rank)
    op = SymmetricAllGather(CudaSymmetricWorkspace(), 300, 257, torch.float16, chunk_rows=64, spin_limit=SPINS)
    expected = torch.empty(world * 300, 257, dtype=torch.float16, device=device)
    for step in range(30):
        producer = PRODUCERS[step % len(PRODUCERS)]
        shard = fresh(rank, step, (300, 257), torch.float16, device)
        if step % 3 == 2:
            if rank == 1:
                bad = (shard.float(), producer) if step % 2 else (shard, "nvlink")
                with pytest.raises(ValueError, match="unknown producer" if step % 2 == 0 else "torch.float32"):
                    op(*bad)
            else:
                op(shard, producer)
                with pytest.raises(PeerRefusedInput, match=rf"at step {step + 1}: rank 0: rank 1's call was refused"):
                    op.errors.check(block=True)
            continue
        got = op(shard, producer).clone()
        dist.all_gather_into_tensor(expected, shard)
        assert torch.equal(got, expected), f"rank {rank}, step {step} ({producer}): differs from NCCL"
    op.errors.check(block=True)


def _unresident_grid(rank: int, world: int) -> None:
    """GemmConfig.num_programs above the SM count: the device push (in the GEMM's launch, whose programs wait for
    each other's chunks) is refused before its GEMM on the rank whose config asks for it, its ValueError, and the
    peer raises PeerRefusedInput naming it (both refuse where both ask), not a timeout after the waits' bound. The
    copy engines run that grid exactly (no wait inside their launch), and the default grid's device push after it."""
    device = torch.device("cuda", rank)
    ws = CudaSymmetricWorkspace()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows, k, n = 1000, 512, 320
    weight = (fresh(0, -1, (n, k), torch.float16, device) / k ** 0.5).t()  # a Linear's weight.t()
    default, large = GemmConfig(spin_limit=SPINS), GemmConfig(num_programs=sms + 1, spin_limit=SPINS)
    calls = [((large, large), "device"), ((default, large), "device"), ((large, large), "copy_engine"),
             ((default, default), "device")]
    for step, (configs, producer) in enumerate(calls):
        x, config = fresh(rank, step, (rows, k), torch.float16, device), configs[rank]
        if producer == "device" and config is large:
            with pytest.raises(ValueError, match=rf"GemmConfig.num_programs={sms + 1}: .* at most {sms} on this GPU"):
                all_gather_matmul(x, weight, ws, producer, config=config)
        elif producer == "device" and large in configs:
            with pytest.raises(PeerRefusedInput, match=rf"rank 0: rank 1's call was refused: its device push's grid "
                                                       rf"of {sms + 1} programs is more than its GPU holds at once"):
                all_gather_matmul(x, weight, ws, producer, config=config)
                op_for(ws, x, config).errors.check(block=True)
        else:
            got = all_gather_matmul(x, weight, ws, producer, config=config)
            bulk, _ = all_gather_matmul_bulk(x, weight)
            error = float((got.float() - bulk.float()).norm() / bulk.float().norm())
            assert error < 2e-3, f"rank {rank}, step {step} ({producer}): relative error {error:.3g}"
    for config in (default, large):
        op_for(ws, x, config).errors.check(block=True)


def test_all_gather_primitives_equal_nccl_all_gather():
    run_world(2, _primitives, backend="nccl")


def test_all_gather_matmul_equals_the_bulk_twin():
    run_world(2, _matmul, backend="nccl")


def test_all_gather_matmul_times_out_naming_the_rank_that_never_called():
    run_world(2, _timeout, backend="nccl")


def test_all_gather_refused_on_one_rank_raises_on_both():
    run_world(2, _refused, backend="nccl")


def test_a_device_push_grid_not_resident_at_once_is_refused_on_every_rank():
    run_world(2, _unresident_grid, backend="nccl", timeout=300)  # the timeout fails a hang fast
