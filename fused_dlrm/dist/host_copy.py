"""Host-built tensors to the GPU without making the host wait for it."""

from __future__ import annotations

import numpy as np
import torch


def host_to_device(arrays: list[torch.Tensor | np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Host tensors or numpy arrays of one dtype -> views of one device tensor, moved in one copy. On GPUs the
    copy is from pinned memory and non-blocking: a copy from pageable memory waits for the GPU to drain first.
    Small host-built arrays are best built in numpy, where an op skips torch's dispatcher (CI's machine: a
    64-element subtraction 0.25 us against 1.26 us for CPU tensors)."""
    if all(isinstance(a, np.ndarray) for a in arrays):
        flat = torch.from_numpy(np.concatenate([a.reshape(-1) for a in arrays]))
    else:
        flat = torch.cat([torch.as_tensor(a).reshape(-1) for a in arrays])
    flat = flat.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else flat.to(device)
    if len(arrays) == 1:
        return [flat.view(tuple(arrays[0].shape))]
    return [part.view(tuple(a.shape)) for part, a in zip(torch.split(flat, [int(np.prod(a.shape)) for a in arrays]),
                                                         arrays)]
