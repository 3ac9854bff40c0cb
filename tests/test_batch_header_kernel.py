"""The input dist's header kernel (interpreter on the CPU) against its torch reference: keys of uneven and empty
value counts, Zipf-skewed indices with some out of range (negative, equal to and past the table size), values
beyond the lengths' sum and fewer than it, int32 and int64 values, destinations owning different feature counts,
more values than one program's block, with and without per-sample weights; the header starts poisoned but for the
column the programs add into."""

from __future__ import annotations

import os

import pytest
import torch

from fused_dlrm.kernels import batch_header as bh
from sm90 import compile_for_sm90

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the Triton interpreter")


def _batch(seed: int, num_keys: int, local_batch: int, extra: int, bad: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randint(1, 500, (num_keys,), generator=gen)
    lengths = torch.randint(0, 6, (num_keys, local_batch), generator=gen)
    lengths[num_keys // 2] = 0  # a key without values
    counts = lengths.sum(dim=1)
    limit = torch.repeat_interleave(rows, counts)
    zipf = (torch.rand(limit.numel(), generator=gen) ** 3 * limit).long()  # skewed to low rows
    # values past the lengths' sum count against the last key's table: half of them just inside it, half at its end
    past = rows[-1] - 1 + torch.arange(max(extra, 0)) % 2
    values = torch.cat([zipf, past])[:limit.numel() + extra]
    where = torch.randperm(values.numel(), generator=gen)[:bad]
    values[where] = torch.tensor([-1, 10_000, 499, 500])[torch.arange(bad) % 4]  # some of these may be in range
    return values.to(dtype), counts, rows


def _header_keys(num_keys: int, world: int, seed: int) -> torch.Tensor:
    """Keys shared round-robin among the destinations, shuffled; padding (num_keys) where a rank owns fewer."""
    order = torch.randperm(num_keys, generator=torch.Generator().manual_seed(seed)).tolist()
    owned = [order[r::world] for r in range(world)]
    width = max(len(o) for o in owned)
    return torch.tensor([o + [num_keys] * (width - len(o)) for o in owned])


@pytest.mark.parametrize("num_keys,world,local_batch,extra,bad,dtype,weights", [
    (7, 2, 300, 0, 0, torch.int64, None),  # > one block of values, all in range
    (7, 2, 300, 0, 9, torch.int64, torch.float32),
    (13, 4, 57, 5, 3, torch.int32, torch.bfloat16),  # values beyond the lengths' sum
    (13, 3, 57, -4, 2, torch.int64, None),  # fewer values than the lengths say
    (1, 1, 9, 0, 1, torch.int64, torch.int64),  # weights of no supported dtype
    (5, 8, 2, 0, 0, torch.int64, torch.float16),  # ranks owning no feature
])
def test_kernel_equals_reference(num_keys, world, local_batch, extra, bad, dtype, weights):
    seed = num_keys * 100 + world * 10 + bad
    values, counts, rows = _batch(seed, num_keys, local_batch, extra, bad, dtype)
    header_keys = _header_keys(num_keys, world, seed)
    code = bh.tensor_dtype_code(None if weights is None else torch.ones(3, dtype=weights))
    want = bh.batch_header_reference(values, counts, rows, header_keys, local_batch, code)
    got = bh.launch_batch_header(values, counts, rows, header_keys, local_batch, code)
    assert torch.equal(got, want), (got, want)
    assert (want[:, bh.OUT_OF_RANGE] > 0).any() == (bad > 0 and bool(((values < 0) | (values >= 500)).any()))
    described = bh.dtype_described(int(want[0, bh.WEIGHTS]), bh.WEIGHT_DTYPES, "weights")
    assert (want[:, bh.INDICES] == bh.dtype_code(dtype)).all()
    assert (want[:, bh.WEIGHTS] == code).all() and described == {
        None: "no weights", torch.float32: "float32 weights", torch.bfloat16: "bfloat16 weights",
        torch.float16: "float16 weights",
        torch.int64: "weights of a dtype other than float32, float16, bfloat16, float64"}[weights]
    assert not want[:, [bh.NO_BATCH, bh.BAD_KEYS]].any()  # the input dist's alone, for a batch that cannot travel


def test_keys_no_table_reads_have_no_range():
    """Keys of no table (rows NOT_READ: another module's features in the KJT) are out of no range, whatever their
    indices; the other keys' bad indices still count, each once."""
    values, counts, rows = _batch(5, 9, 200, 0, 0, torch.int64)
    ends = torch.cumsum(counts, 0)
    not_read = [1, 4, 8]  # 4 has no values; 8 is the last key
    for k in not_read:
        rows[k] = bh.NOT_READ
        values[ends[k] - counts[k]:ends[k]] = torch.tensor([-7, 10_000])[torch.arange(int(counts[k])) % 2]
    values[ends[2] - 1] = -1  # key 2's last index, and key 3's first, out of their tables
    values[ends[2]] = rows[3]
    header_keys = _header_keys(9, 3, 5)
    want = bh.batch_header_reference(values, counts, rows, header_keys, 200, 0)
    assert torch.equal(bh.launch_batch_header(values, counts, rows, header_keys, 200, 0), want)
    assert (want[:, bh.OUT_OF_RANGE] == 2).all()


def test_no_values():
    counts, rows = torch.zeros(3, dtype=torch.int64), torch.tensor([4, 5, 6])
    header_keys = _header_keys(3, 2, 0)
    values = torch.empty(0, dtype=torch.int64)
    want = bh.batch_header_reference(values, counts, rows, header_keys, 11, True)
    assert torch.equal(bh.launch_batch_header(values, counts, rows, header_keys, 11, True), want)


def test_poisoned_header_is_fully_written(monkeypatch):
    """Every cell but the out-of-range column (which the programs add into) is written by the kernel."""
    zeros = torch.zeros
    monkeypatch.setattr(bh.torch, "zeros", lambda *a, **k: zeros(*a, **k).fill_(-7).index_fill_(
        1, torch.tensor([bh.OUT_OF_RANGE]), 0))
    values, counts, rows = _batch(3, 6, 40, 0, 2, torch.int64)
    header_keys = _header_keys(6, 4, 3)
    want = bh.batch_header_reference(values, counts, rows, header_keys, 40, False)
    assert torch.equal(bh.launch_batch_header(values, counts, rows, header_keys, 40, False), want)


@pytest.mark.parametrize("values_type", ["*i64", "*i32"])
def test_kernel_compiles_for_sm90(values_type):
    compile_for_sm90(f"""
from fused_dlrm.kernels import batch_header as bh
types = {{"values_ptr": "{values_type}", "counts_ptr": "*i64", "ends_ptr": "*i64", "rows_ptr": "*i64",
         "header_keys_ptr": "*i64", "header_ptr": "*i64"}}
build(bh._batch_header_kernel, types, dict(BLOCK=bh.BLOCK_VALUES, SEARCH_STEPS=8, WORLD_BLOCK=2, WIDTH_BLOCK=64))
""")


def test_strided_values():
    values, counts, rows = _batch(11, 5, 30, 0, 3, torch.int64)
    strided = torch.stack([values, torch.full_like(values, -5)], dim=1)[:, 0]  # every other element of a buffer
    header_keys = _header_keys(5, 2, 11)
    want = bh.batch_header_reference(values, counts, rows, header_keys, 30, True)
    assert not strided.is_contiguous()
    assert torch.equal(bh.launch_batch_header(strided, counts, rows, header_keys, 30, True), want)
