"""The dense optimizer's step as a CUDA graph (fused_dlrm/train/graphed_step.py): on the CPU its key and the
choice of step; on a GPU (tests named *gpu*, skipped on CI) the graphed step against torch's own, step by step."""

from __future__ import annotations

import pytest
import torch

from fused_dlrm.train.graphed_step import GraphedOptimizerStep, dense_step


def params(device: torch.device, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen).to(device)) for shape in ((37, 19), (19,), (5, 3, 2))]


def test_the_loop_steps_eagerly_where_nothing_is_captured():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    adam, sgd = torch.optim.Adam(params(cpu)), torch.optim.SGD(params(cpu), lr=0.1)
    assert dense_step(adam, True, cpu) == adam.step  # CPU
    assert dense_step(adam, False, cuda) == adam.step  # trainer.cuda_graphs=false
    assert dense_step(sgd, True, cuda) == sgd.step  # no capturable option
    adam.param_groups[0]["capturable"] = True  # as a checkpoint of a graphed run loads it
    dense_step(adam, True, cpu)
    assert adam.param_groups[0]["capturable"] is False  # CPU parameters refuse it
    with pytest.raises(ValueError, match="SGD has no `capturable` option"):
        GraphedOptimizerStep(sgd)


def test_key_names_every_address_and_hyperparameter_a_capture_bakes_in():
    ps = params(torch.device("cpu"))
    optimizer = torch.optim.Adam(ps, lr=1e-3)
    step = GraphedOptimizerStep(optimizer)
    assert all(group["capturable"] for group in optimizer.param_groups)
    for p in ps:
        p.grad = torch.randn_like(p)
    before = step.key()
    for p in ps:
        p.grad.copy_(torch.randn_like(p))  # new values in place: the same step
    assert step.key() == before
    ps[1].grad = torch.randn_like(ps[1])  # a gradient allocated anew
    changed_grad = step.key()
    assert changed_grad != before
    optimizer.param_groups[0]["lr"] = 2e-3
    assert step.key() != changed_grad
    optimizer.param_groups[0]["lr"] = 1e-3
    assert step.key() == changed_grad
    optimizer.state[ps[0]]["exp_avg"] = torch.zeros_like(ps[0])  # state made or loaded
    assert step.key() != changed_grad


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("optimizer_class", [torch.optim.Adam, torch.optim.AdamW])
def test_graphed_step_equals_torchs_step_on_gpu(optimizer_class):
    """12 steps of fresh random gradients, written in place (replays), allocated anew at step 5 (a new key: eager,
    then captured) and a learning rate changed at step 8: parameters and state as torch's own step leaves them."""
    cuda = torch.device("cuda")
    eager_params, graphed_params = params(cuda), params(cuda)
    options = dict(lr=1e-2, weight_decay=0.01, fused=True, capturable=True)  # what GraphedOptimizerStep sets
    eager, graphed = optimizer_class(eager_params, **options), optimizer_class(graphed_params, **options)
    step = GraphedOptimizerStep(graphed)
    gen = torch.Generator(cuda).manual_seed(1)
    for i in range(12):
        if i == 8:
            for opt in (eager, graphed):
                opt.param_groups[0]["lr"] = 3e-3
        for pe, pg in zip(eager_params, graphed_params):
            grad = torch.randn(pe.shape, generator=gen, device=cuda)
            if pg.grad is None or i == 5:
                pe.grad, pg.grad = grad.clone(), grad.clone()
            else:
                pe.grad.copy_(grad)
                pg.grad.copy_(grad)
        eager.step()
        step()
        for pe, pg in zip(eager_params, graphed_params):
            torch.testing.assert_close(pg, pe, rtol=0, atol=0, msg=f"step {i}")
    assert len(step.replays) == 3  # captured at steps 2 (1: state made), 6 and 9 (a key's second step)
    for pe, pg in zip(eager_params, graphed_params):
        for name, value in eager.state[pe].items():
            torch.testing.assert_close(graphed.state[pg][name].float().cpu(), value.float().cpu(), rtol=0, atol=0)
