"""Random bags for tests: the global batch of every feature, and the KJT of one rank's slice of it."""

from __future__ import annotations

import torch
from torchrec import KeyedJaggedTensor


def global_batch(step: int, batch: int, tables, weighted: bool) -> tuple[torch.Tensor, list[torch.Tensor], list]:
    """Random bags (empty ones and skewed lengths included) for every feature: lengths [F, B], values, weights."""
    gen = torch.Generator().manual_seed(1000 + step)
    rows = [t.num_embeddings for t in tables for _ in t.feature_names]
    lengths = torch.randint(0, 4, (len(rows), batch), generator=gen)
    lengths[:, 0] = 0  # an empty bag in every feature
    lengths[0, -1] = 9  # one long bag
    values = [torch.randint(0, r, (int(l.sum()),), generator=gen) for r, l in zip(rows, lengths)]
    weights = [torch.rand(v.numel(), generator=gen) for v in values] if weighted else None
    return lengths, values, weights


def to_kjt(keys, lengths, values, weights, start: int, stop: int) -> KeyedJaggedTensor:
    """The KJT of samples [start, stop) of the global batch."""
    offsets = [torch.cat([torch.zeros(1, dtype=torch.long), l.cumsum(0)]) for l in lengths]
    vals = [v[o[start]:o[stop]] for v, o in zip(values, offsets)]
    ws = None if weights is None else torch.cat([w[o[start]:o[stop]] for w, o in zip(weights, offsets)])
    return KeyedJaggedTensor.from_lengths_sync(keys, torch.cat(vals), lengths[:, start:stop].reshape(-1), ws)
