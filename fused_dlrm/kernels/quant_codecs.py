"""Line codecs for quantized collectives: blocks of 32 values, each block's codes in whole 32-bit words.

A tensor of n values is cut into blocks of 32 consecutive values (the last block zero-padded). The encoding of
num_blocks blocks (`Encoded`) is planar: a payload array of int32 words, block-major ([num_blocks, words]: block
i's codes are words i * words .. i * words + words - 1), and a separate bf16 scale array ([num_blocks]; empty
for fp16, which has no scale). Any range of blocks is a contiguous range of both arrays, so a collective can
send chunks of an encoded tensor without re-packing, and kernels move whole words with wide aligned accesses.

A code of b bits takes b words per block, 32 // b codes to a word: code j of a block is in word j // (32 // b),
from bit b * (j % (32 // b)). q6 is stored as two such planes so that no code straddles a word: the low 4 bits
of its codes (words 0-3, 8 to a word), then their high 2 bits (words 4-5, 16 to a word).

| codec | code per value | scale | bytes per block | reference error bound per element (x fp32, s the block's scale) |
| --- | --- | --- | --- | --- |
| fp16 | fp16 bits | none | 64 | |x| * 2^-11 + 2^-25 (round to nearest) for |x| < 65520; beyond, +-inf (bound inf) |
| fp8 | e4m3 (fn) bits | absmax / 448 | 34 | |x| * (2^-4 + 2^-20) + s * 2^-10 (relative for normals, s * 2^-10 below 2^-6 * s) |
| q8 | 8-bit int | absmax / 127 | 34 | s / 2 |
| q6 | 6-bit int, 4 + 2 bit planes | absmax / 31 | 26 | s / 2 |
| q4 | 4-bit int | absmax / 7 | 18 | s / 2 |

Scales are stored in bf16 (fp32's exponent range in fp16's two bytes) rounded *up* (never below absmax / qmax,
at most 2^-7 above it), so |x / s| <= qmax; a block of zeros gets scale 0 and decodes to zeros. The scale's range
is [2^-126, the largest s with qmax * s finite in fp32]: below, absmax / qmax < 2^-126 (absmax < qmax * 1.2e-38)
gets the smallest normal scale 2^-126 (so 1 / s = 2^126 is finite and exact), and such a block keeps fewer
levels (the table's bounds hold with the scale stored); above, a block whose rounded-up scale times qmax
overflows fp32 (absmax > 3.39e38, within 0.2% of fp32's largest value; q8: > 3.4026e38) is out of range and
decodes as NaN, as a non-finite block (below). (fp16 scales, subnormal below 6.1e-5, i.e. for q8 at
absmax < 7.8e-3, left gradient-sized blocks few levels: q8 blocks at absmax 1e-7 came back half zeros.)
A value is scaled as v = x * (1 / s), the reciprocal and the product each rounded to fp32, so |v| may pass qmax
by a few fp32 steps: integer codes are clamped to +-qmax, and e4m3's rounding brings such a v back to 448 (no
overflow). Integer codes are floor(v + 0.5) (ties away from -inf), stored offset-binary (q + 2^(b-1)). The
bounds hold up to the fp32 roundings of 1 / s, x * (1 / s), v + 0.5 and q * s (relative 2^-24 each;
`error_bound` adds that slack).

fp16's range ends at 65504: values from 65520 (half its last step above) encode as +-inf, as torch's cast makes
them, and so do the all-reduce's partial sums past it, its terms within it or not (kernels/quantized_allreduce.py);
the scaled codecs have fp32's range. Below fp16's normals (|x| < 2^-14 = 6.1e-5) its step is a fixed 2^-24: the
error stays within 2^-25 = 3.0e-8 absolute (the table's bound), a relative error growing as |x| falls (measured,
values spread over each decade: up to 3e-3 at 1e-5..1e-4, 3e-2 at 1e-6..1e-5, 0.2 at 1e-7..1e-6), and values up to
2^-25 come back 0 (those up to 9e-8 as 2^-24 = 6e-8): gradients of that size (a norm's, a shared expert's at
~2.5e-5: ~1e-3 per rounding) lose precision to fp16 that its 65504 overflow does not warn of.

Non-finite values are never laundered into finite ones (a diverging step's NaN must reach the checks downstream):
fp16 keeps each value (inf with its sign, every NaN as the one pattern FP16_NAN). A scaled codec's block holding a
NaN or +-inf, or beyond the scale's range, gets the scale BF16_NAN and codes of zero: it decodes as all NaN (one
scale cannot carry inf beside finite values; the sign of inf is lost). The kernels find such blocks by integer
compares of bits, so that no NaN meets a float max / min, whose NaN semantics differ (GPUs' max.f32 returns the
other operand, the interpreter's numpy maximum the NaN).

`encode_reference` / `decode_reference` are the pure-torch definition; the Triton kernels agree with them bit
for bit (tests/test_quant_codecs.py). fp32 -> e4m3 rounding and e4m3 -> fp32 are done with integer bit
operations in the kernels because the Triton interpreter's fp8 casts do not round to nearest. The per-block
steps are @triton.jit device functions (`block_values`, `encode_blocks`, `store_blocks`, `load_blocks`) shared by
the encode and decode kernels here and the fused all-reduce (kernels/quantized_allreduce.py). A tile of blocks'
payload is one contiguous [blocks, words] int32 array whose rows are 16-byte multiples (q6: 24 bytes), so
compiled for sm_90 from a 16-byte aligned base, a thread's consecutive words load and store as one vector of up
to 128 bits (q6: 64; the all-reduce's PTX is checked by tests/test_quantized_allreduce_kernel.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fused_dlrm.kernels.launch import interpreting

BLOCK = 32  # values per block (one scale)
BLOCKS_PER_PROGRAM = 32  # blocks one kernel program encodes or decodes (not tuned)

FP16, FP8, INT = 0, 1, 2  # kinds of codec (the kernels' KIND)
FP16_NAN = tl.constexpr(0x7E00)  # the bits of the fp16 NaN that the fp16 codec stores (torch's float("nan"))
BF16_NAN = tl.constexpr(0x7FC0)  # the bits of the bf16 NaN scale of a non-finite block (torch's float("nan"))
MIN_SCALE_BITS = tl.constexpr(0x0080)  # bf16 bits of the smallest scale but 0: 2^-126, bf16's smallest normal
INF_BITS = tl.constexpr(0x7F800000)  # fp32 inf's bits
FP16_OVERFLOW = 65520.0  # the least |x| that rounds to fp16's inf: 65504, its largest, plus half its last step
# Launch option of every kernel that encodes or decodes: no fused multiply-add (of x * (1 / s) and + 0.5 when
# encoding, of decode and sum in the all-reduce), so the kernels round as the reference does. The interpreter
# takes no such option (and fuses nothing).
NO_FMA = {} if interpreting() else {"enable_fp_fusion": False}


@dataclass(frozen=True)
class Codec:
    name: str
    kind: int
    bits: int  # bits of one value's code = int32 payload words per block
    qmax: float  # largest |code| of the scaled value (448 for e4m3, 2^(b-1) - 1 for integers)
    low_bits: int  # bits of the code in the first plane (the rest, bits - low_bits, in the second)

    @property
    def words(self) -> int:
        return self.bits

    @property
    def planes(self) -> tuple[tuple[int, int], ...]:
        """(shift, bits) of each plane: the codes' bits shift .. shift + bits - 1, in payload words shift ..
        shift + bits - 1 of their block."""
        high = self.bits - self.low_bits
        return ((0, self.low_bits),) + (((self.low_bits, high),) if high else ())

    @property
    def scaled(self) -> bool:
        return self.kind != FP16

    @property
    def block_bytes(self) -> int:
        return 4 * self.words + (2 if self.scaled else 0)


CODECS = {c.name: c for c in [
    Codec("fp16", FP16, 16, 0.0, 16),
    Codec("fp8", FP8, 8, 448.0, 8),
    Codec("q8", INT, 8, 127.0, 8),
    Codec("q6", INT, 6, 31.0, 4),  # planes of 4 and 2 bits (words of 8 and 16 codes)
    Codec("q4", INT, 4, 7.0, 4),
]}


class Encoded(NamedTuple):
    """The encoding of num_blocks blocks: int32 payload [num_blocks, words], bf16 scales [num_blocks] (fp16: [0])."""
    payload: torch.Tensor
    scales: torch.Tensor


def num_blocks_for(numel: int) -> int:
    return triton.cdiv(numel, BLOCK)


def _blocks(x: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """x as fp32 [num_blocks, 32], zero-padded."""
    flat = x.reshape(-1).float()
    out = flat.new_zeros(num_blocks * BLOCK)
    out[:flat.numel()] = flat
    return out.view(num_blocks, BLOCK)


def _scale_up(xb: torch.Tensor, qmax: float) -> torch.Tensor:
    """bf16 bits (int32 [blocks]) of the scales of blocks xb [blocks, 32]: absmax / qmax (fp32) rounded up to bf16,
    at least 2^-126 (0 for a block of zeros); inf (0x7F80) for a block holding NaN or +-inf or whose qmax * scale
    overflows fp32. absmax is the max of |x|'s bits (integers order non-negative floats and put NaN above inf: no
    NaN meets a float max)."""
    a = xb.abs().view(torch.int32).amax(1)
    finite = a < INF_BITS.value
    ratio = torch.where(finite, a, 0).view(torch.float32) / qmax
    s = (ratio.view(torch.int32) + 0xFFFF) >> 16  # round up: the bits of non-negative floats order as integers
    s = torch.where(a > 0, s.clamp(min=MIN_SCALE_BITS.value), 0)
    finite &= ((s << 16).view(torch.float32) * qmax).view(torch.int32) < INF_BITS.value  # the decode's largest value
    return torch.where(finite, s, 0x7F80)


def _stored(scale_bits: torch.Tensor) -> torch.Tensor:
    """The bf16 scales stored: BF16_NAN for inf (a non-finite block, which decodes as NaN)."""
    return torch.where(scale_bits == 0x7F80, BF16_NAN.value, scale_bits).short().view(torch.bfloat16)


def block_scales(x: torch.Tensor, codec: str, num_blocks: int | None = None) -> torch.Tensor:
    """bf16 [num_blocks] scales of a scaled codec (absmax / qmax rounded up to bf16, at least 2^-126; NaN for a
    non-finite block)."""
    return _stored(_scale_up(_blocks(x, num_blocks or num_blocks_for(x.numel())), CODECS[codec].qmax))


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [blocks, bits]: the low `bits` bits of codes (int32 [blocks, 32]), 32 // bits to a word."""
    per_word = 32 // bits
    k = torch.arange(per_word, device=codes.device, dtype=torch.int32)
    v = (codes & ((1 << bits) - 1)).view(-1, bits, per_word)
    return (v << (bits * k)).sum(-1, dtype=torch.int32)  # the codes' bits do not overlap: sum = or


def _unpack(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [blocks, 32]: the codes of `bits` bits packed in words (int32 [blocks, bits])."""
    k = torch.arange(32 // bits, device=words.device, dtype=torch.int32)
    return ((words[:, :, None] >> (bits * k)) & ((1 << bits) - 1)).view(-1, BLOCK)


def encode_reference(x: torch.Tensor, codec: str, num_blocks: int | None = None) -> Encoded:
    """The encoding of x's values (fp32/fp16/bf16); blocks past x's end encode zeros. num_blocks defaults to
    ceil(numel / 32)."""
    c = CODECS[codec]
    xb = _blocks(x, num_blocks or num_blocks_for(x.numel()))
    if c.kind == FP16:
        codes = torch.where(xb.isnan(), FP16_NAN.value, xb.half().view(torch.int16).int() & 0xFFFF)
        scales = xb.new_empty(0, dtype=torch.bfloat16)
    else:
        bits = _scale_up(xb, c.qmax)
        sf = (bits << 16).view(torch.float32)[:, None]
        # an all-zero block has scale 0 and codes 0; a non-finite one (scale inf) codes 0, its scale NaN
        v = torch.where(sf < torch.inf, xb * torch.where(sf > 0, 1.0 / sf, 1.0), 0.0)
        scales = _stored(bits)
        if c.kind == FP8:
            codes = v.to(torch.float8_e4m3fn).view(torch.uint8).int()
        else:
            codes = (v + 0.5).floor().clamp(-c.qmax, c.qmax).int() + int(c.qmax) + 1
    payload = torch.cat([_pack(codes >> shift, bits) for shift, bits in c.planes], 1)
    return Encoded(payload, scales)


def decode_reference(enc: Encoded, codec: str, numel: int) -> torch.Tensor:
    """fp32 [numel]: the first numel values of the encoded blocks."""
    c = CODECS[codec]
    codes = sum(_unpack(enc.payload[:, shift:shift + bits], bits) << shift for shift, bits in c.planes)
    if c.kind == FP16:
        x = codes.short().view(torch.float16).float()
    else:
        s = enc.scales.float()[:, None]
        if c.kind == FP8:
            x = codes.to(torch.uint8).view(torch.float8_e4m3fn).float() * s
        else:
            x = (codes - (int(c.qmax) + 1)).float() * s
    return x.reshape(-1)[:numel]


def error_bound(x: torch.Tensor, codec: str) -> torch.Tensor:
    """fp32 per-element bound on |x - decode(encode(x))| (the table above, plus fp32 rounding slack); inf where x
    encodes as +-inf (fp16 from |x| >= 65520: no finite bound), NaN where x is NaN or its scaled block non-finite."""
    c = CODECS[codec]
    a = x.reshape(-1).float().abs()
    if c.kind == FP16:
        return torch.where(a >= FP16_OVERFLOW, torch.inf, a * 2.0**-11 + 2.0**-25)
    s = block_scales(x, codec).float().repeat_interleave(BLOCK)[:a.numel()]  # NaN (no bound) where non-finite
    if c.kind == FP8:
        return a * (2.0**-4 + 2.0**-20) + s * 2.0**-10
    return s * (0.5 + (c.qmax + 1) * 2.0**-21)  # the slack: 1 / s, x * (1 / s), v + 0.5 and q * s rounded in fp32


@triton.jit
def _fp32_to_e4m3(v):
    """e4m3fn code (int32) of finite fp32 v with |v| <= 448, round to nearest even."""
    bits = v.to(tl.int32, bitcast=True)
    a = tl.abs(v)
    abits = a.to(tl.int32, bitcast=True)
    # Normals: round the 23-bit mantissa to 3 bits (a carry moves into the exponent), rebias 127 -> 7.
    normal = ((abits + 0x7FFFF + ((abits >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormals (a < 2^-6): multiples of 2^-9; adding 2^23 rounds a * 512 to the nearest even integer.
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(a < 0.015625, sub, normal)
    return code | (((bits >> 31) & 1) << 7)


@triton.jit
def _e4m3_to_fp32(u):
    """fp32 value of e4m3fn code u (int32, 0..255; never the NaN code)."""
    mag = tl.where((u & 0x78) == 0, (u & 7).to(tl.float32) * 0.001953125,  # subnormal: m * 2^-9
                   (((u & 0x7F) << 20) + (120 << 23)).to(tl.float32, bitcast=True))
    # the sign by its bit: Triton's -x is 0 - x, which turns the code of -0 (0x80) into +0
    return (mag.to(tl.int32, bitcast=True) | ((u & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def block_values(r):
    """int64 [ROWS, 32]: the flat index of every value of blocks r (int [ROWS]), one block per row."""
    return r.to(tl.int64)[:, None] * 32 + tl.arange(0, 32)[None, :]


@triton.jit
def encode_blocks(x, KIND: tl.constexpr, QMAX: tl.constexpr, OFFSET: tl.constexpr):
    """fp32 x [ROWS, 32] (one block per row) -> (codes int32 [ROWS, 32], scales bf16 [ROWS]; 0 for fp16)."""
    if KIND == 0:
        u = x.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        u = tl.where(x != x, FP16_NAN, u)  # one NaN pattern (GPUs' cvt gives a canonical NaN, torch keeps bits)
        s = tl.zeros([x.shape[0]], dtype=tl.bfloat16)
    else:
        # absmax as the max of |x|'s bits: integers order non-negative floats and put NaN above inf, so no NaN
        # meets a float max (GPUs' max.f32 returns the other operand, the interpreter's numpy the NaN).
        amax = tl.max(tl.abs(x).to(tl.int32, bitcast=True), axis=1)
        nonfinite = amax >= INF_BITS  # a block holding NaN or +-inf
        ratio = tl.math.div_rn(tl.where(nonfinite, 0, amax).to(tl.float32, bitcast=True), QMAX)
        # Rounded up to bf16 by integer arithmetic (the interpreter's fp32 -> bf16 cast truncates), at least 2^-126
        # (so a denormal ratio gives 2^-126 whether or not the division flushed it to 0).
        s = (ratio.to(tl.int32, bitcast=True) + 0xFFFF) >> 16
        s = tl.where(amax > 0, tl.maximum(s, MIN_SCALE_BITS), 0)
        sf = (s << 16).to(tl.float32, bitcast=True)
        # beyond the scale's range: the decode's largest value, QMAX * s, would overflow fp32 (bits compared)
        nonfinite |= (sf * QMAX).to(tl.int32, bitcast=True) >= INF_BITS
        # One IEEE reciprocal per block (div_rn: Triton's `/` is approximate on GPUs), then a product per value: a
        # division per value (~10 instructions on sm_90) made the encode compute-bound. The launches disable fp
        # fusion, so x * inv is rounded before the + 0.5 below, as in the reference.
        inv = tl.math.div_rn(tl.full(sf.shape, 1.0, tl.float32), tl.where(sf > 0, sf, 1.0))
        # A non-finite block: codes of 0 (v never NaN: the clamp's and int cast's NaN handling differ between GPUs
        # and the interpreter) and scale NaN, so that it decodes as NaN.
        v = tl.where(nonfinite[:, None], 0.0, x * inv[:, None])
        s = tl.where(nonfinite, BF16_NAN, s).to(tl.int16).to(tl.bfloat16, bitcast=True)
        if KIND == 1:
            u = _fp32_to_e4m3(v)
        else:
            q = tl.minimum(tl.maximum(tl.floor(v + 0.5), -QMAX), QMAX)
            u = q.to(tl.int32) + OFFSET
    return u, s


@triton.jit
def _pack_plane(u, SHIFT: tl.constexpr, BITS: tl.constexpr):
    """int32 [ROWS, BITS]: bits SHIFT .. SHIFT + BITS - 1 of codes u [ROWS, 32], 32 // BITS to a word."""
    v = tl.reshape((u >> SHIFT) & ((1 << BITS) - 1), [u.shape[0], BITS, 32 // BITS])
    return tl.sum(v << (BITS * tl.arange(0, 32 // BITS))[None, None, :], axis=2)  # no bits overlap: sum = or


@triton.jit
def _unpack_plane(words, BITS: tl.constexpr):
    """int32 [ROWS, 32]: the codes of BITS bits packed in words [ROWS, BITS].

    Each word is halved (low bits, high bits) until single codes remain, the halves joined into a new last
    dimension of 2 each time: tl.join keeps a word's codes in the thread that loaded it, so a thread ends with
    32 // BITS consecutive values. (Shifting a broadcast [ROWS, BITS, 32 // BITS] let Triton spread a word's codes
    over the threads of a warp where nothing else fixed the layout: the all-reduce's reduce phase then took warp
    shuffles for every block's max and every packed word.)"""
    u = words
    for level in tl.static_range(5):
        if (32 >> level) > BITS:  # halves of 32 >> level bits each hold codes: split them
            u = tl.join(u, u >> (16 >> level))  # bits above a half are cleared at the end
    return tl.reshape(u, [words.shape[0], 32]) & ((1 << BITS) - 1)


@triton.jit
def store_blocks(payload_ptr, scale_ptr, r, mask, u, s, KIND: tl.constexpr, WORDS: tl.constexpr,
                 LOW: tl.constexpr):
    """Store encoded blocks r (int [ROWS], where mask): codes u [ROWS, 32] packed into int32 payload_ptr[r, :WORDS]
    (plane by plane), scales s into bf16 scale_ptr[r]."""
    at = payload_ptr + r[:, None] * WORDS
    tl.store(at + tl.arange(0, LOW)[None, :], _pack_plane(u, 0, LOW), mask=mask[:, None])
    if WORDS > LOW:
        tl.store(at + LOW + tl.arange(0, WORDS - LOW)[None, :], _pack_plane(u, LOW, WORDS - LOW),
                 mask=mask[:, None])
    if KIND != 0:
        tl.store(scale_ptr + r, s, mask=mask)


@triton.jit
def load_blocks(payload_ptr, scale_ptr, r, mask, KIND: tl.constexpr, OFFSET: tl.constexpr, WORDS: tl.constexpr,
                LOW: tl.constexpr):
    """fp32 [ROWS, 32]: the decoded values of blocks r (int [ROWS]; masked blocks read as code 0, scale 0)."""
    at = payload_ptr + r[:, None] * WORDS
    u = _unpack_plane(tl.load(at + tl.arange(0, LOW)[None, :], mask=mask[:, None], other=0), LOW)
    if WORDS > LOW:
        high = tl.load(at + LOW + tl.arange(0, WORDS - LOW)[None, :], mask=mask[:, None], other=0)
        u = u | (_unpack_plane(high, WORDS - LOW) << LOW)
    if KIND == 0:
        x = u.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        # bf16 -> fp32 by its bits (exact, NaN kept, alike on GPUs and in the interpreter)
        s = tl.load(scale_ptr + r, mask=mask, other=0.0).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        s = (s << 16).to(tl.float32, bitcast=True)[:, None]
        if KIND == 1:
            x = _e4m3_to_fp32(u) * s
        else:
            x = (u - OFFSET).to(tl.float32) * s
    return x


@triton.jit
def _codec_kernel(values_ptr, payload_ptr, scale_ptr, numel, num_blocks, DECODE: tl.constexpr,
                  KIND: tl.constexpr, QMAX: tl.constexpr, OFFSET: tl.constexpr, WORDS: tl.constexpr,
                  LOW: tl.constexpr, ROWS: tl.constexpr):
    """Encode values into (payload, scales), or (DECODE) decode them into fp32 values; ROWS blocks per program."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    idx = block_values(r)
    if DECODE:
        x = load_blocks(payload_ptr, scale_ptr, r, r < num_blocks, KIND, OFFSET, WORDS, LOW)
        tl.store(values_ptr + idx, x, mask=idx < numel)
    else:
        x = tl.load(values_ptr + idx, mask=idx < numel, other=0.0).to(tl.float32)
        u, s = encode_blocks(x, KIND, QMAX, OFFSET)
        store_blocks(payload_ptr, scale_ptr, r, r < num_blocks, u, s, KIND, WORDS, LOW)


def kernel_constants(c: Codec) -> dict:
    """The codec's constexpr arguments of the device functions above."""
    return dict(KIND=c.kind, QMAX=c.qmax, OFFSET=int(c.qmax) + 1, WORDS=c.words, LOW=c.low_bits)


def encode(x: torch.Tensor, codec: str, num_blocks: int | None = None) -> Encoded:
    """The kernel twin of `encode_reference` (one launch)."""
    c = CODECS[codec]
    nb = num_blocks or num_blocks_for(x.numel())
    if nb < num_blocks_for(x.numel()):
        raise ValueError(f"{nb} blocks cannot hold {x.numel()} values")
    x = x.contiguous().view(-1)
    enc = Encoded(torch.empty(nb, c.words, dtype=torch.int32, device=x.device),
                  torch.empty(nb if c.scaled else 0, dtype=torch.bfloat16, device=x.device))
    _codec_kernel[(triton.cdiv(nb, BLOCKS_PER_PROGRAM),)](x, *enc, x.numel(), nb, DECODE=False,
                                                          ROWS=BLOCKS_PER_PROGRAM, **kernel_constants(c), **NO_FMA)
    return enc


def decode(enc: Encoded, codec: str, numel: int) -> torch.Tensor:
    """The kernel twin of `decode_reference` (one launch): fp32 [numel]."""
    c = CODECS[codec]
    payload, scales = enc
    nb = payload.shape[0]
    if (payload.shape != (nb, c.words) or payload.dtype != torch.int32 or scales.dtype != torch.bfloat16
            or scales.shape != (nb if c.scaled else 0,) or numel > nb * BLOCK):
        raise ValueError(f"payload {tuple(payload.shape)}, scales {tuple(scales.shape)} are no {codec} encoding "
                         f"of {numel} values")
    out = torch.empty(numel, dtype=torch.float32, device=payload.device)
    _codec_kernel[(triton.cdiv(nb, BLOCKS_PER_PROGRAM),)](out, payload.contiguous(), scales.contiguous(), numel, nb,
                                                          DECODE=True, ROWS=BLOCKS_PER_PROGRAM, **kernel_constants(c),
                                                          **NO_FMA)
    return out
