"""Host-built tensors to the GPU without making the host wait for it."""

from __future__ import annotations

import torch


def host_to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host tensors of one dtype -> views of one device tensor, moved in one copy. On GPUs the copy is from
    pinned memory and non-blocking: a copy from pageable memory waits for the GPU to drain first."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    flat = flat.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else flat.to(device)
    return [part.view(t.shape) for part, t in zip(torch.split(flat, [t.numel() for t in tensors]), tensors)]
