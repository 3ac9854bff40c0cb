"""The AllGather + GEMM bench's check before timing (fused_dlrm/bench/allgather_gemm.py) on a 2-rank gloo world.
The fused op needs CUDA symmetric memory: here the bench's calls of it are stand-ins, exact or failing one way on
one rank, and the bulk twin is the real one (gloo's all-gather). A result unlike the bulk twin's or a timed-out
wait skips the row on every rank; any other error of one rank raises on every rank (a rank raising alone left its
peer in the next collective)."""

from __future__ import annotations

import re

import pytest
import torch

from fused_dlrm.bench import allgather_gemm
from fused_dlrm.kernels.peer_flags import PeerCallMismatch, PeerWaitTimeout
from world import run_world

ROWS, K, N = 6, 16, 10


def _shard(rank: int) -> torch.Tensor:
    return torch.randn(ROWS, K, generator=torch.Generator().manual_seed(rank))


class _Errors:
    def __init__(self, error: Exception | None):
        self.error = error

    def check(self, block: bool = False) -> None:
        if self.error is not None:
            raise self.error


class _Op:
    def __init__(self, error: Exception | None):
        self.errors = _Errors(error)


def _stand_in(rank: int, world: int, failing: str, monkeypatch) -> None:
    """The fused op on this rank: the exact product (every rank's shard rebuilt, no collective, as its peers may be
    elsewhere), or on rank 1 `failing`'s way."""
    fails = rank == 1

    def all_gather_matmul(x, w, ws, producer, return_gathered=False, config=None):
        if fails and failing == "refused":
            raise ValueError("all_gather_matmul: x_shard refused")
        if fails and failing == "out of memory":
            raise torch.OutOfMemoryError("CUDA out of memory")
        gathered = torch.cat([_shard(r) for r in range(world)])
        out = gathered @ w
        return (out * 1.1 if fails and failing == "wrong" else out), gathered

    word = {"timed out": PeerWaitTimeout("rank 1 timed out waiting for rank 0"),
            "call mismatch": PeerCallMismatch("peer 0 called it with other rows")}.get(failing) if fails else None
    monkeypatch.setattr(allgather_gemm, "all_gather_matmul", all_gather_matmul)
    monkeypatch.setattr(allgather_gemm, "op_for", lambda ws, x, config=None: _Op(word))


def _check(rank, world, failing, expected):
    with pytest.MonkeyPatch.context() as monkeypatch:
        _stand_in(rank, world, failing, monkeypatch)
        w = torch.randn(K, N, generator=torch.Generator().manual_seed(10))

        def check():
            return allgather_gemm.check_against_bulk(_shard(rank), w, None, "device", None)

        kind, pattern = expected[rank]
        if kind == "skipped":
            failure = check()
            assert failure is not None and re.search(pattern, failure), failure
        elif kind == "passed":
            assert check() is None
        else:
            with pytest.raises(kind, match=pattern):
                check()


@pytest.mark.parametrize("failing,expected", [
    ("none", [("passed", ""), ("passed", "")]),
    ("wrong", [("skipped", r"^rank 1: relative error 0\.1 against the bulk twin, gathered input exact$"),
               ("skipped", r"^relative error 0\.1 against the bulk twin, gathered input exact$")]),
    ("timed out", [("skipped", r"^rank 1: rank 1 timed out waiting for rank 0$"),
                   ("skipped", r"^rank 1 timed out waiting for rank 0$")]),
    ("refused", [(ValueError, r"^rank 0: rank\(s\) \[1\] failed the AllGather\+GEMM device check: ValueError: "
                              r"all_gather_matmul: x_shard refused$"),
                 (ValueError, r"^all_gather_matmul: x_shard refused$")]),
    ("out of memory", [(ValueError, r"rank\(s\) \[1\] .*: OutOfMemoryError: CUDA out of memory$"),
                       (torch.OutOfMemoryError, "CUDA out of memory")]),
    ("call mismatch", [(ValueError, r"rank\(s\) \[1\] .*: PeerCallMismatch: peer 0 called it with other rows$"),
                       (PeerCallMismatch, "other rows")]),
])
def test_a_failure_on_one_rank_reaches_every_rank(failing, expected):
    """A wrong result or a timed-out wait: every rank skips the row (rank 0 names rank 1's failure); an error of
    another kind, in the call or read from the error word: every rank raises (it was rank 1's alone, rank 0 left
    in the bulk twin's all-gather)."""
    run_world(2, _check, failing, expected, timeout=120)
