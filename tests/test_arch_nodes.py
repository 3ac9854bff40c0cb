"""The dense arches as autograd nodes (models/arch_nodes.py) on the CPU: the gradients of plain autograd, set in one
flat buffer; the node whenever grad mode is on (eval mode too, as DDP), the arch itself without grad (the loop's
evaluation); over two gloo ranks the gradients and parameters of DDP (plain, and a codec's mean; in eval mode);
the dispatch between a graph and the eager node, by shape and mode (a stand-in graph: CI cannot capture CUDA graphs;
tests/test_arch_nodes_gpu.py does)."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchrec.models.dlrm import DenseArch, OverArch

from fused_dlrm.kernels.quant_codecs import CODECS
from fused_dlrm.kernels.quantized_allreduce import two_shot_error_bound
from fused_dlrm.models.arch_nodes import ArchNode, _ArchFunction, dense_arch_nodes, sets_every_gradient
from fused_dlrm.train.build import build_dataset, build_model
from fused_dlrm.train.loop import evaluate
from graph_stand_in import EagerArchGraph
from test_training import CPU as ONE_PROCESS, SMALL, config
from world import run_world

CPU = torch.device("cpu")


class _Arches(nn.Module):
    """DLRM's two dense arches, small; the interaction stands in as a concatenation with a leaf that needs grad."""

    def __init__(self, device: torch.device = CPU):
        super().__init__()
        torch.manual_seed(0)
        self.dense_arch = DenseArch(13, [32, 16], device)
        self.over_arch = OverArch(16 + 24, [32, 8, 1], device)

    def loss(self, dense: torch.Tensor, pooled: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.dense_arch(dense), pooled], dim=1)
        return F.binary_cross_entropy_with_logits(self.over_arch(x).squeeze(-1), labels)


def _batch(seed: int, rows: int = 12):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 13, generator=gen), torch.randn(rows, 24, generator=gen, requires_grad=True),
            torch.rand(rows, generator=gen).round())


def _step(arches: _Arches, batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The pooled input's gradient and every parameter's, after one backward."""
    dense, pooled, labels = batch
    leaf = pooled.detach().requires_grad_()
    arches.loss(dense, leaf, labels).backward()
    return leaf.grad, [p.grad for p in arches.parameters()]


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_node_gives_plain_autograd_gradients_in_one_flat_buffer(mode):
    """In eval mode too (grad on): DDP sets gradients by grad mode, not by train() / eval()."""
    plain, nodes = _Arches().train(mode == "train"), dense_arch_nodes(_Arches()).train(mode == "train")
    batch = _batch(1)
    want_input, want = _step(plain, batch)
    got_input, got = _step(nodes, batch)
    torch.testing.assert_close(got_input, want_input, rtol=1e-6, atol=1e-7)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
    for arch in (nodes.dense_arch, nodes.over_arch):
        node = arch.forward
        assert isinstance(node, ArchNode)
        flat = node.flat
        for p in arch.parameters():  # views of the flat buffer, in parameter order
            assert p.grad._base is flat
    # one node per arch: its output's gradient function is the node's, whose only inputs are x and the anchor
    out = nodes.over_arch(torch.randn(3, 40, requires_grad=True))
    assert out.grad_fn.name() == _ArchFunction.__name__ + "Backward"
    assert len(out.grad_fn.next_functions) == 2


def test_the_backward_sets_the_gradients_and_survives_zero_grad():
    nodes, plain = dense_arch_nodes(_Arches()), _Arches()
    _step(nodes, _batch(1))
    second = _batch(2)
    _, got = _step(nodes, second)  # no zero_grad: set, not added
    _, want = _step(plain, second)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
    torch.optim.Adam(nodes.parameters()).zero_grad(set_to_none=True)
    assert all(p.grad is None for p in nodes.parameters())
    _step(nodes, _batch(3))
    assert all(p.grad is not None and p.grad._base is nodes.over_arch.forward.flat
               for p in nodes.over_arch.parameters())


def test_a_loop_needs_no_zero_grad_only_when_the_nodes_set_every_gradient_it_steps():
    plain, nodes = _Arches(), dense_arch_nodes(_Arches())
    assert sets_every_gradient(nodes, list(nodes.parameters()))
    assert not sets_every_gradient(plain, list(plain.parameters()))
    nodes.scale = nn.Parameter(torch.ones(1))  # a parameter outside the nodes: its gradient would accumulate
    assert not sets_every_gradient(nodes, list(nodes.parameters()))


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_without_grad_mode_the_arch_is_called_itself(mode):
    nodes = dense_arch_nodes(_Arches()).train(mode == "train")
    x = torch.randn(5, 40, requires_grad=True)
    want = nodes.over_arch.forward.eager(x)
    with torch.no_grad():
        got = nodes.over_arch(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert got.grad_fn is None


def test_with_no_parameter_needing_a_gradient_the_arch_is_called_itself():
    """Frozen parameters: nothing for the node to set or average (the input's gradient is autograd's own)."""
    nodes, plain = dense_arch_nodes(_Arches()), _Arches()
    for p in [*nodes.over_arch.parameters(), *plain.over_arch.parameters()]:
        p.requires_grad_(False)
    assert not nodes.over_arch(torch.randn(5, 40)).requires_grad
    x = torch.randn(5, 40, requires_grad=True)
    out = nodes.over_arch(x)
    assert out.grad_fn.name() != _ArchFunction.__name__ + "Backward"
    out.square().sum().backward()
    leaf = x.detach().requires_grad_()
    plain.over_arch(leaf).square().sum().backward()
    torch.testing.assert_close(x.grad, leaf.grad, rtol=1e-6, atol=1e-7)
    assert all(p.grad is None for p in nodes.over_arch.parameters())


def test_a_parameter_frozen_after_the_node_was_built_is_named():
    """Some of an arch's parameters frozen after its node was built (the others not): the node's backward would ask
    autograd for the frozen ones' gradients; its call raises naming them, under grad only."""
    nodes = dense_arch_nodes(_Arches())
    frozen = dict(nodes.over_arch.named_parameters())
    name = next(iter(frozen))
    frozen[name].requires_grad_(False)
    with pytest.raises(RuntimeError, match=rf"parameters \['{re.escape(name)}'\] were frozen after it was built"):
        nodes.over_arch(torch.randn(5, 40))
    with torch.no_grad():
        assert nodes.over_arch(torch.randn(5, 40)).shape == (5, 1)


@pytest.mark.parametrize("change", [None, "rows", "dtype", "requires_grad"])
def test_calls_shaped_like_the_capture_replay_others_run_the_node_eagerly(change):
    nodes, plain = dense_arch_nodes(_Arches()), _Arches()
    node = nodes.over_arch.forward
    graph = node.graph = EagerArchGraph(node, torch.randn(12, 40, requires_grad=True))
    dense, pooled, labels = _batch(4)
    if change == "rows":
        dense, pooled, labels = _batch(4, rows=11)
    elif change == "dtype":
        graph.input = graph.input.double()
    elif change == "requires_grad":
        graph.input = graph.input.detach()
    _, got = _step(nodes, (dense, pooled, labels))
    _, want = _step(plain, (dense, pooled, labels))
    assert graph.calls == ([] if change else ["forward", "backward"])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("captured_in", ["train", "eval"])
def test_a_graph_fits_only_calls_in_the_mode_it_was_captured_in(captured_in):
    """An arch's eval forward may differ from its training one (dropout, batch norm): a graph replays only calls
    in its capture's mode; the node runs the others eagerly (its gradients set and averaged all the same)."""
    nodes, plain = dense_arch_nodes(_Arches()), _Arches()
    node = nodes.over_arch.forward
    nodes.train(captured_in == "train")
    graph = node.graph = EagerArchGraph(node, torch.randn(12, 40, requires_grad=True))
    for mode in ("train", "eval"):
        nodes.train(mode == "train")
        plain.train(mode == "train")
        graph.calls.clear()
        batch = _batch(7)
        _, got = _step(nodes, batch)
        _, want = _step(plain, batch)
        assert graph.calls == (["forward", "backward"] if mode == captured_in else []), mode
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
        assert all(p.grad._base is node.flat for p in nodes.over_arch.parameters())
        plain.zero_grad(set_to_none=True)


def _over_arch_gradients(arches: _Arches, x: torch.Tensor, backward) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaf = x.detach().requires_grad_()
    arches.zero_grad(set_to_none=True)
    backward(arches.over_arch(leaf))
    return leaf.grad, [p.grad.clone() for p in arches.over_arch.parameters()]


def test_a_second_forward_before_the_first_ones_backward_runs_eagerly_not_over_its_graph():
    """A replay rewrites the graph's activations (and output), which the earlier forward's backward reads: while
    that backward is still to come, the node runs eagerly; once done (or its autograd graph dropped), it replays."""
    nodes, plain = dense_arch_nodes(_Arches()), _Arches()
    node = nodes.over_arch.forward
    graph = node.graph = EagerArchGraph(node, torch.randn(12, 40, requires_grad=True))
    gen = torch.Generator().manual_seed(5)
    x1, x2 = (torch.randn(12, 40, generator=gen, requires_grad=True) for _ in range(2))
    out1, out2 = nodes.over_arch(x1), nodes.over_arch(x2)
    for x, out in ((x1, out1), (x2, out2)):  # each backward sets the gradients of its own forward
        out.square().sum().backward()
        want_x, want = _over_arch_gradients(plain, x, lambda out: out.square().sum().backward())
        torch.testing.assert_close(x.grad, want_x, rtol=1e-6, atol=1e-7)
        for got, w in zip(nodes.over_arch.parameters(), want):
            torch.testing.assert_close(got.grad, w, rtol=1e-6, atol=1e-7)
    assert graph.calls == ["forward", "backward"]  # the first forward replayed, the second ran eagerly
    unused = nodes.over_arch(x1)  # a forward whose autograd graph goes unused, then is dropped
    del unused
    nodes.over_arch(x2).sum().backward()
    assert graph.calls == ["forward", "backward", "forward", "forward", "backward"]


def test_a_second_backward_in_one_pass_raises_instead_of_setting_the_gradients_again():
    """Two forwards summed into one loss: DDP sums their gradients; a node sets its buffer at each backward (the
    first one's all-reduce still reading it on GPUs), so one forward's gradients would be lost: refused."""
    nodes = dense_arch_nodes(_Arches())
    x1, x2 = torch.randn(6, 40, requires_grad=True), torch.randn(6, 40, requires_grad=True)
    loss = nodes.over_arch(x1).sum() + nodes.over_arch(x2).sum()
    with pytest.raises(RuntimeError, match="OverArch's node: its backward ran twice in one backward pass"):
        loss.backward()
    _step(nodes, _batch(1))  # the next step's one backward goes on


def test_arches_in_ddp_are_refused():
    run_world(1, _refuses_ddp)


def _refuses_ddp(rank: int, world: int) -> None:
    arches = _Arches()
    arches.dense_arch = nn.parallel.DistributedDataParallel(arches.dense_arch)
    with pytest.raises(ValueError, match="in DDP already"):
        dense_arch_nodes(arches)


def _average_like_ddp(rank: int, world: int) -> None:
    torch.manual_seed(rank)  # unequal starts: the nodes and DDP both take rank 0's parameters
    reference = _Arches()
    for p in reference.parameters():
        p.data.add_(rank)
    ddp = copy.deepcopy(reference)
    ddp.dense_arch = nn.parallel.DistributedDataParallel(ddp.dense_arch)
    ddp.over_arch = nn.parallel.DistributedDataParallel(ddp.over_arch)
    nodes = dense_arch_nodes(copy.deepcopy(reference))
    q8 = dense_arch_nodes(copy.deepcopy(reference), grad_allreduce="q8")
    models = (ddp, nodes, q8)
    optimizers = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in models]
    for step in range(3):
        batch = _batch(100 * rank + step)  # each rank its own data
        results = []
        for model, optimizer in zip(models, optimizers):
            optimizer.zero_grad(set_to_none=True)
            grad_input, grads = _step(model, batch)
            results.append((grad_input, [g.clone() for g in grads]))
            optimizer.step()
        (want_input, want), (got_input, got), (_, quantized) = results
        torch.testing.assert_close(got_input, want_input, rtol=0, atol=0)
        for g, w in zip(got, want):  # 1/world, then the sum: DDP's arithmetic, bit for bit
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        flat = lambda gs: torch.cat([g.flatten() for g in gs])  # noqa: E731
        error = (flat(quantized) - flat(want)).norm() / flat(want).norm()
        # The codec's mean: close to the exact one, not it. Step 0 holds the two-shot's q8 roundings alone (0.0089,
        # each parameter in blocks of its own; 0.013 packed back to back); later steps add the drift of the q8
        # model's parameters from DDP's (0.014, 0.038: Adam moves each value ~lr whatever its gradient's size).
        assert 0 < error < (0.011 if step == 0 else 0.05), (step, error)
    for model in models:  # every rank's parameters stayed equal
        params = torch.cat([p.detach().flatten() for p in model.parameters()])
        gathered = [torch.empty_like(params) for _ in range(world)]
        torch.distributed.all_gather(gathered, params)
        torch.testing.assert_close(gathered[1], gathered[0], rtol=0, atol=0)


def test_two_ranks_average_the_gradients_as_ddp_does():
    run_world(2, _average_like_ddp)


def _eval_mode_averages_like_ddp(rank: int, world: int) -> None:
    """In eval mode: under no_grad no all-reduce starts; with grad on, a backward's gradients are DDP's (bit for
    bit) and the float64 mean of the ranks' own, one all-reduce per arch."""
    reference = _Arches()
    ddp = copy.deepcopy(reference)
    ddp.dense_arch = nn.parallel.DistributedDataParallel(ddp.dense_arch)
    ddp.over_arch = nn.parallel.DistributedDataParallel(ddp.over_arch)
    nodes = dense_arch_nodes(copy.deepcopy(reference))
    exact = copy.deepcopy(reference).double()
    for model in (ddp, nodes, exact):
        model.eval()
    group = nodes.dense_arch.forward.group
    started, all_reduce = [], torch.distributed.all_reduce
    torch.distributed.all_reduce = lambda tensor, *args, group=None, **kwargs: (
        started.append(group) or all_reduce(tensor, *args, group=group, **kwargs))
    try:
        batch = _batch(200 + rank)  # each rank its own data
        with torch.no_grad():
            assert nodes.loss(*batch).grad_fn is None
        assert started == []
        want_input, want = _step(ddp, batch)
        got_input, got = _step(nodes, batch)
        assert started == [group, group]  # the over arch's, then the dense arch's
    finally:
        torch.distributed.all_reduce = all_reduce
    torch.testing.assert_close(got_input, want_input, rtol=0, atol=0)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    _, local = _step(exact, tuple(t.double() for t in batch))
    for g, mine in zip(got, local):
        every = [torch.empty_like(mine) for _ in range(world)]
        torch.distributed.all_gather(every, mine)
        mean = torch.stack(every).mean(0)
        assert ((g.double() - mean).norm() / mean.norm()).item() < 1e-5


def test_two_ranks_in_eval_mode_average_as_ddp_does_and_only_with_grad_on():
    run_world(2, _eval_mode_averages_like_ddp)


def test_the_loops_evaluation_stays_off_the_nodes(monkeypatch):
    """train/loop.py's evaluate runs without grad: the arches eagerly, no node, no gradient to average."""
    cfg = config(*SMALL)
    model = build_model(cfg, ONE_PROCESS)
    entered = []
    apply = _ArchFunction.apply
    monkeypatch.setattr(_ArchFunction, "apply", lambda *args: entered.append(1) or apply(*args))
    scores = evaluate(model, build_dataset(cfg, "eval", ONE_PROCESS), 2, ONE_PROCESS, 0)
    assert entered == [] and 0 <= scores["auc"] <= 1 and model.training


class _TwoScales(nn.Module):
    """Two parameters whose gradients differ ~10^4 in scale, of sizes no multiple of 32: packed one after the other,
    the small one's first values would share a codec block with the large one's last."""

    def __init__(self, device: torch.device = CPU):
        super().__init__()
        self.large = nn.Parameter(torch.randn(45, device=device))
        self.small = nn.Parameter(torch.randn(37, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.large).sum(1, keepdim=True) + 1e-4 * (x[:, :37] * self.small).sum(1, keepdim=True)


def _each_parameter_within_its_own_bound(rank: int, world: int, graphed: bool = False) -> None:
    """A codec's mean of every parameter's gradient within the two-shot bound of that parameter all-reduced alone
    (its own blocks), around the float64 mean of the ranks' gradients: a parameter's precision does not depend on
    its neighbours in the flat buffer. graphed (tests/test_arch_nodes_gpu.py): on the rank's GPU, the nodes' CUDA
    graphs writing the flat buffer, the fused kernel all-reducing it on NCCL."""
    device = torch.device("cuda", torch.cuda.current_device()) if graphed else CPU
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(12, 45, generator=gen).to(device)  # each rank its own batch
    dense, pooled, labels = (t.to(device) for t in _batch(10 + rank))
    for codec in CODECS:
        for make in (_TwoScales, _Arches):
            torch.manual_seed(0)
            plain = make(device)
            model = copy.deepcopy(plain)
            if make is _TwoScales:
                node = ArchNode(model, grad_allreduce=codec)
                if graphed:
                    node.capture(x)
                model(x).sum().backward()
                plain(x).sum().backward()
            else:  # DLRM's two arches as nodes
                dense_arch_nodes(model, grad_allreduce=codec, graph_batch=12 if graphed else None)
                model.loss(dense, pooled, labels).backward()
                plain.loss(dense, pooled, labels).backward()
            for (name, p), mine in zip(model.named_parameters(), plain.parameters()):
                local = [torch.empty_like(mine.grad) for _ in range(world)]  # every rank's gradient, not averaged
                torch.distributed.all_gather(local, mine.grad)
                exact = torch.stack(local).double().mean(0)
                error = (p.grad.double() - exact).abs()
                bound = two_shot_error_bound(local, codec, mean=True).double()
                assert (error <= bound).all(), (codec, name, (error / exact.abs().max()).max().item())


@pytest.mark.parametrize("world", [2, 4])
def test_a_codec_keeps_each_parameters_gradient_within_its_own_blocks_bound(world):
    run_world(world, _each_parameter_within_its_own_bound)


def _after_a_nonfinite_step(rank: int, world: int) -> None:
    """A backward whose gradients hold a NaN (rank 1's input) gives NaN in the blocks holding it on every rank; the
    next backward, finite, must give what a fresh node gives for it (bit for bit). The node's flat buffer, kept
    across steps, had NaN left in its gaps beside those blocks, and every later gradient in them came back NaN."""
    gen = torch.Generator().manual_seed(rank)
    bad, x = torch.randn(12, 45, generator=gen), torch.randn(12, 45, generator=gen)
    if rank == 1:
        bad[5, 40] = float("nan")  # the large parameter's last block (values 32..44, then its gap)
    for codec in ("fp8", "q8", "q6", "q4"):
        torch.manual_seed(0)
        model, fresh = _TwoScales(), _TwoScales()
        fresh.load_state_dict(model.state_dict())
        ArchNode(model, grad_allreduce=codec)
        ArchNode(fresh, grad_allreduce=codec)
        model(bad).sum().backward()
        assert model.large.grad[32:].isnan().all() and model.large.grad[:32].isfinite().all(), codec
        model(x).sum().backward()
        fresh(x).sum().backward()
        for p, want in zip(model.parameters(), fresh.parameters()):
            assert torch.equal(p.grad, want.grad), (codec, p.grad.isnan().sum().item())


def test_a_nonfinite_step_leaves_the_next_ones_gradients_exact():
    run_world(2, _after_a_nonfinite_step)
