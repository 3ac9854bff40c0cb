"""The variable-split all-to-all's autograd (fused_dlrm/dist/alltoall.py) over three gloo ranks with uneven splits, in
float64: the gradient each row receives is the one its destination holds (the bulk exchanges' backward), and a
gradient taken with create_graph=True differentiates again (its backward is the forward exchange)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fused_dlrm.dist.alltoall import all_to_all_v
from world import run_world

# SEND[s][r]: rows rank s sends to rank r (a rank sending none to some peer, another none to itself)
SEND = [[2, 0, 3], [1, 1, 2], [0, 4, 1]]


def _exchange_reference(rank: int, world: int, parts: list[torch.Tensor], counts: list[list[int]]) -> torch.Tensor:
    """What `rank` receives when rank s holds parts[s], cut by counts[s] (rows to each rank): by source."""
    starts = [[sum(row[:r]) for r in range(world)] for row in counts]
    return torch.cat([parts[s][starts[s][rank]:starts[s][rank] + counts[s][rank]] for s in range(world)])


def _gradients_through_the_exchange(rank: int, world: int) -> None:
    send, recv = SEND[rank], [SEND[s][rank] for s in range(world)]
    back = [list(col) for col in zip(*SEND)]  # back[r][s] = SEND[s][r]: the gradient's way home

    def every_rank(seed: int, rows: list[int]) -> list[torch.Tensor]:
        return [torch.randn(rows[r], 3, dtype=torch.float64, generator=torch.Generator().manual_seed(seed * 10 + r))
                for r in range(world)]

    xs, ws, vs = every_rank(1, [sum(row) for row in SEND]), every_rank(2, [sum(col) for col in back]), \
        every_rank(3, [sum(row) for row in SEND])
    x = xs[rank].clone().requires_grad_()
    y = all_to_all_v(x, send, recv)
    ys = [_exchange_reference(r, world, xs, SEND) for r in range(world)]
    torch.testing.assert_close(y, ys[rank], rtol=0, atol=0)

    # loss = sum over ranks of w * y^3: d loss / d x is 3 w y^2 taken home
    grad, = torch.autograd.grad((ws[rank] * y ** 3).sum(), x, create_graph=True)
    home = lambda parts: _exchange_reference(rank, world, parts, back)  # noqa: E731
    torch.testing.assert_close(grad, home([3 * w * yr ** 2 for w, yr in zip(ws, ys)]), rtol=1e-12, atol=1e-12)

    # d/dx of sum over ranks of v * grad: 6 w y (A v) taken home, A v being v sent as x was
    second, = torch.autograd.grad((vs[rank] * grad).sum(), x)
    sent_v = [_exchange_reference(r, world, vs, SEND) for r in range(world)]
    torch.testing.assert_close(second, home([6 * w * yr * av for w, yr, av in zip(ws, ys, sent_v)]), rtol=1e-12,
                               atol=1e-12)
    dist.barrier()


def test_the_exchange_differentiates_as_the_float64_reference_twice():
    run_world(3, _gradients_through_the_exchange, timeout=300)
