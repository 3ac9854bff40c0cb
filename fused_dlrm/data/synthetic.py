"""Synthetic Criteo-like click data with learnable labels.

Each rank generates only its own slice of every global batch, from a generator
seeded by ``(seed, split, step, rank)``, so the stream is reproducible and needs
no communication; the samples therefore depend on the world size, and on the device
(the host's and the GPUs' generators differ; a GPU's draws also with its SM count): a run
compares with runs at its own world size on its own kind of device. Labels come from a
fixed hidden "teacher" model of the features, so a DLRM trained on this data can actually
learn something (its AUC rises well above 0.5).
"""

from __future__ import annotations

import hashlib
import math
import numbers
from collections.abc import Iterator, Sequence

import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from fused_dlrm.config_checks import ArgumentError
from fused_dlrm.data.batching import local_batch_bounds
from fused_dlrm.kernels.bag_hash_means import HASH_MOD, bag_hash_means

# Largest supported table: keeps ``index * multiplier`` of the row scramble (both < 2**31) inside int64.
MAX_ROWS = 2**31
# Knuth's multiplicative-hash prime (~2**32 / golden ratio). It is larger than MAX_ROWS, so it never
# divides a table size and is therefore coprime with every allowed ``num_rows``: the scramble is a bijection.
_SCRAMBLE_PRIME = 2654435761

# Teacher calibration: standard deviations of the dense and sparse parts of the logit (total ~1.6)
# and the target positive rate (Criteo-like CTR).
_DENSE_LOGIT_STD = 1.0
_SPARSE_LOGIT_STD = 1.3
_TARGET_POSITIVE_RATE = 0.3
_CALIBRATION_SAMPLES = 4096


def _derive_seed(*parts: object) -> int:
    """A 63-bit seed from a hash of ``parts`` (stable across processes, unlike ``hash()``)."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class SyntheticCriteo:
    """Infinite stream of synthetic Criteo-like batches for one rank.

    Args:
        num_rows: rows of each embedding table (one per sparse feature), in ``[1, 2**31]``.
        feature_names: sparse feature names, the KJT keys, in table order.
        global_batch_size: samples per step over all ranks.
        rank, world_size: this rank's slice is ``local_batch_bounds(global_batch_size, rank, world_size)``.
        num_dense: number of dense features, each ~ N(0, 1) (already on the log-transformed scale).
        mean_pooling: mean bag size, a scalar or one per feature. Bag sizes are uniform integers in
            ``[0, round(2 * mean_pooling)]``, so empty bags occur and the mean is ``mean_pooling``
            rounded to the nearest 0.5.
        zipf_alpha: exponent of the bounded Zipf law of the indices (0 = uniform, larger = more skewed).
        seed: base seed of data and teacher.
        split: stream name, e.g. ``"train"`` or ``"eval"``; different splits give different streams
            labelled by the same teacher.
        device: where batches are generated (the config's ``auto``, the model's device, is resolved by
            ``fused_dlrm.train.build.build_dataset``).
    """

    def __init__(
        self,
        num_rows: Sequence[int],
        feature_names: Sequence[str],
        global_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        num_dense: int = 13,
        mean_pooling: float | Sequence[float] = 4.0,
        zipf_alpha: float = 1.05,
        seed: int = 0,
        split: str = "train",
        device: torch.device | str = "cpu",
    ) -> None:
        num_rows = [int(n) for n in num_rows]
        feature_names = list(feature_names)
        if len(feature_names) == 0:
            raise ArgumentError("feature_names", "must name at least one sparse feature, got none")
        if len(num_rows) != len(feature_names):
            raise ValueError(
                f"len(num_rows) ({len(num_rows)}) must equal len(feature_names) ({len(feature_names)})"
            )
        if len(set(feature_names)) != len(feature_names):
            raise ArgumentError("feature_names", f"must be unique, got {feature_names}")
        for name, rows in zip(feature_names, num_rows):
            if not 1 <= rows <= MAX_ROWS:
                raise ArgumentError("num_rows", f"of feature {name!r} must be in [1, {MAX_ROWS}], got {rows}")
        if isinstance(mean_pooling, numbers.Real):
            mean_pooling = [float(mean_pooling)] * len(feature_names)
        mean_pooling = [float(m) for m in mean_pooling]
        if len(mean_pooling) != len(feature_names):
            raise ArgumentError(
                "mean_pooling", f"has {len(mean_pooling)} values, expected 1 or {len(feature_names)} (one per feature)"
            )
        if any(not 0 <= m < math.inf for m in mean_pooling):  # inf: an OverflowError in round(2 * m)
            raise ArgumentError("mean_pooling", f"must be finite and >= 0, got {mean_pooling}")
        if num_dense < 1:
            raise ArgumentError("num_dense", f"must be >= 1, got {num_dense}")
        if not zipf_alpha >= 0:
            raise ArgumentError("zipf_alpha", f"must be >= 0, got {zipf_alpha}")
        if not isinstance(split, str) or not split:
            raise ArgumentError("split", f"must be a non-empty string, got {split!r}")
        start, stop = local_batch_bounds(global_batch_size, rank, world_size)

        self.num_rows = num_rows
        self.feature_names = feature_names
        self.global_batch_size = global_batch_size
        self.rank = rank
        self.world_size = world_size
        self.local_batch_size = stop - start
        self.num_dense = num_dense
        self.mean_pooling = mean_pooling
        self.zipf_alpha = float(zipf_alpha)
        self.seed = seed
        self.split = split
        self.device = torch.device(device)

        # Per-feature sampling parameters, one row each: table size, max bag size, scramble multiplier
        # and offset. Kept on the CPU and moved to the generator's device per draw, so that the teacher
        # calibration below can sample on the CPU whatever the data device.
        self._feature_params = torch.tensor(
            [
                num_rows,
                [round(2 * m) for m in mean_pooling],
                [_SCRAMBLE_PRIME % n for n in num_rows],
                [_derive_seed(seed, "scramble", f) % n for f, n in enumerate(num_rows)],
            ],
            dtype=torch.int64,
        )

        # The teacher depends only on the seed and the feature/table layout, never on rank, world
        # size, split or device: it is built and calibrated on the CPU.
        teacher_gen = torch.Generator().manual_seed(_derive_seed(seed, "teacher"))
        w_dense = torch.randn(num_dense, generator=teacher_gen, dtype=torch.float64)
        self._w_dense = (w_dense * (_DENSE_LOGIT_STD / w_dense.norm())).float()
        self._hash_salt = _derive_seed(seed, "hash") % HASH_MOD
        self._max_length = max(round(2 * m) for m in mean_pooling)  # the longest bag a batch can hold
        self._device_copies: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._sparse_scale, self._bias = self._calibrate_teacher()

    def teacher_settings(self) -> dict:
        """The settings besides the tables that decide how a sample is labelled: the seed draws the teacher's weights,
        its hash salt and the ids' scramble; the teacher is calibrated on bags of this mean_pooling and zipf_alpha.
        An evaluation stream labelled by the training stream's teacher has the same (its split makes its samples its
        own)."""
        return {"seed": self.seed, "mean_pooling": self.mean_pooling, "zipf_alpha": self.zipf_alpha}

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(feature parameters, teacher's dense weights) on `device`, copied once: a copy from pageable host
        memory per batch would wait for the GPU each time."""
        if device not in self._device_copies:
            self._device_copies[device] = (self._feature_params.to(device), self._w_dense.to(device))
        return self._device_copies[device]

    def _calibrate_teacher(self) -> tuple[float, float]:
        """Return the teacher's (sparse scale, bias), fitted on a fixed sample of features.

        Scaling the sparse part empirically (rather than analytically) accounts for the Zipf skew,
        which makes the same hot rows and hence the same hash values repeat.
        """
        gen = torch.Generator().manual_seed(_derive_seed(self.seed, "calibration"))
        dense, lengths, values = self._sample_features(gen, _CALIBRATION_SAMPLES)
        dense_part = dense @ self._w_dense
        sparse_part = bag_hash_means(lengths, values, _CALIBRATION_SAMPLES, self._hash_salt, self._max_length)
        sparse_std = sparse_part.std().item()
        # A constant sparse term (e.g. every table has one row, or every bag is empty) is absorbed by the bias.
        sparse_scale = _SPARSE_LOGIT_STD / sparse_std if sparse_std > 1e-6 else 1.0
        logits = (dense_part + sparse_scale * sparse_part).double()
        # mean(sigmoid(logits + bias)) increases with bias: bisect for the target positive rate.
        low, high = -30.0, 30.0
        for _ in range(60):
            mid = (low + high) / 2
            if torch.sigmoid(logits + mid).mean().item() < _TARGET_POSITIVE_RATE:
                low = mid
            else:
                high = mid
        return sparse_scale, (low + high) / 2

    def _sample_features(
        self, gen: torch.Generator, batch_size: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draw dense ``[B, num_dense]``, key-major lengths ``[F * B]`` and values for ``batch_size`` samples.

        Tensors are created on ``gen``'s device.
        """
        device = gen.device
        num_rows, max_lengths, scramble_mult, scramble_offset = self._on(device)[0]
        num_features = len(self.feature_names)
        dense = torch.randn(batch_size, self.num_dense, generator=gen, device=device)
        # float64 so that floor(u * (max + 1)) can never round up to max + 1.
        u = torch.rand(num_features, batch_size, generator=gen, device=device, dtype=torch.float64)
        lengths = torch.floor(u * (max_lengths + 1).unsqueeze(1)).long()

        per_feature = lengths.sum(dim=1)
        total = int(per_feature.sum())  # the one host sync: the value count sizes the draws
        feature_of_value = torch.repeat_interleave(torch.arange(num_features, device=device), per_feature,
                                                   output_size=total)
        rows = num_rows[feature_of_value]
        u = torch.rand(feature_of_value.numel(), generator=gen, device=device, dtype=torch.float64)
        # Inverse CDF of the continuous power law x^-alpha on [1, N + 1); floor(x) - 1 is in [0, N).
        n_plus_1 = (rows + 1).double()
        if abs(self.zipf_alpha - 1.0) < 1e-6:
            x = torch.pow(n_plus_1, u)  # alpha == 1: log-uniform
        else:
            one_minus_alpha = 1.0 - self.zipf_alpha
            x = torch.pow(1.0 + u * (torch.pow(n_plus_1, one_minus_alpha) - 1.0), 1.0 / one_minus_alpha)
        ranks = torch.minimum(torch.floor(x).long() - 1, rows - 1).clamp_(min=0)  # clamp float round-off
        # Bijective scramble so that the hot rows are spread over the table, not all small ids.
        values = (ranks * scramble_mult[feature_of_value] + scramble_offset[feature_of_value]) % rows
        return dense, lengths.flatten(), values

    def _logits(self, dense: torch.Tensor, lengths: torch.Tensor, values: torch.Tensor,
                max_length: int) -> torch.Tensor:
        """The teacher's logit; no bag longer than ``max_length``. Its sparse term, per sample the sum over features
        of the bag's mean row hash, is one kernel on GPUs (fused_dlrm.kernels.bag_hash_means)."""
        batch_size = dense.shape[0]
        w_dense = self._on(dense.device)[1]
        sparse = bag_hash_means(lengths, values, batch_size, self._hash_salt, max_length)
        return dense @ w_dense + self._sparse_scale * sparse + self._bias

    def teacher_logits(self, batch: Batch) -> torch.Tensor:
        """The hidden teacher's logits for ``batch`` (its labels are Bernoulli(sigmoid(logits)))."""
        kjt = batch.sparse_features
        if list(kjt.keys()) != self.feature_names:
            raise ValueError(f"batch has sparse features {kjt.keys()}, expected {self.feature_names}")
        lengths = kjt.lengths()
        longest = int(lengths.max()) if lengths.numel() else 0  # any batch's bags, not only this stream's
        return self._logits(batch.dense_features, lengths, kjt.values(), longest)

    def batch(self, step: int) -> Batch:
        """This rank's slice of global batch ``step``: a function of (seed, split, step, rank, world_size) on one
        kind of device."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        gen = torch.Generator(device=self.device).manual_seed(
            _derive_seed(self.seed, self.split, step, self.rank)
        )
        dense, lengths, values = self._sample_features(gen, self.local_batch_size)
        probs = torch.sigmoid(self._logits(dense, lengths, values, self._max_length))
        labels = torch.bernoulli(probs, generator=gen)
        # Not from_lengths_sync: its per-key value counts would be one more wait for the GPU.
        sparse = KeyedJaggedTensor(keys=self.feature_names, values=values, lengths=lengths.int(),
                                   stride=self.local_batch_size)
        return Batch(dense_features=dense, sparse_features=sparse, labels=labels)

    def __iter__(self) -> Iterator[Batch]:
        step = 0
        while True:
            yield self.batch(step)
            step += 1
