"""moe.permute's autograd Functions: gradcheck in float64, backwards that only gather (no index_put_ accumulate,
no index_add or scatter), low-precision dtypes, and dropped assignments next to NaN / inf rows in the backward.

Forward values and gradients against per-token reference code are in tests/test_moe_routing.py.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fused_dlrm.dist.reorder import inverse_permutation, reorder
from moe import permute, unpermute
from moe.permute import expert_order_kernels, expert_order_reference, permutation
from moe.routing import top_k_softmax_kernels
from sm90 import compile_for_sm90

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # of the kernels' tensors (CPU: interpreter)


def assignments(num_tokens: int, num_experts: int, top_k: int, drop: float, seed: int):
    """Distinct experts per token, and kept (None when dropless) with about a `drop` share of False."""
    generator = torch.Generator().manual_seed(seed)
    expert_ids = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(num_tokens)])
    expert_ids = expert_ids.reshape(num_tokens, top_k)  # T = 0 included
    kept = torch.rand(num_tokens, top_k, generator=generator) >= drop if drop else None
    return expert_ids, kept


@pytest.mark.parametrize("top_k", [1, 3])
@pytest.mark.parametrize("drop", [0.0, 0.4, 1.0])
def test_gradcheck(top_k, drop):
    num_tokens, num_experts, d = 9, 4, 3
    expert_ids, kept = assignments(num_tokens, num_experts, top_k, drop, seed=top_k)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(num_tokens, d, generator=generator, dtype=torch.float64, requires_grad=True)
    rows, perm = permute(x, expert_ids, num_experts, kept)
    assert rows.shape[0] == (num_tokens * top_k if kept is None else int(kept.sum()))
    weights = torch.rand(num_tokens, top_k, generator=generator, dtype=torch.float64, requires_grad=True)
    rows = rows.detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda x: permute(x, expert_ids, num_experts, kept)[0], (x,))
    assert torch.autograd.gradcheck(lambda rows, weights: unpermute(rows, perm, weights), (rows, weights))


@pytest.mark.parametrize("num_tokens, num_experts, top_k, case", [
    (37, 6, 2, "distinct"), (1100, 128, 3, "zipf"), (300, 64, 6, "zipf"), (129, 8, 4, "repeats"),
    (64, 16, 2, "dropped"), (10, 4, 2, "all dropped"), (1, 1, 1, "distinct")])
def test_expert_order_kernels_equal_the_stable_sort(num_tokens, num_experts, top_k, case):
    """The counting-sort kernels (interpreter) against torch's stable sort, every output equal: Zipf-skewed
    experts (some empty), more blocks than one chunk of the block counts (1100 tokens of 128 experts), an expert
    repeated within a token, dropped assignments (key num_experts)."""
    generator = torch.Generator().manual_seed(num_tokens)
    if case == "distinct":
        keys, _ = assignments(num_tokens, num_experts, top_k, 0.0, seed=num_tokens)
    elif case == "zipf":
        weights = 1 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** 1.5
        keys = torch.multinomial(weights.expand(num_tokens, -1), top_k, generator=generator)
    else:
        keys = torch.randint(0, num_experts, (num_tokens, top_k), generator=generator)
        if case != "repeats":
            drop = torch.rand(num_tokens, top_k, generator=generator) < (0.3 if case == "dropped" else 2)
            keys = torch.where(drop, num_experts, keys)
    keys = keys.reshape(-1)
    routing_weights = torch.rand(keys.shape, generator=generator, dtype=torch.bfloat16)
    got = expert_order_kernels(keys.to(DEVICE), num_experts, top_k, routing_weights.to(DEVICE))
    want = expert_order_reference(keys, num_experts)
    num_rows = int(want[3][-1])
    assert torch.equal(got.order.cpu()[:num_rows], want[0][:num_rows])
    for g, w in zip(got[1:4], want[1:]):
        assert g.dtype == torch.int64 and torch.equal(g.cpu(), w)
    assert got.token_of_row.dtype == torch.int64
    assert torch.equal(got.token_of_row.cpu()[:num_rows], want[0][:num_rows] // top_k)
    assert got.row_weights.dtype == torch.float32
    assert torch.equal(got.row_weights.cpu()[:num_rows], routing_weights.float()[want[0][:num_rows]])
    assert expert_order_kernels(keys.to(DEVICE), num_experts, top_k).row_weights is None


@pytest.mark.parametrize("drop", [0.0, 0.4])
def test_permutation_gives_each_rows_token_and_weight(drop):
    """Permutation.token_of_row and row_weights (the layer's push reads them) are the rows' own, cut to the kept
    rows."""
    expert_ids, kept = assignments(11, 5, 3, drop, seed=5)
    weights = torch.rand(11, 3, generator=torch.Generator().manual_seed(5), dtype=torch.bfloat16)
    perm = permutation(expert_ids, 5, kept, weights)
    assert perm.token_of_row.shape == perm.order.shape == perm.row_weights.shape
    assert torch.equal(perm.token_of_row, perm.order // 3)
    assert perm.row_weights.dtype == torch.float32
    assert torch.equal(perm.row_weights, weights.reshape(-1).float()[perm.order])
    assert permutation(expert_ids, 5, kept).row_weights is None
    if kept is not None:  # block counts (the router's) count every assignment: a routing with drops refuses them
        with pytest.raises(ValueError, match="block_counts count every assignment"):
            permutation(expert_ids, 5, kept, weights, torch.zeros(1, 5, dtype=torch.int32))


@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(300, 64, 6), (37, 6, 2), (129, 8, 4)])
def test_the_routers_block_counts_are_the_permutations_first_pass(num_tokens, num_experts, top_k):
    """The router's kernel counts each block's assignments on the way (Routing.block_counts); the permutation
    given them skips its first kernel and orders the rows the same (interpreter)."""
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(num_tokens))
    choice = top_k_softmax_kernels(logits.to(DEVICE), top_k, True)
    keys = choice.expert_ids.reshape(-1)
    given = expert_order_kernels(keys, num_experts, top_k, choice.weights.reshape(-1), choice.block_counts)
    counted = expert_order_kernels(keys, num_experts, top_k, choice.weights.reshape(-1))
    for a, b in zip(given, counted):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="block_counts must be int32"):
        expert_order_kernels(keys, num_experts, top_k, block_counts=choice.block_counts.long())


class RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


ACCUMULATING = {"index_put", "index_put_", "_index_put_impl_", "index_add", "index_add_", "scatter_add",
                "scatter_add_", "scatter_reduce", "scatter_reduce_", "put_", "put"}


@pytest.mark.parametrize("drop", [0.0, 0.3])
def test_backward_only_gathers(drop):
    num_tokens, num_experts, top_k, d = 12, 5, 2, 4
    expert_ids, kept = assignments(num_tokens, num_experts, top_k, drop, seed=1)
    x = torch.randn(num_tokens, d, requires_grad=True)
    weights = torch.rand(num_tokens, top_k, requires_grad=True)
    rows, perm = permute(x, expert_ids, num_experts, kept)
    y = unpermute(rows * 2, perm, weights)
    with RecordOps() as recorded:
        y.backward(torch.randn(num_tokens, d))
    assert "index_select" in recorded.ops and not recorded.ops & ACCUMULATING, recorded.ops
    # The recorder does see the accumulating backward of plain indexing.
    with RecordOps() as plain:
        x[perm.order // top_k].sum().backward()
    assert plain.ops & ACCUMULATING


def test_low_precision_rows_and_fp32_weights():
    """bf16 rows, fp32 weights: bf16 output and row gradients, fp32 weight gradients, close to float64."""
    num_tokens, num_experts, top_k, d = 40, 6, 3, 16
    expert_ids, kept = assignments(num_tokens, num_experts, top_k, 0.2, seed=2)
    generator = torch.Generator().manual_seed(3)
    x64 = torch.randn(num_tokens, d, generator=generator, dtype=torch.float64)
    w64 = torch.rand(num_tokens, top_k, generator=generator, dtype=torch.float64)
    g64 = torch.randn(num_tokens, d, generator=generator, dtype=torch.float64)
    results = []
    for x, weights in ((x64.bfloat16(), w64.float()), (x64.bfloat16().double(), w64.float().double())):
        x, weights = x.requires_grad_(), weights.requires_grad_()
        rows, perm = permute(x, expert_ids, num_experts, kept)
        y = unpermute(rows * 3, perm, weights)
        y.backward(g64.to(y.dtype))
        results.append((y, x.grad, weights.grad))
    (y, grad_x, grad_w), want = results
    assert y.dtype == grad_x.dtype == torch.bfloat16 and grad_w.dtype == torch.float32
    for got, expected in zip((y, grad_x, grad_w), want):
        torch.testing.assert_close(got.double(), expected, rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_dropped_assignments_have_exact_zero_gradients_next_to_nan_rows(bad):
    num_tokens, num_experts, top_k, d = 17, 4, 2, 5
    expert_ids, kept = assignments(num_tokens, num_experts, top_k, 0.4, seed=4)
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(num_tokens, d, generator=generator, dtype=torch.float64)
    rows, perm = permute(x, expert_ids, num_experts, kept)
    assert (perm.inverse == rows.shape[0]).any()
    rows[-1] = bad  # the row that dropped assignments read (clamped index)
    rows.requires_grad_()
    weights = torch.rand(num_tokens, top_k, generator=generator, dtype=torch.float64, requires_grad=True)
    grad_y = torch.randn(num_tokens, d, generator=generator, dtype=torch.float64)
    grad_y[0] = bad  # and a non-finite output gradient: it reaches token 0's rows only
    unpermute(rows, perm, weights).backward(grad_y)
    assert (weights.grad[~kept] == 0).all()
    owner = perm.order[-1] // top_k
    others = torch.ones(num_tokens, top_k, dtype=torch.bool)
    others[0] = others[owner] = False
    assert weights.grad[others].isfinite().all()
    token_of_row = perm.order // top_k
    assert rows.grad[token_of_row != 0].isfinite().all()
    # Through permute, tokens without a kept assignment get exact zeros even when every row's gradient is bad.
    x.requires_grad_()
    permuted, _ = permute(x, expert_ids, num_experts, kept)
    permuted.backward(torch.full_like(permuted, bad))
    has_row = kept.any(dim=1)
    assert not has_row.all() and (x.grad[~has_row] == 0).all() and not x.grad[has_row].isfinite().any()


def test_dropless_permute_needs_no_host_sync():
    """Without `kept` the row count is T * k, known on the host: permute must not read a device value back (the
    sync a training step would wait on). Meta tensors raise on any read of their data."""
    num_tokens, num_experts, top_k = 6, 4, 2
    expert_ids, _ = assignments(num_tokens, num_experts, top_k, drop=0.0, seed=1)
    rows, perm = permute(torch.empty(num_tokens, 3, device="meta"), expert_ids.to("meta"), num_experts)
    assert rows.shape == (num_tokens * top_k, 3) and perm.order.shape == (num_tokens * top_k,)


@pytest.mark.parametrize("dim", [0, 1])
def test_reorder_is_a_gather_both_ways(dim):
    """The bulk exchanges' regrouping (MoE rows, pooled embeddings' columns): x[order] along `dim` with gradient
    grad[inverse], no accumulating op."""
    generator = torch.Generator().manual_seed(3)
    order = torch.randperm(7, generator=generator)
    inverse = inverse_permutation(order)
    assert torch.equal(order[inverse], torch.arange(7))
    x = torch.randn(7, 7, generator=generator, dtype=torch.float64, requires_grad=True)
    assert torch.equal(reorder(x, dim, order, inverse), x.index_select(dim, order))
    assert torch.autograd.gradcheck(lambda x: reorder(x, dim, order, inverse), (x,))
    with RecordOps() as recorded:
        reorder(x, dim, order, inverse).backward(torch.randn(7, 7, dtype=torch.float64))
    assert "index_select" in recorded.ops and not recorded.ops & ACCUMULATING, recorded.ops


def test_expert_order_kernels_compile_for_sm90():
    """The permutation's kernels as GPUs launch them (int64 keys; 64 experts top-6, 8 top-2, 256 top-8)."""
    compile_for_sm90("""
from moe.permute import _expert_block_counts_kernel, _expert_order_kernel
from moe.permute import tokens_per_program
for experts, k in ((64, 6), (8, 2), (256, 8)):
    e_p2 = triton.next_power_of_2(experts)
    shape = dict(E=experts, E_P2=e_p2, TOP_K=k, BLOCK_T=tokens_per_program(experts))
    build(_expert_block_counts_kernel, dict(keys_ptr="*i64", block_counts_ptr="*i32"), shape)
    floats = dict(block_counts_ptr="*i32", weights_ptr="*fp32", row_weights_ptr="*fp32")
    for weights in (False, True):
        build(_expert_order_kernel, {n: floats.get(n, "*i64") for n in _expert_order_kernel.arg_names
                                     if n.endswith("_ptr")},
              dict(shape, BLOCKS_P2=128, CHUNK=max(1, min(128, 4096 // e_p2)), WEIGHTS=weights))
""")
