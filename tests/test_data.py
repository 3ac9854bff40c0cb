"""Tests of fused_dlrm.data: batch splitting, the synthetic generator and the Criteo TSV reader."""

from __future__ import annotations

import gzip
import math
import random
import re
import time

import pytest
import torch
from torchmetrics.functional.classification import binary_auroc
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from fused_dlrm.data import (
    CRITEO_NUM_DENSE,
    CRITEO_NUM_SPARSE,
    CRITEO_SPARSE_FEATURES,
    CriteoTSV,
    SyntheticCriteo,
    local_batch_bounds,
)
from fused_dlrm.data import criteo
from fused_dlrm.train.build import batch_stream


@pytest.fixture(autouse=True)
def single_thread():
    """Run single-threaded: these tensors are small, and intra-op threads fighting other jobs for
    the cores slow the tests down (and make the timing test flaky) instead of speeding them up."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


# ---------------------------------------------------------------------------------------------
# local_batch_bounds


@pytest.mark.parametrize("global_batch_size,world_size", [(1, 1), (7, 1), (8, 2), (10, 3), (13, 4), (5, 5), (1000, 7)])
def test_local_batch_bounds_cover_batch_evenly(global_batch_size, world_size):
    bounds = [local_batch_bounds(global_batch_size, r, world_size) for r in range(world_size)]
    assert bounds[0][0] == 0
    assert bounds[-1][1] == global_batch_size
    for (_, stop), (start, _) in zip(bounds, bounds[1:]):
        assert stop == start
    sizes = [stop - start for start, stop in bounds]
    extra = global_batch_size % world_size
    assert sizes == [global_batch_size // world_size + (1 if r < extra else 0) for r in range(world_size)]


def test_local_batch_bounds_uneven_example():
    assert [local_batch_bounds(10, r, 3) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]


@pytest.mark.parametrize(
    "args,match",
    [
        ((3, 0, 4), "global_batch_size"),
        ((0, 0, 1), "global_batch_size"),
        ((8, 2, 2), "rank"),
        ((8, -1, 2), "rank"),
        ((8, 0, 0), "world_size"),
        ((8.0, 0, 2), "integer"),
        ((True, 0, 1), "integer"),  # YAML's true, an int to Python
    ],
)
def test_local_batch_bounds_errors(args, match):
    with pytest.raises(ValueError, match=match):
        local_batch_bounds(*args)


# ---------------------------------------------------------------------------------------------
# SyntheticCriteo

NAMES = [f"f{i}" for i in range(4)]
ROWS = [1, 7, 1000, 10**6]


def assert_batches_equal(a, b):
    torch.testing.assert_close(a.dense_features, b.dense_features, rtol=0, atol=0)
    torch.testing.assert_close(a.labels, b.labels, rtol=0, atol=0)
    assert a.sparse_features.keys() == b.sparse_features.keys()
    assert torch.equal(a.sparse_features.lengths(), b.sparse_features.lengths())
    assert torch.equal(a.sparse_features.values(), b.sparse_features.values())
    assert a.sparse_features.lengths().dtype == b.sparse_features.lengths().dtype
    assert a.sparse_features.values().dtype == b.sparse_features.values().dtype


def batches_equal(a, b) -> bool:
    return (
        a.dense_features.shape == b.dense_features.shape
        and torch.equal(a.dense_features, b.dense_features)
        and torch.equal(a.sparse_features.values(), b.sparse_features.values())
    )


def test_synthetic_batch_layout():
    ds = SyntheticCriteo(ROWS, NAMES, global_batch_size=64)
    batch = ds.batch(0)
    assert batch.dense_features.shape == (64, 13)
    assert batch.dense_features.dtype == torch.float32
    assert batch.labels.shape == (64,)
    assert batch.labels.dtype == torch.float32
    assert set(batch.labels.unique().tolist()) <= {0.0, 1.0}
    kjt = batch.sparse_features
    assert kjt.keys() == NAMES
    assert kjt.lengths().numel() == len(NAMES) * 64
    assert kjt.values().dtype == torch.int64
    assert int(kjt.lengths().sum()) == kjt.values().numel()
    assert kjt.stride() == 64


def test_synthetic_determinism():
    ds = SyntheticCriteo(ROWS, NAMES, global_batch_size=32, seed=3)
    again = SyntheticCriteo(ROWS, NAMES, global_batch_size=32, seed=3)
    assert_batches_equal(ds.batch(5), ds.batch(5))
    assert_batches_equal(ds.batch(5), again.batch(5))
    assert not batches_equal(ds.batch(5), ds.batch(6))
    eval_ds = SyntheticCriteo(ROWS, NAMES, global_batch_size=32, seed=3, split="eval")
    assert not batches_equal(ds.batch(5), eval_ds.batch(5))
    other_seed = SyntheticCriteo(ROWS, NAMES, global_batch_size=32, seed=4)
    assert not batches_equal(ds.batch(5), other_seed.batch(5))
    rank0 = SyntheticCriteo(ROWS, NAMES, global_batch_size=32, rank=0, world_size=2, seed=3)
    rank1 = SyntheticCriteo(ROWS, NAMES, global_batch_size=32, rank=1, world_size=2, seed=3)
    assert not batches_equal(rank0.batch(5), rank1.batch(5))


def test_synthetic_iter_yields_consecutive_steps():
    ds = SyntheticCriteo(ROWS, NAMES, global_batch_size=8)
    it = iter(ds)
    for step in range(3):
        assert_batches_equal(next(it), ds.batch(step))


def test_synthetic_rank_slice_sizes():
    sizes = []
    for rank in range(3):
        batch = SyntheticCriteo(ROWS, NAMES, global_batch_size=10, rank=rank, world_size=3).batch(0)
        assert batch.dense_features.shape[0] == batch.labels.shape[0] == batch.sparse_features.stride()
        assert batch.sparse_features.lengths().numel() == len(NAMES) * batch.labels.shape[0]
        sizes.append(batch.labels.shape[0])
    assert sizes == [4, 3, 3]


def test_synthetic_indices_in_range_and_empty_bags():
    ds = SyntheticCriteo(ROWS, NAMES, global_batch_size=512, mean_pooling=3.0)
    for step in range(3):
        kjt = ds.batch(step).sparse_features
        per_feature = kjt.to_dict()
        for name, rows in zip(NAMES, ROWS):
            jt = per_feature[name]
            values, lengths = jt.values(), jt.lengths()
            assert values.min() >= 0 and values.max() < rows
            assert (lengths == 0).any(), "empty bags should occur"
            assert lengths.max() <= 6
        assert torch.equal(per_feature["f0"].values(), torch.zeros_like(per_feature["f0"].values()))


@pytest.mark.parametrize("alpha", [0.0, 1.0, 1.05, 2.5])
def test_synthetic_indices_in_range_for_any_alpha(alpha):
    ds = SyntheticCriteo([7, 2**31, 10**6], ["a", "b", "c"], global_batch_size=256, zipf_alpha=alpha)
    per_feature = ds.batch(0).sparse_features.to_dict()
    for name, rows in (("a", 7), ("b", 2**31), ("c", 10**6)):
        values = per_feature[name].values()
        assert values.min() >= 0 and values.max() < rows


def test_synthetic_mean_pooling():
    means = [0.0, 1.0, 4.0, 10.0]
    ds = SyntheticCriteo([100] * 4, NAMES, global_batch_size=4096, mean_pooling=means)
    lengths = ds.batch(0).sparse_features.lengths().view(4, 4096).float()
    assert torch.equal(lengths[0], torch.zeros(4096))
    for f, mean in enumerate(means[1:], start=1):
        assert lengths[f].mean().item() == pytest.approx(mean, rel=0.05)
        assert lengths[f].max().item() == 2 * mean
        assert lengths[f].min().item() == 0


def top_share(values: torch.Tensor, num_rows: int, fraction: float) -> float:
    counts = torch.bincount(values, minlength=num_rows)
    return counts.topk(int(num_rows * fraction)).values.sum().item() / values.numel()


def test_synthetic_zipf_skew_and_scramble():
    rows = 10**6
    ds = SyntheticCriteo([rows], ["a"], global_batch_size=4096, mean_pooling=10.0, zipf_alpha=1.05)
    values = torch.cat([ds.batch(step).sparse_features.values() for step in range(3)])
    assert top_share(values, rows, 0.01) > 0.5
    # The scramble spreads the hottest rows over the table instead of keeping them at small ids.
    hottest = torch.bincount(values, minlength=rows).topk(10).indices
    assert (hottest >= 1000).sum() >= 8


def test_synthetic_alpha_zero_is_uniform():
    # A small table, so that every row is drawn many times and the counts are not dominated by noise.
    rows = 1000
    ds = SyntheticCriteo([rows], ["a"], global_batch_size=4096, mean_pooling=10.0, zipf_alpha=0.0)
    values = ds.batch(0).sparse_features.values()
    assert top_share(values, rows, 0.01) < 0.02


def test_synthetic_log_uniform_alpha_one_is_skewed():
    rows = 10**5
    ds = SyntheticCriteo([rows], ["a"], global_batch_size=4096, mean_pooling=10.0, zipf_alpha=1.0)
    values = ds.batch(0).sparse_features.values()
    # For the log-uniform law the top 1% of rows hold about log(1000) / log(100000) = 60% of the mass.
    assert top_share(values, rows, 0.01) == pytest.approx(math.log(1001) / math.log(100001), abs=0.05)


CRITEO_LIKE_ROWS = [10**6] * 8 + [10**4] * 8 + [100] * 6 + [3] * 4


def test_synthetic_teacher_is_learnable_and_criteo_like():
    ds = SyntheticCriteo(CRITEO_LIKE_ROWS, CRITEO_SPARSE_FEATURES, global_batch_size=4096)
    batches = [ds.batch(step) for step in range(2)]
    logits = torch.cat([ds.teacher_logits(b) for b in batches])
    labels = torch.cat([b.labels for b in batches])
    assert 0.15 <= labels.mean().item() <= 0.45
    assert 1.2 <= logits.std().item() <= 2.2
    assert binary_auroc(logits, labels.long()).item() > 0.75


def test_synthetic_teacher_independent_of_rank_world_size_and_split():
    batch = SyntheticCriteo(ROWS, NAMES, global_batch_size=64, seed=1).batch(0)
    reference = SyntheticCriteo(ROWS, NAMES, global_batch_size=64, seed=1).teacher_logits(batch)
    for kwargs in ({"rank": 2, "world_size": 3}, {"split": "eval"}, {"global_batch_size": 8}):
        other = SyntheticCriteo(ROWS, NAMES, **{"global_batch_size": 64, "seed": 1, **kwargs})
        torch.testing.assert_close(other.teacher_logits(batch), reference)
    different_seed = SyntheticCriteo(ROWS, NAMES, global_batch_size=64, seed=2)
    assert not torch.allclose(different_seed.teacher_logits(batch), reference)


def test_synthetic_speed():
    ds = SyntheticCriteo(CRITEO_LIKE_ROWS, CRITEO_SPARSE_FEATURES, global_batch_size=2048, mean_pooling=10.0)
    ds.batch(0)  # warm-up
    # Best of several steps (typically ~0.03 s each on one thread): robust to other jobs sharing the machine.
    best = math.inf
    for step in range(1, 6):
        start = time.perf_counter()
        ds.batch(step)
        best = min(best, time.perf_counter() - start)
    assert best < 0.1


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_rows": [10, 10]}, "len\\(num_rows\\)"),
        ({"num_rows": [10, 0, 10, 10]}, "num_rows"),
        ({"num_rows": [10, 10, 10, 2**31 + 1]}, "num_rows"),
        ({"feature_names": ["a", "a", "b", "c"]}, "unique"),
        ({"mean_pooling": [1.0, 2.0]}, "mean_pooling"),
        ({"mean_pooling": -1.0}, "mean_pooling"),
        ({"zipf_alpha": -0.5}, "zipf_alpha"),
        ({"num_dense": 0}, "num_dense"),
        ({"split": ""}, "split"),
        ({"global_batch_size": 2, "world_size": 4, "rank": 0}, "global_batch_size"),
        ({"rank": 1}, "rank"),
    ],
)
def test_synthetic_argument_errors(kwargs, match):
    args = {"num_rows": [10] * 4, "feature_names": NAMES, "global_batch_size": 8, **kwargs}
    with pytest.raises(ValueError, match=match):
        SyntheticCriteo(**args)


def test_synthetic_negative_step_error():
    with pytest.raises(ValueError, match="step"):
        SyntheticCriteo(ROWS, NAMES, global_batch_size=8).batch(-1)


# ---------------------------------------------------------------------------------------------
# CriteoTSV

TABLE_ROWS = [1000] * CRITEO_NUM_SPARSE


def criteo_line(label, dense=None, cats=None) -> str:
    """A Criteo TSV line; ``None`` entries of ``dense`` / ``cats`` are written as missing (empty)."""
    dense = [0] * CRITEO_NUM_DENSE if dense is None else dense
    cats = ["0000000a"] * CRITEO_NUM_SPARSE if cats is None else cats
    fields = [str(label)] + ["" if d is None else str(d) for d in dense] + ["" if c is None else c for c in cats]
    return "\t".join(fields) + "\n"


def numbered_lines(n: int) -> list[str]:
    """Lines whose first dense count is the line number, so each sample can be identified after reading."""
    return [criteo_line(i % 2, dense=[i] + [0] * (CRITEO_NUM_DENSE - 1)) for i in range(n)]


def line_ids(batch) -> list[int]:
    return [round(math.expm1(x)) for x in batch.dense_features[:, 0].tolist()]


def write(path, lines) -> str:
    path.write_text("".join(lines))
    return str(path)


def test_criteo_constants():
    assert CRITEO_NUM_DENSE == 13
    assert CRITEO_NUM_SPARSE == 26
    assert CRITEO_SPARSE_FEATURES == [f"cat_{i}" for i in range(26)]


def test_criteo_parses_values_missing_and_negatives(tmp_path):
    dense_full = list(range(CRITEO_NUM_DENSE))
    dense_missing = [None, -3, 5] + [None] * (CRITEO_NUM_DENSE - 3)
    cats_full = [f"{i:08x}" for i in range(CRITEO_NUM_SPARSE)]
    cats_missing = [None if i % 3 == 0 else "ffffffff" for i in range(CRITEO_NUM_SPARSE)]
    path = write(
        tmp_path / "day_0",
        [criteo_line(1, dense_full, cats_full), criteo_line(0, dense_missing, cats_missing)],
    )
    num_rows = [1000] * 25 + [7]
    batches = list(CriteoTSV(path, num_rows, global_batch_size=2))
    assert len(batches) == 1
    batch = batches[0]

    torch.testing.assert_close(batch.labels, torch.tensor([1.0, 0.0]))
    expected_dense = torch.tensor(
        [[math.log1p(x) for x in dense_full], [0.0, 0.0, math.log1p(5)] + [0.0] * (CRITEO_NUM_DENSE - 3)]
    )
    assert batch.dense_features.dtype == torch.float32
    torch.testing.assert_close(batch.dense_features, expected_dense)

    kjt = batch.sparse_features
    assert kjt.keys() == CRITEO_SPARSE_FEATURES
    assert kjt.values().dtype == torch.int64 and kjt.lengths().dtype == torch.int32  # ids were sent as int32
    per_feature = kjt.to_dict()
    for i, name in enumerate(CRITEO_SPARSE_FEATURES):
        jt = per_feature[name]
        missing = i % 3 == 0
        assert jt.lengths().tolist() == [1, 0 if missing else 1]
        expected = [i % num_rows[i]] + ([] if missing else [0xFFFFFFFF % num_rows[i]])
        assert jt.values().tolist() == expected
    # Key-major layout: all samples of cat_0, then all samples of cat_1, ...
    assert kjt.lengths().tolist()[:4] == [1, 0, 1, 1]


def test_criteo_custom_feature_names(tmp_path):
    path = write(tmp_path / "d", numbered_lines(3))
    names = [f"C{i + 1}" for i in range(CRITEO_NUM_SPARSE)]
    batch = next(iter(CriteoTSV(path, TABLE_ROWS, global_batch_size=3, feature_names=names)))
    assert batch.sparse_features.keys() == names


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_criteo_ranks_partition_lines_in_order(tmp_path, world_size):
    lines = numbered_lines(11)
    path = write(tmp_path / "d", lines)
    per_rank = [list(CriteoTSV(path, TABLE_ROWS, 4, rank=r, world_size=world_size)) for r in range(world_size)]
    # Every rank yields the same number of batches; batch k of all ranks is global batch k.
    num_batches = len(per_rank[0])
    assert all(len(batches) == num_batches for batches in per_rank)
    ids, labels = [], []
    for k in range(num_batches):
        for r in range(world_size):
            ids += line_ids(per_rank[r][k])
            labels += per_rank[r][k].labels.tolist()
    # Global batches of 4, 4 and a last short one of 3 lines (dropped only if it has < world_size lines).
    assert ids == list(range(11))
    assert labels == [float(i % 2) for i in range(11)]


def test_criteo_rank_slices_of_global_batch(tmp_path):
    path = write(tmp_path / "d", numbered_lines(10))
    rank0 = [line_ids(b) for b in CriteoTSV(path, TABLE_ROWS, 4, rank=0, world_size=2)]
    rank1 = [line_ids(b) for b in CriteoTSV(path, TABLE_ROWS, 4, rank=1, world_size=2)]
    assert rank0 == [[0, 1], [4, 5], [8]]
    assert rank1 == [[2, 3], [6, 7], [9]]


def test_criteo_last_short_batch(tmp_path):
    path = write(tmp_path / "d", numbered_lines(10))
    assert [line_ids(b) for b in CriteoTSV(path, TABLE_ROWS, 4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [line_ids(b) for b in CriteoTSV(path, TABLE_ROWS, 4, drop_last=True)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # The last global batch (2 lines) is too short for 3 ranks: every rank drops it.
    for rank in range(3):
        assert len(list(CriteoTSV(path, TABLE_ROWS, 4, rank=rank, world_size=3))) == 2
    # An exact multiple leaves no short batch.
    assert len(list(CriteoTSV(path, TABLE_ROWS, 5))) == 2


def test_criteo_concatenates_files_and_reads_gz(tmp_path):
    lines = numbered_lines(7)
    plain = write(tmp_path / "day_0", lines[:3])
    gz_path = tmp_path / "day_1.gz"
    with gzip.open(gz_path, "wt") as f:
        f.writelines(lines[3:])
    # The second global batch spans both files.
    batches = list(CriteoTSV([plain, gz_path], TABLE_ROWS, 4))
    assert [line_ids(b) for b in batches] == [[0, 1, 2, 3], [4, 5, 6]]

    whole_plain = write(tmp_path / "all", lines)
    for a, b in zip(batches, CriteoTSV(whole_plain, TABLE_ROWS, 4)):
        assert_batches_equal(a, b)


def test_criteo_is_reiterable(tmp_path):
    path = write(tmp_path / "d", numbered_lines(5))
    reader = CriteoTSV(path, TABLE_ROWS, 2)
    assert [line_ids(b) for b in reader] == [line_ids(b) for b in reader]


def test_criteo_unreadable_files_name_the_file_and_line(tmp_path):
    """A truncated .gz, a corrupt one, a byte that is not UTF-8, a plain file named .gz: the error says which file,
    where."""
    lines = numbered_lines(6)
    whole = tmp_path / "whole.gz"
    with gzip.open(whole, "wt") as f:
        f.writelines(lines)
    truncated = tmp_path / "truncated.gz"
    truncated.write_bytes(whole.read_bytes()[:-12])
    # whole.gz, then a gzip member whose deflate data starts with a block of the reserved type 3: zlib.error
    corrupt = tmp_path / "corrupt.gz"
    corrupt.write_bytes(whole.read_bytes() + b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff\x07" + bytes(16))
    not_utf8 = tmp_path / "latin1.tsv"
    not_utf8.write_bytes("".join(lines[:2]).encode() + b"\xff\xfe\n")
    not_gzip = write(tmp_path / "plain.gz", lines)
    for path, where in ((truncated, r"truncated.gz: cannot read past line \d+"),
                        (corrupt, r"corrupt.gz: cannot read past line 6: Error -3 while decompressing data"),
                        (not_utf8, r"latin1.tsv: cannot read past line \d+"),
                        (not_gzip, r"plain.gz: cannot read past line 0")):
        with pytest.raises(ValueError, match=where):
            list(CriteoTSV(str(path), TABLE_ROWS, 2))


def test_criteo_missing_file(tmp_path):
    present = write(tmp_path / "d", numbered_lines(2))
    missing = str(tmp_path / "nope.tsv")
    with pytest.raises(FileNotFoundError, match="nope.tsv"):
        CriteoTSV([present, missing], TABLE_ROWS, 2)


def test_criteo_directory_is_named_as_one(tmp_path):
    """The folder of a day's files given for its files: "not found" named a path that exists."""
    (tmp_path / "days").mkdir()
    write(tmp_path / "days" / "day_0", numbered_lines(2))
    with pytest.raises(IsADirectoryError, match=rf"^Criteo path {tmp_path}/days is a directory: give its files "
                                                r"\(paths=\[day_0, day_1, ...\]\)$"):
        CriteoTSV(str(tmp_path / "days"), TABLE_ROWS, 2)


@pytest.mark.parametrize(
    "bad_line,match",
    [
        ("1\t2\t3\n", "columns"),
        (criteo_line(2), "label"),
        (criteo_line(1, dense=["x1"] + [0] * 12), "integer"),
        (criteo_line(1, cats=["zz"] + ["0"] * 25), "hexadecimal"),
        ("\n", "columns"),
        ("\t".join(criteo_line(1).split("\t")[:-1]) + "\n", "got 39"),
        (criteo_line(1).rstrip("\n") + "\t\n", "got 41"),
        (criteo_line(" 1"), "label"),
        (criteo_line(1, dense=["-"] + [0] * 12), "integer"),
        (criteo_line(1, dense=[1.5] + [0] * 12), "integer"),
        (criteo_line(1, dense=[0] * 12 + ["12a"]), "integer"),
        pytest.param(criteo_line(1, dense=["9" * 400] + [0] * 12),
                     r"'99999999999999999999'\.\.\. \(400 characters\) is too large", id="400 digits"),
        pytest.param(criteo_line(1, dense=["9" * 5000] + [0] * 12), "4300 digits", id="5000 digits"),  # int()'s limit
        (criteo_line(1, cats=["0"] * 25 + ["0x"]), "hexadecimal"),
        (criteo_line(1, cats=["0"] * 25 + ["ab\x00"]), "hexadecimal"),
    ],
)
def test_criteo_malformed_line_reports_file_and_line(tmp_path, bad_line, match):
    lines = numbered_lines(5)
    lines[3] = bad_line
    path = write(tmp_path / "bad.tsv", lines)
    with pytest.raises(ValueError, match=match) as info:
        list(CriteoTSV(path, TABLE_ROWS, 2))
    assert f"{path}:4" in str(info.value)


def test_criteo_names_the_first_malformed_line_of_a_batch(tmp_path):
    lines = numbered_lines(8)
    lines[5] = criteo_line(1, cats=["0"] * 25 + ["xyz"])
    lines[6] = "garbage\n"
    path = write(tmp_path / "bad.tsv", lines)
    with pytest.raises(ValueError, match=r"bad.tsv:6: malformed Criteo line: categorical value 'xyz'"):
        list(CriteoTSV(path, TABLE_ROWS, 4))


def random_criteo_lines(rng: random.Random, n: int) -> list[str]:
    """Lines in the canonical form with every kind of value: missing ones in every column, negative, zero and
    leading-zero counts of 1..16 digits, hex values of 1..16 digits (either case, some >= 2**63)."""
    def dense():
        count = rng.randrange(-(10 ** rng.randint(1, 15)), 10 ** rng.randint(1, 16))
        return rng.choice(["", "", "0", "-0", "007", str(count)])

    def categorical():
        digits = rng.randint(1, 16)
        value = rng.getrandbits(4 * digits) | (rng.random() < 0.3) << (4 * digits - 1)  # top bit set: >= 2**63 at 16
        return rng.choice(["", f"{value:0{digits}x}", f"{value:0{digits}X}"])

    return [criteo_line(rng.randint(0, 1), [dense() for _ in range(13)], [categorical() for _ in range(26)])
            for _ in range(n)]


def reference_batch(lines: list[str], num_rows, feature_names=CRITEO_SPARSE_FEATURES):
    """The batch of `lines` as CriteoTSV made it line by line (_parse_line) before the vectorised parser."""
    labels, dense, sparse = zip(*(criteo._parse_line(line, num_rows) for line in lines))
    ids = torch.tensor(sparse, dtype=torch.int64).t()
    present = ids >= 0
    return Batch(
        dense_features=torch.tensor(dense, dtype=torch.float64).log1p().float(),
        sparse_features=KeyedJaggedTensor.from_lengths_sync(
            keys=feature_names, values=ids[present], lengths=present.flatten().int()),
        labels=torch.tensor(labels, dtype=torch.float32),
    )


# Uneven, with 1 (every id 0), sizes past 2**32 and 2**63 - 1 (ids of values >= 2**63 taken mod it).
UNEVEN_ROWS = [1, 2, 7, 1000, 65537, 2**31 - 1, 2**32 + 15, 2**62 + 9, 2**63 - 1, 10**18 + 3,
               3, 5, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61]


def test_criteo_vectorised_parser_equals_per_line_reference():
    seed = random.randrange(2**32)
    lines = random_criteo_lines(random.Random(seed), 3000)
    parsed = criteo._parse_canonical(lines, UNEVEN_ROWS)
    assert parsed is not None, f"seed {seed}: canonical lines left to the per-line parser"
    labels, dense, sparse = zip(*(criteo._parse_line(line, UNEVEN_ROWS) for line in lines))
    for got, expected in zip(parsed, (labels, dense, sparse)):
        expected = torch.tensor(expected, dtype=torch.from_numpy(got).dtype)  # as the reader made them
        assert torch.equal(torch.from_numpy(got), expected), f"seed {seed}"
    ids = torch.tensor(sparse)
    assert ids.min() == -1 and ids.max() >= 2**32, f"seed {seed}: missing values and large ids not covered"


def test_criteo_reads_a_file_as_the_per_line_parser_did(tmp_path):
    """End to end over two files, the first without a final newline, its last line in the same batch as the second
    file's first: every rank's batches equal those that the line-by-line parsing made."""
    seed = random.randrange(2**32)
    lines = random_criteo_lines(random.Random(seed), 700)
    first = write(tmp_path / "day_0", [*lines[:332], lines[332].rstrip("\n")])
    second = write(tmp_path / "day_1", lines[333:])
    for rank in range(3):
        batches = list(CriteoTSV([first, second], UNEVEN_ROWS, 128, rank=rank, world_size=3))
        assert len(batches) == 6
        for index, batch in enumerate(batches):
            global_batch = lines[index * 128 : (index + 1) * 128]
            start, stop = local_batch_bounds(len(global_batch), rank, 3)
            assert_batches_equal(batch, reference_batch(global_batch[start:stop], UNEVEN_ROWS))


@pytest.mark.parametrize("dense,cat", [
    (" 5", "a"), ("+5", "a"), ("1_000", "a"), ("\u0663", "a"),  # an Arabic-Indic 3
    ("1" * 17, "a"), ("98765432109876543210987", "a"), pytest.param("-" + "9" * 400, "a", id="-400 digits"),
    ("0", "0x1f"), ("0", "-1f"), ("0", " ff "), ("0", "F_F"), ("0", "1" * 17), ("0", "f" * 40), ("0", "\u0663"),
])
def test_criteo_values_off_the_canonical_form_parse_as_int_does(tmp_path, dense, cat):
    """What Python's int() accepts beyond the canonical form is accepted still (line by line: same result)."""
    lines = random_criteo_lines(random.Random(), 5)
    lines[2] = criteo_line(1, [dense] * 13, [cat] * 26)
    assert criteo._parse_canonical(lines, UNEVEN_ROWS) is None
    batch = next(iter(CriteoTSV(write(tmp_path / "d", lines), UNEVEN_ROWS, 5)))
    assert_batches_equal(batch, reference_batch(lines, UNEVEN_ROWS))


def test_criteo_other_ranks_lines_are_not_parsed(tmp_path):
    lines = numbered_lines(4)
    lines[3] = "garbage\n"
    path = write(tmp_path / "d", lines)
    # Rank 0 of 2 owns lines 0-1 of the single global batch and never parses line 3.
    assert [line_ids(b) for b in CriteoTSV(path, TABLE_ROWS, 4, rank=0, world_size=2)] == [[0, 1]]
    with pytest.raises(ValueError, match=":4"):
        list(CriteoTSV(path, TABLE_ROWS, 4, rank=1, world_size=2))


@pytest.mark.parametrize("files,world_size,drop_last,match", [
    ([0], 1, False, r"d0 hold 0 lines, fewer than one batch takes: 1 \(one per rank"),
    ([1], 2, False, r"d0 hold 1 lines, fewer than one batch takes: 2 \(one per rank"),
    ([0, 1], 2, False, r"d0, .*d1 hold 1 lines, fewer than one batch takes: 2"),
    ([3], 1, True, r"d0 hold 3 lines, fewer than one batch takes: 4 \(a whole global batch: drop_last"),
])
def test_criteo_files_too_short_for_a_batch_are_refused(tmp_path, files, world_size, drop_last, match):
    """Files that make no batch are refused when the reader is made (train.py: before training, on every rank,
    naming them); they yielded nothing, and the run failed where it first read them (the evaluation's: after
    trainer.eval_every steps) with "is the file empty or smaller than one global batch?", which a file of fewer
    lines than a global batch is not (its short batch is kept)."""
    paths = [write(tmp_path / f"d{i}", numbered_lines(n)) for i, n in enumerate(files)]
    with pytest.raises(ValueError, match=match):
        CriteoTSV(paths, TABLE_ROWS, 4, rank=0, world_size=world_size, drop_last=drop_last)
    # one line more (the first file's) makes a batch: its short one, or with drop_last a whole one
    write(tmp_path / "d0", numbered_lines(files[0] + 1))
    assert len(list(CriteoTSV(paths, TABLE_ROWS, 4, rank=0, world_size=world_size, drop_last=drop_last))) == 1


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_resume_reads_the_batches_before_it_without_parsing_them(tmp_path, monkeypatch, num_workers):
    """batch_stream from step 4 over 3 passes of 3 batches (10 lines in global batches of 4, rank 1 of 2): the
    batches of the whole stream from there, and only their lines parsed. Parsing a line costs ~10x reading it: a
    resume deep into a day of Criteo parsed every line before its step (minutes) to throw it away."""
    reader = CriteoTSV(write(tmp_path / "d", numbered_lines(10)), TABLE_ROWS, 4, rank=1, world_size=2,
                       num_workers=num_workers)
    whole = [(epoch, line_ids(batch)) for epoch, batch in batch_stream(reader, 0, None, epochs=3)]
    assert whole[:4] == [(0, [2, 3]), (0, [6, 7]), (0, [9]), (1, [2, 3])]
    parsed = tmp_path / "parsed"  # a line per line parsed, appended by whichever process parses it
    parse = criteo._parse_canonical

    def counted(lines, rows):
        with parsed.open("a") as f:
            f.writelines(lines)
        return parse(lines, rows)

    monkeypatch.setattr(criteo, "_parse_canonical", counted)
    resumed = [(epoch, line_ids(batch)) for epoch, batch in batch_stream(reader, 4, None, epochs=3)]
    assert resumed == whole[4:]
    assert len(parsed.read_text().splitlines()) == sum(len(ids) for _, ids in resumed)


@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_criteo_workers_make_the_batches_of_one_process(tmp_path, num_workers):
    """Batch for batch what the reader makes in its own process: over three files (a .gz, one without its final
    newline) with the short last batch or without (drop_last), for every rank of 3, from the start or resumed."""
    lines = random_criteo_lines(random.Random(1), 700)
    with gzip.open(tmp_path / "day_1.gz", "wt") as f:
        f.writelines(lines[250:600])
    paths = [write(tmp_path / "day_0", lines[:250]), str(tmp_path / "day_1.gz"),
             write(tmp_path / "day_2", [*lines[600:-1], lines[-1].rstrip("\n")])]
    for drop_last in (False, True):
        for world_size, rank in ((1, 0), (3, 0), (3, 2)):
            def reader(workers):
                return CriteoTSV(paths, UNEVEN_ROWS, 64, rank=rank, world_size=world_size, drop_last=drop_last,
                                 num_workers=workers)
            for skipped in (0, 4):
                alone, made = list(reader(0).skipping(skipped)), list(reader(num_workers).skipping(skipped))
                assert len(alone) == 10 + (not drop_last) and len(made) == len(alone)
                for index, (a, b) in enumerate(zip(alone, made)):
                    assert (a is None) == (b is None) == (index < skipped)
                    if a is not None:
                        assert_batches_equal(a, b)


@pytest.mark.parametrize("cpus,local_ranks,workers", [(2, 1, 1), (1, 1, 1), (16, 4, 3), (64, 8, 7), (64, 1, 8),
                                                     (8, 16, 1)])
def test_criteo_default_workers_share_the_cpus_of_a_node(monkeypatch, cpus, local_ranks, workers):
    monkeypatch.setattr(criteo.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_ranks))
    assert criteo.default_num_workers() == workers


@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_criteo_worker_errors_reach_the_caller_at_their_batch(tmp_path, num_workers):
    """A malformed line, or a file that cannot be read past a line, raises the reader's own ValueError (not a
    DataLoader's copy, its message a worker's traceback) after the batches before it, from any worker."""
    lines = numbered_lines(30)
    lines[17] = criteo_line(2)  # global batch 4 of 4 lines
    bad = write(tmp_path / "bad.tsv", lines)
    with gzip.open(tmp_path / "whole.gz", "wt") as f:
        f.writelines(numbered_lines(3000))
    truncated = tmp_path / "truncated.gz"
    truncated.write_bytes((tmp_path / "whole.gz").read_bytes()[:-100])
    for paths, message, made in (
        (bad, re.escape(f"{bad}:18: malformed Criteo line: label must be 0 or 1, got '2'"), 4),
        ([bad.replace("bad.tsv", "good.tsv"), truncated],
         re.escape(f"{truncated}: cannot read past line ") + r"(\d+): Compressed file ended .*", None),
    ):
        if made is None:
            write(tmp_path / "good.tsv", numbered_lines(2))
        batches = iter(CriteoTSV(paths, TABLE_ROWS, 4, num_workers=num_workers))
        yielded = []
        with pytest.raises(ValueError) as info:
            yielded.extend(batches)
        found = re.fullmatch(message, str(info.value))
        assert found, str(info.value)
        if made is None:  # the batch that holds the line after the last one read: 2 lines of good.tsv first
            made = (2 + int(found.group(1))) // 4
        assert len(yielded) == made


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_rows": [10] * 13}, "26"),
        ({"num_rows": [0] * 26}, "num_rows"),
        ({"num_rows": [2**63] * 26}, r"num_rows must all be in \[1, 2\*\*63\)"),
        ({"feature_names": ["a", "b"]}, "feature_names"),
        ({"global_batch_size": 1, "world_size": 2}, "global_batch_size"),
        ({"num_workers": -1}, r"num_workers must be an integer >= 0 \(0: no worker processes\), got -1"),
        ({"num_workers": True}, r"num_workers must be an integer >= 0 \(0: no worker processes\), got True"),
        ({"num_dense": 10}, r"^num_dense must be 13 \(Criteo lines hold 13 dense counts\), got 10$"),
        ({"paths": []}, r"^paths must name at least one Criteo file, got \[\]$"),
    ],
)
def test_criteo_argument_errors(tmp_path, kwargs, match):
    path = write(tmp_path / "d", numbered_lines(2))
    args = {"paths": path, "num_rows": TABLE_ROWS, "global_batch_size": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        CriteoTSV(**args)


def test_criteo_refuses_a_dense_feature_count_other_than_its_13(tmp_path):
    """The model's dense input is data.num_dense: with data=criteo any other count than the files' 13 is refused
    where the dataset is made (every rank), not at the first step's forward as a shape mismatch of the dense arch."""
    from fused_dlrm.train.build import build_dataset
    from test_training import CPU, config

    path = write(tmp_path / "d", numbered_lines(4))
    cfg = config("data=criteo", f"data.train.paths=[{path}]", f"data.eval.paths=[{path}]", "data.num_dense=10",
                 "data.global_batch_size=2", "model.num_rows=100")
    for split in ("train", "eval"):  # by its key (its message began with "Criteo", and named none)
        with pytest.raises(ValueError, match=rf"^data.{split}.num_dense must be 13 \(Criteo lines hold 13 dense "
                                             rf"counts\), got 10$"):
            build_dataset(cfg, split, CPU)


class SplitFilesCriteo(SyntheticCriteo):
    """A dataset class of a user's (data.<split>._target_) refusing something else in words that begin with one
    of its keys (split: the stream's name)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        raise ValueError("split files are not supported: give one file per table")


def test_build_dataset_names_only_an_argument_the_dataset_refuses():
    """build_dataset names a refused argument by its key (data.<split>.<argument>), and leaves any other error as
    it is: this one was named data.train.split, which is fine."""
    from fused_dlrm.train.build import build_dataset
    from test_training import CPU, config

    cfg = config(f"data.train._target_={__name__}.SplitFilesCriteo")
    with pytest.raises(ValueError, match=r"^split files are not supported: give one file per table$"):
        build_dataset(cfg, "train", CPU)
    with pytest.raises(ValueError, match=r"^data.train.zipf_alpha must be >= 0, got -1$"):  # its argument's
        build_dataset(config(f"data.train._target_={__name__}.SplitFilesCriteo", "data.train.zipf_alpha=-1"),
                      "train", CPU)
