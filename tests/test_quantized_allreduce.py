"""Quantized two-shot all-reduce on gloo processes (the bulk twin): equal bit for bit to the pure-torch reference
that the fused kernel also equals, within the documented bound of the exact sum, identical on every rank; calls
that differ between ranks raise CallMismatch on every rank (on gloo, and in the bulk twin as on NCCL); the DDP
hook keeps a tiny model's gradients within the bound of plain DDP and reduces each parameter of a bucket from a
block of its own (in place where DDP's layout is that already)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fused_dlrm.dist import env
from fused_dlrm.dist.env import CallMismatch
from fused_dlrm.kernels.quant_codecs import BLOCK, CODECS
from fused_dlrm.kernels.quantized_allreduce import quantized_all_reduce_reference, two_shot_error_bound
from fused_dlrm.tp import (GRAD_ALLREDUCE_CODECS, QuantizedHookState, block_offsets, chooser, flat_buffer,
                           quantized_all_reduce, quantized_allreduce_hook)
import fused_dlrm.tp.quantized_allreduce as qar
from world import run_world


def inputs(world: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return [torch.randn(n, generator=g) * (1 + 10 * torch.rand(n, generator=g)) for _ in range(world)]


def _reduce(rank: int, world: int) -> None:
    for n in (1, 0, 45, 4099):  # no multiple of world * 32 but 0 (an empty call: a chunk of one padding block)
        xs = inputs(world, n)
        exact = sum(xs)
        for codec in CODECS:  # fp16 sends no scales, q6 two planes
            for mean in (False, True):
                y = quantized_all_reduce(xs[rank], codec, mean=mean)
                want = exact / world if mean else exact
                assert y.shape == xs[rank].shape and y.dtype == torch.float32
                assert torch.equal(y, quantized_all_reduce_reference(xs, codec, mean))  # the fused kernel's too
                assert ((y - want).abs() <= two_shot_error_bound(xs, codec, mean)).all(), (codec, n, mean)
                same = [torch.empty_like(y) for _ in range(world)]
                dist.all_gather(same, y)
                assert all(torch.equal(s, y) for s in same)  # bit-identical on every rank
        assert torch.allclose(quantized_all_reduce(xs[rank], "nccl"), exact, atol=1e-5)
    # bf16 in, bf16 out; [rows, cols] shape kept
    xs = [x.view(8, 12).bfloat16() for x in inputs(world, 96)]
    y = quantized_all_reduce(xs[rank], "q8")
    assert y.shape == (8, 12) and y.dtype == torch.bfloat16
    assert torch.equal(y, quantized_all_reduce_reference(xs, "q8"))


@pytest.mark.parametrize("world", [1, 2, 4])  # a group of one: every message a single row
def test_quantized_all_reduce_within_bound(world):
    run_world(world, _reduce)


def _into_out(rank: int, world: int) -> None:
    xs = inputs(world, 4099)
    for codec in ("nccl", "q6"):
        want = quantized_all_reduce(xs[rank], codec, mean=True)
        given = torch.full_like(xs[rank], float("nan"))
        assert quantized_all_reduce(xs[rank], codec, mean=True, out=given) is given
        x = xs[rank].clone()
        assert quantized_all_reduce(x, codec, mean=True, out=x) is x
        assert torch.equal(given, want) and torch.equal(x, want), codec
        with pytest.raises(ValueError, match="out must be contiguous"):
            quantized_all_reduce(xs[rank], codec, out=torch.empty(4099, dtype=torch.float64))
        # one rank's out refused: every rank raises (rank 0 alone would leave rank 1 in the collective)
        out = torch.empty(4099, dtype=torch.float64) if rank == 0 else torch.full_like(xs[rank], float("nan"))
        said = [f"4099 float32 elements, codec {codec}, mean{suffix}" for suffix in (", into an unusable out", "")]
        with pytest.raises(ValueError, match=f"^quantized all-reduce: rank {rank}: peer {1 - rank} called it with "
                                             f"{said[1 - rank]}; this rank with {said[rank]} \\("):
            quantized_all_reduce(xs[rank], codec, mean=True, out=out)
        assert out.isnan().all() or rank == 0  # nothing was received
    # integers would come back wrong from a codec (q8 rounds them by block): refused; "nccl" sums them exactly
    with pytest.raises(TypeError, match="takes fp32, fp16 or bf16 tensors, got torch.int32"):
        quantized_all_reduce(torch.arange(64, dtype=torch.int32), "q8")
    assert torch.equal(quantized_all_reduce(torch.arange(64), "nccl"), torch.arange(64) * world)
    # an integer mean is no integer: refused before the sum, which would have been left in x, reduced in place
    x = torch.arange(64)
    with pytest.raises(TypeError, match="mean=True divides by the world size: not an integer tensor"):
        quantized_all_reduce(x, "nccl", mean=True, out=x)
    assert torch.equal(x, torch.arange(64))


def test_result_into_a_given_output_or_in_place():
    run_world(2, _into_out, timeout=300)


def _fp16_sum_overflows(rank: int, world: int) -> None:
    """Values within fp16's range whose sum is not: the partial sum is re-encoded in fp16, so those elements come
    back +-inf (as torch's cast makes them) and the bound says inf there, finite elsewhere; with mean the encoded
    value is the mean, which fits, and so is the plain mean's sum."""
    xs = inputs(world, 100)
    big = torch.zeros(100, dtype=torch.bool)
    big[[3, 40, 97]] = True  # each term within fp16's range, their sums (+-1e5, 1.2e5) past it
    for r, x in enumerate(xs):
        x[big] = torch.tensor([30000.0, -25000.0, 30000.0]) * (1 + r % 2)
    y = quantized_all_reduce(xs[rank], "fp16")
    exact = sum(xs)
    assert torch.equal(y, quantized_all_reduce_reference(xs, "fp16"))
    assert torch.equal(y[big], exact[big].sign() * torch.inf)
    bound = two_shot_error_bound(xs, "fp16")
    assert torch.equal(bound.isinf(), big) and ((y - exact).abs() <= bound).all()
    mean = quantized_all_reduce(xs[rank], "fp16", mean=True)
    bound = two_shot_error_bound(xs, "fp16", mean=True)
    assert mean.isfinite().all() and bound.isfinite().all() and ((mean - exact / world).abs() <= bound).all()
    # fp16 tensors whose sum passes 65504, their mean not: the plain mean divides before the sum (DDP's allreduce_hook
    # and Megatron scale first), as the fp16 codec sums in fp32; summed first, it came back +-inf (the hook's small
    # buckets go plain: `chooser`)
    halves = [x.half() for x in xs]
    exact = sum(h.double() for h in halves) / world
    for codec in ("nccl", "fp16"):
        mean = quantized_all_reduce(halves[rank], codec, mean=True)
        assert mean.dtype == torch.float16 and mean.isfinite().all(), codec
        torch.testing.assert_close(mean.double(), exact, rtol=2e-3, atol=2e-3)


def test_fp16_sums_past_its_range_are_inf_and_so_is_their_bound():
    run_world(3, _fp16_sum_overflows)


def _ddp_hook(rank: int, world: int, device_type: str = "cpu") -> None:
    """Also run on 2 GPUs by tests/test_quantized_allreduce_gpu.py (there the hook takes the fused kernel)."""
    device = torch.device(device_type, rank if device_type == "cuda" else 0)

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(13, 40), nn.ReLU(), nn.Linear(40, 1)).to(device)

    g = torch.Generator().manual_seed(rank)
    x, t = torch.randn(16, 13, generator=g).to(device), torch.randn(16, 1, generator=g).to(device)
    plain, quant = DistributedDataParallel(model()), DistributedDataParallel(model())
    quant.register_comm_hook(QuantizedHookState("q8"), quantized_allreduce_hook)
    for m in (plain, quant):
        nn.functional.mse_loss(m(x), t).backward()
    # Plain DDP's grads are the exact mean of the local grads (up to fp32 order). DDP's bucket puts its own block
    # boundaries through the parameters, so bound with the largest possible q8 scale: absmax of all / 127.
    local = torch.autograd.grad(nn.functional.mse_loss((m := model())(x), t), list(m.parameters()))
    absmax = torch.stack([g.abs().max() for g in local]).max()
    everyone = torch.empty(world, device=device)
    dist.all_gather_into_tensor(everyone, absmax.view(1))
    exact_max = max(p.grad.abs().max() for p in plain.parameters())
    step = (1 + 2.0**-6) / 2 / 127  # half a q8 step per unit of absmax, with the bf16 scale's round-up (2^-7)
    first = everyone.sum() * step / world
    bound = first + (exact_max + first) * step
    for p, q in zip(plain.parameters(), quant.parameters()):
        assert ((p.grad - q.grad).abs() <= bound + 1e-6).all()
        assert not torch.equal(p.grad, q.grad)  # the codec was used


def test_ddp_hook_within_bound_of_plain_ddp():
    run_world(2, _ddp_hook)


class _TwoScales(nn.Module):
    """Two parameters whose gradients are the forward's inputs, as given: DDP packs them into one bucket."""

    def __init__(self, large: int, small: int):
        super().__init__()
        self.large, self.small = nn.Parameter(torch.zeros(large)), nn.Parameter(torch.zeros(small))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (self.large * a).sum() + (self.small * b).sum()


def _ddp_hook_blocks(rank: int, world: int, device_type: str = "cpu") -> None:
    """A bucket packing a large parameter's gradients (~1e3) beside a small one's (~1e-3), in both orders (DDP's
    first step packs the parameters' order, its second the order their gradients came in). Packed back to back,
    a block holding both got the large values' scale and the small ones came back as 0 (q8, fp8, q6, q4); the hook
    reduces each from a block of its own: bit for bit the two-shot of `flat_buffer`'s layout, each parameter
    within its own bound. A bucket already laid out so (each parameter from a block), or a plain codec, is reduced
    in place; a copied one's buffer is made once per layout (steps 1 and 2 share DDP's rebuilt bucket), its gaps
    still zero at its second use. Also run on 2 GPUs by tests/test_quantized_allreduce_gpu.py (the fused kernel)."""
    device = torch.device(device_type, rank if device_type == "cuda" else 0)
    reduced = []  # (address, numel) of what each all-reduce was given
    reduce = qar.quantized_all_reduce

    def recording(x, *args, **kwargs):
        reduced.append((x.data_ptr(), x.numel()))
        return reduce(x, *args, **kwargs)

    qar.quantized_all_reduce = recording  # the hook's; this rank's process alone

    def hook(state, bucket):  # unannotated: this module's annotations are strings, which DDP refuses
        buffer = bucket.buffer()
        layouts.append(([p.numel() for p in bucket.parameters()],
                        [g.storage_offset() - buffer.storage_offset() for g in bucket.gradients()]))
        fut = quantized_allreduce_hook(state, bucket)
        layouts[-1] += (reduced[-1] == (buffer.data_ptr(), buffer.numel()),)  # in place
        return fut

    unaligned = []
    for large, small in ((1000, 20), (1024, 32)):  # a block shared in either order; whole blocks each
        for codec in GRAD_ALLREDUCE_CODECS:
            model = DistributedDataParallel(_TwoScales(large, small).to(device))
            model.register_comm_hook(QuantizedHookState(codec), hook)
            buffers = []  # what each step reduced: its address
            for step in range(3):
                gens = [torch.Generator().manual_seed(10 * step + r) for r in range(world)]
                local = [{large: torch.randn(large, generator=g) * 1e3, small: torch.randn(small, generator=g) * 1e-3}
                         for g in gens]
                layouts = []
                model.zero_grad()
                model(local[rank][large].to(device), local[rank][small].to(device)).backward()
                [(numels, offsets, in_place)] = layouts
                # the parameters' order, then (DDP's rebuilt bucket) the order their gradients came in: the
                # small one first (its block shared with the large one's first values, not its last)
                assert numels == ([large, small] if step == 0 else [small, large]), numels
                aligned = all(o % BLOCK == 0 for o in offsets)
                unaligned += [not aligned]
                grads = {p.numel(): p.grad.cpu() for p in model.parameters()}
                if codec in qar.PLAIN:  # as plain DDP: each term halved, then summed
                    for n, g in grads.items():
                        assert torch.equal(g, sum(x[n] / world for x in local)), (codec, n)
                else:
                    for n, g in grads.items():
                        xs = [x[n] for x in local]
                        exact = sum(x.double() for x in xs) / world
                        assert ((g.double() - exact).abs() <= two_shot_error_bound(xs, codec, mean=True)).all(), (
                            codec, n, offsets, ((g.double() - exact).abs() / exact.abs()).max().item())
                    laid = [flat_buffer([x[n] for n in numels], codec) for x in local]
                    for (_, views), x in zip(laid, local):
                        torch._foreach_copy_(views, [x[n] for n in numels])
                    want = quantized_all_reduce_reference([flat for flat, _ in laid], codec, mean=True)
                    for n, start in zip(numels, block_offsets(numels, codec)):
                        assert torch.equal(grads[n], want[start:start + n]), (codec, n)
                assert in_place == (aligned or codec in qar.PLAIN), (codec, offsets)
                buffers.append(reduced[-1][0])
            if not in_place:  # steps 1 and 2: one layout, one buffer
                assert buffers[2] == buffers[1], (codec, large, small)
    assert any(unaligned) and not all(unaligned)  # both kinds of bucket were met


def test_ddp_hook_reduces_each_parameter_from_a_block_of_its_own():
    run_world(2, _ddp_hook_blocks, timeout=600)


def _ddp_hook_after_a_nonfinite_step(rank: int, world: int) -> None:
    """Step 1's gradients hold a NaN (rank 1's small parameter) or an inf (rank 0's large one): every rank gets NaN
    in the blocks holding it, so a NaN / inf check (GradScaler's, a NaN-loss stop) sees it. Step 2's are finite
    again: they must come back as a fresh buffer's two-shot, finite. The hook's kept buffer (the bucket's block
    layout, reused from step 1) had NaN left in its gaps beside those blocks, and every later step's gradients in
    them came back NaN (GradScaler would skip every step from there on)."""
    large, small = 1000, 20  # packed back to back in one bucket: reduced in flat_buffer's layout, gaps after each
    for codec in ("fp8", "q8", "q6", "q4"):
        model = DistributedDataParallel(_TwoScales(large, small))
        model.register_comm_hook(QuantizedHookState(codec), quantized_allreduce_hook)
        for step in range(3):  # step 0: DDP's first bucket order; 1 and 2: its rebuilt bucket, one kept buffer
            gens = [torch.Generator().manual_seed(10 * step + r) for r in range(world)]
            local = [{large: torch.randn(large, generator=g), small: torch.randn(small, generator=g)} for g in gens]
            if step == 1:
                local[1][small][3] = float("nan")
                local[0][large][-2] = float("inf")
            model.zero_grad()
            model(local[rank][large], local[rank][small]).backward()
            grads = {p.numel(): p.grad for p in model.parameters()}
            if step == 1:  # the non-finite blocks: all NaN on every rank; the others finite
                assert grads[small].isnan().all() and grads[large][-(large % BLOCK):].isnan().all(), codec
                assert grads[large][:-(large % BLOCK)].isfinite().all(), codec
                continue
            for n, g in grads.items():
                want = quantized_all_reduce_reference([x[n] for x in local], codec, mean=True)
                assert torch.equal(g, want), (codec, step, n, g.isnan().sum().item())


def test_ddp_hook_after_a_nonfinite_step_reduces_the_next_exactly():
    run_world(2, _ddp_hook_after_a_nonfinite_step)


# Rank 1's call differs from the others' (4096 float32 values, q8 sums; `numel` values where a third item says) in one
# way: (x, codec, mean) and what the messages say of it. int32 with q8 is refused on its own; here the others learn of
# it too. "one wire": the bulk twin's messages keep their length (as many blocks per chunk at worlds 2 and 3, a codec
# of as many bytes per block), so unchecked, the exchange would run and sum silently.
DIFFERENT_CALLS = {
    "numel": ((torch.randn(4100), "q8", False), "4100 float32 elements, codec q8"),
    "numel, one wire": ((torch.randn(4050), "q8", False), "4050 float32 elements, codec q8"),
    "no values": ((torch.randn(0), "q8", False), "0 float32 elements, codec q8"),
    "no values, one wire": ((torch.randn(0), "q8", False), "0 float32 elements, codec q8", 45),
    "codec": ((torch.randn(4096), "q4", False), "4096 float32 elements, codec q4"),
    "codec, one wire": ((torch.randn(4096), "fp8", False), "4096 float32 elements, codec fp8"),
    "dtype": ((torch.randn(4096).bfloat16(), "q8", False), "4096 bfloat16 elements, codec q8"),
    "mean": ((torch.randn(4096), "q8", True), "4096 float32 elements, codec q8, mean"),
    "plain": ((torch.randn(4096), "nccl", False), "4096 float32 elements, codec nccl"),
    "integers": ((torch.arange(4096, dtype=torch.int32), "q8", False), "4096 int32 elements, codec q8"),
}


def _different_calls(rank: int, world: int, backend: str = "gloo") -> None:
    """backend="nccl": the bulk twin as on NCCL (fused=False), whose check runs over the group's gloo side group.
    On GPUs (tests/test_quantized_allreduce_gpu.py) NCCL's own; on the CPU the group is taken for NCCL's, its data's
    collectives gloo's all the same: a call that reached them with other sizes would abort the processes."""
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    if backend == "nccl" and device.type == "cpu":
        qar._backend = lambda group: "nccl"
    fused = False if backend == "nccl" else None
    for difference, ((x, codec, mean), odd, *numel) in DIFFERENT_CALLS.items():
        numel = numel[0] if numel else 4096
        if rank != 1:
            x, codec, mean = torch.randn(numel), "q8", False
        x = x.to(device)
        out = torch.full_like(x, float("nan") if x.is_floating_point() else -1)
        poisoned = out.clone()
        usual = f"{numel} float32 elements, codec q8"
        peer, mine, theirs = (0, odd, usual) if rank == 1 else (1, usual, odd)
        with pytest.raises(CallMismatch, match=f"^quantized all-reduce: rank {rank}: peer {peer} called it with "
                                               f"{re.escape(theirs)}; this rank with {re.escape(mine)} \\("):
            quantized_all_reduce(x, codec, mean=mean, out=out, fused=fused)
        assert torch.equal(out.nan_to_num(7), poisoned.nan_to_num(7)), difference  # nothing was received
        # the next call, alike on every rank, sums (fresh data)
        xs = inputs(world, 1000 + len(difference))
        y = quantized_all_reduce(xs[rank].to(device), "q8", fused=fused).cpu()
        exact = sum(x.double() for x in xs)
        assert torch.equal(y, quantized_all_reduce_reference(xs, "q8")), difference
        assert ((y.double() - exact).abs() <= two_shot_error_bound(xs, "q8").double()).all(), difference
    # NCCL: the group's gloo side group, made at the first call, checked every call since
    assert list(env._GLOO_SIDE_GROUPS.values()) == ([env.gloo_side_group(None)] if backend == "nccl" else [])


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
@pytest.mark.parametrize("world", [2, 3])
def test_calls_that_differ_between_ranks_raise_on_every_rank(world, backend):
    """Rank 1's call differs from the others': on gloo and, as on NCCL, in the bulk twin (its collectives abort the
    processes on gloo, hang or mix data up on NCCL, or sum where the lengths agree)."""
    run_world(world, _different_calls, backend)


def test_chooser_goes_plain_below_the_threshold():
    assert chooser(1024, "q4", min_bytes=65536) == "nccl"
    assert chooser(65536, "q4", min_bytes=65536) == "q4"


def test_a_hook_state_refuses_an_unknown_codec_when_made():
    """A misspelt codec was taken: it raised only in the first backward's all-reduce (after a whole forward and
    backward), and with min_bytes only for a bucket past it, so a small model's buckets all went plain ("nccl")
    and the typo was never named."""
    for codec in ("q9", "Q8", "", None):
        with pytest.raises(ValueError, match=re.escape(f"unknown codec {codec!r}: expected one of "
                                                       f"{qar.PLAIN + tuple(CODECS)}")):
            QuantizedHookState(codec, min_bytes=1 << 30)
    for codec in qar.PLAIN + tuple(CODECS):
        assert QuantizedHookState(codec).codec == codec


def test_a_codecs_flat_buffer_starts_each_tensor_at_a_block_and_a_plain_one_packs_them():
    tensors = [torch.randn(3, 15), torch.randn(32), torch.randn(1), torch.randn(2, 40)]
    assert block_offsets([t.numel() for t in tensors], "nccl") == [0, 45, 77, 78, 158]  # as a cat, no padding
    assert block_offsets([t.numel() for t in tensors], "q8") == [0, 64, 96, 128, 224]  # < 32 zeros after each
    for codec in ("nccl", "q8"):
        flat, views = flat_buffer(tensors, codec)
        assert flat.numel() == block_offsets([t.numel() for t in tensors], codec)[-1] and not flat.any()
        for view, t, start in zip(views, tensors, block_offsets([t.numel() for t in tensors], codec)):
            assert view.shape == t.shape and view._base is flat and view.data_ptr() == flat[start:].data_ptr()
    with pytest.raises(ValueError, match="several dtypes or devices"):
        flat_buffer([torch.randn(3), torch.randn(3, dtype=torch.float64)], "q8")


# Two gloo ranks forked from a process that never set TRITON_INTERPRET: Triton has no CPU backend there.
_NO_INTERPRETER = """
import os, sys
import torch, torch.distributed as dist, torch.multiprocessing as mp
from fused_dlrm.kernels.quant_codecs import CODECS
from fused_dlrm.kernels.quantized_allreduce import quantized_all_reduce_reference
from fused_dlrm.tp import quantized_all_reduce

def rank_fn(rank, store):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(4099, generator=g) for _ in range(2)]
    for codec in CODECS:
        y = quantized_all_reduce(xs[rank], codec, mean=True)
        assert torch.equal(y, quantized_all_reduce_reference(xs, codec, mean=True)), codec
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.start_processes(rank_fn, args=(sys.argv[1],), nprocs=2, start_method="fork")
"""


def test_the_bulk_twin_on_cpu_needs_no_triton_interpreter(tmp_path):
    """On CPU tensors the bulk twin encodes and decodes with the codecs' pure-torch reference (bit for bit the
    kernels'): outside the interpreter (a plain `python train.py ... comm.grad_allreduce=q8` on a CPU machine) the
    kernels stopped the first step deep inside Triton ("0 active drivers")."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", _NO_INTERPRETER, str(tmp_path / "store")], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
