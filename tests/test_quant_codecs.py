"""Line codecs: the Triton kernels equal the pure-torch reference bit for bit, and the reference meets its
documented error bound on normal and heavy-tailed data, odd lengths, zero blocks, fp32/bf16/fp16 inputs."""

from __future__ import annotations

import pytest
import torch

from fused_dlrm.kernels.quant_codecs import (CODECS, block_scales, decode, decode_reference, encode,
                                             encode_reference, error_bound)


def data(kind: str, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return torch.randn(n, generator=g)
    if kind == "student_t":  # 2 degrees of freedom: heavy tails, blocks whose absmax dwarfs the rest
        return torch.randn(n, generator=g) / (torch.randn(n, 2, generator=g).pow(2).mean(1).sqrt())
    # Cauchy clipped at 1e4, with tiny (fp16-subnormal scale) and all-zero blocks, and -0.0
    x = torch.tan(torch.pi * (torch.rand(n, generator=g) - 0.5)).clamp(-1e4, 1e4)
    x[32:64] = 0.0
    x[64:96] *= 1e-7
    x[96:97] = -0.0
    return x


@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("kind", ["normal", "student_t", "cauchy"])
@pytest.mark.parametrize("n", [1, 33, 1000, 4131])
def test_kernel_equals_reference_and_meets_bound(codec, kind, n):
    x = data(kind, n)
    rows = encode_reference(x, codec)
    assert rows.shape == (-(-n // 32), CODECS[codec].row_bytes)
    assert torch.equal(encode(x, codec), rows)
    y = decode_reference(rows, codec, n)
    assert torch.equal(decode(rows, codec, n), y)
    assert not y.isnan().any()
    err = (x - y).abs()
    assert (err <= error_bound(x, codec)).all(), (err / error_bound(x, codec)).nan_to_num().max()


@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(codec, dtype):
    x = data("student_t", 777).clamp(-1e3, 1e3).to(dtype)
    rows = encode_reference(x, codec)
    assert torch.equal(encode(x, codec), rows)
    assert torch.equal(rows, encode_reference(x.float(), codec))  # the same values encode the same
    y = decode(rows, codec, x.numel())
    assert ((x.float() - y).abs() <= error_bound(x, codec)).all()


@pytest.mark.parametrize("codec", list(CODECS))
def test_zero_blocks_and_padding_blocks_decode_to_zero(codec):
    x = torch.zeros(70)
    rows = encode(x, codec, num_blocks=5)  # 3 blocks of data, 2 past the end
    assert torch.equal(rows, encode_reference(x, codec, num_blocks=5))
    assert torch.equal(decode(rows, codec, 160), torch.zeros(160))


@pytest.mark.parametrize("codec", ["fp8", "q8", "q6", "q4"])
def test_scale_is_absmax_over_qmax_rounded_up(codec):
    x = data("student_t", 4096)
    s = block_scales(x, codec).float()
    ratio = x.view(-1, 32).abs().amax(1) / CODECS[codec].qmax
    assert (s >= ratio).all() and (s <= ratio * (1 + 2.0**-10)).all()


def test_q4_and_q6_pack_and_q8_is_one_byte_per_value():
    assert [CODECS[c].row_bytes for c in ("fp16", "fp8", "q8", "q6", "q4")] == [64, 34, 34, 26, 18]
    # q4: value 2i in the low nibble, 2i + 1 in the high one, offset 8; the scale follows, little-endian
    x = torch.tensor([7.0, -7.0] + [0.0] * 30)
    row = encode(x, "q4")[0]
    assert row[0].item() == (8 + 7) | ((8 - 7) << 4) and row[16:].view(torch.float16).item() == 1.0


def test_fp8_codes_match_torch_on_every_e4m3_value_and_midpoint():
    # All finite e4m3 values (times scale 1: a block with absmax 448) and the midpoints between neighbours,
    # where round-to-nearest-even decides: the kernel's bit arithmetic must agree with torch's cast.
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    pos = values[:127].unique()  # 0 .. 448, without the NaN codes
    mids = (pos[1:] + pos[:-1]) / 2
    x = torch.cat([pos, -pos, mids, -mids])
    x = torch.cat([x, torch.zeros(-x.numel() % 31)]).view(-1, 31)
    x = torch.cat([x, torch.full((x.shape[0], 1), 448.0)], 1).reshape(-1)  # every block's absmax is 448
    assert torch.equal(encode(x, "fp8"), encode_reference(x, "fp8"))
