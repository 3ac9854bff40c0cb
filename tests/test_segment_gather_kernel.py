"""The input dist's segment regroup: its torch reference against split + cat, and the kernel (interpreter on the
CPU) against the reference, exactly: empty segments (first and last included), segments listed twice or not at
all (a feature bound for several ranks, or for none), Zipf-skewed sizes spanning many blocks and programs, int64
indices, fp32 weights and int32 values, a view that does not start at its storage's start; x of rows refused."""

from __future__ import annotations

import os

import pytest
import torch

from fused_dlrm.kernels import segment_gather as sg
from sm90 import compile_for_sm90


def _segments(seed: int, n: int, skewed: bool):
    gen = torch.Generator().manual_seed(seed)
    if skewed:  # a few large segments, many small ones
        counts = (torch.rand(n, generator=gen) ** 4 * 300).long()
    else:
        counts = torch.randint(0, 5, (n,), generator=gen)
    counts[0] = counts[n // 2] = counts[-1] = 0
    return counts, gen


@pytest.mark.parametrize("seed", range(4))
def test_reference_matches_split_and_cat(seed):
    counts, gen = _segments(seed, 17, skewed=False)
    x = torch.randn(int(counts.sum()), generator=gen)
    order = torch.randperm(counts.numel(), generator=gen)
    chunks = torch.split(x, counts.tolist())
    expected = torch.cat([chunks[i] for i in order.tolist()])
    total = int(counts[order].sum())
    torch.testing.assert_close(sg.gather_segments_reference(x, counts, order, total), expected, rtol=0, atol=0)


def test_reference_of_nothing():
    counts = torch.zeros(3, dtype=torch.long)
    assert sg.gather_segments_reference(torch.empty(0), counts, torch.tensor([2, 0, 1]), 0).numel() == 0


interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the Triton interpreter")


@interpreter
@pytest.mark.parametrize("n,order_kind,skewed,dtype", [
    (17, "permutation", False, torch.int64), (33, "repeats and omissions", True, torch.float32),
    (64, "permutation", True, torch.int32), (5, "one segment", False, torch.int64)])
def test_kernel_equals_reference(monkeypatch, n, order_kind, skewed, dtype):
    monkeypatch.setattr(sg, "BLOCK_ELEMENTS", 16)  # many blocks per segment in a small case
    monkeypatch.setattr(sg, "ELEMENTS_PER_PROGRAM", 40)  # and several programs on each segment
    counts, gen = _segments(n, n, skewed)
    if order_kind == "permutation":
        order = torch.randperm(n, generator=gen)
    elif order_kind == "one segment":
        order = torch.tensor([n // 3])
    else:  # every segment 0-2 times, in random order
        order = torch.cat([torch.randperm(n, generator=gen)[:n // 2], torch.randperm(n, generator=gen)])
    storage = (torch.randn(int(counts.sum()) + 3, generator=gen) * 1000).to(dtype)
    x = storage[3:]  # a view: not at its storage's start
    total = int(counts[order].sum())
    expected = sg.gather_segments_reference(x, counts, order, total)
    got = sg.launch_gather_segments(x, counts, order, total)
    assert got.dtype == dtype and torch.equal(got, expected)


@interpreter
def test_kernel_with_nothing_to_move():
    counts = torch.tensor([0, 4, 0])
    assert sg.launch_gather_segments(torch.arange(4), counts, torch.tensor([2, 0]), 0).numel() == 0


@interpreter
def test_rows_are_refused_on_every_path():
    """The kernel moves elements: x of rows ([n, d]; the reference would move whole rows) is refused, not
    flattened into a wrong [total] result on GPUs, and refused on the CPU as well (it passed there)."""
    counts = torch.tensor([2, 3])
    with pytest.raises(ValueError, match=r"x of shape \(5, 2\)"):
        sg.gather_segments(torch.randn(5, 2), counts, torch.tensor([1, 0]), 5)


@interpreter
def test_kernel_compiles_for_sm90():
    compile_for_sm90("""
from fused_dlrm.kernels import segment_gather as sg
for dtype in ("i64", "fp32", "i32"):
    build(sg._gather_segments_kernel, {"x_ptr": "*" + dtype, "counts_ptr": "*i64", "order_ptr": "*i64",
                                        "out_ptr": "*" + dtype}, dict(BLOCK=sg.BLOCK_ELEMENTS, LIST_BLOCK=128))
""")
