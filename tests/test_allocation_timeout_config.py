"""comm.allocation_timeout_s (conf/comm/*.yaml) reaches every symmetric workspace a run makes: DLRM's embedding exchange
(both transports), its dense arches' quantized gradient all-reduce, the MoE layers, the tensor-parallel projections,
the MoE gradients' all-reduce, the report's and DDP's hook (QuantizedHookState); a value that is not a positive
number of seconds is refused when the model is built.

On the CPU no workspace can exist (symmetric memory is CUDA's): each rank of a gloo world runs every site up to
the workspace's constructor, which records the bound it was given and stops there (`_Reached`); the paths that
take their fused kernel on CUDA tensors only are called with fused=True."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import fused_dlrm.models.arch_nodes as arch_nodes
import fused_dlrm.report.layers as report_layers
import fused_dlrm.tp.quantized_allreduce as quantized_allreduce_module
import moe.train as moe_train
from fused_dlrm.dist import DistEnv, symmetric
from fused_dlrm.dist.symmetric import check_allocation_timeout
from fused_dlrm.report.dlrm import with_comm
from fused_dlrm.report.moe import with_modes
from fused_dlrm.sparse.fused_all_to_all import build_fused_exchange
from fused_dlrm.tp import linear
from fused_dlrm.tp.quantized_allreduce import QuantizedHookState, quantized_all_reduce, quantized_allreduce_hook
from fused_dlrm.train import build
from test_moe_training import SMALL as MOE
from test_training import CPU, SMALL as DLRM, config
from world import run_world

BOUND = 7.5  # not the default (60)


class _Reached(Exception):
    """A workspace constructor was called: the site got this far."""


def _record_workspaces(seen: list) -> None:
    """Every workspace constructor records (its class, the bound) and raises _Reached; cuda_workspace's question
    to the GPUs (whether two ranks share one) is answered no."""
    def constructor(self, group=None, allocation_timeout_s=symmetric.ALLOCATION_TIMEOUT_S):
        seen.append((type(self).__name__, allocation_timeout_s))
        raise _Reached

    for kind in (symmetric.CudaSymmetricWorkspace, symmetric.NvshmemSymmetricWorkspace):
        kind.__init__ = constructor
    symmetric.ranks_share_a_gpu = lambda group: False


def _reaches(seen: list, kind: str, run) -> None:
    """run() stops at a workspace constructor of `kind` that got BOUND."""
    seen.clear()
    with pytest.raises(_Reached):
        run()
    assert seen == [(kind, BOUND)]


def _every_site(rank: int, world: int) -> None:
    seen: list = []
    _record_workspaces(seen)
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    bound = f"comm.allocation_timeout_s={BOUND}"

    # DLRM's embedding exchange (CUDA only: built here from its config up to the workspace), by transport
    for transport, kind in (("p2p", "CudaSymmetricWorkspace"), ("nvshmem", "NvshmemSymmetricWorkspace")):
        comm = build.fused_comm(config(*DLRM, "comm=fused", f"comm.transport={transport}", bound).comm)
        _reaches(seen, kind, lambda: build_fused_exchange(None, None, comm, None, torch.device("cuda")))

    # the fused kernels of the quantized all-reduce, taken on CUDA tensors only: here asked for
    fused_all_reduce = partial(quantized_all_reduce, fused=True)
    arch_nodes.quantized_all_reduce = moe_train.quantized_all_reduce = fused_all_reduce
    report_layers.quantized_all_reduce = quantized_allreduce_module.quantized_all_reduce = fused_all_reduce

    # DLRM's dense arches (comm=bulk builds them too)
    model = build.build_model(config(*DLRM, "comm.grad_allreduce=q8", bound), env)
    for arch in (model.dense_arch, model.over_arch):
        _reaches(seen, "CudaSymmetricWorkspace", arch.forward.hand_gradients)

    # the MoE layers, made as the model is built (device None: a model moved to the GPU later, if there is one)
    is_available, torch.cuda.is_available = torch.cuda.is_available, lambda: True
    _reaches(seen, "CudaSymmetricWorkspace", lambda: moe_train.build_model(config(*MOE, "comm=fused", bound), env))
    torch.cuda.is_available = is_available

    # the MoE Transformer's gradients
    model = moe_train.build_model(config(*MOE, "comm.grad_allreduce=q8", bound), env)
    _reaches(seen, "CudaSymmetricWorkspace", lambda: moe_train.sync_gradients(model, "q8"))

    # its tensor-parallel projections, each kind (the fused path on the CPU: bf16, as on CUDA)
    linear.TPLinear._fused_dtype = lambda self, x: torch.bfloat16
    for sequence_parallel in ("false", "true"):
        model = moe_train.build_model(config(*MOE, "model.tp_size=2", "model.tp_comm=fused", "model.precision=bf16",
                                             f"model.sequence_parallel={sequence_parallel}", bound), env)
        for kind in (linear.ColumnParallelLinear, linear.RowParallelLinear):
            layer = next(m for m in model.modules() if isinstance(m, kind))
            _reaches(seen, "CudaSymmetricWorkspace", lambda: layer(torch.randn(4, layer.weight.shape[1])))

    # the report's gradient all-reduce
    layer = report_layers.grad_allreduce_layer([100], "q8", env, None, BOUND)
    _reaches(seen, "CudaSymmetricWorkspace", layer.fused["fwd_bwd"])

    # DDP's communication hook (its bucket: its buffer, one parameter's gradient)
    state = QuantizedHookState("q8", allocation_timeout_s=BOUND)
    grads = torch.randn(100)
    bucket = SimpleNamespace(buffer=lambda: grads, gradients=lambda: [grads])
    _reaches(seen, "CudaSymmetricWorkspace", lambda: quantized_allreduce_hook(state, bucket))
    dist.barrier()


def test_the_configured_bound_reaches_every_workspace():
    run_world(2, _every_site, timeout=600)


def test_the_reports_fused_twins_of_a_bulk_run_keep_the_configured_bound():
    for with_fused, model in ((with_comm, []), (with_modes, MOE)):
        cfg = config(*model, f"comm.allocation_timeout_s={BOUND}")
        assert with_fused(cfg, "fused").comm.allocation_timeout_s == BOUND


@pytest.mark.parametrize("value", ["0", "-5", "abc", "null", "true", "inf", "nan"])
def test_an_allocation_timeout_that_is_not_a_positive_number_is_refused_when_the_model_is_built(value):
    said = r"^allocation_timeout_s=.* \(comm.allocation_timeout_s\): expected a positive, finite number of seconds"
    for build_model, model in ((build.build_model, DLRM), (moe_train.build_model, MOE)):
        cfg = config(*model, "comm=fused", f"comm.allocation_timeout_s={value}")
        with pytest.raises(ValueError, match=said):
            build_model(cfg, CPU)


def test_a_whole_number_of_seconds_is_taken():
    assert check_allocation_timeout(60) == 60.0 and check_allocation_timeout(0.5) == 0.5
