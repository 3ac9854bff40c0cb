"""What row-wise sharding adds around the input and output dists (plan.py says how a table is cut into row blocks).

Before the input dist, `RowBuckets` cuts each row-wise feature's bags by row block: every index goes to the block
holding its row, rebased to the block's first row, as that block's feature (`RowBlock.feature`); the input dist then
sends each block's feature to its rank only, like any feature. After the output dist, `RowBlockSum` adds the
blocks' pooled parts of each sample (block order: the same sum on every run) and divides a mean-pooled feature's
sum by the sample's bag size, which only the sample's own rank knows (`pooling_divisors`). Both are torch ops that
never wait for the GPU. The sum's backward gives every block the sample's gradient (a mean's divided); where the
wide row is the fused exchange's output, the sum offers the exchange's gradient push on (`RowBlockPush`): a consumer
whose kernel makes the real row's gradient (DLRM's interaction) then stores it at every block's part itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from fused_dlrm.kernels.batch_header import value_keys
from fused_dlrm.kernels.push_columns import GradientDestinations, is_feature_view
from fused_dlrm.sparse.plan import RowBlock, RowWiseColumns

if TYPE_CHECKING:  # (fused_all_to_all imports the input dist, which imports this module)
    from fused_dlrm.sparse.fused_all_to_all import GradientPush


# A value v of key k, clamped to +-2**40 (tables hold < 2**31 rows), sits at k * _KEY_SPAN + v on one line on which
# every cut key starts at a point (`RowBuckets.starts`): one search over those few points finds each value's cut
# key, without a [values x blocks] comparison.
_KEY_SPAN, _CLAMP = 2 ** 42, 2 ** 40


@dataclass
class RowBuckets:
    """The cut of one KJT key order: where each cut key starts on the line of (key, index) and its block's first
    row."""
    keys: list[str]  # the cut KJT's keys: each row-wise key replaced by its blocks' features, in row order
    starts: torch.Tensor  # [cut keys] int64, ascending: key k's block 0 below any of k's values, block b at its row
    first_rows: torch.Tensor  # [cut keys] int64: what a value of that cut key is rebased by
    mean_keys: torch.Tensor  # the keys whose bag sizes divide their pooled sums (mean-pooled row-wise features)

    @classmethod
    def of(cls, keys: list[str], blocks: dict[str, list[RowBlock]], mean_features: Sequence[str],
           device: torch.device) -> "RowBuckets":
        starts, first_rows, cut = [], [], []
        for k, key in enumerate(keys):
            mine = blocks.get(key) or [RowBlock(key, 0)]
            starts += [k * _KEY_SPAN - 2 * _CLAMP] + [k * _KEY_SPAN + b.row for b in mine[1:]]
            first_rows += [b.row for b in mine]
            cut += [b.feature for b in mine]
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)
        return cls(cut, as_tensor(starts), as_tensor(first_rows), as_tensor([keys.index(f) for f in mean_features]))

    def cut(self, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(values, lengths [cut keys, batch], weights) of the cut KJT. An index outside its table goes to its first
        or last block and stays outside that block's rows (the input dist's header reports it on the uncut KJT); a
        KJT whose values and lengths disagree, or whose indices are of a dtype the input dist refuses (bool ones
        too), is cut without failing (the header reports it too)."""
        batch = lengths.shape[1]
        if values.numel() == 0 or batch == 0:  # nothing to cut (values without samples: the header reports them)
            return values, lengths.new_zeros(len(self.keys), batch), weights
        bag = value_keys(values, lengths.reshape(-1))  # each value's (key, sample), robust to a bad batch
        key, sample = bag // batch, bag % batch
        # rebased in int64: torch refuses to subtract from bool indices, which then raised on this rank alone
        wide = values.long()
        line = key * _KEY_SPAN + wide.clamp(-_CLAMP, _CLAMP)
        cut_key = torch.searchsorted(self.starts, line, right=True) - 1
        # by cut key, each key's values keeping their order (int32 keys: half the radix sort's passes)
        order = torch.sort(cut_key.int(), stable=True).indices
        cut_values = (wide - self.first_rows[cut_key]).to(values.dtype)[order]
        cut_lengths = torch.zeros(len(self.keys) * batch, dtype=lengths.dtype, device=values.device)
        cut_lengths.index_add_(0, cut_key * batch + sample, torch.ones_like(cut_key, dtype=lengths.dtype))
        return cut_values, cut_lengths.view(len(self.keys), batch), None if weights is None else weights[order]

    def pooling_divisors(self, lengths: torch.Tensor) -> torch.Tensor | None:
        """[batch, mean-pooled row-wise features]: their bag sizes (at least 1: an empty bag's mean is 0), from the
        uncut lengths [keys, batch]; None without such features."""
        if self.mean_keys.numel() == 0:
            return None
        return lengths[self.mean_keys].t().clamp(min=1).float()


class RowBlockSum:
    """The wide pooled row [batch, real + blocks' columns] (plan.row_wise_columns) -> the real row [batch, real]."""

    def __init__(self, real_len: int, columns: list[RowWiseColumns]):
        self.real_len = real_len
        self.columns = columns
        self.mean_features = [c.feature for c in columns if c.mean]
        self._mean_features: dict[tuple[torch.device, int], torch.Tensor] = {}  # feature_divisors' columns
        self._pushed_features: dict[tuple[int, torch.device], torch.Tensor] = {}  # fan_out's tables
        self._extra_len = sum(c.dim * (len(c.block_cols) - 1) for c in columns)  # the wide row's later blocks
        # Slices, not index tensors (docs/benchmarks.md, 2026-12-02, fifty-fifth session): a group is features side
        # by side in both rows, of one width and one block count, each feature's later blocks side by side after
        # the real row (plan.row_wise_columns' layout), so block b of the whole group is one strided slice: the
        # paper config, every table in blocks, is one group.
        self._groups: list[tuple[int, int, int, int, int]] = []  # (column, first later column, features, dim, blocks)
        for c in columns:
            blocks = len(c.block_cols)
            if any(col != c.block_cols[1] + (b - 1) * c.dim for b, col in enumerate(c.block_cols[1:], 1)):
                raise ValueError(f"feature {c.feature!r}: its later blocks are not side by side (block_cols "
                                 f"{c.block_cols}): not plan.row_wise_columns' layout")
            last = self._groups[-1] if self._groups else None
            if (last and last[3:] == (c.dim, blocks) and last[0] + last[2] * c.dim == c.col
                    and last[1] + last[2] * (blocks - 1) * c.dim == c.block_cols[1]):
                self._groups[-1] = (last[0], last[1], last[2] + 1, c.dim, blocks)
            else:
                self._groups.append((c.col, c.block_cols[1], 1, c.dim, blocks))
        means = [(c.col, k, c.dim) for k, c in enumerate(c for c in columns if c.mean)]
        self._mean_runs = []  # (first column, first divisor, features, dim): mean-pooled features side by side
        for col, k, dim in means:
            last = self._mean_runs[-1] if self._mean_runs else None
            if last and last[3] == dim and last[0] + last[2] * dim == col and last[1] + last[2] == k:
                self._mean_runs[-1] = (last[0], last[1], last[2] + 1, dim)
            else:
                self._mean_runs.append((col, k, 1, dim))

    def pushable(self, dim: int) -> bool:
        """Whether the real row seen as features of `dim` columns finds each row-wise feature one of them, and each
        of its blocks' parts one of the wide row's (pushed_features can name them)."""
        return self.real_len % dim == 0 and all(c.dim == dim and all(col % dim == 0 for col in c.block_cols)
                                                for c in self.columns)

    def pushed_features(self, dim: int, device: torch.device) -> torch.Tensor:
        """For a kernel that makes the real row's gradient as [batch, features, dim] and stores it into the wide
        row's owners (GradientDestinations.block_features; `pushable(dim)`): int32 [most blocks, features], the
        wide row's feature (its first column / dim) holding row block l's part of feature f (l = 0: f itself), -1
        where f has fewer blocks."""
        if not self.pushable(dim):
            raise ValueError(f"the row-wise features are not features of {dim} columns in both rows")
        table = torch.full((max(len(c.block_cols) for c in self.columns), self.real_len // dim), -1,
                           dtype=torch.int32)
        table[0] = torch.arange(table.shape[1])
        for c in self.columns:
            for block, col in enumerate(c.block_cols[1:], 1):
                table[block, c.col // dim] = col // dim
        return table.to(device)

    def feature_divisors(self, divisors: torch.Tensor | None, dim: int) -> torch.Tensor | None:
        """[batch, features] fp32 (every feature `dim` wide): what each feature's gradient is divided by on its way
        to the blocks, its bag size for a mean-pooled row-wise feature (`divisors`' columns), else 1; None without
        such features."""
        if not self.mean_features:
            return None
        key = (divisors.device, dim)
        if key not in self._mean_features:
            self._mean_features[key] = torch.tensor([c.col // dim for c in self.columns if c.mean],
                                                    device=divisors.device)
        mean_features = self._mean_features[key]
        ones = divisors.new_ones(divisors.shape[0], self.real_len // dim)
        return ones.index_copy_(1, mean_features, divisors)

    def fan_out(self, destinations: GradientDestinations, divisors: torch.Tensor | None,
                dim: int) -> GradientDestinations:
        """The exchange's `destinations` (over the wide row) for a kernel that stores the real row's gradient
        [batch, features, dim]: every feature's at each of its blocks' parts, a mean's divided by its bag size
        (`divisors`, the bags' pooling_divisors): the sum's backward on the way."""
        key = (dim, destinations.block_dest.device)
        if key not in self._pushed_features:
            self._pushed_features[key] = self.pushed_features(dim, destinations.block_dest.device)
        return replace(destinations, block_features=self._pushed_features[key],
                       divisors=self.feature_divisors(divisors, dim))

    def __call__(self, wide: torch.Tensor, divisors: torch.Tensor | None) -> torch.Tensor:
        """The real row, with autograd's backward (`wide_gradient`), and the exchange's push offered on."""
        return _BlockSum.apply(wide, divisors, self)

    def sum_blocks(self, wide: torch.Tensor, divisors: torch.Tensor | None) -> torch.Tensor:
        """The real row (no autograd)."""
        if wide.shape[1] != self.real_len + self._extra_len:
            raise ValueError(f"a wide row of {wide.shape[1]} columns; the row blocks' sum takes {self.real_len} "
                             f"real and {self._extra_len} later blocks' columns")
        out = wide[:, :self.real_len].clone()  # block 0's parts, at their place
        for block in range(1, max(g[4] for g in self._groups)):  # block by block: every sum in the same order
            for col, first, count, dim, blocks in self._groups:
                if block < blocks:
                    later = wide[:, first:first + count * (blocks - 1) * dim].unflatten(1, (count, blocks - 1, dim))
                    out[:, col:col + count * dim].unflatten(1, (count, dim)).add_(later[:, :, block - 1])
        return self._divide_means_(out, divisors)

    def _divide_means_(self, real: torch.Tensor, divisors: torch.Tensor | None) -> torch.Tensor:
        """real's mean-pooled features' columns divided by their bag sizes, in place (only those columns)."""
        for col, k, count, dim in self._mean_runs:
            real[:, col:col + count * dim].unflatten(1, (count, dim)).div_(divisors[:, k:k + count, None])
        return real

    def wide_gradient(self, grad: torch.Tensor, divisors: torch.Tensor | None) -> torch.Tensor:
        """The wide row's gradient from the real row's: each block's part receives its feature's (a mean's divided
        by the bag size)."""
        if self._mean_runs:
            grad = self._divide_means_(grad.clone(), divisors)
        wide = grad.new_empty(grad.shape[0], self.real_len + self._extra_len)  # every column is some block's
        wide[:, :self.real_len] = grad
        for col, first, count, dim, blocks in self._groups:
            later = wide[:, first:first + count * (blocks - 1) * dim].unflatten(1, (count, blocks - 1, dim))
            later.copy_(grad[:, col:col + count * dim].unflatten(1, (count, 1, dim)).expand_as(later))
        return wide


class RowBlockPush:
    """The fused exchange's gradient push (GradientPush) offered on through the row blocks' sum of its output: a
    consumer's kernel storing the gradient of the real row stores it at every block's part of the exchange's row
    (RowBlockSum.fan_out); the sum's backward then receives no gradient and passes none on, and the exchange's
    backward only waits for the flags (GradientPush's protocol)."""

    def __init__(self, push: GradientPush, block_sum: RowBlockSum, divisors: torch.Tensor | None,
                 output: torch.Tensor):
        self.push, self.block_sum, self.divisors = push, block_sum, divisors
        # the output's place and shape, not the tensor: the sum's node holds this offer, and the output holds
        # its node (a cycle that would keep every step's real row until Python's garbage collector ran)
        self.output = (output.data_ptr(), tuple(output.shape), output.stride(0))

    def serves(self, x: torch.Tensor, block: int) -> bool:
        """x is the real row seen as [batch, F, D], the row-wise features D-column features in both rows, and the
        exchange's row cut in blocks of `block` columns per feature finds each one owner's contiguous, aligned
        columns."""
        return (is_feature_view(x, *self.output) and self.block_sum.pushable(x.shape[2])
                and self.push.exchange.push_blocks(x.shape[2], block) is not None)

    def begin(self, dim: int, block: int) -> GradientDestinations:
        return self.block_sum.fan_out(self.push.begin(dim, block), self.divisors, dim)


class _BlockSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, wide: torch.Tensor, divisors: torch.Tensor | None, block_sum: RowBlockSum) -> torch.Tensor:
        ctx.block_sum, ctx.divisors = block_sum, divisors
        ctx.set_materialize_grads(False)  # None: the consumer pushed the gradient itself (RowBlockPush)
        out = block_sum.sum_blocks(wide, divisors)
        push = getattr(wide.grad_fn, "gradient_push", None)  # the fused exchange's, when wide is its output
        ctx.gradient_push = None if push is None else RowBlockPush(push, block_sum, divisors, out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        ctx.gradient_push = None  # its part is done (the consumer's kernel has begun the push, or will not)
        # (a gradient here after the consumer pushed: the exchange's backward says there is another consumer)
        return None if grad is None else ctx.block_sum.wide_gradient(grad, ctx.divisors), None, None

