"""Reader of the Criteo Kaggle / Terabyte click logs in their raw TSV format.

Each line is ``label \\t I1 .. I13 \\t C1 .. C26``: a 0/1 label, 13 integer
counts and 26 categorical values as hex strings. Any column except the label
may be empty (missing).
"""

from __future__ import annotations

import gzip
import os
from collections.abc import Iterator, Sequence
from itertools import count, islice
from typing import IO

import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from fused_dlrm.data.batching import local_batch_bounds

CRITEO_NUM_DENSE = 13
CRITEO_NUM_SPARSE = 26
CRITEO_SPARSE_FEATURES = [f"cat_{i}" for i in range(CRITEO_NUM_SPARSE)]
_NUM_COLUMNS = 1 + CRITEO_NUM_DENSE + CRITEO_NUM_SPARSE


def _open_text(path: str) -> IO[str]:
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _shown(column: str) -> str:
    """repr of a column, cut short: a corrupt one may be thousands of characters long."""
    return repr(column) if len(column) <= 40 else f"{column[:20]!r}... ({len(column)} characters)"


def _dense_count(column: str) -> int:
    """max(int(column), 0), missing -> 0; refused if float64 (which log1p takes it in) cannot hold it."""
    try:
        count = max(int(column), 0) if column else 0
        float(count)
    except ValueError as error:  # not an integer, or over the 4300 digits Python converts
        raise ValueError(f"dense value {_shown(column)} is not an integer ({error})") from None
    except OverflowError:  # a count beyond 1.8e308 is no count of a click log, but a corrupt line: say where
        raise ValueError(f"dense value {_shown(column)} is too large (beyond float64)") from None
    return count


def _parse_line(line: str, num_rows: Sequence[int]) -> tuple[float, list[int], list[int]]:
    """Return (label, dense counts, categorical ids); a missing categorical is -1.

    Dense counts are missing -> 0 and negatives clamped to 0; ids are ``int(hex, 16) % num_rows[f]``.
    """
    columns = line.rstrip("\n").split("\t")
    if len(columns) != _NUM_COLUMNS:
        raise ValueError(f"expected {_NUM_COLUMNS} tab-separated columns, got {len(columns)}")
    if columns[0] not in ("0", "1"):
        raise ValueError(f"label must be 0 or 1, got {_shown(columns[0])}")
    dense = [_dense_count(column) for column in columns[1 : 1 + CRITEO_NUM_DENSE]]
    sparse = []
    for column, rows in zip(columns[1 + CRITEO_NUM_DENSE :], num_rows):
        try:
            sparse.append(int(column, 16) % rows if column else -1)
        except ValueError:
            raise ValueError(f"categorical value {_shown(column)} is not hexadecimal") from None
    return float(columns[0]), dense, sparse


class CriteoTSV:
    """Iterate this rank's slices of the global batches of Criteo TSV files (plain or ``.gz``).

    Global batches are consecutive runs of ``global_batch_size`` lines over the concatenated
    ``paths``; this rank yields lines ``local_batch_bounds(...)`` of each. The final short global
    batch is split the same way; it is dropped if ``drop_last`` or if it has fewer lines than
    ``world_size``, so that every rank yields the same number of batches.

    Dense features are ``log(1 + max(count, 0))`` (missing -> 0) as float32. Each categorical
    feature is a bag of one id ``int(hex, 16) % num_rows[f]``, or an empty bag when missing.
    """

    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        num_rows: Sequence[int],
        global_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        feature_names: Sequence[str] | None = None,
        drop_last: bool = False,
    ) -> None:
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        self.paths = [os.fspath(p) for p in paths]
        if not self.paths:
            raise ValueError("no Criteo files given")
        for path in self.paths:
            if not os.path.isfile(path):
                raise FileNotFoundError(f"Criteo file not found: {path}")
        self.num_rows = [int(n) for n in num_rows]
        if len(self.num_rows) != CRITEO_NUM_SPARSE:
            raise ValueError(
                f"num_rows must have {CRITEO_NUM_SPARSE} entries (one per Criteo categorical feature), "
                f"got {len(self.num_rows)}"
            )
        if any(n < 1 for n in self.num_rows):
            raise ValueError(f"num_rows must all be >= 1, got {self.num_rows}")
        self.feature_names = list(CRITEO_SPARSE_FEATURES if feature_names is None else feature_names)
        if len(self.feature_names) != CRITEO_NUM_SPARSE:
            raise ValueError(
                f"feature_names must have {CRITEO_NUM_SPARSE} entries, got {len(self.feature_names)}"
            )
        local_batch_bounds(global_batch_size, rank, world_size)  # validates the split
        self.global_batch_size = global_batch_size
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        # Files too short for one batch would yield none, found only where they are first read (an evaluation's:
        # after trainer.eval_every steps); their first lines tell now.
        needed = global_batch_size if drop_last else world_size
        found = sum(1 for _ in islice(self._lines(), needed))
        if found < needed:
            raise ValueError(f"Criteo files {', '.join(self.paths)} hold {found} lines, fewer than one batch takes: "
                             f"{needed} ({'a whole global batch: drop_last' if drop_last else 'one per rank'})")

    def _lines(self) -> Iterator[tuple[str, int, str]]:
        """(path, 1-based line number, line) over all files in order."""
        for path in self.paths:
            line_number = 0
            try:
                with _open_text(path) as f:
                    for line_number, line in enumerate(f, start=1):
                        yield path, line_number, line
            except (OSError, EOFError, UnicodeDecodeError) as error:  # a truncated .gz, a bad byte: say where
                raise ValueError(f"{path}: cannot read past line {line_number}: {error}") from error

    def __iter__(self) -> Iterator[Batch]:
        return self.skipping(0)

    def skipping(self, batches: int) -> Iterator[Batch | None]:
        """One pass over the files as iter(self) makes it, its first `batches` batches read but not made: None in
        their place. A resume finds its step so (train/build.py's batch_stream): parsing a line costs ~80x reading
        it, and a step deep into a day of Criteo lies behind millions of lines."""
        lines = self._lines()
        for index in count():
            # Lines of other ranks, and of the batches skipped, are only read, not parsed.
            global_batch = list(islice(lines, self.global_batch_size))
            if len(global_batch) < self.global_batch_size:
                if self.drop_last or len(global_batch) < self.world_size:
                    return
            if index < batches:
                yield None
                continue
            start, stop = local_batch_bounds(len(global_batch), self.rank, self.world_size)
            yield self._to_batch(global_batch[start:stop])

    def _to_batch(self, lines: list[tuple[str, int, str]]) -> Batch:
        labels, dense, sparse = [], [], []
        for path, line_number, line in lines:
            try:
                label, dense_row, sparse_row = _parse_line(line, self.num_rows)
            except ValueError as e:
                raise ValueError(f"{path}:{line_number}: malformed Criteo line: {e}") from None
            labels.append(label)
            dense.append(dense_row)
            sparse.append(sparse_row)
        dense_features = torch.tensor(dense, dtype=torch.float64).log1p().float()
        # [B, 26] -> key-major [26, B]: KJT lengths/values list all samples of feature 0 first.
        ids = torch.tensor(sparse, dtype=torch.int64).t()
        present = ids >= 0
        sparse_features = KeyedJaggedTensor.from_lengths_sync(
            keys=self.feature_names, values=ids[present], lengths=present.flatten().int()
        )
        return Batch(
            dense_features=dense_features,
            sparse_features=sparse_features,
            labels=torch.tensor(labels, dtype=torch.float32),
        )
