"""Tensor-parallel linears on gloo worlds of 2 and 4 processes against one-process nn.Linear layers.

Every rank builds the TP layers and the unsharded reference from the same (seed, std); outputs, input gradients
and each rank's weight-gradient shard must equal the reference's (float64 data, so only summation order differs).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fused_dlrm.tp.linear import ColumnParallelLinear, RowParallelLinear, full_weight, tp_groups
from moe.transformer import MoETransformer, expert_parameters
from world import run_torchrun, run_world

D_IN, D_HID = 12, 24


def _reference_weight(*args) -> torch.Tensor:
    """The unsharded weight as the layers hold it (float32 parameters), in float64 for the reference."""
    return full_weight(*args).float().double().requires_grad_()


def _close(got, expected):
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def _layers_match_one_process(rank: int, world: int, tp_size: int) -> None:
    tp, dp = tp_groups(tp_size)
    assert dist.get_process_group_ranks(tp) == list(range(rank - rank % tp_size, rank - rank % tp_size + tp_size))
    assert dist.get_process_group_ranks(dp) == list(range(rank % tp_size, world, tp_size))
    r = dist.get_rank(tp)
    gen = torch.Generator().manual_seed(7)  # the same data on every rank (a TP group sees replicated inputs)
    x = torch.randn(5, 3, D_IN, generator=gen, dtype=torch.float64)
    grad_out = torch.randn(5, 3, D_IN, generator=gen, dtype=torch.float64)

    # MLP: column-parallel -> gelu -> row-parallel, against the unsharded layers.
    up = ColumnParallelLinear(D_IN, D_HID, tp, seed=11, std=0.3).double()
    down = RowParallelLinear(D_HID, D_IN, tp, seed=12, std=0.2).double()
    per = D_HID // tp_size
    assert up.weight.shape == (per, D_IN) and down.weight.shape == (D_IN, per)
    assert [n for n, _ in up.named_parameters()] == [f"shard_{r}_of_{tp_size}"]
    w_up = _reference_weight(D_HID, D_IN, 11, 0.3)
    w_down = _reference_weight(D_IN, D_HID, 12, 0.2)
    x_tp, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = down(F.gelu(up(x_tp)))
    expected = F.linear(F.gelu(F.linear(x_ref, w_up)), w_down)
    _close(y, expected)
    y.backward(grad_out)
    expected.backward(grad_out)
    _close(x_tp.grad, x_ref.grad)
    _close(up.weight.grad, w_up.grad[r * per:(r + 1) * per])
    _close(down.weight.grad, w_down.grad[:, r * per:(r + 1) * per])

    # qkv-like: three parts, each split over the ranks (rank r: [part 0 of r, part 1 of r, part 2 of r]).
    qkv = ColumnParallelLinear(D_IN, 3 * D_HID, tp, seed=14, std=0.3, parts=3).double()
    w_qkv = _reference_weight(3 * D_HID, D_IN, 14, 0.3)
    x_tp, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    mine = torch.cat([torch.arange(p * D_HID + r * per, p * D_HID + (r + 1) * per) for p in range(3)])
    out, expected = qkv(x_tp), F.linear(x_ref, w_qkv)
    _close(out, expected[..., mine])
    grad = torch.randn(expected.shape, generator=gen, dtype=torch.float64)
    out.backward(grad[..., mine])
    expected.backward(grad)
    _close(x_tp.grad, x_ref.grad)
    _close(qkv.weight.grad, w_qkv.grad[mine])

    # Sequence-sharded input: rank r holds rows r of x, all-gathered before the matmul.
    seq = ColumnParallelLinear(D_IN, D_HID, tp, seed=13, std=0.5, sequence_sharded=True).double()
    w_seq = _reference_weight(D_HID, D_IN, 13, 0.5)
    rows = x.reshape(-1, D_IN)[: 4 * tp_size]
    mine = rows.view(tp_size, 4, D_IN)[r].clone().requires_grad_()
    ref_rows = rows.clone().requires_grad_()
    out = seq(mine)
    expected = F.linear(ref_rows, w_seq)
    _close(out, expected[:, r * per:(r + 1) * per])
    grad = torch.randn(expected.shape, generator=gen, dtype=torch.float64)
    out.backward(grad[:, r * per:(r + 1) * per])
    expected.backward(grad)
    _close(mine.grad, ref_rows.grad.view(tp_size, 4, D_IN)[r])
    _close(seq.weight.grad, w_seq.grad[r * per:(r + 1) * per])

    # Sequence-sharded output: rank r gets rows r of the all-reduced sum (a reduce-scatter over dim 0).
    scatter = RowParallelLinear(D_HID, D_IN, tp, seed=15, std=0.4, sequence_sharded=True).double()
    w_scatter = _reference_weight(D_IN, D_HID, 15, 0.4)
    h = torch.randn(4 * tp_size, 3, D_HID, generator=gen, dtype=torch.float64)
    h_tp, h_ref = h[..., r * per:(r + 1) * per].clone().requires_grad_(), h.clone().requires_grad_()
    out, expected = scatter(h_tp), F.linear(h_ref, w_scatter)
    _close(out, expected.view(tp_size, 4, 3, D_IN)[r])
    grad = torch.randn(expected.shape, generator=gen, dtype=torch.float64)
    out.backward(grad.view(tp_size, 4, 3, D_IN)[r])
    expected.backward(grad)
    _close(h_tp.grad, h_ref.grad[..., r * per:(r + 1) * per])
    _close(scatter.weight.grad, w_scatter.grad[:, r * per:(r + 1) * per])
    with pytest.raises(ValueError, match=f"dim 0 of x \\({tp_size + 1}\\) into {tp_size} equal parts"):
        scatter(torch.randn(tp_size + 1, per, dtype=torch.float64))

    # with its config key: "comm=fused ...; use comm=bulk" alone read as the run's comm, which may be bulk already
    with pytest.raises(RuntimeError, match=r"comm=fused \(model.tp_comm in .*\) needs CUDA .*; use comm=bulk "
                                           r"\(model.tp_comm=bulk\) on the CPU"):
        RowParallelLinear(D_HID, D_IN, tp, comm="fused")(torch.randn(2, D_HID // tp_size))
    with pytest.raises(ValueError, match="does not split"):
        ColumnParallelLinear(D_IN, 3 * tp_size + 1, tp)
    for bad in (3, 0, 2.0, True):  # before any group is made: 0 divided by, a float or bool counted as a size
        with pytest.raises(ValueError, match=rf"^tp_size={bad!r}: expected a whole number >= 1 dividing the world "
                                             rf"size {world}$"):
            tp_groups(bad)
    with pytest.raises(ValueError, match=f"^model.num_heads=3 must be a multiple of model.tp_size={tp_size}"):
        MoETransformer(d_model=48, num_heads=3, group=dp, tp_group=tp)
    with pytest.raises(ValueError, match=f"^model.ffn=65 must be a multiple of model.tp_size={tp_size}"):
        MoETransformer(ffn=65, moe_every=2, group=dp, tp_group=tp)
    if world > tp_size:  # the world as the data-parallel group would sum different TP shards' gradients
        for whole_world in (None, dist.group.WORLD):  # given or not
            with pytest.raises(ValueError, match="with a TP group, pass the data-parallel group too"):
                MoETransformer(num_experts=world, group=whole_world, tp_group=tp)
        # groups of the right sizes that share ranks: the TP group given as the data-parallel one too
        with pytest.raises(ValueError, match=r"^rank 0: the data-parallel group \[0, 1\] holds TP ranks \[0, 1\] "):
            MoETransformer(num_experts=world, group=tp, tp_group=tp)
        if world == 4 and tp_size == 2:  # crossed over the TP groups {0, 1}, {2, 3}: rank 0 with rank 3 (TP rank 1)
            crossed = [dist.new_group(ranks) for ranks in ([0, 3], [1, 2])]
            with pytest.raises(ValueError, match=r"^rank 0: the data-parallel group \[0, 3\] holds TP ranks \[0, 1\] "
                                                 r"\(TP groups \[\(0, 1\), \(2, 3\)\]\): each must hold one TP rank"):
                MoETransformer(num_experts=world, group=crossed[rank in (1, 2)], tp_group=tp)

    # Sequence parallelism: the rank's contiguous 1/tp of a batch's rows, the experts over the whole world, and
    # the gradients summed over the data-parallel group (the projections' shards) or the world (the rest).
    model = MoETransformer(num_experts=2 * world, moe_every=2, shared_expert=True, group=dp, tp_group=tp,
                           sequence_parallel=True)
    tokens = torch.arange(4 * 6 * tp_size).view(4, 6 * tp_size)
    assert torch.equal(model.local_tokens(tokens), tokens.reshape(-1).view(tp_size, -1)[r])
    # a batch that does not cut: no rows, as the forward runs it (which raises on every rank, test_moe_training)
    assert model.local_tokens(torch.zeros(1, tp_size + 1)).shape == (0,)
    assert model.blocks[1].ffn.num_local_experts == 2 and model.blocks[1].ffn.experts.first_expert == 2 * rank
    (_, shards, dp_group), (_, rest, world_group) = model.gradient_groups()
    assert dp_group is dp and world_group is None
    tp_linears = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    assert {id(p) for p in shards} == {id(m.weight) for m in tp_linears} and len(tp_linears) == 2 * 2 + 2 + 2
    assert all(m.sequence_sharded for m in tp_linears)
    experts = {id(p) for p in expert_parameters(model)}
    assert {id(p) for p in rest} == {id(p) for p in model.parameters()} - experts - {id(p) for p in shards}
    plain = MoETransformer(group=dp, tp_group=tp)  # the rows replicated: one group, the data-parallel one
    assert [g for _, _, g in plain.gradient_groups()] == [dp] and not plain.sequence_parallel
    assert torch.equal(plain.local_tokens(tokens), tokens.reshape(-1))


@pytest.mark.parametrize("world_size,tp_size", [(2, 2), (4, 2)])
def test_tp_layers_match_one_process(world_size, tp_size):
    """At 4 ranks with tp_size 2: two TP groups {0, 1}, {2, 3} and two data-parallel groups {0, 2}, {1, 3}."""
    run_world(world_size, _layers_match_one_process, tp_size)


def _float64_under_autocast(rank: int, world: int) -> None:
    tp, _ = tp_groups(world)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2 * world, 3, D_IN, generator=gen, dtype=torch.float64)
    w = _reference_weight(D_HID, D_IN, 21, 0.3)
    per = D_HID // world
    for sequence_sharded in (False, True):
        layer = ColumnParallelLinear(D_IN, D_HID, tp, seed=21, std=0.3, sequence_sharded=sequence_sharded).double()
        x_ref = x.clone().requires_grad_()
        x_tp = (x.view(world, 2, 3, D_IN)[rank] if sequence_sharded else x).clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, expected = layer(x_tp), F.linear(x_ref, w)
        assert y.dtype == expected.dtype == torch.float64
        _close(y, expected[..., rank * per:(rank + 1) * per])
        grad = torch.randn(expected.shape, generator=gen, dtype=torch.float64)
        y.backward(grad[..., rank * per:(rank + 1) * per])
        expected.backward(grad)
        _close(x_tp.grad, x_ref.grad.view(world, 2, 3, D_IN)[rank] if sequence_sharded else x_ref.grad)
        _close(layer.weight.grad, w.grad[rank * per:(rank + 1) * per])
        w.grad = None


def test_a_float64_column_parallel_layer_under_autocast_computes_in_float64_as_nn_linear():
    """Autocast leaves float64 operands as they are (F.linear of float64 under a bf16 autocast is float64); the
    column-parallel layer cast its float64 x to bf16 for its collective, and its matmul then failed ("expected m1
    and m2 to have the same dtype ... BFloat16 != double") where the unsharded layer computes in float64."""
    run_world(2, _float64_under_autocast)


def _calls_that_differ(rank: int, world: int) -> None:
    """Rank 1's x differs from the others' in rows (every layer: its collective, forward or backward, would move
    other sizes; none at all: an empty batch), in its last dim (rank 1's matmul alone refuses it), in dtype, or rank
    1 alone runs under autocast (its collectives would move bf16); then alike calls work, an empty batch's too."""
    tp, _ = tp_groups(world)
    layers = [ColumnParallelLinear(D_IN, 3 * world, tp), RowParallelLinear(2 * world, D_IN, tp),
              ColumnParallelLinear(D_IN, 3 * world, tp, sequence_sharded=True),
              RowParallelLinear(2 * world, D_IN, tp, sequence_sharded=True)]
    for layer in layers:
        width = layer.weight.shape[1]
        usual = ([world, 3, width], torch.float32, False)
        for odd in (([2 * world, 3, width], torch.float32, False), ([0, 3, width], torch.float32, False),
                    ([world, 3, width + 1], torch.float32, False),
                    ([world, 3, width], torch.bfloat16, False), ([world, 3, width], torch.float32, True)):
            shape, dtype, autocast = odd if rank == 1 else usual
            x = torch.randn(shape, dtype=dtype, requires_grad=True)
            said = [f"x {s} {str(d).removeprefix('torch.')}, weight float32{', autocast bfloat16' if a else ''}"
                    for s, d, a in (usual, odd)]
            peer = 0 if rank == 1 else 1  # the first peer whose call differs from this rank's
            with pytest.raises(ValueError, match=f"^{type(layer).__name__}: rank {rank}: peer {peer} called it with "
                                                 f"{re.escape(said[peer == 1])}; this rank with "
                                                 f"{re.escape(said[rank == 1])} \\("):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    layer(x).sum().backward()
        layer(torch.randn(world, 3, width, requires_grad=True)).sum().backward()  # alike on every rank: no error
        layer.weight.grad = None
        x = torch.randn(0, 3, width, requires_grad=True)  # an empty batch on every rank: empty, forward and backward
        y = layer(x)
        y.sum().backward()
        assert y.shape[:2] == (0, 3) and x.grad.shape == x.shape and not layer.weight.grad.any()


@pytest.mark.parametrize("world", [2, 3])
def test_calls_that_differ_between_ranks_raise_on_every_rank(world):
    """On gloo, whose collectives abort the process on messages of other sizes or dtypes (SIGABRT, no message), and
    where a rank that raises alone leaves the others in the collective."""
    run_world(world, _calls_that_differ, timeout=120)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_moe_transformer_with_tp_2_trains_like_tp_1(tmp_path, sequence_parallel):
    """torchrun, 2 gloo ranks, model.tp_size=2 (one data-parallel replica): the loss curve of one process, auxiliary
    losses included. With sequence parallelism each rank holds half the tokens and half the experts (a shared
    expert and a dense layer too: every kind of projection)."""
    from test_moe_training import CPU, SAME_AS_ONE_PROCESS, config

    from moe.train import train

    # the auxiliary losses on, large: under sequence parallelism the load balancing counts the TP pair's choices
    steps = SAME_AS_ONE_PROCESS + ["trainer.max_steps=4", "data.global_batch_size=8", "model.aux_coeff=0.5",
                                   "model.z_coeff=0.01"]
    if sequence_parallel:
        steps += ["model.num_layers=3", "model.moe_every=2", "model.shared_expert=true"]
    one = train(config(*steps), CPU, tmp_path / "one")
    run_torchrun([*steps, "model.tp_size=2", f"model.sequence_parallel={sequence_parallel}",
                  f"hydra.run.dir={tmp_path}/tp"])
    lines = [json.loads(l) for l in (tmp_path / "tp" / "metrics.jsonl").read_text().splitlines()]
    tp_losses = [l["loss"] for l in lines if "loss" in l]
    assert len(tp_losses) == 4
    torch.testing.assert_close(tp_losses, [l for _, l in one.losses], rtol=2e-4, atol=2e-4)


def _group_without_this_rank(rank: int, world: int) -> None:
    group = dist.new_group([0])  # rank 1 gets torch's stand-in for a group it is not in (size and rank -1)
    for layer in (ColumnParallelLinear, RowParallelLinear):
        if rank == 0:  # its own group of one: a dense layer
            assert layer(D_IN, D_HID, group)(torch.randn(2, D_IN)).shape == (2, D_HID)
            continue
        with pytest.raises(ValueError, match="^rank 1 is not in the group the layer is given"):
            layer(D_IN, D_HID, group)


def test_a_group_without_this_rank_is_refused():
    """A layer given a group its rank is not in (another TP group's): it took torch's -1 for size and rank, so a
    column-parallel layer held an empty shard (`shard_-1_of_-1`, outputs of 0 features) and a row-parallel one
    failed in a reshape."""
    run_world(2, _group_without_this_rank, timeout=120)


def test_column_parallel_parts_from_seeds_of_their_own():
    """A tuple of seeds draws each part as its own weight: a SwiGLU's w13 keeps w1's and w3's initialisation."""
    fused = ColumnParallelLinear(D_IN, 2 * D_HID, seed=(3, 4), std=0.1, parts=2)
    expected = torch.cat([full_weight(D_HID, D_IN, 3, 0.1), full_weight(D_HID, D_IN, 4, 0.1)]).float()
    assert torch.equal(fused.weight, expected)
    with pytest.raises(ValueError, match="3 seeds for 2 part\\(s\\): give one per part, or one int"):
        ColumnParallelLinear(D_IN, 2 * D_HID, seed=(3, 4, 5), parts=2)


class _ExchangeStarted(Exception):
    pass


class _NoExchange:
    """Stands in for the fused forward's GEMM + reduce-scatter: reaching it means the exchange would start."""

    @staticmethod
    def apply(*args):
        raise _ExchangeStarted


def _fused_sequence_sharded_shapes(rank: int, world: int) -> None:
    from fused_dlrm.tp import linear

    # the fused path on the CPU up to its exchange: bf16 as comm=fused would compute on CUDA, the exchange stubbed
    linear.TPLinear._fused_dtype = lambda self, x: torch.bfloat16
    linear._FusedRowParallelScatter = _NoExchange
    for in_features, out_features, refusal in [(48, 12, "the output gradient that RowParallelLinear's backward "
                                                         "all-gathers \\(4, 12\\) torch.bfloat16"),
                                               (40, 16, "all_gather_matmul's weight \\(as it lies\\) \\(16, 20\\)")]:
        layer = RowParallelLinear(in_features, out_features, dist.group.WORLD, "fused", sequence_sharded=True)
        x = torch.randn(4, 2, in_features // world)
        for _ in range(2):  # every call, not only the first
            with pytest.raises(ValueError, match=f"^{refusal} .* multiple of 8 elements"):
                layer(x)
    with pytest.raises(_ExchangeStarted):  # shapes the backward takes go on to the exchange
        RowParallelLinear(48, 16, dist.group.WORLD, "fused", sequence_sharded=True)(torch.randn(4, 2, 24))


def test_fused_sequence_sharded_row_parallel_refuses_backward_shapes_in_forward():
    """The backward's all-gather + GEMM reads the output gradient and the weight's shard through TMA (rows of a
    multiple of 8 fp16 / bf16 values): out_features = 12, or in_features / tp = 20, are refused by the forward,
    before its exchange starts, in the backward's words (not after a forward, on GPUs only)."""
    run_world(2, _fused_sequence_sharded_shapes, timeout=120)


def _sequence_sharded_x_without_rows(rank: int, world: int) -> None:
    """x of features alone (1-D) has no rows to gather or scatter: refused in words on every rank. It passed the
    row-parallel layer's check (its features, a multiple of the group size, taken for rows) and failed in gloo's
    reduce-scatter ("Check failed: outputShape[0] * worldSize == inputShape[0]"), the column-parallel one's in the
    matmul after the all-gather had joined the ranks' features ("mat1 and mat2 shapes cannot be multiplied")."""
    tp, _ = tp_groups(world)
    for layer in (ColumnParallelLinear(D_IN, 2 * world, tp, sequence_sharded=True),
                  RowParallelLinear(2 * world, D_IN, tp, sequence_sharded=True)):
        x = torch.randn(layer.weight.shape[1], requires_grad=True)
        with pytest.raises(ValueError, match=rf"^{type(layer).__name__}: a sequence-sharded layer cuts dim 0 of x "
                                             rf"over the ranks: x \[{x.shape[0]}\] has no rows \(features alone\)$"):
            layer(x)
        y = layer(x[None].expand(world, -1))  # its rows: the call works
        y.sum().backward()
        assert x.grad.isfinite().all()


def test_a_sequence_sharded_layer_refuses_x_without_rows():
    run_world(2, _sequence_sharded_x_without_rows)
