"""Line codecs for quantized collectives: blocks of 32 values, each encoded into one self-contained byte row.

A tensor of n values is cut into blocks of 32 consecutive values (the last block zero-padded); block i becomes
row i of a uint8 [num_blocks, row_bytes] tensor: the packed payload, then (scaled codecs) the block's fp16 scale,
little-endian. One row per block means any range of blocks is a contiguous range of rows, so a collective can
send chunks of an encoded tensor without re-packing.

| codec | payload per value | scale | row bytes | reference error bound per element (x fp32, s the block's scale) |
| --- | --- | --- | --- | --- |
| fp16 | fp16 bits | none | 64 | |x| * 2^-11 + 2^-25 (round to nearest; |x| <= 65504) |
| fp8 | e4m3 (fn) bits | absmax / 448 | 34 | |x| * 2^-4 + s * 2^-10 (relative for normals, s * 2^-10 below 2^-6 * s) |
| q8 | 8-bit int | absmax / 127 | 34 | s / 2 |
| q6 | 6-bit int, 4 values in 3 bytes | absmax / 31 | 26 | s / 2 |
| q4 | 4-bit int, 2 values in 1 byte | absmax / 7 | 18 | s / 2 |

Scales are stored in fp16 rounded *up* (never below absmax / qmax), so |x / s| <= qmax: integer codes need no
saturation and e4m3 never overflows; a block of zeros gets scale 0 and decodes to zeros. Integer codes are
floor(x / s + 0.5) (ties away from -inf), stored offset-binary (q + 2^(b-1)). The bounds hold up to fp32
rounding of x / s and q * s (relative 2^-24; `error_bound` adds that slack) and require absmax <= 65504 * qmax
(the fp16 scale's range; gradients beyond that are already lost).

`encode_reference` / `decode_reference` are the pure-torch definition; the Triton kernels agree with them bit
for bit (tests/test_quant_codecs.py). fp32 -> e4m3 rounding and e4m3 -> fp32 are done with integer bit
operations in the kernels because the Triton interpreter's fp8 casts do not round to nearest. The per-block
steps are @triton.jit device functions (`block_values`, `encode_blocks`, `store_rows`, `load_blocks`) shared by
the encode and decode kernels here and the fused all-reduce (kernels/quantized_allreduce.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK = 32  # values per block (one scale, one row)
BLOCKS_PER_PROGRAM = 32  # rows one kernel program encodes or decodes (not tuned)

FP16, FP8, INT = 0, 1, 2  # kinds of codec (the kernels' KIND)


@dataclass(frozen=True)
class Codec:
    name: str
    kind: int
    bits: int  # bits of one value's code
    qmax: float  # largest |code| of the scaled value (448 for e4m3, 2^(b-1) - 1 for integers)
    values_per_word: int  # values packed together into `bytes_per_word` bytes

    @property
    def bytes_per_word(self) -> int:
        return self.values_per_word * self.bits // 8

    @property
    def scaled(self) -> bool:
        return self.kind != FP16

    @property
    def payload_bytes(self) -> int:
        return BLOCK * self.bits // 8

    @property
    def row_bytes(self) -> int:
        return self.payload_bytes + (2 if self.scaled else 0)


CODECS = {c.name: c for c in [
    Codec("fp16", FP16, 16, 0.0, 1),
    Codec("fp8", FP8, 8, 448.0, 1),
    Codec("q8", INT, 8, 127.0, 1),
    Codec("q6", INT, 6, 31.0, 4),  # 4 values = 24 bits = 3 bytes
    Codec("q4", INT, 4, 7.0, 2),  # 2 values = 1 byte
]}


def num_blocks_for(numel: int) -> int:
    return triton.cdiv(numel, BLOCK)


def _blocks(x: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """x as fp32 [num_blocks, 32], zero-padded."""
    flat = x.reshape(-1).float()
    out = flat.new_zeros(num_blocks * BLOCK)
    out[:flat.numel()] = flat
    return out.view(num_blocks, BLOCK)


def _scale_up(ratio: torch.Tensor) -> torch.Tensor:
    """fp16 scale >= ratio (fp32): round to nearest, then one fp16 step up where that fell below."""
    s = ratio.half()
    return (s.view(torch.int16) + (s.float() < ratio).short()).view(torch.float16)


def block_scales(x: torch.Tensor, codec: str, num_blocks: int | None = None) -> torch.Tensor:
    """fp16 [num_blocks] scales of a scaled codec (absmax / qmax rounded up to fp16)."""
    c = CODECS[codec]
    xb = _blocks(x, num_blocks or num_blocks_for(x.numel()))
    return _scale_up(xb.abs().amax(1) / c.qmax)


def encode_reference(x: torch.Tensor, codec: str, num_blocks: int | None = None) -> torch.Tensor:
    """uint8 [num_blocks, row_bytes]: the encoding of x's values (fp32/fp16/bf16), blocks past x's end encode
    zeros. num_blocks defaults to ceil(numel / 32)."""
    c = CODECS[codec]
    nb = num_blocks or num_blocks_for(x.numel())
    xb = _blocks(x, nb)
    if c.kind == FP16:
        u = xb.half().view(torch.int16).int() & 0xFFFF
    else:
        s = _scale_up(xb.abs().amax(1) / c.qmax)
        sf = s.float()[:, None]
        v = xb / torch.where(sf > 0, sf, 1.0)  # an all-zero block has scale 0 and codes 0
        if c.kind == FP8:
            u = v.to(torch.float8_e4m3fn).view(torch.uint8).int()
        else:
            u = (v + 0.5).floor().clamp(-c.qmax, c.qmax).int() + int(c.qmax) + 1
    k = torch.arange(c.values_per_word, device=x.device, dtype=torch.int32)
    words = (u.view(nb, -1, c.values_per_word) << (c.bits * k)).sum(-1, dtype=torch.int32)
    payload = torch.stack([(words >> (8 * j)) & 255 for j in range(c.bytes_per_word)], -1)
    rows = payload.reshape(nb, c.payload_bytes).to(torch.uint8)
    if c.scaled:
        rows = torch.cat([rows, s.view(torch.uint8).view(nb, 2)], 1)
    return rows


def decode_reference(rows: torch.Tensor, codec: str, numel: int) -> torch.Tensor:
    """fp32 [numel]: the first numel values of the encoded rows."""
    c = CODECS[codec]
    nb = rows.shape[0]
    payload = rows[:, :c.payload_bytes].int().view(nb, -1, c.bytes_per_word)
    words = sum(payload[:, :, j] << (8 * j) for j in range(c.bytes_per_word))
    k = torch.arange(c.values_per_word, device=rows.device, dtype=torch.int32)
    u = ((words[:, :, None] >> (c.bits * k)) & ((1 << c.bits) - 1)).view(nb, BLOCK)
    if c.kind == FP16:
        x = u.short().view(torch.float16).float()
    else:
        s = rows[:, c.payload_bytes:].contiguous().view(torch.float16).float()
        if c.kind == FP8:
            x = u.to(torch.uint8).view(torch.float8_e4m3fn).float() * s
        else:
            x = (u - (int(c.qmax) + 1)).float() * s
    return x.reshape(-1)[:numel]


def error_bound(x: torch.Tensor, codec: str) -> torch.Tensor:
    """fp32 per-element bound on |x - decode(encode(x))| (the table above, plus fp32 rounding slack)."""
    c = CODECS[codec]
    a = x.reshape(-1).float().abs()
    if c.kind == FP16:
        return a * 2.0**-11 + 2.0**-25
    s = block_scales(x, codec).float().repeat_interleave(BLOCK)[:a.numel()]
    if c.kind == FP8:
        return a * 2.0**-4 + s * 2.0**-10
    return s * (0.5 + c.qmax * 2.0**-22)  # the slack: x / s and q * s are rounded in fp32


@triton.jit
def _fp32_to_e4m3(v):
    """e4m3fn code (int32) of fp32 v with |v| <= 448, round to nearest even."""
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
    return tl.where((u & 0x80) != 0, -mag, mag)


@triton.jit
def block_values(r, K: tl.constexpr):
    """int64 [ROWS, 32 // K, K]: the index of every value of blocks r (int [ROWS]) in the flat tensor."""
    g = tl.arange(0, 32 // K)
    k = tl.arange(0, K)
    return r.to(tl.int64)[:, None, None] * 32 + g[None, :, None] * K + k[None, None, :]


@triton.jit
def encode_blocks(x, KIND: tl.constexpr, BITS: tl.constexpr, QMAX: tl.constexpr, OFFSET: tl.constexpr,
                  K: tl.constexpr):
    """fp32 x [ROWS, 32 // K, K] (one block per row) -> (payload words int32 [ROWS, 32 // K], scale bits int32
    [ROWS]; 0 for fp16)."""
    if KIND == 0:
        u = x.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        s_bits = tl.zeros([x.shape[0]], dtype=tl.int32)
    else:
        ratio = tl.math.div_rn(tl.max(tl.max(tl.abs(x), axis=2), axis=1), QMAX)
        s = ratio.to(tl.float16)
        s = (s.to(tl.int16, bitcast=True) + (s.to(tl.float32) < ratio).to(tl.int16)).to(tl.float16, bitcast=True)
        sf = s.to(tl.float32)
        # div_rn: IEEE division on GPU too (Triton's `/` is approximate there), so the codes match the reference.
        v = tl.math.div_rn(x, tl.where(sf > 0, sf, 1.0)[:, None, None])
        if KIND == 1:
            u = _fp32_to_e4m3(v)
        else:
            q = tl.minimum(tl.maximum(tl.floor(v + 0.5), -QMAX), QMAX)
            u = q.to(tl.int32) + OFFSET
        s_bits = s.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    k = tl.arange(0, K)
    words = tl.sum(u << (BITS * k)[None, None, :], axis=2)  # the codes' bits do not overlap: sum = or
    return words, s_bits


@triton.jit
def store_rows(rows_ptr, r, row_mask, words, s_bits, KIND: tl.constexpr, K: tl.constexpr, NBYTES: tl.constexpr,
               PAYLOAD: tl.constexpr, ROW_BYTES: tl.constexpr):
    """Store encoded blocks (`encode_blocks`' words and scale bits) as rows r of a uint8 [rows, ROW_BYTES] tensor."""
    g = tl.arange(0, 32 // K)
    at = rows_ptr + r.to(tl.int64)[:, None] * ROW_BYTES + g[None, :] * NBYTES
    for j in tl.static_range(NBYTES):
        tl.store(at + j, ((words >> (8 * j)) & 255).to(tl.uint8), mask=row_mask[:, None])
    if KIND != 0:
        row = rows_ptr + r.to(tl.int64) * ROW_BYTES + PAYLOAD
        tl.store(row, (s_bits & 255).to(tl.uint8), mask=row_mask)
        tl.store(row + 1, (s_bits >> 8).to(tl.uint8), mask=row_mask)


@triton.jit
def load_blocks(rows_ptr, r, row_mask, KIND: tl.constexpr, BITS: tl.constexpr, OFFSET: tl.constexpr,
                K: tl.constexpr, NBYTES: tl.constexpr, PAYLOAD: tl.constexpr, ROW_BYTES: tl.constexpr):
    """fp32 [ROWS, 32 // K, K]: the decoded values of rows r of a uint8 [rows, ROW_BYTES] tensor (0 where masked)."""
    g = tl.arange(0, 32 // K)
    k = tl.arange(0, K)
    at = rows_ptr + r.to(tl.int64)[:, None] * ROW_BYTES + g[None, :] * NBYTES
    words = tl.zeros([r.shape[0], 32 // K], dtype=tl.int32)
    for j in tl.static_range(NBYTES):
        words = words | (tl.load(at + j, mask=row_mask[:, None], other=0).to(tl.int32) << (8 * j))
    u = (words[:, :, None] >> (BITS * k)[None, None, :]) & ((1 << BITS) - 1)
    if KIND == 0:
        x = u.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        row = rows_ptr + r.to(tl.int64) * ROW_BYTES + PAYLOAD
        s_bits = (tl.load(row, mask=row_mask, other=0).to(tl.int32)
                  | (tl.load(row + 1, mask=row_mask, other=0).to(tl.int32) << 8))
        s = s_bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)[:, None, None]
        if KIND == 1:
            x = _e4m3_to_fp32(u) * s
        else:
            x = (u - OFFSET).to(tl.float32) * s
    return x


@triton.jit
def _codec_kernel(src_ptr, dst_ptr, numel, num_blocks, DECODE: tl.constexpr,
                  KIND: tl.constexpr, BITS: tl.constexpr, QMAX: tl.constexpr, OFFSET: tl.constexpr,
                  K: tl.constexpr, NBYTES: tl.constexpr, PAYLOAD: tl.constexpr, ROW_BYTES: tl.constexpr,
                  ROWS: tl.constexpr):
    """Encode values src into rows dst, or (DECODE) rows src into fp32 values dst; ROWS blocks per program."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    idx = block_values(r, K)
    if DECODE:
        x = load_blocks(src_ptr, r, r < num_blocks, KIND, BITS, OFFSET, K, NBYTES, PAYLOAD, ROW_BYTES)
        tl.store(dst_ptr + idx, x, mask=idx < numel)
    else:
        x = tl.load(src_ptr + idx, mask=idx < numel, other=0.0).to(tl.float32)
        words, s_bits = encode_blocks(x, KIND, BITS, QMAX, OFFSET, K)
        store_rows(dst_ptr, r, r < num_blocks, words, s_bits, KIND, K, NBYTES, PAYLOAD, ROW_BYTES)


def kernel_constants(c: Codec) -> dict:
    """The codec's constexpr arguments of the device functions above."""
    return dict(KIND=c.kind, BITS=c.bits, QMAX=c.qmax, OFFSET=int(c.qmax) + 1, K=c.values_per_word,
                NBYTES=c.bytes_per_word, PAYLOAD=c.payload_bytes, ROW_BYTES=c.row_bytes)


def encode(x: torch.Tensor, codec: str, num_blocks: int | None = None) -> torch.Tensor:
    """The kernel twin of `encode_reference` (one launch)."""
    c = CODECS[codec]
    nb = num_blocks or num_blocks_for(x.numel())
    if nb < num_blocks_for(x.numel()):
        raise ValueError(f"{nb} blocks cannot hold {x.numel()} values")
    x = x.contiguous().view(-1)
    rows = torch.empty(nb, c.row_bytes, dtype=torch.uint8, device=x.device)
    _codec_kernel[(triton.cdiv(nb, BLOCKS_PER_PROGRAM),)](x, rows, x.numel(), nb, DECODE=False,
                                                          ROWS=BLOCKS_PER_PROGRAM, **kernel_constants(c))
    return rows


def decode(rows: torch.Tensor, codec: str, numel: int) -> torch.Tensor:
    """The kernel twin of `decode_reference` (one launch): fp32 [numel]."""
    c = CODECS[codec]
    if rows.dim() != 2 or rows.shape[1] != c.row_bytes or numel > rows.shape[0] * BLOCK:
        raise ValueError(f"{tuple(rows.shape)} rows of {codec} cannot hold {numel} values")
    out = torch.empty(numel, dtype=torch.float32, device=rows.device)
    nb = rows.shape[0]
    _codec_kernel[(triton.cdiv(nb, BLOCKS_PER_PROGRAM),)](rows.contiguous(), out, numel, nb, DECODE=True,
                                                          ROWS=BLOCKS_PER_PROGRAM, **kernel_constants(c))
    return out
