"""sparse/row_wise.py: the cut of a KJT's row-wise features by block, against a loop over the values (the sum of
the blocks' parts is checked against whole tables in test_sharded_ebc.py and test_fused_embedding_kernels.py)."""

from __future__ import annotations

import pytest
import torch

from fused_dlrm.sparse.plan import RowBlock
from fused_dlrm.sparse.row_wise import RowBuckets

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
