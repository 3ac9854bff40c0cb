"""Quantized all-reduce: two-shot, every message encoded with a line codec; fused on CUDA, bulk elsewhere.

Two-shot: x is cut into `world` chunks of whole 32-value blocks (zero-padded at the end);
1. reduce-scatter: every rank encodes all chunks and sends chunk r to rank r; rank r decodes the `world`
   encodings of its chunk and sums them in fp32 (rank order);
2. all-gather: rank r re-encodes its reduced chunk and sends it to everyone; every rank decodes all.
Every rank decodes the same bytes, so the result is bit-identical on all ranks (DDP replicas stay in sync).

Error (per element, quant_codecs.error_bound as B): |result - exact sum| <= sum_r B(x_r) + B(z), z the decoded
partial sum of stage 1 (|z| <= |exact| + sum_r B(x_r)); with mean=True both stages' errors are divided by world;
bf16 / fp16 tensors add the rounding of that fp32 result to their dtype (relative 2^-8 / 2^-11; for bf16 more
than the fp16 codec's own error) (kernels.quantized_allreduce.two_shot_error_bound). Range: fp16 carries |values|
up to 65504, inputs and the partial sums z alike (z the mean with mean=True): past it an element comes back
+-inf and its bound is inf (the scaled codecs have fp32's range); below 2^-14 its subnormals keep 2^-25 absolute,
not relative, precision (quant_codecs). Tensors packed into one buffer: `flat_buffer` gives each its own blocks.

Two implementations with the same arithmetic, bit for bit: on CUDA tensors of an NCCL group, the fused
one-launch kernel (kernels/quantized_allreduce.py) on a symmetric workspace created lazily per process group
(collectively, at the group's first call); elsewhere (gloo, CPU) the bulk twin: the codec kernels (on CPU tensors
their pure-torch reference: no Triton needed) around all_to_all_single and all_gather_into_tensor, each chunk's
encoding (int32 payload words, bf16 scales) sent as one message. Codec "nccl" / "none" is a plain dist.all_reduce
(with mean=True of x / world, divided first as DDP's allreduce_hook divides: fp16 values whose mean fits in fp16 may
sum past 65504).

Every rank must call with the same size, dtype, codec and mean (and an out it can take). The fused kernel checks
its peers' calls on the device (a signature beside its flags), where a call one rank refuses (dtype, codec, out)
raises on every rank too. Every other call (on gloo all, on NCCL the bulk
twin's) compares them first (dist.env.check_same_call: one all-gather of 5 int64 on the host; on NCCL over the
group's gloo side group, made at its first bulk call), so a mismatch raises CallMismatch (a ValueError) on every
rank before any collective whose size follows from the call: gloo's abort the process on messages of other sizes,
NCCL's hang or mix data up, and where the messages keep their length (0 values against up to world x 32, fp8
against q8, another dtype or mean) they would sum silently. A signature word in the wire could not replace it:
NCCL's sizes are host arguments, agreed only by an exchange of a fixed size that the host reads before them. So the
twin on NCCL (a baseline of the benchmarks: bench/allreduce.py's twin_us) does that much more than the fused
kernel: one host exchange per call, no device work, no wait for the device. Not compared: the plain codec on NCCL
without fused=False (a dist.all_reduce, unchecked as torch's) and, fused, a call that grows the buffers on some
ranks only (kernels/quantized_allreduce.py says why).
"""

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import torch
import torch.distributed as dist

from fused_dlrm.dist.symmetric import ALLOCATION_TIMEOUT_S, cuda_workspace
from fused_dlrm.dist.env import check_same_call, gloo_side_group
from fused_dlrm.kernels.quant_codecs import (BLOCK, CODECS, Encoded, decode, decode_reference, encode,
                                              encode_reference)
from fused_dlrm.kernels.quantized_allreduce import (FusedQuantizedAllReduce, call_signature, check_out,
                                                    check_quantizable, chunk_blocks_for, describe_call,
                                                    max_programs_for, out_problem, sum_in_rank_order)

GRAD_ALLREDUCE_CODECS = ("nccl", "fp16", "fp8", "q8", "q6", "q4")  # the values of comm.grad_allreduce
PLAIN = ("nccl", "none")


def check_grad_allreduce(codec: str) -> None:
    """comm.grad_allreduce, checked when the model is built: a world of one never reaches the all-reduce's own
    check, and a larger one would reach it only after a whole forward and backward."""
    if codec not in GRAD_ALLREDUCE_CODECS:
        raise ValueError(f"comm.grad_allreduce={codec!r}: expected one of {GRAD_ALLREDUCE_CODECS}")


def check_codec(codec: object) -> None:
    """Raise unless `codec` is one that `quantized_all_reduce` takes: a plain one or a line codec."""
    if codec not in PLAIN + tuple(CODECS):
        raise ValueError(f"unknown codec {codec!r}: expected one of {PLAIN + tuple(CODECS)}")


def block_offsets(numels: Sequence[int], codec: str) -> list[int]:
    """Where each of several tensors starts in one flat buffer that `codec` all-reduces, then the buffer's size.
    A codec's: each from a block boundary (a multiple of BLOCK; the gaps, < BLOCK values each, zeros), since a
    block's one scale follows its largest value: a tensor whose values are small beside its neighbour's would lose
    its precision in a block they shared (q8, reported on 4 ranks: a norm's ~5e-5 gradients beside the router's
    ~1e-2 came back 85% off); so each tensor's error is its own blocks' (two_shot_error_bound of it alone). The
    all-reduce's chunks are whole blocks, so these are its blocks on every rank. Plain ("nccl", "none"): packed
    back to back (as before; a scale-free sum loses nothing to a neighbour, and padding would cost it bytes)."""
    align = 1 if codec in PLAIN else BLOCK
    offsets = [0]
    for n in numels:
        offsets.append(offsets[-1] + -(-n // align) * align)
    return offsets


def flat_buffer(tensors: Sequence[torch.Tensor], codec: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A zeroed flat buffer laid out by `block_offsets` for `tensors` (one dtype and device), and a view of it
    shaped like each (the values are not copied)."""
    kinds = {(t.dtype, t.device) for t in tensors}
    if len(kinds) > 1:
        raise ValueError(f"one flat buffer cannot hold tensors of several dtypes or devices: "
                         f"{sorted(map(str, kinds))}")
    offsets = block_offsets([t.numel() for t in tensors], codec)
    flat = torch.zeros(offsets[-1], dtype=tensors[0].dtype, device=tensors[0].device)
    return flat, [flat[o:o + t.numel()].view_as(t) for o, t in zip(offsets, tensors)]


def padding_views(flat: torch.Tensor, numels: Sequence[int], codec: str) -> list[torch.Tensor]:
    """The gaps of a `flat_buffer` of tensors of these sizes (after each, < BLOCK values; none for a plain codec),
    as views of it. A buffer kept across steps zeroes them before each all-reduce: a block holding a NaN or inf
    decodes as all NaN, its gap too, which would leave NaN in that block at every later step."""
    offsets = block_offsets(numels, codec)
    return [flat[o + n:end] for o, n, end in zip(offsets, numels, offsets[1:]) if o + n < end]


# Below this many bytes an all-reduce is latency-bound and the codec saves nothing worth its rounding error.
# 64 KiB is an estimate, not yet measured on GPUs (neither for the bulk twin nor for the fused kernel).
MIN_QUANTIZED_BYTES = 64 * 1024


def chooser(nbytes: int, codec: str, min_bytes: int = MIN_QUANTIZED_BYTES) -> str:
    """The codec for a message of nbytes: plain "nccl" below min_bytes, `codec` from there on."""
    return "nccl" if nbytes < min_bytes else codec


def wire_bytes(numel: int, world: int, codec: str) -> int:
    """The bytes each rank sends in one quantized all-reduce of numel values over world ranks (fused or bulk twin
    alike): world - 1 encoded chunks in the reduce-scatter, then its reduced chunk's encoding to world - 1 peers."""
    return 2 * (world - 1) * chunk_blocks_for(numel, world) * CODECS[codec].block_bytes


def quantized_all_reduce(x: torch.Tensor, codec: str, group: dist.ProcessGroup | None = None, mean: bool = False,
                         fused: bool | None = None, out: torch.Tensor | None = None,
                         allocation_timeout_s: float = ALLOCATION_TIMEOUT_S) -> torch.Tensor:
    """The sum (mean with mean=True) over the group's ranks of x, in `out` (contiguous, x's shape and dtype; x
    itself to reduce in place) or, by default, a new tensor. fused: the one-launch kernel (default: on CUDA
    tensors of an NCCL group), else the bulk twin; its workspace's allocations wait `allocation_timeout_s` for
    the peers (`fused_for_group`)."""
    group = group or dist.group.WORLD
    backend = _backend(group)
    if fused is None:
        fused = x.is_cuda and backend == "nccl"
    # Before the local checks (a codec, dtype or out refused on one rank raises on all) and before any collective
    # whose size follows from the call: on gloo every call; on NCCL every call with fused false, over the group's gloo
    # side group (the fused kernel checks its peers on the device; a plain call with fused true or by default is
    # torch's all_reduce, unchecked as any).
    if backend == "gloo" or not fused:
        check_same_call(call_signature(x.numel(), x.dtype, codec, mean) + [int(out_problem(x, out) is not None)],
                        group if backend == "gloo" else gloo_side_group(group), describe_call, "quantized all-reduce")
    if codec in PLAIN:
        if mean and not (x.is_floating_point() or x.is_complex()):  # before the sum (x, in place, would keep it)
            raise TypeError(f"mean=True divides by the world size: not an integer tensor (got {x.dtype})")
        check_out(x, out)
        out = x.clone() if out is None else (out if out is x else out.copy_(x))
        if mean:  # before the sum, as DDP's allreduce_hook does: fp16 terms whose mean fits may sum past 65504
            out.div_(dist.get_world_size(group))
        dist.all_reduce(out, group=group)
        return out
    if fused:  # the op checks codec, dtype and out: a refusal raises on every rank (a check here, on one rank alone)
        return fused_for_group(group, x.device, allocation_timeout_s)(x, codec, mean, out)
    check_codec(codec)
    check_quantizable(x)
    check_out(x, out)
    world = dist.get_world_size(group)
    numel = x.numel()
    chunk_blocks = chunk_blocks_for(numel, world)  # whole blocks per chunk
    chunk = chunk_blocks * BLOCK
    # CPU tensors: the codecs' pure-torch reference, bit for bit the kernels' (Triton has no CPU backend: outside
    # its interpreter a kernel launch fails with "0 active drivers")
    enc, dec = (encode, decode) if x.is_cuda else (encode_reference, decode_reference)
    sent = _wire(enc(x, codec, num_blocks=world * chunk_blocks), world)
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    parts = dec(_unwire(received, codec), codec, world * chunk).view(world, chunk)
    mine = _wire(enc(sum_in_rank_order(list(parts), mean), codec), 1)
    gathered = mine.new_empty((world, mine.shape[1]))
    dist.all_gather_into_tensor(gathered, mine, group=group)
    result = dec(_unwire(gathered, codec), codec, numel).view(x.shape).to(x.dtype)
    return result if out is None else out.copy_(result)


def _wire(enc: Encoded, parts: int) -> torch.Tensor:
    """uint8 [parts, bytes]: the encoding cut into `parts` equal ranges of blocks, each one message (its payload
    bytes, then its scale bytes), so that one collective moves both arrays."""
    payload = enc.payload.view(torch.uint8).view(parts, -1)
    return torch.cat([payload, enc.scales.view(torch.uint8).view(parts, enc.scales.numel() * 2 // parts)], 1)


def _unwire(wire: torch.Tensor, codec: str) -> Encoded:
    """The encoding that `_wire` cut into the rows of wire."""
    c = CODECS[codec]
    split = wire.shape[1] // c.block_bytes * 4 * c.words  # payload bytes of a range
    # reshape(-1), not contiguous(): a single row's column range counts as contiguous, but its row stride (the
    # whole wire row, not always a multiple of 4 bytes) would stop the int32 view; flat, only its start matters.
    return Encoded(wire[:, :split].reshape(-1).view(torch.int32).view(-1, c.words),
                   wire[:, split:].reshape(-1).view(torch.bfloat16))


_FUSED: dict[tuple[dist.ProcessGroup, float], FusedQuantizedAllReduce] = {}
_backend = lru_cache(maxsize=None)(dist.get_backend)  # per group: asked per call, it would cost a microsecond


def fused_for_group(group: dist.ProcessGroup | None, device: torch.device,
                    allocation_timeout_s: float = ALLOCATION_TIMEOUT_S) -> FusedQuantizedAllReduce:
    """The group's fused all-reduce (its symmetric workspace is allocated collectively at the first call, its
    ranks waiting `allocation_timeout_s` for each other), one per group and bound (a run has one bound)."""
    key = (group or dist.group.WORLD, allocation_timeout_s)
    if key not in _FUSED:
        _FUSED[key] = FusedQuantizedAllReduce(cuda_workspace(key[0], allocation_timeout_s), max_programs_for(device))
    return _FUSED[key]


@dataclass
class QuantizedHookState:
    """What `quantized_allreduce_hook` needs: the codec, the group (None: the default group, as torch's hooks take
    it; a DDP model over a data-parallel group must be given that group: DDP does not pass it), and `chooser`'s
    threshold: buckets below min_bytes go plain. 0 (the default) quantizes every bucket, as a configured codec
    asks; pass MIN_QUANTIZED_BYTES for the size rule. allocation_timeout_s: how long the fused kernel's ranks wait
    for each other at its workspace's allocation (`fused_for_group`). The hook keeps each bucket's block-aligned
    buffer here (`aligned_buffer`). An unknown codec is refused here, when made: in the hook it would raise only
    after a whole forward and backward, and with min_bytes only at a bucket past it (smaller ones go plain)."""
    codec: str
    group: dist.ProcessGroup | None = None
    min_bytes: int = 0
    allocation_timeout_s: float = ALLOCATION_TIMEOUT_S
    _aligned: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        check_codec(self.codec)

    def aligned_buffer(self, bucket: dist.GradBucket, views: list[torch.Tensor], codec: str
                       ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """The bucket's `flat_buffer` for these gradients and its `padding_views`, made once per bucket layout (DDP
        rebuilds its buckets once, after the first step), not allocated at every step (only the gaps are zeroed)."""
        layout = (codec, tuple((v.shape, v.dtype, v.device) for v in views))
        kept = self._aligned.get(bucket.index())
        if kept is None or kept[0] != layout:
            flat, aligned = flat_buffer(views, codec)
            kept = self._aligned[bucket.index()] = (layout, (flat, aligned,
                                                             padding_views(flat, [v.numel() for v in views], codec)))
        return kept[1]


# No `from __future__ import annotations` here: DDP checks the hook's annotations as objects.
def quantized_allreduce_hook(state: QuantizedHookState,
                             bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's gradients averaged over ranks with the state's codec.

    Register with `ddp_model.register_comm_hook(QuantizedHookState("q8"), quantized_allreduce_hook)`. The
    exchange is enqueued inside backward on the current stream (fused on CUDA: one launch; the bulk twin's
    collectives are synchronous). DDP packs a bucket's parameters back to back, where a small parameter's gradients
    sharing a block with a larger one's would get that block's scale (a 1e-3 gradient beside 1e3 ones came back 0).
    So, with a codec, a bucket whose parameters do not each start at a block is reduced in `flat_buffer`'s layout
    (each from a block, its error its own blocks') and copied back: one copy each way. A bucket laid out so
    already (a single parameter, sizes of whole blocks) or a plain codec's is reduced in place."""
    grads = bucket.buffer()
    codec = chooser(grads.numel() * grads.element_size(), state.codec, state.min_bytes)
    views = bucket.gradients()  # each parameter's, views of grads; laid out alike on every rank: one branch for all
    if ([v.storage_offset() - grads.storage_offset() for v in views]
            == block_offsets([v.numel() for v in views], codec)[:-1]):
        flat = grads  # in place: no copy
    else:
        flat, aligned, gaps = state.aligned_buffer(bucket, views, codec)
        torch._foreach_copy_(aligned, views)
        if gaps:  # NaN where a non-finite block of an earlier step held them
            torch._foreach_zero_(gaps)
    quantized_all_reduce(flat, codec, state.group, mean=True, out=flat,
                         allocation_timeout_s=state.allocation_timeout_s)
    if flat is not grads:
        torch._foreach_copy_(views, aligned)
    fut = torch.futures.Future()
    fut.set_result(grads)
    return fut
