"""Line codecs: the Triton kernels equal the pure-torch reference bit for bit, the reference places codes and
scales as documented (planar int32 words, q6's two planes), and meets its documented error bound on normal and
heavy-tailed data, odd lengths, zero blocks, fp32/bf16/fp16 inputs; NaN and +-inf are never laundered into
finite values (whatever a float max / min does with NaN)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fused_dlrm.kernels.launch import interpreting
from fused_dlrm.kernels.quant_codecs import (CODECS, Encoded, block_scales, decode, decode_reference, encode,
                                             encode_reference, error_bound)

# NaNs of several bit patterns: the GPUs' canonical NaN, torch's, a negative one, an fp16 NaN widened to fp32.
NAN_BITS = (0x7FFFFFFF, 0x7FC00000, 0xFFFFFFFF, 0x7FFFE000)


def floats_of(bits: list[int]) -> torch.Tensor:
    """fp32 values of the given 32-bit patterns."""
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


@pytest.fixture(params=["interpreter", "ptx"])
def max_min(request, monkeypatch):
    """The float maximum / minimum of two values as the interpreter has them (numpy's: NaN wins) or, "ptx", as
    GPUs do (max.f32 / min.f32 are maxNum / minNum: the non-NaN operand). (The interpreter's tl.max reduction
    is numpy's nanmax, which ignores NaN as GPUs do.)"""
    if request.param == "ptx":
        if not interpreting():
            pytest.skip("emulates the GPU's semantics in the interpreter")
        from triton.runtime.interpreter import InterpreterBuilder
        monkeypatch.setattr(InterpreterBuilder, "create_maxnumf", lambda self, a, b: self.binary_op(a, b, np.fmax))
        monkeypatch.setattr(InterpreterBuilder, "create_minnumf", lambda self, a, b: self.binary_op(a, b, np.fmin))
    return request.param


def data(kind: str, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return torch.randn(n, generator=g)
    if kind == "student_t":  # 2 degrees of freedom: heavy tails, blocks whose absmax dwarfs the rest
        return torch.randn(n, generator=g) / (torch.randn(n, 2, generator=g).pow(2).mean(1).sqrt())
    # Cauchy clipped at 1e4, with tiny (once fp16-subnormal scale) and all-zero blocks, and -0.0
    x = torch.tan(torch.pi * (torch.rand(n, generator=g) - 0.5)).clamp(-1e4, 1e4)
    x[32:64] = 0.0
    x[64:96] *= 1e-7
    x[96:97] = -0.0
    return x


def same(a: Encoded, b: Encoded) -> bool:
    """Bit for bit (NaN scales too)."""
    return torch.equal(a.payload, b.payload) and torch.equal(a.scales.view(torch.int16), b.scales.view(torch.int16))


@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("kind", ["normal", "student_t", "cauchy"])
@pytest.mark.parametrize("n", [1, 33, 1000, 4131])
def test_kernel_equals_reference_and_meets_bound(codec, kind, n):
    x = data(kind, n)
    enc = encode_reference(x, codec)
    c = CODECS[codec]
    assert enc.payload.shape == (-(-n // 32), c.words) and enc.payload.dtype == torch.int32
    assert enc.scales.shape == ((-(-n // 32)) if c.scaled else 0,) and enc.scales.dtype == torch.bfloat16
    assert same(encode(x, codec), enc)
    y = decode_reference(enc, codec, n)
    assert torch.equal(decode(enc, codec, n), y)
    assert not y.isnan().any()
    err = (x - y).abs()
    assert (err <= error_bound(x, codec)).all(), (err / error_bound(x, codec)).nan_to_num().max()


@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(codec, dtype):
    x = data("student_t", 777).clamp(-1e3, 1e3).to(dtype)
    enc = encode_reference(x, codec)
    assert same(encode(x, codec), enc)
    assert same(enc, encode_reference(x.float(), codec))  # the same values encode the same
    y = decode(enc, codec, x.numel())
    assert ((x.float() - y).abs() <= error_bound(x, codec)).all()


@pytest.mark.parametrize("codec", list(CODECS))
def test_zero_blocks_and_padding_blocks_decode_to_zero(codec):
    x = torch.zeros(70)
    enc = encode(x, codec, num_blocks=5)  # 3 blocks of data, 2 past the end
    assert same(enc, encode_reference(x, codec, num_blocks=5))
    assert torch.equal(decode(enc, codec, 160), torch.zeros(160))


@pytest.mark.parametrize("codec", ["fp8", "q8", "q6", "q4"])
def test_scale_is_absmax_over_qmax_rounded_up(codec):
    x = data("student_t", 4096)
    s = block_scales(x, codec).float()
    ratio = x.view(-1, 32).abs().amax(1) / CODECS[codec].qmax
    assert (s >= ratio).all() and (s <= ratio * (1 + 2.0**-7)).all()


def test_codes_fill_whole_words_q6_in_two_planes():
    assert [(CODECS[c].words, CODECS[c].block_bytes) for c in ("fp16", "fp8", "q8", "q6", "q4")] == [
        (16, 64), (8, 34), (8, 34), (6, 26), (4, 18)]
    # Codes of 7 (+max), -7 (-max) and 0 with scale 1, offset 8: 15, 1, 8; code j at bits 4 * (j % 8) of word j // 8
    x = torch.tensor([7.0, -7.0] + [0.0] * 29 + [-7.0])
    enc = encode(x, "q4")
    assert enc.scales.tolist() == [1.0]
    assert [w & 0xFFFFFFFF for w in enc.payload[0].tolist()] == [0x8888881F, 0x88888888, 0x88888888, 0x18888888]
    # q6, offset 32: 31 -> 63, -31 -> 1, 0 -> 32; low 4 bits in words 0-3 (8 a word), high 2 bits in words 4-5
    # (16 a word, 2 bits each)
    x = torch.tensor([31.0, -31.0] + [0.0] * 30)
    lo = [0x0000001F, 0, 0, 0]  # 63 & 15 = 15, 1 & 15 = 1, 32 & 15 = 0
    hi = [0xAAAAAAA3, 0xAAAAAAAA]  # 63 >> 4 = 3, 1 >> 4 = 0, 32 >> 4 = 2
    assert [w & 0xFFFFFFFF for w in encode(x, "q6").payload[0].tolist()] == lo + hi


def test_fp8_codes_match_torch_on_every_e4m3_value_and_midpoint():
    # All finite e4m3 values (times scale 1: a block with absmax 448) and the midpoints between neighbours,
    # where round-to-nearest-even decides: the kernel's bit arithmetic must agree with torch's cast.
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    pos = values[:127].unique()  # 0 .. 448, without the NaN codes
    mids = (pos[1:] + pos[:-1]) / 2
    x = torch.cat([pos, -pos, mids, -mids])
    x = torch.cat([x, torch.zeros(-x.numel() % 31)]).view(-1, 31)
    x = torch.cat([x, torch.full((x.shape[0], 1), 448.0)], 1).reshape(-1)  # every block's absmax is 448
    assert same(encode(x, "fp8"), encode_reference(x, "fp8"))


def test_fp8_decodes_every_code_as_torch_bit_for_bit():
    """Every e4m3 code but NaN (those two as negative zero, 0x80) under scales of every kind decodes to torch's
    value, sign of zero included: -0 (a small negative value's code) once came back +0 (Triton's -x is 0 - x)."""
    codes = torch.arange(256)
    codes[codes & 0x7F == 0x7F] = 0x80  # the NaN codes 0x7F, 0xFF
    payload = codes.to(torch.uint8).view(8, 32).view(torch.int32)  # code j: byte j % 4 of word j // 4
    scales = torch.tensor([1.0, 0.5, 3.0, 2.0**-126, 1e30, 7e-3, 448.0, 0.0]).bfloat16()
    enc = Encoded(payload, scales)
    want = decode_reference(enc, "fp8", 256)
    assert want.view(torch.int32).lt(0).sum() > 100 and (want == 0).sum() > 8  # both signs, zeros of both
    assert torch.equal(decode(enc, "fp8", 256).view(torch.int32), want.view(torch.int32))



@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # past fp16's range (the interpreter's numpy)
def test_fp16_range_ends_at_65504_and_its_bound_is_inf_past_it():
    """Up to 65520 (fp16's largest, 65504, plus half its last step) values round to finite fp16 within the bound;
    from there they come back +-inf, as torch's cast makes them, and the bound is inf: none is finite."""
    x = torch.tensor([65504.0, -65519.99, 65520.0, -7e4, 1e30] + [1.0] * 27)
    y = decode(encode(x, "fp16"), "fp16", x.numel())
    assert torch.equal(y, x.half().float()) and y[:2].isfinite().all() and y[2:5].isinf().all()
    bound = error_bound(x, "fp16")
    assert torch.equal(bound.isinf(), y.isinf()) and ((x - y).abs() <= bound).all()


def test_fp16_below_its_normals_keeps_absolute_not_relative_precision():
    """The numbers quant_codecs' docstring states: below 2^-14 the error stays within 2^-25 absolute, up to ~3e-3
    relative at 1e-5..1e-4 and ~3e-2 at 1e-6..1e-5; values up to 2^-25 come back 0, those just above as 2^-24."""
    gen = torch.Generator().manual_seed(0)
    x = 10 ** (-4 - 2 * torch.rand(4096, generator=gen))  # 1e-6..1e-4
    y = decode(encode(x, "fp16"), "fp16", x.numel())
    assert torch.equal(y, x.half().float()) and ((x - y).abs() <= 2 ** -25).all()
    relative = (x - y).abs() / x
    assert 2e-3 < relative[x > 1e-5].max() <= 3e-3 and 2e-2 < relative[x < 1e-5].max() <= 3e-2
    tiny = torch.tensor([2 ** -25, -2 ** -25, 1e-8, 2 ** -25 * 1.01, 8.9e-8] + [0.0] * 27)
    y = decode(encode(tiny, "fp16"), "fp16", tiny.numel())
    assert not y[:3].any() and (y[3:5] == 2 ** -24).all()


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN where NaN (a NaN's payload follows the platform's arithmetic)."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def with_nonfinite(x: torch.Tensor, at: dict[int, int]) -> torch.Tensor:
    """x with the values of the 32-bit patterns `at` (index: bits) put in."""
    x = x.clone()
    x[list(at)] = floats_of(list(at.values())).to(x.dtype)
    return x


INF, NEG_INF = 0x7F800000, 0xFF800000


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # 3e38 to fp16 (the interpreter's numpy)
@pytest.mark.parametrize("codec", list(CODECS))
def test_nonfinite_values_are_never_laundered(codec, max_min):
    """A block holding NaN or +-inf decodes as all NaN in the scaled codecs (its scale is NaN: one scale cannot
    carry inf beside finite values), kernel and reference alike, bit for bit; fp16 keeps each value, NaN (one
    pattern) and inf with its sign, as torch's cast. A finite block near fp32's limit (3e38) is finite in the
    scaled codecs (the bf16 scale has fp32's range) and within the bound; fp16: inf. Finite blocks are
    untouched."""
    # 8 blocks, the last one partial: NaNs in 0, 1, 7, NaN and +inf in 3, +inf in 4, -inf and +inf in 5, 3e38 in 6
    x = with_nonfinite(data("normal", 250), {3: NAN_BITS[0], 37: NAN_BITS[1], 100: NAN_BITS[2], 101: INF, 130: INF,
                                             161: NEG_INF, 162: INF, 247: NAN_BITS[3]})
    x[192] = 3e38
    enc = encode_reference(x, codec)
    assert same(encode(x, codec), enc)
    y = decode_reference(enc, codec, x.numel())
    assert same_values(decode(enc, codec, x.numel()), y)
    if CODECS[codec].scaled:
        bad = torch.tensor([True, True, False, True, True, True, False, True])
        assert torch.equal(enc.scales.isnan(), bad)
        assert torch.equal(y.isnan(), bad.repeat_interleave(32)[:250])
        assert ((y - x)[192:224].abs() <= error_bound(x[192:224], codec)).all() and y[192] > 2.9e38
    else:
        assert same_values(y, x.half().float())
    assert torch.equal(y[64:96], decode_reference(encode_reference(x[64:96], codec), codec, 32))


@pytest.mark.parametrize("codec", ["fp8", "q8", "q6", "q4"])
def test_small_blocks_keep_every_level(codec):
    """Gradient-sized blocks (absmax 1e-6 .. 3e-8, fresh random data at each) round-trip as well as blocks in
    the scale's comfortable range (1e-2): an fp16 scale (absmax / qmax below 6.1e-5 is an fp16 subnormal, a
    multiple of 6e-8) left q8 blocks at absmax 1e-7 half zeros. Relative error (norm) within 10% of the 1e-2
    blocks', and every element within half a step of absmax / qmax (bf16's round-up: 1 + 2^-7)."""
    c = CODECS[codec]
    rel = {}
    for seed, amax in enumerate([1e-2, 1e-6, 1e-7, 3e-8]):
        x = data("normal", 32 * 64, seed=100 + seed).view(-1, 32)
        x = (x / x.abs().amax(1, keepdim=True) * amax).reshape(-1)
        enc = encode_reference(x, codec)
        assert same(encode(x, codec), enc)
        y = decode_reference(enc, codec, x.numel())
        assert torch.equal(decode(enc, codec, x.numel()), y)
        step = amax / c.qmax * (1 + 2.0**-7) * (1 + 2.0**-20)
        bound = x.abs() * (2.0**-4 + 2.0**-20) + step * 2.0**-10 if c.kind == 1 else step / 2 * (1 + 2.0**-20)
        assert ((x - y).abs() <= bound).all(), (amax, ((x - y).abs() / bound).max())
        rel[amax] = float((x.double() - y.double()).norm() / x.double().norm())
    assert all(r <= 1.1 * rel[1e-2] for r in rel.values()), rel


@pytest.mark.filterwarnings("ignore:overflow encountered")  # the range check's product (the interpreter's numpy)
@pytest.mark.parametrize("codec", ["fp8", "q8", "q6", "q4"])
def test_scale_range_limits(codec, max_min):
    """The bf16 scale's limits: blocks down to fp32's denormals get at least the scale 2^-126 (finite reciprocal
    2^126; below absmax = qmax * 2^-126 fewer levels, within the bound of the scale stored), blocks up to 3.39e38
    a finite scale; a block at fp32's largest value (qmax * its rounded-up scale overflows fp32) is out of range
    and decodes as NaN. Kernel and reference alike, bit for bit."""
    x = data("normal", 32 * 9, seed=7).view(-1, 32)
    amax = torch.tensor([1e-30, 1e-36, 1e-37, 1e-38, 1e-39, 1e-44, 1e30, 3.39e38, torch.finfo().max])
    x = ((x / x.abs().amax(1, keepdim=True)).double() * amax.double()[:, None]).float().reshape(-1)
    enc = encode_reference(x, codec)
    assert same(encode(x, codec), enc)
    y = decode_reference(enc, codec, x.numel())
    assert same_values(decode(enc, codec, x.numel()), y)
    s, ok = enc.scales.float(), slice(0, 8 * 32)
    assert (s[:8] >= 2.0**-126).all() and s[:8].isfinite().all() and s[8].isnan()
    assert (s[:8] >= x[ok].view(-1, 32).abs().amax(1) / CODECS[codec].qmax).all()
    assert ((x[ok] - y[ok]).abs() <= error_bound(x[ok], codec)).all()
    assert y[8 * 32:].isnan().all()
    assert (y[:32] != 0).float().mean() > 0.7  # 1e-30: the levels of any block (some values round to 0)
