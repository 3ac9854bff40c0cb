"""MoELayer(comm="fused") against comm="bulk" on the CPU: a one-rank simulated world runs the fused combine kernels
in the Triton interpreter, and the autograd node around them must give the bulk layer's outputs and gradients
(tokens, routing weights through the router, every expert weight). Multi-rank exchanges of the same kernels are
tested in test_moe_fused_combine.py (2 and 4 ranks) and on GPUs in test_moe_fused_gpu.py: the layer's own
collectives (counts, bulk dispatch) need one process per rank."""

from __future__ import annotations

import os

import pytest
import torch

from fused_dlrm.dist.host_copy import PendingHostCopy
from fused_dlrm.dist.symmetric import SimulatedWorld
from fused_dlrm.kernels import graphed_calls
from fused_dlrm.kernels.graphed_calls import GraphedCalls
from fused_dlrm.kernels.peer_flags import PeerErrors, PeerRefusedInput
from graph_stand_in import stand_in_capture
from world import run_world
from fused_dlrm.train.adamw import AdamW
from fused_dlrm.train.compute_copies import want_compute_copy
from moe import MoELayer
from moe import layer as layer_module
from moe.layer import TOKEN_OUT_OF_VOCABULARY, FusedMoEConfig

D_MODEL, FFN, EXPERTS, TOP_K, SEED = 16, 24, 4, 2, 3
NEVER = -30.0

interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the Triton interpreter")


def run(layer, x, bias, grad):
    x = x.clone().requires_grad_()
    y, aux = layer(x, bias)
    (y * grad).sum().backward()
    return y.detach(), x.grad, aux


def training_step_matches_bulk(fused, bulk, x, grad) -> None:
    """A training step of both layers on x: the outputs, x's gradient and every parameter's gradient equal."""
    for layer in (fused, bulk):
        layer.zero_grad()
    (y, gx, _), (want_y, want_gx, _) = run(fused, x, None, grad), run(bulk, x, None, grad)
    torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5 * max(want_y.abs().max().item(), 1.0))
    torch.testing.assert_close(gx, want_gx, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(fused.named_parameters(), bulk.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@interpreter
@pytest.mark.parametrize("mode", ["grown", "bounded", "bounded, by token"])
@pytest.mark.parametrize("tokens,bias,capacity", [
    (13, None, None),
    (17, [0.0, 6.0, 0.0, 0.0], None),  # skewed
    (11, [0.0, 0.0, NEVER, 0.0], None),  # an expert without rows
    (15, [0.0, 3.0, 0.0, 0.0], 1.0),  # dropped assignments
    (0, None, None),  # no tokens
])
def test_fused_layer_matches_bulk(tokens, bias, capacity, mode):
    """Buffers grown to the rows seen, or sized for max_tokens_per_rank (here more than the call's tokens: the
    kernels must walk only the rows received), the dispatch by row or by token (GEMM 1 storing `received`)."""
    workspace = SimulatedWorld(1).workspaces()[0]
    config = FusedMoEConfig(max_tokens_per_rank=tokens + 5 if mode != "grown" else None,
                            dispatch="tokens" if "by token" in mode else "rows")
    fused = MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, capacity_factor=capacity, seed=SEED, comm="fused",
                     fused=config, workspace=workspace)
    bulk = MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, capacity_factor=capacity, seed=SEED)
    gen = torch.Generator().manual_seed(tokens)
    bias = None if bias is None else torch.tensor(bias)
    for step in range(2):  # the second step reuses the workspace's flags and buffers
        x = torch.randn(tokens, D_MODEL, generator=gen)
        grad = torch.randn(tokens, D_MODEL, generator=gen)
        for layer in (fused, bulk):
            layer.zero_grad()
        y, gx, aux = run(fused, x, bias, grad)
        want_y, want_gx, want_aux = run(bulk, x, bias, grad)
        scale = max(want_y.abs().max().item(), 1.0) if tokens else 1.0
        torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5 * scale)
        torch.testing.assert_close(gx, want_gx, rtol=1e-5, atol=1e-5)
        for (name, p), q in zip(fused.named_parameters(), bulk.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
        assert torch.equal(aux["tokens_per_local_expert"], want_aux["tokens_per_local_expert"])
        assert aux["dropped"] == want_aux["dropped"]
    if capacity is not None:
        assert aux["dropped"] > 0
    assert workspace.next_epoch("combine") == 3


@interpreter
def test_fused_layer_dispatches_again_when_the_rows_outgrow_the_capacity():
    """The fused layer launches its dispatch at the receive capacity of earlier calls and reads the counts
    afterwards: a call with more rows than that dispatches again in larger buffers, with the same results."""
    workspace = SimulatedWorld(1).workspaces()[0]
    fused = MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, seed=SEED, comm="fused", workspace=workspace)
    bulk = MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, seed=SEED)
    gen = torch.Generator().manual_seed(7)
    capacities = []
    for tokens in (6, 40, 12):  # 12 rows, then 80 (past the first capacity: 64, the chunk), then 24
        x, grad = torch.randn(tokens, D_MODEL, generator=gen), torch.randn(tokens, D_MODEL, generator=gen)
        training_step_matches_bulk(fused, bulk, x, grad)
        capacities.append(fused.dispatch.capacity)
    assert capacities == [64, 128, 128]
    assert workspace.next_epoch("moe_dispatch") == 5  # the second call dispatched twice


@interpreter
def test_a_forward_whose_dispatch_failed_before_its_launches_leaves_the_next_one_exact(monkeypatch):
    """The dispatch's epoch (`begin`) is taken before its launches, which may fail before any kernel is enqueued
    (here the tables): that epoch must not count, or every later forward reads the other half of the double
    buffer than its kernels wrote (the `received` rows of the weight gradient: stale)."""
    workspace = SimulatedWorld(1).workspaces()[0]
    fused = MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, seed=SEED, comm="fused", workspace=workspace)
    bulk = MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, seed=SEED)
    gen = torch.Generator().manual_seed(9)
    tables = layer_module.dispatch_tables

    def fails_once(*args, **kwargs):
        monkeypatch.setattr(layer_module, "dispatch_tables", tables)
        raise RuntimeError("out of memory")

    for step in range(3):
        x, grad = torch.randn(13, D_MODEL, generator=gen), torch.randn(13, D_MODEL, generator=gen)
        if step == 1:
            monkeypatch.setattr(layer_module, "dispatch_tables", fails_once)
            with pytest.raises(RuntimeError, match="out of memory"):
                fused(x)
        training_step_matches_bulk(fused, bulk, x, grad)
    assert int(fused.dispatch._epoch_done) == workspace.epoch("moe_dispatch") == 3


@interpreter
def test_bounded_forward_never_reads_the_counts_on_the_host(monkeypatch):
    """With max_tokens_per_rank the buffers hold any routing of that many tokens: the forward dispatches once and
    never waits for its counts (the backward reads them once; a forward under no_grad never: the layer's next call
    reads its refusal words, copied long before), and a call with more tokens is refused, naming the rank and the
    limit."""
    workspace = SimulatedWorld(1).workspaces()[0]
    layer = MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, seed=SEED, comm="fused",
                     fused=FusedMoEConfig(max_tokens_per_rank=20), workspace=workspace)
    assert layer.dispatch.capacity >= 20 * TOP_K
    reads = []
    read = PendingHostCopy.get
    monkeypatch.setattr(PendingHostCopy, "get", lambda self: reads.append("read") or read(self))
    gen = torch.Generator().manual_seed(41)
    for tokens in (20, 7, 0, 20):
        x, grad = torch.randn(tokens, D_MODEL, generator=gen), torch.randn(tokens, D_MODEL, generator=gen)
        xi = x.clone().requires_grad_()
        with torch.no_grad():
            layer(x, torch.tensor([9.0, 0.0, 0.0, 0.0]))  # every token to expert 0: the most rows one expert gets
        y, _ = layer(xi)
        assert reads == ["read"]  # the no_grad call's words
        (y * grad).sum().backward()
        assert reads == ["read", "read"]
        reads.clear()
    assert workspace.next_epoch("moe_dispatch") == 9  # once per forward
    with pytest.raises(ValueError, match="rank 0: 21 tokens, more than max_tokens_per_rank=20"):
        layer(torch.randn(21, D_MODEL))
    with pytest.raises(ValueError, match="max_tokens_per_rank=0 must be positive"):
        MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, comm="fused", fused=FusedMoEConfig(max_tokens_per_rank=0),
                 workspace=SimulatedWorld(1).workspaces()[0])
    with pytest.raises(ValueError, match="dispatch='tokens' sizes its buffers by max_tokens_per_rank: set it"):
        MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, comm="fused", fused=FusedMoEConfig(dispatch="tokens"),
                 workspace=SimulatedWorld(1).workspaces()[0])
    with pytest.raises(ValueError, match="dispatch='token': expected 'auto', 'rows' or 'tokens'"):
        MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, comm="fused", workspace=SimulatedWorld(1).workspaces()[0],
                 fused=FusedMoEConfig(max_tokens_per_rank=4, dispatch="token"))


def _one_rank_refused(rank: int, world_size: int) -> None:
    """Rank 1 gets one token more than max_tokens_per_rank, then rank 0 passes refusal words of its own (the
    Transformer's token ids): every rank raises, at the counts' all-gather, naming the refused rank."""
    workspace = SimulatedWorld(world_size).workspaces()[rank]  # never touched: every rank stops before the dispatch
    layer = MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, seed=SEED, comm="fused", workspace=workspace,
                     fused=FusedMoEConfig(max_tokens_per_rank=8))
    whose = "9 tokens" if rank == 1 else "rank 1 has 9 tokens"
    with pytest.raises(ValueError, match=f"rank {rank}: {whose}, more than max_tokens_per_rank=8"):
        layer(torch.randn(8 + rank, D_MODEL))
    refused = torch.tensor([TOKEN_OUT_OF_VOCABULARY, 300, 256] if rank == 0 else [0, 0, 0])
    whose = "token id 300" if rank == 0 else "rank 0 has token id 300"
    with pytest.raises(ValueError, match=rf"rank {rank}: {whose} in its batch, outside the vocabulary \[0, 256\)"):
        layer(torch.randn(8, D_MODEL), refused=refused)


def test_a_refused_rank_stops_every_rank():
    """Refused on that rank alone, its peers would wait in the router's or the counts' collective until gloo's
    timeout (here: the world's timeout fails the test); the refusal words ride in the counts' all-gather instead."""
    run_world(2, _one_rank_refused, timeout=240)


class ReadLater(PeerErrors):
    """The error word read as on GPUs: not at the call's end but at a later call's check (here the next one's, as if
    the copy behind this call had completed) or check(block=True), either clearing it."""

    def after_wait(self) -> None:
        pass

    def check(self, block: bool = False) -> None:
        self._raise_if_set(self.word)


@interpreter
@pytest.mark.parametrize("dispatch", ["rows", "tokens"])
def test_a_refusal_raises_once_whether_a_backward_comes_or_not(dispatch):
    """On NCCL the bounded forward reads no counts. A rank over max_tokens_per_rank (here the only rank, taken for
    one with peers) then sends none of its tokens, its output NaN, and every rank records the refusal words
    all-gathered with the counts in its dispatch's error word, read as on GPUs (ReadLater): a backward raises
    them where it reads the counts, and no later call raises them again; a forward without backward, with grad
    (an evaluation that forgot no_grad, a dropped loss) or without, raises them at the next call or
    errors.check(block=True). The caller's refusal words (the Transformer's token ids) alike. Every call's exchange
    completes: the next call's results are the bulk layer's. On the CPU as it is (the word read at the call's
    end) the refused forward raises at once, with grad too."""
    workspace = SimulatedWorld(1).workspaces()[0]
    fused = MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, seed=SEED, comm="fused", workspace=workspace,
                     fused=FusedMoEConfig(max_tokens_per_rank=20, dispatch=dispatch))
    fused._refuse_alone = False
    bulk = MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, seed=SEED)
    gen = torch.Generator().manual_seed(17)
    over = "rank 0: 21 tokens, more than max_tokens_per_rank=20"
    vocabulary = r"rank 0: token id -4 in its batch, outside the vocabulary \[0, 256\)"

    def next_step() -> int:  # the dispatch's next epoch (peeked: next_epoch would take it)
        return workspace._epochs.get("moe_dispatch", 0) + 1

    def matches_bulk():  # a good training call: nothing raised, the bulk layer's results
        x, grad = torch.randn(13, D_MODEL, generator=gen), torch.randn(13, D_MODEL, generator=gen)
        for layer in (fused, bulk):
            layer.zero_grad()
        (y, gx, _), (want_y, want_gx, _) = run(fused, x, None, grad), run(bulk, x, None, grad)
        fused.dispatch.errors.check(block=True)
        torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5 * max(want_y.abs().max().item(), 1.0))
        torch.testing.assert_close(gx, want_gx, rtol=1e-5, atol=1e-5)

    for tokens, refused, message in ((21, None, over), (11, [TOKEN_OUT_OF_VOCABULARY, -4, 256], vocabulary)):
        refused = None if refused is None else torch.tensor(refused)
        x = torch.randn(tokens, D_MODEL, generator=gen, requires_grad=True)
        with pytest.raises(PeerRefusedInput, match=rf"fused MoE dispatch at step {next_step()}: {message}"):
            fused(x, refused=refused)  # the CPU's own reading: at once
        errors = fused.dispatch.errors
        fused.dispatch.errors = ReadLater(errors.word.device, errors.rank, errors.what,
                                          describe_refused=errors.describe_refused)
        step = next_step()
        y, _ = fused(x, refused=refused)
        assert y.shape == x.shape and y.isnan().all() == (refused is None)
        with pytest.raises(PeerRefusedInput, match=rf"fused MoE dispatch at step {step}: {message}"):
            y.sum().backward()  # from the error word, which it clears
        matches_bulk()  # the backward raised it: not again
        for grad_enabled, read in ((True, "next call"), (True, "check"), (False, "next call"), (False, "check")):
            with torch.set_grad_enabled(grad_enabled):
                step = next_step()
                fused(x, refused=refused)  # no backward
            with pytest.raises(PeerRefusedInput, match=rf"fused MoE dispatch at step {step}: {message}"):
                if read == "next call":
                    fused(torch.randn(5, D_MODEL, generator=gen))
                else:
                    fused.dispatch.errors.check(block=True)
            matches_bulk()
        fused.dispatch.errors = errors


class CopyNotDone(ReadLater):
    """The error word as on a GPU whose copy of it has not completed by the next call (a peer's GPU may be
    further on): a non-blocking check finds nothing; check(block=True) reads it."""

    def check(self, block: bool = False) -> None:
        if block:
            self._raise_if_set(self.word)


@interpreter
def test_a_refusal_no_backward_read_raises_at_the_next_call_before_its_exchange(monkeypatch):
    """Every rank records a refusal in its error word, which each rank's host sees once its own GPU's copy of it
    is done: raised there alone, a rank whose copy was done first would leave its peers waiting in that call's
    counts' exchange. The layer's next call reads the words the refused call left unread (their copy ended long
    before) and raises before its exchange, whatever the error word's copy: on every rank at the same call. Once
    only: the call after it runs."""
    workspace = SimulatedWorld(1).workspaces()[0]
    fused = MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, seed=SEED, comm="fused", workspace=workspace,
                     fused=FusedMoEConfig(max_tokens_per_rank=20))
    fused._refuse_alone = False  # a rank taken for one with peers (NCCL): the forward records its refusal
    errors = fused.dispatch.errors
    fused.dispatch.errors = CopyNotDone(errors.word.device, errors.rank, errors.what,
                                        describe_refused=errors.describe_refused)
    exchanges = []
    gather = layer_module.gather_counts_and_words
    monkeypatch.setattr(layer_module, "gather_counts_and_words", lambda *args: exchanges.append(1) or gather(*args))
    gen = torch.Generator().manual_seed(23)
    for grad_enabled in (False, True):  # an evaluation; a training forward whose loss was dropped
        with torch.set_grad_enabled(grad_enabled):
            step = workspace._epochs["moe_dispatch"] + 1 if "moe_dispatch" in workspace._epochs else 1
            fused(torch.randn(21, D_MODEL, generator=gen))
            exchanges.clear()
            with pytest.raises(PeerRefusedInput, match=rf"fused MoE dispatch at step {step}: rank 0: 21 tokens, "
                                                       rf"more than max_tokens_per_rank=20"):
                fused(torch.randn(5, D_MODEL, generator=gen))
            assert exchanges == []  # raised before this call's exchange
            y, _ = fused(torch.randn(5, D_MODEL, generator=gen))
            assert y.isfinite().all()
    fused.dispatch.errors.check(block=True)  # nothing left in the word


@interpreter
@pytest.mark.parametrize("comm", ["bulk", "fused"])
def test_the_callers_refusal_raises_where_the_forward_reads_the_counts(comm):
    """Without max_tokens_per_rank the host reads the counts in the forward (bulk: their splits; fused: once GEMM 1
    is queued): a refusal raises there, and the next call runs as ever."""
    workspace = SimulatedWorld(1).workspaces()[0] if comm == "fused" else None
    layer = MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, seed=SEED, comm=comm, workspace=workspace)
    x = torch.randn(9, D_MODEL, generator=torch.Generator().manual_seed(2))
    refused = torch.tensor([TOKEN_OUT_OF_VOCABULARY, 256, 256])
    for _ in range(2):  # the first fused call reads its counts before the dispatch, the second after it
        with pytest.raises(ValueError, match=r"rank 0: token id 256 in its batch, outside the vocabulary \[0, 256\)"):
            layer(x, refused=refused)
        assert layer(x)[0].isfinite().all()
    with pytest.raises(ValueError, match=r"refused must be int64 \[3\] on cpu, got \[2\] torch.int64"):
        layer(x, refused=refused[:2])


@interpreter
@pytest.mark.parametrize("dispatch", ["rows", "tokens"])
def test_rows_past_a_bound_that_did_not_hold_are_left_out_and_the_backward_refuses(dispatch):
    """max_tokens_per_rank's capacity holds every routing of distinct experts per token. Were it short (here: cut
    by hand to 64 receive rows for 80), the forward's kernels stop at it (GEMM 1 computes no row past it, the
    combine's tiles end there: nothing read past h, nothing written past the owner's rows) and the backward, which
    sees the counts, raises instead of reading past h."""
    workspace = SimulatedWorld(1).workspaces()[0]
    layer = MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, seed=SEED, comm="fused", workspace=workspace,
                     fused=FusedMoEConfig(max_tokens_per_rank=40, dispatch=dispatch))
    assert layer.dispatch.capacity == 128
    layer.dispatch.capacity = 64  # a multiple of the push's chunk, as reserve makes it
    x = torch.randn(40, D_MODEL, generator=torch.Generator().manual_seed(8), requires_grad=True)
    y, _ = layer(x)
    assert not y.isnan().any()
    with pytest.raises(RuntimeError, match="rank 0: an owner received 80 rows, more than the 64 its buffers hold"):
        y.sum().backward()


def test_dispatch_auto_is_by_token_where_the_tokens_are_bounded():
    """dispatch="auto" (the default): by token with max_tokens_per_rank (its buffers are sized by it), else by row;
    an explicit choice stands."""
    for max_tokens, dispatch, by_token in ((None, "auto", False), (4, "auto", True), (4, "rows", False),
                                           (4, "tokens", True)):
        layer = MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, comm="fused", workspace=SimulatedWorld(1).workspaces()[0],
                         fused=FusedMoEConfig(max_tokens_per_rank=max_tokens, dispatch=dispatch))
        assert layer.dispatch.by_token == by_token, (max_tokens, dispatch)


@interpreter
@pytest.mark.parametrize("comm", ["bulk", "fused"])
def test_alongside_runs_before_the_host_sync_and_adds_to_the_output(comm, monkeypatch):
    """`alongside` (the Transformer's shared expert) is called once the counts are on their way to the host and
    before the host reads them (the fused layer's first call reads its counts before it dispatches), once, in the
    caller's grad mode: y = routed + alongside(), with that sum's gradients."""
    workspace = SimulatedWorld(1).workspaces()[0] if comm == "fused" else None
    layer = MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, seed=SEED, comm=comm, workspace=workspace)
    shared = torch.nn.Linear(D_MODEL, D_MODEL)
    events = []
    read = PendingHostCopy.get
    monkeypatch.setattr(PendingHostCopy, "get", lambda self: events.append("counts read") or read(self))
    gen = torch.Generator().manual_seed(31)
    for step in range(3):
        x, grad = torch.randn(12, D_MODEL, generator=gen), torch.randn(12, D_MODEL, generator=gen)
        results = []
        for overlapped in (True, False):
            xi = x.clone().requires_grad_()
            for module in (layer, shared):
                module.zero_grad()
            events.clear()
            if overlapped:
                y, _ = layer(xi, alongside=lambda: events.append("alongside") or shared(xi))
                first_read = events.index("counts read")
                assert events.count("alongside") == 1
                assert (events.index("alongside") > first_read) if comm == "fused" and step == 0 else (
                    events.index("alongside") < first_read), events
            else:
                y = layer(xi)[0] + shared(xi)
            (y * grad).sum().backward()
            results.append((y.detach(), xi.grad, [p.grad for p in (*layer.parameters(), *shared.parameters())]))
        (y, gx, grads), (want_y, want_gx, want_grads) = results
        torch.testing.assert_close(y, want_y, rtol=0, atol=0)
        torch.testing.assert_close(gx, want_gx, rtol=1e-6, atol=1e-6)
        for g, want in zip(grads, want_grads):
            torch.testing.assert_close(g, want, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        assert not layer(x, alongside=lambda: shared(x))[0].requires_grad
    with pytest.raises(ValueError, match=r"alongside returned \[12, 3\]; the layer's output is \[12, 16\]"):
        layer(x, alongside=lambda: x[:, :3])
    calls = []
    with pytest.raises(ValueError, match=r"alongside returned NoneType"):
        layer(x, alongside=lambda: calls.append(1))
    assert calls == [1]


def test_fused_needs_cuda_under_torchrun():
    with pytest.raises(RuntimeError, match="comm=fused needs CUDA GPUs under torchrun"):
        MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, comm="fused")
    with pytest.raises(ValueError, match="expected 'bulk' or 'fused'"):
        MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, comm="nccl")


@interpreter
def test_fused_layer_matches_bulk_under_autocast():
    """Mixed precision: the fused layer's kernels get 16-bit rows and 16-bit copies of the fp32 experts, as the
    bulk layer's GEMMs do; outputs and gradients agree to that rounding, and the fp32 weights get fp32
    gradients (the fused experts' unrounded). fp16 here: the Triton interpreter multiplies the bit patterns of
    bf16 `tl.dot` operands (values ~1e10; triton-lang/triton#11584, "not supported yet"), so bf16 is checked on
    GPUs only (tests/test_moe_fused_gpu.py, moe.bench)."""
    workspace = SimulatedWorld(1).workspaces()[0]
    fused = MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, seed=SEED, comm="fused", workspace=workspace)
    bulk = MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, seed=SEED)
    gen = torch.Generator().manual_seed(11)
    x, grad = torch.randn(21, D_MODEL, generator=gen), torch.randn(21, D_MODEL, generator=gen)
    results = []
    for layer in (fused, bulk):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.float16):
            y, _ = layer(xi)
        (y.float() * grad).sum().backward()
        results.append((y, xi.grad, [p.grad for p in layer.parameters()]))
    (y, gx, grads), (want_y, want_gx, want_grads) = results
    assert y.dtype == want_y.dtype == torch.float16
    torch.testing.assert_close(y.float(), want_y.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gx, want_gx, rtol=2e-2, atol=2e-2)
    for g, want in zip(grads, want_grads):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, want, rtol=2e-2, atol=5e-2)
    # The fused backward stores the expert weights' gradients in fp32; the bulk one's are 16-bit values cast back.
    for layer, rounded in ((fused, False), (bulk, True)):
        for g in (layer.experts.w13.grad, layer.experts.w2.grad):
            assert torch.equal(g.half().float(), g) == rounded


@interpreter
def test_fused_layer_under_no_grad_keeps_nothing_for_a_backward():
    """Under torch.no_grad (evaluation) the parameters still report requires_grad inside the autograd node: the
    forward must not store GEMM 1's products, copy the received rows or keep each assignment's row (they cost a
    training forward ~0.3 ms of GPU time at issue 4's first config); its output is the training forward's."""
    workspace = SimulatedWorld(1).workspaces()[0]
    layer = MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, seed=SEED, comm="fused", workspace=workspace)
    kept = []
    launch, combine_finish = layer.dispatch.launch, layer.combine.finish
    layer.dispatch.launch = lambda *a, a13_out=None, own_rows, **kw: kept.append(a13_out) or launch(
        *a, a13_out=a13_out, own_rows=own_rows, **kw)
    layer.combine.finish = lambda *a, rows_out=None: kept.append(rows_out) or combine_finish(*a, rows_out=rows_out)
    x = torch.randn(9, D_MODEL, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        y_eval, _ = layer(x)
    assert kept == [None, None]
    y_train, _ = layer(x)
    assert y_train.requires_grad and all(t is not None for t in kept[2:]) and len(kept) == 4
    torch.testing.assert_close(y_eval, y_train.detach(), rtol=0, atol=0)


@interpreter
@pytest.mark.parametrize("combine", ["auto", "rows"])
def test_the_combine_follows_the_config_in_every_forward_and_backward(combine):
    """combine="auto" with the dispatch by token: every forward (under no_grad, training through the router,
    training the experts alone) sums each token's rows on the owner (start_by_token), and its backward sends the
    output gradient by token (start_backward_by_token), the owner returning the routing weights' gradient.
    "rows": always by row. Outputs and gradients (the router's too) equal the bulk layer's."""
    workspace = SimulatedWorld(1).workspaces()[0]
    layer = MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, seed=SEED, comm="fused", workspace=workspace,
                     fused=FusedMoEConfig(max_tokens_per_rank=16, combine=combine))
    bulk = MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, seed=SEED)
    used = []
    for name in ("start_by_token", "start", "start_backward_by_token", "start_backward"):
        method = getattr(layer.combine, name)
        setattr(layer.combine, name, lambda *a, name=name, method=method: used.append(name) or method(*a))
    gen = torch.Generator().manual_seed(21)
    x, grad = torch.randn(14, D_MODEL, generator=gen), torch.randn(14, D_MODEL, generator=gen)
    with torch.no_grad():
        y_eval, want_eval = layer(x)[0], bulk(x)[0]
    y, gx, _ = run(layer, x, None, grad)
    want_y, want_gx, _ = run(bulk, x, None, grad)
    for p, q in zip(layer.router.parameters(), bulk.router.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)
    for module in (layer, bulk):
        module.zero_grad()
        module.router.requires_grad_(False)
    experts_only = layer(x)[0]
    (experts_only * grad).sum().backward()
    (bulk(x)[0] * grad).sum().backward()
    forward, backward = ("start_by_token", "start_backward_by_token") if combine == "auto" else ("start",
                                                                                                  "start_backward")
    assert used == [forward, forward, backward, forward, backward]
    for got, want in ((y_eval, want_eval), (y, want_y), (experts_only.detach(), want_y)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, want_gx, rtol=1e-5, atol=1e-5)
    for p, q in zip(layer.experts.parameters(), bulk.experts.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="combine='tokens': expected 'auto' or 'rows'"):
        MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, comm="fused", workspace=workspace,
                 fused=FusedMoEConfig(max_tokens_per_rank=4, combine="tokens"))


def fused_pair(monkeypatch, log, config: FusedMoEConfig | None = None):
    """Two fused layers of the same weights, the first replaying its dispatch through stand-in graphs (CPU: the
    graph's work runs again on its own copies of the inputs, tests/graph_stand_in.py), the second eager."""
    monkeypatch.setattr(graphed_calls, "_capture", stand_in_capture(log))
    layers = [MoELayer(D_MODEL, FFN, EXPERTS, TOP_K, seed=SEED, comm="fused", fused=config,
                       workspace=SimulatedWorld(1).workspaces()[0]) for _ in range(2)]
    layers[0]._dispatch_graphs = GraphedCalls()
    return layers


@interpreter
@pytest.mark.parametrize("config", [None, FusedMoEConfig(max_tokens_per_rank=14, dispatch="tokens")],
                         ids=["grown", "bounded, by token"])
def test_graphed_dispatch_gives_the_eager_results(monkeypatch, config):
    """Steps of one shape and changing routing: the graphed layer captures at the second step and replays from the
    third on, with each step's tokens and routing; outputs and every gradient equal the eager layer's, and the
    epochs the kernels count on the device stay those the host counts (the receive buffer's halves). By token the
    permutation's inverse is one of the graph's inputs, and `received` one of its outputs."""
    log = []
    graphed, eager = fused_pair(monkeypatch, log, config)
    gen = torch.Generator().manual_seed(21)
    for step in range(5):
        x, grad = torch.randn(14, D_MODEL, generator=gen), torch.randn(14, D_MODEL, generator=gen)
        bias = torch.randn(EXPERTS, generator=gen) * 3  # another routing every step
        for layer in (graphed, eager):
            layer.zero_grad()
        (y, gx, _), (want_y, want_gx, _) = run(graphed, x, bias, grad), run(eager, x, bias, grad)
        torch.testing.assert_close(y, want_y, rtol=0, atol=0)
        torch.testing.assert_close(gx, want_gx, rtol=0, atol=0)
        for (name, p), q in zip(graphed.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
        with torch.no_grad():  # another key (no a13 kept): its own graph
            torch.testing.assert_close(graphed(x, bias)[0], eager(x, bias)[0], rtol=0, atol=0)
    assert log == ["capture", "replay", "capture", "replay"] + ["replay", "replay"] * 3
    for layer in (graphed, eager):
        assert int(layer.dispatch._epoch_done) == layer.dispatch.ws.next_epoch("moe_dispatch") - 1 == 10


@interpreter
def test_a_second_forward_before_the_backward_does_not_rewrite_the_first(monkeypatch):
    """Two forwards, then their backwards (micro-batches, recomputation): the first forward's outputs are a
    graph's and are held for its backward, so the second forward runs without the graph."""
    log = []
    graphed, eager = fused_pair(monkeypatch, log)
    gen = torch.Generator().manual_seed(22)
    xs = [torch.randn(10, D_MODEL, generator=gen) for _ in range(4)]
    grads = [torch.randn(10, D_MODEL, generator=gen) for _ in range(4)]
    for layer in (graphed, eager):
        run(layer, xs[0], None, grads[0])  # the key's first call
        layer.zero_grad()
        x1, x2 = xs[1].clone().requires_grad_(), xs[2].clone().requires_grad_()
        y1, y2 = layer(x1)[0], layer(x2)[0]
        ((y2 * grads[2]).sum() + (y1 * grads[1]).sum()).backward()
        layer.grads = [x1.grad, x2.grad] + [p.grad for p in layer.parameters()]
    assert log == ["capture", "replay"]  # the second forward ran eagerly
    for g, want in zip(graphed.grads, eager.grads):
        torch.testing.assert_close(g, want, rtol=0, atol=0)
    y, _, _ = run(graphed, xs[3], None, grads[3])  # both backwards are done: the graph replays again
    assert log == ["capture", "replay", "replay"]
    torch.testing.assert_close(y, run(eager, xs[3], None, grads[3])[0], rtol=0, atol=0)


@interpreter
def test_fused_layer_computes_with_the_compute_copies(monkeypatch):
    """Mixed precision with compute copies (fp16: see test_fused_layer_matches_bulk_under_autocast): once AdamW has
    written them, the dispatch and combine compute with the experts' copies, the graphed layer replaying, and give
    the results of an eager twin that casts the same weights; a poisoned copy shows in the output; a torch write to
    a weight (its version moves) has its copy rewritten before the next forward."""
    log = []
    graphed, eager = fused_pair(monkeypatch, log)
    experts = graphed.experts
    for p in (experts.w13, experts.w2):
        want_compute_copy(p, torch.float16)
    gen = torch.Generator().manual_seed(23)
    x, grad = torch.randn(12, D_MODEL, generator=gen), torch.randn(12, D_MODEL, generator=gen)

    def run16(layer):
        with torch.autocast("cpu", dtype=torch.float16):
            return run(layer, x, None, grad)[0]

    optimizer = AdamW(graphed.parameters(), fused=True, lr=1e-2)
    run16(graphed)  # the key's first call, eager
    optimizer.step()  # writes the copies
    eager.load_state_dict(graphed.state_dict())
    for _ in range(2):  # capture, then replay
        assert torch.equal(run16(graphed), run16(eager))
    assert log[-1] == "replay"
    experts.w13.compute_copy.tensor.fill_(float("nan"))  # the copy's own version moves, not the weight's
    assert run16(graphed).isnan().all()
    with torch.no_grad():
        experts.w13.mul_(1.0)
    assert torch.equal(run16(graphed), run16(eager))
    # A copy dropped and made anew (marked for another dtype and back) lives elsewhere: a graph of the old one
    # must not replay (its key names the copy's address; the stand-in graph would not show the old address read).
    old_copy = experts.w13.compute_copy.tensor
    graphed.zero_grad()  # the poisoned call's gradients
    want_compute_copy(experts.w13, torch.bfloat16)
    run16(graphed)
    want_compute_copy(experts.w13, torch.float16)
    optimizer.step()
    eager.load_state_dict(graphed.state_dict())
    assert experts.w13.compute_copy.tensor.data_ptr() != old_copy.data_ptr()
    old_copy.fill_(float("nan"))
    calls = len(log)
    assert torch.equal(run16(graphed), run16(eager))
    assert log[calls:] == [], "a graph of the old copy replayed"
