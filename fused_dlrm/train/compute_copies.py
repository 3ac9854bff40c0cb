"""Low-precision compute copies of fp32 parameters, written by the optimizer's step.

Mixed precision keeps fp32 weights and computes in bf16, so every forward casts the weights it uses: for the MoE
experts a pass over billions of weights per step, right after the optimizer's own pass over them. A model marks the
parameters it wants copies of (`want_compute_copy`); an optimizer that writes copies (fused_dlrm.train.adamw.AdamW)
creates one when it first steps such a parameter and rewrites it in the same pass as every update after;
`compute_weight` hands the model the copy, or casts as before where there is none.

A copy is current while its parameter's version counter and address have not moved since it was written: the
optimizer's kernel leaves the counter (it records the version after writing), every torch in-place op moves it
(copy_, load_state_dict, a checkpoint's load, foreach ops), and `param.data = ...` moves the address, so such a change
is seen and the copy rewritten at its next use (a copy of another shape or device is dropped). In-place writes to
`param.data` are not seen, nor are torch's fused optimizers' (their kernels leave the counter too): stepping a
parameter that has a copy with another optimizer leaves the copy stale (the AdamW's own torch steps mark it).

The copy is not in autograd's graph: callers route the gradient to the parameter themselves (custom autograd
Functions that take the parameter as an input, as the MoE experts' do).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass
class _Copy:
    tensor: torch.Tensor
    written_at: tuple[int, int] | None  # the parameter's (address, version counter) when the copy was written


def want_compute_copy(param: torch.nn.Parameter, dtype: torch.dtype) -> None:
    """Mark an fp32 parameter as computed with in `dtype` (bf16 / fp16): an optimizer that writes copies keeps one."""
    if param.dtype != torch.float32 or dtype not in LOW_PRECISION:
        raise ValueError(f"compute copies are bf16 / fp16 copies of fp32 parameters, got a {param.dtype} parameter "
                         f"and {dtype}")
    param.compute_copy_dtype = dtype


def wanted_dtype(param: torch.Tensor) -> torch.dtype | None:
    """The dtype `param` is marked to be computed with (None: unmarked)."""
    return getattr(param, "compute_copy_dtype", None)


def copy_to_write(param: torch.nn.Parameter) -> torch.Tensor:
    """The optimizer's: the copy its step is about to write (made, contiguous, at the first call)."""
    copy = _copy(param)
    if copy is None:
        copy = param.compute_copy = _Copy(torch.empty(param.shape, dtype=wanted_dtype(param), device=param.device),
                                          written_at=None)
    return copy.tensor


def written(param: torch.nn.Parameter) -> None:
    """The optimizer's: the copy now holds the parameter as it is."""
    param.compute_copy.written_at = _state(param)


def written_unseen(param: torch.nn.Parameter) -> None:
    """The optimizer's: param was updated by a write its version counter does not show (torch's fused step): its
    copy, if any, is rewritten at its next use."""
    copy = _copy(param)
    if copy is not None:
        copy.written_at = None


def refresh_compute_copy(param: torch.nn.Parameter) -> None:
    """Rewrite param's copy if the parameter changed since the copy was written (no-op without a copy). Callers
    replaying a CUDA graph that reads the copy call it before the replay, which runs no Python."""
    copy = _copy(param)
    if copy is not None and copy.written_at != _state(param):
        copy.tensor.copy_(param.detach())
        copy.written_at = _state(param)


def mirror_compute_copy(param: torch.nn.Parameter, source: torch.nn.Parameter) -> None:
    """Mark `param`, which holds `source`'s values, as `source` is marked, with a copy of its own where `source` has
    one: a twin of a module (a layer copied to run another way) then computes as the module does, with a copy or
    casting."""
    dtype = wanted_dtype(source)
    if dtype is None:
        return
    want_compute_copy(param, dtype)
    if _copy(source) is not None:
        copy_to_write(param).copy_(param.detach())
        written(param)


def compute_copy(param: torch.nn.Parameter, dtype: torch.dtype) -> torch.Tensor | None:
    """The copy `compute_weight(param, dtype)` returns (as it is, not refreshed), None where it casts instead."""
    copy = _copy(param)
    return copy.tensor if copy is not None and copy.tensor.dtype == dtype else None


def compute_weight(param: torch.nn.Parameter, dtype: torch.dtype) -> torch.Tensor:
    """param in `dtype`: its compute copy when it has one of that dtype (rewritten first if stale), else
    param.to(dtype) (param itself when of that dtype)."""
    copy = compute_copy(param, dtype)
    if copy is None:
        return param.to(dtype)
    refresh_compute_copy(param)
    return copy


def _state(param: torch.nn.Parameter) -> tuple[int, int]:
    """What a write to the parameter changes: its address (`param.data = ...`) or its version counter."""
    return param.data_ptr(), param._version


def _copy(param: torch.nn.Parameter) -> _Copy | None:
    """param's copy, dropped if it no longer has the parameter's shape or device (e.g. the module moved by .to(),
    which swaps param.data) or the dtype the parameter is marked for."""
    copy = getattr(param, "compute_copy", None)
    if copy is not None and (copy.tensor.shape != param.shape or copy.tensor.device != param.device
                             or copy.tensor.dtype != wanted_dtype(param)):
        del param.compute_copy
        return None
    return copy
