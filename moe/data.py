"""Byte-level text for the MoE Transformer: a corpus file, split 95 / 5 into train and eval, random windows.

Without a file, a corpus is built from text that ships with Python: the standard library's top-level module
sources (`sysconfig.get_paths()["stdlib"]`, `*.py`, sorted by name) concatenated until `size_bytes` (None: all of
them, 4.46-4.70 MB on Pythons 3.10-3.13). No download. It is written to a cache file (atomically) and read back
from there when it holds that many bytes.

Batch `step` of a split is a function of (seed, split, step): `global_batch_size` window starts drawn from a
generator seeded by them; rank r takes its slice `local_batch_bounds(...)` of those windows. The global batch
is therefore the same whatever the world size.
"""

from __future__ import annotations

import hashlib
import logging
import numbers
import os
import sysconfig
import uuid
from pathlib import Path

import torch

from fused_dlrm.data.batching import local_batch_bounds
from fused_dlrm.config_checks import check_count

log = logging.getLogger(__name__)

DEFAULT_SIZE_BYTES = 2_000_000
EVAL_FRACTION = 0.05


def _derive_seed(*parts: object) -> int:
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _stdlib_sources() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))
    if not files:
        raise FileNotFoundError(f"no *.py module sources under the Python standard library at {stdlib}")
    return files


def _stdlib_size(size_bytes: int | None) -> int:
    """data.size_bytes, checked; None: the bytes of all the stdlib module sources."""
    if size_bytes is None:
        return sum(f.stat().st_size for f in _stdlib_sources())
    check_count("data.size_bytes", size_bytes, 1, "a byte count >= 1, or null: all of the standard library's "
                "module sources")
    return size_bytes


def stdlib_corpus(size_bytes: int | None = DEFAULT_SIZE_BYTES) -> bytes:
    """The first `size_bytes` of the sorted stdlib module sources, concatenated (fewer if the stdlib is smaller;
    None: all of them)."""
    size_bytes = _stdlib_size(size_bytes)
    files = _stdlib_sources()
    parts, total = [], 0
    for f in files:
        parts.append(f.read_bytes())
        total += len(parts[-1])
        if total >= size_bytes:
            break
    data = b"".join(parts)[:size_bytes]
    if len(data) < size_bytes:  # trained on what there is, but not without a word
        log.warning("the standard library's module sources hold %d bytes, fewer than data.size_bytes=%d: the "
                    "corpus is all of them", len(data), size_bytes)
    return data


def load_corpus(path: str | os.PathLike | None, cache: str | os.PathLike | None = None,
                size_bytes: int | None = DEFAULT_SIZE_BYTES) -> bytes:
    """The bytes of `path`; with path None, the stdlib corpus of `size_bytes` (None: all of it), read from `cache`
    if it holds at least that many, else built (and written to `cache` when given)."""
    if path is not None:
        path = Path(path)
        if path.is_dir():  # it exists: "not found" would mislead
            raise IsADirectoryError(f"corpus path {path} is a directory: give the corpus file itself (data.path)")
        if not path.is_file():
            raise FileNotFoundError(f"corpus file not found: {path}")
        return path.read_bytes()
    size_bytes = _stdlib_size(size_bytes)
    if cache is not None and Path(cache).is_file():
        data = Path(cache).read_bytes()
        if len(data) >= size_bytes:  # the corpus of a size is the prefix of any larger one's
            return data[:size_bytes]
        # built for fewer bytes (or the stdlib holds no more): built again, not trained on the smaller corpus
    data = stdlib_corpus(size_bytes)
    if cache is not None:  # every rank may build it: write to a private name, then rename atomically
        cache = Path(cache)
        cache.parent.mkdir(parents=True, exist_ok=True)
        # A random name, created exclusively, not the pid: ranks on other hosts of a shared filesystem (in
        # containers often of the same pid) would write one file, and the second rename would find none.
        tmp = cache.with_name(f"{cache.name}.{uuid.uuid4().hex}.tmp")
        try:
            with tmp.open("xb") as f:
                f.write(data)
            os.replace(tmp, cache)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return data


class ByteWindows:
    """One split of a byte corpus, batched per rank: `batch(step)` -> (inputs, targets), both [local, seq_len]
    int64, targets = inputs shifted by one byte."""

    def __init__(self, corpus: bytes, split: str, seq_len: int, global_batch_size: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, eval_fraction: float = EVAL_FRACTION):
        if split not in ("train", "eval"):
            raise ValueError(f"split must be train or eval, got {split!r}")
        # else a step of no tokens (its loss 0 / 0, stopped as a divergence), a float failing deep in torch, or
        # YAML's true (an int) taken as 1
        check_count("data.seq_len", seq_len, 1, "at least 1 byte per window, a whole number")
        # else the cut lands elsewhere (1.5: at -len / 2), or nowhere (NaN); null a TypeError naming nothing
        if isinstance(eval_fraction, bool) or not isinstance(eval_fraction, numbers.Real) or not 0 < eval_fraction < 1:
            raise ValueError(f"data.eval_fraction={eval_fraction!r}: expected a fraction in (0, 1) of the corpus, "
                             "held out for evaluation")
        cut = int(len(corpus) * (1 - eval_fraction))
        part = corpus[:cut] if split == "train" else corpus[cut:]
        if len(part) < seq_len + 1:
            share = f"{'' if split == 'eval' else '1 - '}data.eval_fraction={eval_fraction!r}"
            raise ValueError(f"the {split} part of the corpus ({share} of its {len(corpus)} bytes) has {len(part)} "
                             f"bytes, fewer than one window of data.seq_len + 1 = {seq_len + 1} bytes")
        self.data = torch.frombuffer(bytearray(part), dtype=torch.uint8)
        self.split, self.seq_len, self.seed = split, seq_len, seed
        self.global_batch_size = global_batch_size
        self.start, self.stop = local_batch_bounds(global_batch_size, rank, world_size)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        gen = torch.Generator().manual_seed(_derive_seed(self.seed, self.split, step))
        starts = torch.randint(0, len(self.data) - self.seq_len, (self.global_batch_size,), generator=gen)
        starts = starts[self.start:self.stop]
        windows = self.data[starts[:, None] + torch.arange(self.seq_len + 1)].long()
        return windows[:, :-1], windows[:, 1:]
