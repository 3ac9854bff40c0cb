"""The dense optimizer's step replayed as a CUDA graph (`trainer.cuda_graphs`, GPUs).

torch's fused Adam steps every dense parameter in two kernels, but the host takes ~0.3 ms per step to launch them
(torch.optim's step wrapper, `_init_group` over every parameter, grouping by device and dtype): in a DLRM step that
the host binds (docs/benchmarks.md, 2026-11-29), time the GPU waits. `GraphedOptimizerStep` replays the captured
kernels instead, through `kernels.launch.GraphReplays`: keyed by everything they read besides tensor values (the
addresses of parameters, gradients and optimizer state) and the hyperparameters they were captured with (kernel
arguments), so a gradient allocated anew, a loaded checkpoint or another learning rate is a new key: run eagerly,
captured when it comes again. The first step (which creates the optimizer's state) runs eagerly too.

The optimizer must offer `capturable` (Adam, AdamW: the step count kept on the device); it is switched on for
every parameter group, so make the step after loading a checkpoint (loading sets the groups' options). Step hooks
and the optimizer's Python side run at eager calls and captures only.
"""

from __future__ import annotations

from typing import Callable, Hashable

import torch

from fused_dlrm.kernels.launch import GraphReplays


class GraphedOptimizerStep:
    """`optimizer.step()` as a callable that replays a CUDA graph of it whenever its key repeats."""

    def __init__(self, optimizer: torch.optim.Optimizer, max_graphs: int = 4):
        if "capturable" not in optimizer.defaults:
            raise ValueError(f"{type(optimizer).__name__} has no `capturable` option: its step cannot be captured")
        for group in optimizer.param_groups:
            group["capturable"] = True
        self.optimizer = optimizer
        self.replays = GraphReplays(max_graphs)

    def __call__(self) -> None:
        self.replays(self.key(), self.optimizer.step)

    def key(self) -> Hashable:
        """What a captured step depends on besides tensor values: hyperparameters and tensor addresses."""
        state, key = self.optimizer.state, []
        for group in self.optimizer.param_groups:
            key.append(tuple((name, value) for name, value in group.items() if name != "params"))
            for p in group["params"]:
                key.append((p.data_ptr(), None if p.grad is None else p.grad.data_ptr(),
                            *(t.data_ptr() for t in state.get(p, {}).values() if isinstance(t, torch.Tensor))))
        return tuple(key)


def dense_step(optimizer: torch.optim.Optimizer, cuda_graphs: bool, device: torch.device) -> Callable[[], None]:
    """The training loop's optimizer step: graphed with `trainer.cuda_graphs` on GPUs where the optimizer can be
    captured, else optimizer.step itself."""
    if cuda_graphs and device.type == "cuda" and "capturable" in optimizer.defaults:
        return GraphedOptimizerStep(optimizer)
    if "capturable" in optimizer.defaults:  # a graphed run's checkpoint says True, which CPU parameters refuse
        for group in optimizer.param_groups:
            group["capturable"] = optimizer.defaults["capturable"]
    return optimizer.step
