"""sparse/row_wise.py: the cut of a KJT's row-wise features by block, against a loop over the values; the blocks'
parts' sum, its backward and the kernel push's tables against loops over the features (the whole path is checked
against whole tables in test_sharded_ebc.py and test_fused_embedding_kernels.py)."""

from __future__ import annotations

import pytest
import torch

from fused_dlrm.sparse.plan import RowBlock, RowWiseColumns, plan_sharding
from fused_dlrm.sparse.row_wise import RowBlockSum, RowBuckets

# Keys "a" (rows cut at 4 and 8: three blocks), "b" (whole), "c" (cut at 5); the KJT lists them as b, c, a.
BLOCKS = {"a": [RowBlock("a@0", 0), RowBlock("a@4", 4), RowBlock("a@8", 8)],
          "c": [RowBlock("c@0", 0), RowBlock("c@5", 5)]}
KEYS = ["b", "c", "a"]


def cut_by_loop(values, lengths, weights):
    """The cut as the docstring says it, one value at a time: (cut keys, values, lengths, weights)."""
    keys, out = [], {}
    for key in KEYS:
        for block in BLOCKS.get(key, [RowBlock(key, 0)]):
            keys.append(block.feature)
            out[block.feature] = ([], [0] * lengths.shape[1], [])
    i = 0
    for k, key in enumerate(KEYS):
        for sample in range(lengths.shape[1]):
            for _ in range(int(lengths[k, sample])):
                blocks = BLOCKS.get(key, [RowBlock(key, 0)])
                block = max([b for b in blocks if int(values[i]) >= b.row] or blocks[:1], key=lambda b: b.row)
                vals, lens, ws = out[block.feature]
                vals.append(int(values[i]) - block.row)
                lens[sample] += 1
                ws.append(float(weights[i]))
                i += 1
    return (keys, torch.tensor([v for k in keys for v in out[k][0]]), torch.tensor([out[k][1] for k in keys]),
            torch.tensor([w for k in keys for w in out[k][2]]))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_cut_sends_each_index_to_its_block_rebased(dtype):
    gen = torch.Generator().manual_seed(3)
    lengths = torch.randint(0, 5, (3, 6), generator=gen)
    lengths[:, 0] = 0  # an empty bag in every key
    values = torch.randint(0, 12, (int(lengths.sum()),), generator=gen)
    values[:4] = torch.tensor([-3, 4, 12, 2 ** 31 - 1])  # b's or c's first values: negatives, past the table
    a = int(lengths[:2].sum())
    values[a:a + 3] = torch.tensor([3, 4, 8])  # a's first three: the block boundaries
    weights = torch.rand(values.numel(), generator=gen)
    buckets = RowBuckets.of(KEYS, BLOCKS, [], torch.device("cpu"))
    got_values, got_lengths, got_weights = buckets.cut(values.to(dtype), lengths, weights)
    keys, want_values, want_lengths, want_weights = cut_by_loop(values, lengths, weights)
    assert buckets.keys == keys == ["b", "c@0", "c@5", "a@0", "a@4", "a@8"]
    assert got_values.dtype == dtype and torch.equal(got_values.long(), want_values)
    assert torch.equal(got_lengths, want_lengths) and torch.equal(got_weights, want_weights)


def test_a_cut_of_a_bad_batch_does_not_fail():
    """Values past the lengths' sum, and an empty batch: the header reports the first; the cut must not raise."""
    buckets = RowBuckets.of(KEYS, BLOCKS, ["a"], torch.device("cpu"))
    lengths = torch.ones(3, 2, dtype=torch.int64)
    values, lengths_cut, _ = buckets.cut(torch.arange(9), lengths, None)
    assert values.numel() == 9 and lengths_cut.shape == (6, 2)
    values, lengths_cut, _ = buckets.cut(torch.arange(0), torch.zeros(3, 0, dtype=torch.int64), None)
    assert values.numel() == 0 and lengths_cut.shape == (6, 0)
    assert torch.equal(buckets.pooling_divisors(torch.tensor([[1, 0], [2, 2], [0, 3]])), torch.tensor([[1.], [3.]]))


# A real row of five features [f0: 4, f1: 8 (not row-wise), f2: 6, f3: 6, f4: 16 columns] and the wide row's later
# blocks after it: f0 in 2 blocks, f2 in 3 (mean-pooled), f3 in 2 (mean-pooled), f4 in 3, in config order (the
# column runs of f3 and f4 continue each other; f2's and f3's divisions are one run).
DIMS, STARTS, REAL = [4, 8, 6, 6, 16], [0, 4, 12, 18, 24], 40
ROW_BLOCKS, MEANS = {0: 2, 2: 3, 3: 2, 4: 3}, (2, 3)


def mixed_columns() -> tuple[list[RowWiseColumns], int]:
    columns, extra = [], REAL
    for f, blocks in ROW_BLOCKS.items():
        cols = (STARTS[f],) + tuple(extra + DIMS[f] * b for b in range(blocks - 1))
        extra += DIMS[f] * (blocks - 1)
        columns.append(RowWiseColumns(f"f{f}", STARTS[f], DIMS[f], cols, f in MEANS))
    return columns, extra


@pytest.mark.parametrize("batch", [0, 7])
def test_block_sum_and_its_backward_are_the_loops(batch):
    """Each feature's real columns are the sum of its blocks' parts (a mean-pooled one divided by the sample's bag
    size), block 0 first; autograd gives every block the sample's gradient (a mean's divided); float64 loops."""
    columns, wide_len = mixed_columns()
    gen = torch.Generator().manual_seed(11)
    wide = torch.randn(batch, wide_len, generator=gen, dtype=torch.float64, requires_grad=True)
    divisors = torch.randint(1, 9, (batch, len(MEANS)), generator=gen).double()
    grad = torch.randn(batch, REAL, generator=gen, dtype=torch.float64)
    out = RowBlockSum(REAL, columns)(wide, divisors)
    out.backward(grad)
    want, want_grad = wide.detach()[:, :REAL].clone(), torch.zeros_like(wide)
    want_grad[:, :REAL] = grad
    for c in columns:
        k = [m.feature for m in columns if m.mean].index(c.feature) if c.mean else None
        divisor = divisors[:, k:k + 1] if c.mean else 1.0
        for b, col in enumerate(c.block_cols):
            if b:
                want[:, c.col:c.col + c.dim] += wide.detach()[:, col:col + c.dim]
            want_grad[:, col:col + c.dim] = grad[:, c.col:c.col + c.dim] / divisor
        want[:, c.col:c.col + c.dim] /= divisor
    torch.testing.assert_close(out, want, rtol=1e-12, atol=0)
    torch.testing.assert_close(wide.grad, want_grad, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match=f"a wide row of {wide_len - 1} columns"):
        RowBlockSum(REAL, columns)(wide.detach()[:, 1:], divisors)


def test_pushed_features_and_divisors_name_every_block():
    """For a kernel storing the real row's gradient in the wide row (features of one width: 8 columns): block l of
    feature f at wide feature pushed_features[l, f], -1 past its blocks; divisors 1 but for mean-pooled features."""
    columns, extra = [], 32
    for f, blocks in enumerate([2, 1, 3, 2]):  # f1 not row-wise
        if blocks > 1:
            cols = (8 * f,) + tuple(extra + 8 * b for b in range(blocks - 1))
            extra += 8 * (blocks - 1)
            columns.append(RowWiseColumns(f"f{f}", 8 * f, 8, cols, f == 2))
    block_sum = RowBlockSum(32, columns)
    assert block_sum.pushed_features(8, torch.device("cpu")).tolist() == [[0, 1, 2, 3], [4, -1, 5, 7], [-1, -1, 6, -1]]
    divisors = torch.tensor([[3.0], [5.0]])
    assert block_sum.feature_divisors(divisors, 8).tolist() == [[1, 1, 3, 1], [1, 1, 5, 1]]
    with pytest.raises(ValueError, match="are not features of 16 columns"):
        block_sum.pushed_features(16, torch.device("cpu"))


def test_tables_alike_are_one_slice_per_block():
    """Tables of one width cut into as many blocks (the paper config's kind) make one group: the sum is one strided
    slice add per block, not one per feature (plan_sharding's layout, 3 blocks over 2 ranks)."""
    from torchrec import EmbeddingBagConfig

    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=16, num_embeddings=30, feature_names=[f"f{i}"])
              for i in range(8)]
    columns = plan_sharding(tables, 2, row_shards=3).row_wise_columns(tables)
    assert len(columns) == 8 and all(len(c.block_cols) == 3 for c in columns)
    assert RowBlockSum(8 * 16, columns)._groups == [(0, 8 * 16, 8, 16, 3)]

