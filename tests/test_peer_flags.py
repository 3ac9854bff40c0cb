"""PeerErrors without a GPU: `record_timeout` keeps the first timeout (with its step) until the host reads the word,
`record_mismatch` both calls' signatures for the message, `record_refused` the refused rank's words, and
`CopySchedule` decides when the GPU path copies the word to the host (every `check_every` calls, never while
a copy is in flight); every op refuses a wait bound its waits cannot count (`check_spin_limit`)."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from fused_dlrm.dist.symmetric import SimulatedWorld
from fused_dlrm.kernels.peer_flags import (SIGNATURE_WORDS, CopySchedule, PeerCallMismatch, PeerErrors,
                                           PeerRefusedInput, PeerWaitTimeout, ReadyWait, check_every_error_word,
                                           record_mismatch, record_refused, record_timeout, wait_ready)


@triton.jit
def _record_kernel(error_ptr, code, epoch, first_slot):
    """Every program records a timeout naming itself: peer = program, slot = first_slot + 10 x program."""
    pid = tl.program_id(0)
    record_timeout(error_ptr, code, pid, first_slot + 10 * pid, epoch)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the Triton interpreter")
def test_the_first_timeout_is_kept_until_the_host_reads_it():
    errors = PeerErrors(torch.device("cpu"), rank=3, what="op")
    _record_kernel[(3,)](errors.word, 1, 5, 0)  # the interpreter runs program 0 first: it claims the word
    _record_kernel[(3,)](errors.word, 2, 6, 0)  # a later launch's timeouts are consequences: not recorded
    assert errors.word.tolist()[:5] == [1, 0, 0, 5, 1]
    with pytest.raises(PeerWaitTimeout, match=r"^op: rank 3 timed out at step 5 waiting for rank 0, slice 0 "):
        errors.after_wait()  # the step comes from the word: the failing launch's, not the latest call's
    assert not errors.word.any()
    errors.after_wait()  # read and cleared: nothing left to raise
    _record_kernel[(2,)](errors.word, 2, 8, 7)  # code 2's slot: the step never finished
    with pytest.raises(PeerWaitTimeout, match=r"^op: rank 3 timed out at step 8 waiting for rank 0 to release its "
                                              r"buffer \(rank 0 never finished step 7\)"):
        errors.after_wait()


@triton.jit
def _mismatch_kernel(error_ptr, epoch, their_epoch, their_base):
    """Program 0 records a mismatch with peer 2 (signatures [epoch, 10, 11, ...] and [their_epoch, their_base + 1,
    their_base + 2, ...]), then every program a timeout, which comes too late."""
    w = tl.arange(0, SIGNATURE_WORDS)
    if tl.program_id(0) == 0:
        record_mismatch(error_ptr, 2, 7, epoch, tl.where(w == 0, epoch, 9 + w),
                        tl.where(w == 0, their_epoch, their_base + w))
    record_timeout(error_ptr, 1, tl.program_id(0), 0, epoch)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the Triton interpreter")
def test_a_mismatch_keeps_both_signatures_for_the_message():
    errors = PeerErrors(torch.device("cpu"), rank=1, what="op",
                        describe_calls=lambda mine, theirs: (f"calls {mine[1:3]}", f"calls {theirs[1:3]}"))
    _mismatch_kernel[(2,)](errors.word, 4, 4, 19)
    with pytest.raises(PeerCallMismatch, match=r"^op: rank 1 at step 4: peer 2 called it with calls \[20, 21\]; "
                                               r"this rank with calls \[10, 11\] \("):
        errors.after_wait()
    assert not errors.word.any()
    _record_kernel[(1,)](errors.word, 1, 5, 0)  # the word serves timeouts again
    with pytest.raises(PeerWaitTimeout, match="at step 5 waiting for rank 0"):
        errors.after_wait()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the Triton interpreter")
@pytest.mark.parametrize("their_step,which", [(6, "a later"), (2, "an earlier")])
def test_a_call_unlike_this_ranks_only_in_the_step_is_named_a_later_or_earlier_one(their_step, which):
    """A peer that moved on after a timeout (or one this rank's call overtook): no caller's bug, and the message says
    so rather than ask for the same calls in the same order."""
    errors = PeerErrors(torch.device("cpu"), rank=1, what="op",
                        describe_calls=lambda mine, theirs: (f"calls {mine[1:3]}", f"calls {theirs[1:3]}"))
    _mismatch_kernel[(1,)](errors.word, 4, their_step, 9)
    with pytest.raises(PeerCallMismatch, match=rf"^op: rank 1 at step 4: peer 2 called it with calls \[10, 11\]; "
                                               rf"this rank with calls \[10, 11\] \(peer 2's call is {which} one: a "
                                               r"rank moved on after a wait for its peer timed out\)$"):
        errors.after_wait()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the Triton interpreter")
def test_a_refusal_names_this_rank_if_refused_else_the_first_refused_rank():
    # every rank's refusal words, as rows of a wider tensor (the MoE layer's: after each rank's counts)
    gathered = torch.tensor([[5, 5, 0, 0, 0], [6, 6, 1, 21, 20], [7, 7, 0, 0, 0], [8, 8, 2, -3, 256]])
    words = gathered[:, 2:]
    for rank, refused, value in ((0, 1, 21), (1, 1, 21), (3, 3, -3)):
        errors = PeerErrors(torch.device("cpu"), rank=rank, what="op",
                            describe_refused=lambda peer, w: f"rank {peer} sent {w[:3]}, {w[3]}")
        record_refused(words, errors.word, rank, 9)
        with pytest.raises(PeerRefusedInput, match=rf"^op at step 9: rank {refused} sent \[\d, {value}, \d+\], 0$"):
            errors.after_wait()
    errors = PeerErrors(torch.device("cpu"), rank=2, what="op")
    record_refused(words[[0, 2]], errors.word, 1, 3)  # nothing refused: nothing recorded
    assert not errors.word.any()
    _record_kernel[(1,)](errors.word, 1, 4, 0)
    record_refused(words, errors.word, 2, 5)  # the first error is the cause: the refusal is not recorded
    with pytest.raises(PeerWaitTimeout, match="at step 4 waiting for rank 0"):
        errors.after_wait()
    record_refused(words, errors.word, 2, 6)
    with pytest.raises(PeerRefusedInput, match=r"^op at step 6: rank 2: rank 1's input was refused \(words "
                                               r"\[1, 21, 20, 0"):
        errors.after_wait()
    with pytest.raises(ValueError, match="refusal words must be int64"):
        record_refused(gathered.T[:, 2:], errors.word, 2, 7)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the Triton interpreter")
@pytest.mark.parametrize("cached", [False, True])
def test_the_wait_kernel_looks_once_while_an_unread_error_is_recorded(monkeypatch, cached):
    """On GPUs the host reads the error word only every check_every calls: a wait of a later call, whose result is
    lost anyway, must give up at once instead of spinning its whole bound (~54 s each) until then. Counted in
    atomic operations: the interpreter runs the polls one by one. Every producer is still acknowledged, its flags
    up or not: the call is over here (a producer that was only late then stores its next call)."""
    from triton.runtime.interpreter import InterpreterBuilder
    world, slots, spin_limit = 2, 3, 500
    ready = torch.zeros(world * slots, dtype=torch.int32)
    acks = [torch.zeros(world, dtype=torch.int32) for _ in range(world)]
    ack_ptrs = torch.tensor([a.data_ptr() for a in acks], dtype=torch.int64)
    errors = PeerErrors(torch.device("cpu"), rank=0, what="op")
    cached_wait = ReadyWait(ready, ack_ptrs, errors.word, 0, world, slots, spin_limit)
    wait = cached_wait if cached else (lambda epoch: wait_ready(ready, ack_ptrs, errors.word, 0, world, epoch, slots,
                                                                  spin_limit))
    atomics = []
    rmw = InterpreterBuilder.create_atomic_rmw
    monkeypatch.setattr(InterpreterBuilder, "create_atomic_rmw", lambda *a, **k: atomics.append(1) or rmw(*a, **k))
    wait(1)  # nobody raises a flag: the wait spins its bound, then records the timeout
    assert len(atomics) > spin_limit and errors.word.tolist()[:4] == [1, 0, 0, 1]
    atomics.clear()
    ready[slots:] = 2  # rank 1's flags of the next call are up, rank 0's are not
    wait(2)  # the host has not read the word yet
    assert len(atomics) < 10 * world, "a wait spun although an error is recorded"
    assert errors.word.tolist()[:4] == [1, 0, 0, 1], "the first error is the cause"
    assert [a.tolist() for a in acks] == [[2, 0], [2, 0]], "every producer acknowledged, its flags up or not"
    with pytest.raises(PeerWaitTimeout, match="at step 1 waiting for rank 0, slice 0"):
        errors.after_wait()


def test_copy_schedule_copies_every_n_calls_when_none_is_in_flight():
    schedule = CopySchedule(4)
    due = []
    for call in range(1, 13):
        if schedule.call():
            due.append(call)
            schedule.copied()
        if call == 4:  # the copy after call 4 is inspected at once; the one after call 8 never
            schedule.inspected()
    assert due == [4, 8]  # not 12: the copy after call 8 is still in flight
    assert schedule.in_flight and schedule.uncovered()  # calls 9-12 are after the copy of call 8
    schedule.inspected()
    assert schedule.call()  # call 13: 5 calls since the last copy, none in flight
    schedule.copied()
    assert not schedule.uncovered()


def test_copy_schedule_waits_for_the_copy_in_flight():
    schedule = CopySchedule(2)
    assert [schedule.call(), schedule.call()] == [False, True]
    schedule.copied()
    assert [schedule.call(), schedule.call(), schedule.call()] == [False, False, False]  # in flight
    schedule.inspected()
    assert schedule.call()  # the first call after the inspection: 4 calls since the copy
    with pytest.raises(ValueError, match="check_every must be >= 1"):
        CopySchedule(0)


class _CopiedAtOnce:
    """A CUDA event's stand-in whose copy is always done: PeerErrors' GPU reading path on the CPU."""

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def as_on_a_gpu(errors: PeerErrors) -> PeerErrors:
    """`errors` read as on a GPU: the host copies its word every check_every calls, not at every wait."""
    errors._host, errors._event = torch.zeros_like(errors.word), _CopiedAtOnce()
    return errors


def record_a_timeout(errors: PeerErrors, peer: int, slot: int, epoch: int) -> None:
    """What record_timeout stores ([code, peer, slot, epoch, claim]), written from the host."""
    errors.word[:5] = torch.tensor([1, peer, slot, epoch, 1], dtype=torch.int32)


def test_every_live_error_word_is_read_before_results_are_kept():
    """check_every_error_word reads the word of every op alive (a timeout in a call no copy covered yet raises),
    not of one freed."""
    quiet = as_on_a_gpu(PeerErrors(torch.device("cpu"), rank=0, what="quiet op", check_every=16))
    failed = as_on_a_gpu(PeerErrors(torch.device("cpu"), rank=0, what="failed op", check_every=16))
    for _ in range(3):  # calls 1-3: the first is copied (and clean), then the wait of call 3 gives up
        for errors in (quiet, failed):
            errors.check()
            errors.after_wait()
    record_a_timeout(failed, peer=1, slot=4, epoch=3)
    failed.check()  # the non-blocking read: the copy of call 1 holds no error, calls 2-3 are not copied yet
    with pytest.raises(PeerWaitTimeout, match=r"^failed op: rank 0 timed out at step 3 waiting for rank 1, slice 4"):
        check_every_error_word()
    check_every_error_word()  # read and cleared
    record_a_timeout(failed, peer=1, slot=4, epoch=5)
    del failed  # a freed op's word is no longer read
    check_every_error_word()


@pytest.mark.parametrize("spins", [2**31, 3_000_000_000, 0, -1, float("nan"), True, 2e6])
def test_every_ops_wait_bound_is_checked_where_it_is_taken_in(spins):
    """The waits count polls in 32 bits (from 2**31 on a lost peer hangs the wait; below 1 every wait gives up at
    its first look): every op's constructor, or config, that takes a bound refuses one they cannot honour, with the
    setting's name (FusedCommConfig's own test: test_sharded_ebc.py)."""
    from fused_dlrm.kernels.allgather import SymmetricAllGather
    from fused_dlrm.kernels.allgather_gemm import GemmConfig
    from fused_dlrm.kernels.gemm_allreduce import GemmAllReduce
    from fused_dlrm.kernels.quantized_allreduce import FusedQuantizedAllReduce
    from moe.layer import FusedMoEConfig

    ws = SimulatedWorld(2).workspaces()[0]
    takers = {"spin_limit": [lambda s: GemmAllReduce(ws, num_programs=2, spin_limit=s),
                             lambda s: SymmetricAllGather(ws, 4, 8, torch.float16, spin_limit=s),
                             lambda s: FusedQuantizedAllReduce(ws, 2, spin_limit=s)],
              "GemmConfig.spin_limit": [lambda s: GemmConfig(spin_limit=s)],
              "comm.wait_timeout_spins": [lambda s: FusedMoEConfig(wait_timeout_spins=s)]}
    for what, makers in takers.items():
        for make in makers:
            with pytest.raises(ValueError, match=rf"^{what}=.* whole number of polls from 1 to 2\*\*31 - 1"):
                make(spins)
            make(2**31 - 1)


@pytest.mark.parametrize("field, value, expected", [
    ("num_programs", 0, "a whole number >= 1 or None"), ("num_programs", 2.0, "a whole number >= 1 or None"),
    ("push_rounds", -1, "a whole number >= 0 or None"), ("copy_rows", 0, "a whole number >= 1 or None"),
    ("chunk_rows", True, "a whole number >= 1"), ("group_m", 0, "a whole number >= 1"),
    ("num_stages", 0, "a whole number >= 1"), ("block_m", 96, "a power of two"), ("block_k", 0, "a power of two"),
    ("num_warps", 6, "a power of two"), ("block_n", 128.0, "a power of two")])
def test_gemm_config_refuses_a_bad_count_when_built(field, value, expected):
    """Each rank builds the config alike: refused there, every rank raises; at a launch (num_programs=0: an empty
    grid) or a compile (block_m=96), one rank could raise after its peers started the call."""
    from fused_dlrm.kernels.allgather_gemm import GemmConfig

    with pytest.raises(ValueError, match=rf"^GemmConfig\.{field}={value!r}: expected {expected}$"):
        GemmConfig(**{field: value})
    GemmConfig(num_programs=None, push_rounds=0, copy_rows=None)  # the Nones and 0 rounds stay valid
