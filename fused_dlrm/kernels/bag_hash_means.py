"""The synthetic data's teacher term: per sample, the sum over features of the mean row hash of its bag.

The teacher (fused_dlrm.data.synthetic) labels each sample from sum_f mean_{v in bag(f, b)} hash(f, v), a
deterministic integer hash of (feature, row) mapped to [-1, 1]. As torch ops it is a dozen int64 elementwise
kernels over every index, a repeat_interleave and an index_add: 1.4 ms of GPU time per paper-config batch
(4096 x 128 bags, ~5M indices) on an H200, with the rest of the batch's generation, in the training loop's
batch thread every step (docs/benchmarks.md, 2026-11-24). Here one kernel reads each index once: program
(block of samples, group of features) loops over its bags' values and writes partial sums per feature group,
which a sum over the groups finishes (a fixed order: reproducible).

Hash values are bit-identical to the torch reference (int64 arithmetic, the same float64 scaling); the sums
differ from it only in fp32 summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

HASH_MOD = 2**31 - 1  # a Mersenne prime below 2**31: products with the 31-bit multipliers stay inside int64
HASH_MULTIPLIERS = (1_103_515_245, 1_664_525_077, 2_038_074_743)
HASH_SCALE = 2.0 / (HASH_MOD - 1)  # maps [0, HASH_MOD - 1] onto [0, 2] (then shifted to [-1, 1])
BLOCK_SAMPLES = 128
FEATURES_PER_PROGRAM = 8
_MOD = tl.constexpr(HASH_MOD)
_A, _B, _C = (tl.constexpr(m) for m in HASH_MULTIPLIERS)
_SCALE = tl.constexpr(HASH_SCALE)


def row_hash(features: torch.Tensor, values: torch.Tensor, salt: int) -> torch.Tensor:
    """Deterministic hash of (feature, index) mapped to [-1, 1] (float32)."""
    a, b, c = HASH_MULTIPLIERS
    # Every intermediate stays below 2**31, so products with the 31-bit multipliers fit int64.
    x = (values % HASH_MOD * a + (features + 1) * b + salt) % HASH_MOD
    x = x ^ (x >> 15)
    x = (x * c + a) % HASH_MOD
    x = x ^ (x >> 13)
    x = (x * b) % HASH_MOD
    return (x.double() * HASH_SCALE - 1.0).float()


def bag_hash_means_reference(lengths: torch.Tensor, values: torch.Tensor, batch_size: int,
                             salt: int) -> torch.Tensor:
    """Sum over features of the mean row hash of each bag (empty bags contribute 0), shape [batch_size];
    lengths are key-major ([F * B]: feature f's bags, then f + 1's), values the bags' indices in that order."""
    lengths = lengths.long()
    bag_of_value = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths,
                                           output_size=values.numel())
    hashes = row_hash(bag_of_value // batch_size, values, salt)
    bag_sums = torch.zeros(lengths.numel(), device=lengths.device).index_add_(0, bag_of_value, hashes)
    bag_means = bag_sums / lengths.clamp(min=1)
    return bag_means.view(-1, batch_size).sum(dim=0)


@triton.jit
def _row_hash(feature, values, salt):
    """row_hash on int64 lanes (the same operations, so the same bits)."""
    x = (values % _MOD * _A + (feature + 1) * _B + salt) % _MOD
    x = x ^ (x >> 15)
    x = (x * _C + _A) % _MOD
    x = x ^ (x >> 13)
    x = (x * _B) % _MOD
    scale = tl.full([1], _SCALE, tl.float64)  # a float64 constant, as torch's
    return (x.to(tl.float64) * scale - 1.0).to(tl.float32)


@triton.jit(do_not_specialize=["batch_size", "num_features", "salt"])
def _bag_hash_means_kernel(lengths_ptr, offsets_ptr, values_ptr, partial_ptr, batch_size, num_features, salt,
                           MAX_LENGTH: tl.constexpr, BLOCK: tl.constexpr, FEATURES: tl.constexpr):
    """partial[group, b] = sum over the group's features f of mean_j hash(f, values[offsets[f, b] + j])."""
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_batch = b < batch_size
    group = tl.program_id(1)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(FEATURES):  # a constexpr bound: the interpreter cannot range() over a loaded value
        f = group * FEATURES + i
        live = in_batch & (f < num_features)
        bag = f.to(tl.int64) * batch_size + b
        n = tl.load(lengths_ptr + bag, mask=live, other=0)
        start = tl.load(offsets_ptr + bag, mask=live, other=0)
        bag_sum = tl.zeros([BLOCK], dtype=tl.float32)
        for j in range(MAX_LENGTH):
            take = live & (j < n)
            v = tl.load(values_ptr + start + j, mask=take, other=0)
            bag_sum += tl.where(take, _row_hash(f.to(tl.int64), v, salt), 0.0)
        total += bag_sum / tl.maximum(n, 1).to(tl.float32)
    tl.store(partial_ptr + group * batch_size + b, total, mask=in_batch)


def bag_hash_means(lengths: torch.Tensor, values: torch.Tensor, batch_size: int, salt: int,
                   max_length: int) -> torch.Tensor:
    """bag_hash_means_reference's result: the kernel on GPUs, the torch reference elsewhere. No bag may be longer
    than max_length (the kernel's loop bound; a longer bag's tail would be left out)."""
    values = values.long()  # the hash's products need int64 (int32 indices would overflow, here and in torch)
    if values.is_cuda:
        return launch_bag_hash_means(lengths, values, batch_size, salt, max_length)
    return bag_hash_means_reference(lengths, values, batch_size, salt)


def launch_bag_hash_means(lengths: torch.Tensor, values: torch.Tensor, batch_size: int, salt: int,
                          max_length: int) -> torch.Tensor:
    """The kernel, on the tensors' device (the CPU under TRITON_INTERPRET=1)."""
    if batch_size and lengths.numel() % batch_size:
        raise ValueError(f"bag_hash_means: {lengths.numel()} lengths are no whole number of features of batch_size "
                         f"{batch_size}")
    num_features = lengths.numel() // batch_size if batch_size else 0
    if num_features == 0:
        return torch.zeros(batch_size, device=values.device)
    lengths, values = lengths.long().contiguous(), values.contiguous()  # read at ptr + i (a KJT's may be views)
    offsets = torch.cumsum(lengths, 0) - lengths
    groups = triton.cdiv(num_features, FEATURES_PER_PROGRAM)
    partial = torch.empty(groups, batch_size, device=values.device)
    _bag_hash_means_kernel[(triton.cdiv(batch_size, BLOCK_SAMPLES), groups)](
        lengths, offsets, values, partial, batch_size, num_features, salt, MAX_LENGTH=max(1, max_length),
        BLOCK=BLOCK_SAMPLES, FEATURES=FEATURES_PER_PROGRAM)
    return partial.sum(dim=0)
