"""GPU check of the fused one-launch quantized all-reduce against its bulk twin (2 GPUs, NCCL; skipped without them;
the repeated calls' direct replays also at world 1 on one GPU).

Bit-equal to the bulk twin (codec kernels around NCCL all_to_all / all_gather) for every codec, bf16 and fp32
inputs, sum and mean; bit-identical across ranks; within the documented bound of the fp64 sum; 1,000 consecutive
calls of changing sizes and codecs on the same flags; calls that replay CUDA graphs; the DDP hook (q8, fused) within
the bound of plain DDP, and each parameter of a bucket reduced from a block of its own; a missing peer raises
PeerWaitTimeout; ranks calling with other codecs raise PeerCallMismatch and a call one rank refuses raises on both
(two ranks sharing one GPU suffice), and calls unlike a peer's CallMismatch in the bulk twin (its check over the
group's gloo side group); the codec kernels equal the CPU reference bit for bit at every magnitude, fp32's denormals
to its largest value (one GPU).
CI has no GPU: this runs on the device machine.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fused_dlrm.dist.symmetric import CudaSymmetricWorkspace
from fused_dlrm.kernels.peer_flags import PeerCallMismatch, PeerRefusedInput, PeerWaitTimeout
from fused_dlrm.kernels.quant_codecs import CODECS, Encoded, decode, decode_reference, encode, encode_reference
from fused_dlrm.kernels.quantized_allreduce import FusedQuantizedAllReduce, max_programs_for, two_shot_error_bound
from fused_dlrm.tp.quantized_allreduce import fused_for_group, quantized_all_reduce
from test_quantized_allreduce import _ddp_hook, _ddp_hook_blocks, _different_calls
from world import ONE_GPU, TWO_GPUS, run_world


SIZES = [1, 45, 4099, 1_000_003, 3 * 2**22 + 17]  # none a multiple of world * 32; up to ~12.6M values


def world_inputs(n: int, world: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Every rank's input (each rank builds all of them): heavy-tailed (Student t, 2 degrees of freedom)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    xs = []
    for _ in range(world):
        t = torch.randn(n, device="cuda", generator=gen)
        t /= torch.randn(n, 2, device="cuda", generator=gen).pow(2).mean(1).sqrt()
        xs.append(t.clamp(-1e4, 1e4).to(dtype))
    return xs


def assert_same_on_every_rank(y: torch.Tensor, world: int) -> None:
    everyone = [torch.empty_like(y) for _ in range(world)]
    dist.all_gather(everyone, y)
    assert all(torch.equal(e, y) for e in everyone)


def codecs_at_every_magnitude(device: str) -> None:
    """The codec kernels on `device` against the pure-torch reference on the CPU, bit for bit (payload, scales and
    decoded values), every codec, on blocks from fp32's denormals to its largest value: gradient-sized blocks
    (1e-6 .. 3e-8, where fp16 scales were subnormal), tiny ones (bf16 scales' floor 2^-126), 3.39e38 (the largest
    finite scale) and fp32's largest value (out of range: NaN), and a block holding NaN and inf."""
    g = torch.Generator().manual_seed(5)
    amax = torch.tensor([1.0, 1e-2, 1e-6, 1e-7, 3e-8, 1e-20, 1e-30, 1e-36, 1e-37, 1e-38, 1e-39, 1e-44, 1e30, 3.39e38,
                         torch.finfo().max])
    x = torch.randn(len(amax), 32, generator=g)
    x = ((x / x.abs().amax(1, keepdim=True)).double() * amax.double()[:, None]).float().reshape(-1)
    x = torch.cat([x, torch.tensor([float("nan"), float("inf"), -float("inf")] + [1e-7] * 28)])  # 31: padded
    for codec in CODECS:
        want = encode_reference(x, codec)
        got = encode(x.to(device), codec)
        assert torch.equal(got.payload.cpu(), want.payload), codec
        assert torch.equal(got.scales.cpu().view(torch.int16), want.scales.view(torch.int16)), codec
        y = decode_reference(want, codec, x.numel())
        yk = decode(Encoded(want.payload.to(device), want.scales.to(device)), codec, x.numel()).cpu()
        assert torch.equal(yk.isnan(), y.isnan()) and torch.equal(yk.nan_to_num(), y.nan_to_num()), codec


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_codec_kernels_equal_the_reference_at_every_magnitude():
    """The GPU's codec kernels (no fp fusion; denormals kept by div.rn / mul.rn, not flushed) equal the CPU
    reference bit for bit from fp32's denormals to its largest value (one GPU)."""
    codecs_at_every_magnitude("cuda")


def _fused_equals_bulk(rank: int, world: int) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        for i, n in enumerate(SIZES):
            xs = world_inputs(n, world, dtype, seed=n)
            exact = sum(x.double() for x in xs)
            mean = i % 2 == 1  # sum and mean both meet every codec, with half the compiled kernel variants
            for codec in CODECS:
                y = quantized_all_reduce(xs[rank], codec, mean=mean, fused=True)
                bulk = quantized_all_reduce(xs[rank], codec, mean=mean, fused=False)
                assert y.dtype == dtype and y.shape == xs[rank].shape
                assert torch.equal(y, bulk), (dtype, n, codec, mean)
                in_place = xs[rank].clone()
                quantized_all_reduce(in_place, codec, mean=mean, fused=True, out=in_place)
                assert torch.equal(in_place, y), (dtype, n, codec, mean)
                assert_same_on_every_rank(y, world)
                err = (y.double() - exact / (world if mean else 1)).abs()  # bf16: the bound has its rounding
                assert (err <= two_shot_error_bound(xs, codec, mean).double()).all(), (dtype, n, codec, mean)
    fused_for_group(None, xs[0].device).errors.check(block=True)


@TWO_GPUS
def test_fused_equals_bulk_twin_every_codec():
    run_world(2, _fused_equals_bulk, backend="nccl")


def _many_calls(rank: int, world: int) -> None:
    codecs = list(CODECS)
    sizes = [1000, 300_000, 33, 2_500_001]
    for step in range(1000):
        n, codec = sizes[step % len(sizes)], codecs[step % len(codecs)]
        x = world_inputs(n, world, torch.bfloat16, seed=step)[rank]
        y = quantized_all_reduce(x, codec, mean=True, fused=True)  # as the DDP hook calls it
        if step % 10 == 0 or step >= 990:  # the bulk twin on a tenth of the calls keeps the run short
            assert torch.equal(y, quantized_all_reduce(x, codec, mean=True, fused=False)), step
    fused_for_group(None, x.device).errors.check(block=True)
    assert_same_on_every_rank(y, world)


@TWO_GPUS
def test_one_thousand_consecutive_calls_on_the_same_flags():
    run_world(2, _many_calls, backend="nccl")


def _graph_replays(rank: int, world: int) -> None:
    x = torch.empty(300_000, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(x)
    op = fused_for_group(None, x.device)
    for step in range(200):  # new data in the same tensors: every call after the first replays a graph
        x.copy_(world_inputs(x.numel(), world, torch.bfloat16, seed=step)[rank])
        out.fill_(float("nan"))
        quantized_all_reduce(x, "q8", fused=True, out=out)
        if step % 20 == 0 or step >= 195:
            assert torch.equal(out, quantized_all_reduce(x, "q8", fused=False)), step
        quantized_all_reduce(x, "q4", fused=True, out=x)  # in place: a graph of its own
    op.errors.check(block=True)
    call = op.start(x, "q8", out=out)
    assert len(call.plan.replays) == 1
    assert_same_on_every_rank(out, world)


@TWO_GPUS
def test_calls_on_the_same_tensors_replay_a_graph():
    """The epoch comes from the device, so the 2nd and later calls on the same x and out replay a CUDA graph:
    still bit-equal to the bulk twin, with new data at every call, in between in-place calls of another codec."""
    run_world(2, _graph_replays, backend="nccl")


@TWO_GPUS
def test_ddp_hook_within_bound_of_plain_ddp():
    run_world(2, _ddp_hook, "cuda", backend="nccl")


@TWO_GPUS
def test_ddp_hook_reduces_each_parameter_from_a_block_of_its_own():
    run_world(2, _ddp_hook_blocks, "cuda", backend="nccl", timeout=600)


def _missing_peer(rank: int, world: int) -> None:
    device = torch.device("cuda", rank)
    op = FusedQuantizedAllReduce(CudaSymmetricWorkspace(), max_programs_for(device), spin_limit=20_000)
    call = op.start(torch.randn(5000, device=device), "q8")  # allocation is collective: both ranks start
    if rank == 0:  # rank 1 never launches
        op.run(call)
        op.finish(call)
        with pytest.raises(PeerWaitTimeout, match=r"rank 0 timed out at step 1 waiting for rank 1, slice \d+ "):
            op.errors.check(block=True)
    dist.barrier()


@TWO_GPUS
def test_missing_peer_times_out_naming_rank_and_slice():
    run_world(2, _missing_peer, backend="nccl")


def _repeats_replay_their_own_graph(rank: int, world: int) -> None:
    op = fused_for_group(None, torch.device("cuda"))

    def check(x, codec, out):
        out.fill_(float("nan"))
        y = op(x, codec, out=out)
        assert y is out and torch.equal(out, quantized_all_reduce(x, codec, fused=False)), (x.numel(), codec)

    def repeats_are_live_graphs():  # each one a graph that a live plan still holds for its addresses
        return all(any(g is p.replays.graph(k[:2]) for p in op._plans.values()) for k, g in op._repeats.items())

    small, small_out = torch.empty(5000, dtype=torch.bfloat16, device="cuda"), torch.empty(5000, dtype=torch.bfloat16,
                                                                                          device="cuda")
    for step in range(6):  # new data every call: the 2nd captures the graph; from the 3rd on it is replayed directly
        small.copy_(world_inputs(small.numel(), world, torch.bfloat16, seed=step)[rank])
        check(small, "q8", small_out)
        check(small, "fp8", small_out)  # another codec on the same tensors: a graph (and plan) of its own
    assert len(op._repeats) == 2 and repeats_are_live_graphs()
    large = world_inputs(3_000_000, world, torch.bfloat16, seed=7)[rank]  # grows the buffers: plans and graphs go
    check(large, "q8", torch.empty_like(large))
    assert repeats_are_live_graphs() and not op._repeats
    for step in range(4):  # the small calls plan, capture and replay anew
        small.copy_(world_inputs(small.numel(), world, torch.bfloat16, seed=10 + step)[rank])
        check(small, "q8", small_out)
    assert len(op._repeats) == 1 and repeats_are_live_graphs()
    strided = world_inputs(10_000, world, torch.bfloat16, seed=20)[rank][::2]  # copied to be read: never a repeat
    for _ in range(3):
        check(strided, "q8", torch.empty(5000, dtype=torch.bfloat16, device="cuda"))
    op.errors.check(block=True)  # no error-word copy in flight (its event is not queried inside a capture)
    captured = torch.cuda.CUDAGraph()  # a caller's own capture of a repeated call: launched into it, not replayed
    with torch.cuda.graph(captured):
        op(small, "q8", out=small_out)
    small.copy_(world_inputs(small.numel(), world, torch.bfloat16, seed=30)[rank])
    small_out.fill_(float("nan"))
    captured.replay()
    assert torch.equal(small_out, quantized_all_reduce(small, "q8", fused=False))
    op.errors.check(block=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_repeated_calls_replay_their_graph_directly_at_world_one():
    """FusedQuantizedAllReduce.__call__'s repeats: a call on the same x and out as an earlier one replays that
    call's graph without planning (new data every call, two codecs on the same tensors); a larger message grows
    the buffers and drops the repeats with their plans; a strided x is never one; inside a caller's capture the
    call is launched into the caller's graph. Results equal the bulk twin's (world 1: one GPU suffices)."""
    run_world(1, _repeats_replay_their_own_graph, backend="nccl")


def _codecs_differ(rank: int, world: int) -> None:
    op = fused_for_group(None, torch.device("cuda", 0))  # the ranks share GPU 0: a CUDA IPC workspace
    x = world_inputs(100_003, world, torch.float32, seed=3)[rank]
    kept, mine, theirs = x.clone(), ("q8", "q4")[rank], ("q8", "q4")[1 - rank]
    with pytest.raises(PeerCallMismatch, match=rf"rank {rank} at step \d+: peer {1 - rank} called it with 100003 "
                                               rf"float32 elements, codec {theirs}; this rank with 100003 float32 "
                                               rf"elements, codec {mine}"):
        op(x, mine, out=x)
        op.errors.check(block=True)
    assert torch.equal(x, kept)  # reduced in place: a failed call stores nothing
    y = op(x, "q8")  # the flags and slots as after any call: the next call is exact
    assert torch.equal(y, quantized_all_reduce(x, "q8", fused=False))
    op.errors.check(block=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_ranks_calling_with_other_codecs_raise_on_one_gpu():
    """The kernel's signatures on a GPU: rank 0 calls with q8, rank 1 with q4; both raise, naming both calls."""
    run_world(2, _codecs_differ, backend=ONE_GPU, timeout=240)


def _one_rank_refuses(rank: int, world: int) -> None:
    op = fused_for_group(None, torch.device("cuda", 0))  # the ranks share GPU 0: a CUDA IPC workspace
    x = world_inputs(100_003, world, torch.float32, seed=4)[rank]
    op(x, "q8")  # plans (allocates) on every rank: the refused call's peers then allocate nothing
    kept = x.clone()
    if rank == 1:
        with pytest.raises(TypeError, match="got torch.int32"):
            op(x.to(torch.int32), "q8")
    else:
        with pytest.raises(PeerRefusedInput, match=rf"at step 2: rank {rank}: rank 1's call was refused: its x is "
                                                   r"int32, which no codec takes"):
            op(x, "q8", out=x)
            op.errors.check(block=True)
    op.errors.check(block=True)  # nothing (else) recorded
    assert torch.equal(x, kept)  # reduced in place: a failed call stores nothing
    y = op(x, "q8")  # the ranks' epochs still in step: the next call is exact
    assert torch.equal(y, quantized_all_reduce(x, "q8", fused=False))
    op.errors.check(block=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_call_refused_on_one_rank_raises_on_every_rank_on_one_gpu():
    """Rank 1 passes an int32 x: it raises TypeError, rank 0 PeerRefusedInput naming rank 1 and why (not a timeout
    after the wait's bound); the next call is exact. The timeout fails a hang fast."""
    run_world(2, _one_rank_refuses, backend=ONE_GPU, timeout=240)


@TWO_GPUS
def test_bulk_twin_calls_that_differ_raise_on_every_rank():
    """The bulk twin on NCCL (fused=False) compares the ranks' calls over the group's gloo side group before its
    collectives: rank 1's call unlike rank 0's (0 values against n, another codec, dtype, mean; messages of one
    length or not) raises CallMismatch on both, naming both calls, instead of waiting in NCCL or summing; the next
    call sums (bit-equal to the CPU reference). The timeout fails a hang fast."""
    run_world(2, _different_calls, "nccl", backend="nccl", timeout=300)
