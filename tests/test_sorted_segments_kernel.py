"""The segments of sorted keys (the embedding backward's tables): the torch reference against
unique_consecutive, and the two kernels (interpreter on the CPU; compiled, on a GPU where there is one) against
the reference, exactly, on outputs poisoned before the kernels write them: one key, all keys equal, all
distinct, Zipf-skewed runs over many tiles and over several tiles per program, 32- and 64-bit keys, keys that are
a view off their storage's start, a strided view."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from fused_dlrm.kernels import sorted_segments as ss
from sm90 import compile_for_sm90


def zipf_sorted_keys(n: int, dtype: torch.dtype, seed: int, rows: int = 1 << 20) -> torch.Tensor:
    """n sorted keys whose runs are Zipf-skewed, as the embedding backward's (a few long runs, many of one)."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    ranks = torch.floor(torch.pow(float(rows + 1), u)).long() - 1  # log-uniform: Zipf(1)
    keys = (ranks * 2654435761 % rows).sort().values  # hot rows scattered over the key range
    return keys.to(dtype)


def expect(keys: torch.Tensor):
    unique, counts = torch.unique_consecutive(keys, return_counts=True)
    return torch.cumsum(counts, 0) - counts, unique


def test_reference_matches_unique_consecutive():
    sorted_keys = [torch.tensor([3, 3, 3, 5, 8, 8, 9, 11, 11, 11, 11, 12]),  # repeated and unique keys
                   torch.tensor([4]), torch.tensor([2, 2, 2]), torch.arange(5)]  # one key, all one, all unique
    for keys in sorted_keys:
        starts, segment_keys, num_segments = ss.sorted_segments_reference(keys)
        want_starts, want_keys = expect(keys)
        k = want_keys.numel()
        assert num_segments.shape == (1,) and int(num_segments) == k
        assert torch.equal(starts[:k], want_starts) and torch.equal(segment_keys[:k], want_keys)


def test_reference_has_no_data_dependent_shape():
    """On the meta device any op needing the keys' values on the host (unique, nonzero, mask indexing, .item())
    fails: the segment tables must build there, so they need no host sync on a GPU."""
    starts, segment_keys, num_segments = ss.sorted_segments_reference(torch.empty(1000, dtype=torch.int64,
                                                                                  device="meta"))
    assert starts.shape == (2000,) and segment_keys.shape == (1000,) and num_segments.shape == (1,)
    assert starts.device.type == num_segments.device.type == "meta"


def poison_allocations(monkeypatch):
    """torch.empty / empty_like / Tensor.new_empty return NaN (floating point) or -7 everywhere: a slot the kernels
    should have written and did not shows."""
    empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty

    def poisoned(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan") if t.is_floating_point() else -7)

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poisoned(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poisoned(empty_like(*a, **k)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **k: poisoned(new_empty(self, *a, **k)))


def check_kernels(keys: torch.Tensor) -> None:
    starts, segment_keys, num_segments = ss.launch_sorted_segments(keys)
    want_starts, want_keys = expect(keys.cpu())
    k = want_keys.numel()
    assert num_segments.shape == (1,) and num_segments.dtype == torch.int64 and int(num_segments) == k
    assert starts.dtype == torch.int64 and starts.numel() >= keys.numel()
    assert segment_keys.dtype == keys.dtype
    assert torch.equal(starts[:k].cpu(), want_starts) and torch.equal(segment_keys[:k].cpu(), want_keys)


interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the Triton interpreter")


@interpreter
@pytest.mark.parametrize("keys", [torch.tensor([4]), torch.tensor([2, 2, 2]), torch.arange(5),
                                  torch.tensor([3, 3, 3, 5, 8, 8, 9, 11, 11, 11, 11, 12])])
def test_kernels_small_cases(monkeypatch, keys):
    poison_allocations(monkeypatch)
    check_kernels(keys)


@interpreter
@pytest.mark.parametrize("n,dtype,tile,max_programs", [
    (1000, torch.int32, 16, 1024),  # 63 tiles, a program each
    (1001, torch.int64, 16, 4),  # 63 tiles over 4 programs: 16 tiles per program, the last one short
    (4096, torch.int32, 64, 8),  # tiles exactly full
    (333, torch.int64, 1024, 1024)])  # one tile, mostly masked
def test_kernels_equal_reference_on_zipf_runs(monkeypatch, n, dtype, tile, max_programs):
    monkeypatch.setattr(ss, "TILE", tile)
    monkeypatch.setattr(ss, "MAX_PROGRAMS", max_programs)
    poison_allocations(monkeypatch)
    storage = zipf_sorted_keys(n + 1, dtype, seed=n)
    check_kernels(storage[1:])  # a view: not at its storage's start


@interpreter
def test_kernels_read_strided_keys_as_their_elements(monkeypatch):
    """Keys read at ptr + i: a strided view (every other key of a sorted tensor, still sorted) is made contiguous
    first, not read as its storage's neighbours."""
    monkeypatch.setattr(ss, "TILE", 16)
    poison_allocations(monkeypatch)
    check_kernels(zipf_sorted_keys(2 * 301, torch.int64, seed=301)[::2])


@interpreter
def test_kernels_compile_for_sm90():
    compile_for_sm90("""
from fused_dlrm.kernels import sorted_segments as ss
for key_type in ("*i32", "*i64"):
    types = {"keys_ptr": key_type, "segment_keys_ptr": key_type, "counts_ptr": "*i64", "starts_ptr": "*i64",
             "num_segments_ptr": "*i64", "n": "i64"}
    build(ss._count_starts_kernel, types, dict(TILE=ss.TILE))
    build(ss._write_segments_kernel, types, dict(TILE=ss.TILE, MAX_PROGRAMS=ss.MAX_PROGRAMS))
""")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_gpu_kernels_equal_reference_at_paper_scale(dtype):
    """The DLRM paper step's backward keys (2.6M occurrences on a rank of 2) and a batch of many programs' tiles
    each (10M), through the compiled binaries, without a host sync after the first call."""
    for n in (2_600_000, 10_000_000):
        keys = zipf_sorted_keys(n, dtype, seed=n).cuda()
        want = ss.sorted_segments_reference(keys)
        for call in range(2):  # the first call compiles, the second launches the binaries
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as record:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")  # a warning per synchronizing call
                try:
                    got = ss.sorted_segments(keys)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            if call:
                assert not [str(w.message) for w in record if "synchroniz" in str(w.message)]
            k = int(want[2])
            assert int(got[2]) == k
            assert torch.equal(got[0][:k], want[0][:k]) and torch.equal(got[1][:k], want[1][:k])
