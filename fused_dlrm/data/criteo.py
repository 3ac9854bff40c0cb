"""Reader of the Criteo Kaggle / Terabyte click logs in their raw TSV format.

Each line is ``label \\t I1 .. I13 \\t C1 .. C26``: a 0/1 label, 13 integer
counts and 26 categorical values as hex strings. Any column except the label
may be empty (missing).

A batch's lines are parsed at once with numpy (`_parse_canonical`, ~10x the cost of reading them) when all are in
the canonical form Criteo's files hold: a dense count is an optional ``-`` and 1 to 16 ASCII digits, a categorical
1 to 16 ASCII hex digits (either case). A batch with anything else (or a file's last line without its newline) is
parsed line by line (`_parse_line`, ~5x slower) with Python's ``int()``, which accepts more with the same result:
surrounding whitespace, a ``+`` or ``-`` sign, ``_`` between digits, a ``0x`` prefix or a sign on hex, non-ASCII
digits, longer values. The first line it refuses raises a ValueError naming its file and line; so does a count
beyond float64 (log1p's input; > 1.8e308, no count of a click log but a corrupt line, which clamping would hide).

`num_workers` processes (torch's DataLoader) make the batches, each reading every line and parsing (its rank's
slice of) every num_workers-th global batch: the training process is left the step, and the parse rate grows with
the workers (docs/benchmarks.md, "The Criteo TSV reader in worker processes").
"""

from __future__ import annotations

import gzip
import os
import zlib
from collections.abc import Iterator, Sequence
from itertools import count, islice
from typing import IO

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from fused_dlrm.config_checks import ArgumentError
from fused_dlrm.data.batching import local_batch_bounds

CRITEO_NUM_DENSE = 13
CRITEO_NUM_SPARSE = 26
CRITEO_SPARSE_FEATURES = [f"cat_{i}" for i in range(CRITEO_NUM_SPARSE)]
_NUM_COLUMNS = 1 + CRITEO_NUM_DENSE + CRITEO_NUM_SPARSE


def default_num_workers() -> int:
    """Parsing processes per rank: the CPUs this process may run on, shared by the ranks of its node (torchrun's
    LOCAL_WORLD_SIZE), one of them left to the rank itself (its training step and batch thread); at least 1, at
    most 8 (past what one GPU's step takes, docs/benchmarks.md)."""
    cpus = len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, min(8, cpus - 1))


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
    The reference parser: `_parse_canonical` gives the same for the lines it takes.
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


_NOT_A_DIGIT = 255  # its high nibble set, as _field_values checks
_DIGIT_VALUE = np.full(256, _NOT_A_DIGIT, dtype=np.uint8)  # byte -> its (hex) digit's value
for _digit in "0123456789abcdef":
    _DIGIT_VALUE[ord(_digit)] = _DIGIT_VALUE[ord(_digit.upper())] = int(_digit, 16)
_WORD = 8  # a field's digit values are read 8 at a time, as one big-endian uint64 (a digit a byte)
# Dense counts below 10**16 fit int64 (and convert to float64 as Python's float(int) does); hex values of 16 digits
# fit uint64.
_MAX_DIGITS = 2 * _WORD
_KEEP_LAST_BYTES = np.array([(1 << 8 * n) - 1 for n in range(_WORD + 1)], dtype=np.uint64)
_EACH_BYTE = 0x0101010101010101
_HIGH_NIBBLES = 0xF0F0F0F0F0F0F0F0


def _word_value(word: np.ndarray, base: int) -> np.ndarray:
    """The value in `base` of each uint64 `word`'s 8 digits (a byte each, most significant first): adjacent digits
    combined into 16-bit lanes, those into 32-bit lanes, then those two, all words at once."""
    for bits, lanes in ((8, 0x00FF00FF00FF00FF), (16, 0x0000FFFF0000FFFF), (32, 0x00000000FFFFFFFF)):
        word = ((word >> bits) & lanes) * base ** (bits // 8) + (word & lanes)
    return word


def _field_values(words: np.ndarray, end: np.ndarray, length: np.ndarray, base: int):
    """(uint64 value in `base`, whether all its bytes are digits in `base`) of the fields (any shape) of `length`
    <= _MAX_DIGITS digits ending at `end`. `words[i]` is the big-endian uint64 of digit values i .. i + 7, which
    start with _MAX_DIGITS zeros, so that no field's words start before them."""
    value = np.zeros(end.shape, np.uint64)
    valid = np.ones(end.shape, bool)
    for words_after in reversed(range(-(-int(length.max()) // _WORD))):
        word = words[end - _WORD * (words_after + 1)].astype(np.uint64)
        word &= _KEEP_LAST_BYTES[np.clip(length - _WORD * words_after, 0, _WORD)]  # the bytes before the field: 0
        # A byte above 15 has high bits; with 16 - base added (no carry out of a byte below 16), one >= base has too.
        valid &= ((word | (word + (16 - base) * _EACH_BYTE)) & _HIGH_NIBBLES) == 0
        value = value * base**_WORD + _word_value(word, base)
    return value, valid


def _parse_canonical(lines: list[str], num_rows: Sequence[int]):
    """(labels float32 [B], counts float64 [B, 13], ids int64 [B, 26] with -1 for missing) of `lines` parsed
    at once, as `_parse_line` parses each; None if any line is not in the canonical form (module docstring)."""
    # A non-ASCII character is bytes >= 128 in UTF-8: no digit, tab or newline.
    buffer = np.frombuffer("".join(lines).encode("utf-8"), dtype=np.uint8)
    separators = np.flatnonzero((buffer == ord("\t")) | (buffer == ord("\n")))
    # Every line has 39 tabs, then its newline: separator k of each line's 40 is a newline iff k = 39. (A file's
    # last line may lack its newline: its batch then goes line by line.)
    if len(separators) != len(lines) * _NUM_COLUMNS:
        return None
    newline = buffer[separators].reshape(len(lines), _NUM_COLUMNS) == ord("\n")
    if not (newline[:, -1].all() and not newline[:, :-1].any()):
        return None
    end = separators.reshape(len(lines), _NUM_COLUMNS)
    start = np.concatenate(([0], separators[:-1] + 1)).reshape(len(lines), _NUM_COLUMNS)
    length = end - start

    label = buffer[start[:, 0]]
    if not ((length[:, 0] == 1) & ((label == ord("0")) | (label == ord("1")))).all():
        return None

    digits = np.concatenate((np.zeros(_MAX_DIGITS, np.uint8), np.take(_DIGIT_VALUE, buffer)))
    words = np.ndarray((len(digits) - _WORD + 1,), dtype=">u8", buffer=digits, strides=(1,))
    end = end + _MAX_DIGITS  # in `digits`

    dense = slice(1, 1 + CRITEO_NUM_DENSE)
    negative = buffer[start[:, dense]] == ord("-")  # an empty field's first byte is its separator: not "-"
    dense_digits = length[:, dense] - negative
    if dense_digits.max() > _MAX_DIGITS or ((dense_digits == 0) & negative).any():  # "-" alone is no count
        return None
    counts, valid = _field_values(words, end[:, dense], dense_digits, 10)
    if not valid.all():
        return None
    counts = counts.astype(np.float64)  # < 10**16: rounded as float(int) rounds
    counts[negative] = 0

    sparse = slice(1 + CRITEO_NUM_DENSE, None)
    if length[:, sparse].max() > _MAX_DIGITS:
        return None
    hashes, valid = _field_values(words, end[:, sparse], length[:, sparse], 16)
    if not valid.all():
        return None
    # uint64 throughout: values >= 2**63 are taken mod num_rows exactly as Python's int does (numpy would turn
    # uint64 with int64 into float64).
    ids = (hashes % np.asarray(num_rows, dtype=np.uint64)).astype(np.int64)
    ids[length[:, sparse] == 0] = -1
    return (label == ord("1")).astype(np.float32), counts, ids


class CriteoTSV:
    """Iterate this rank's slices of the global batches of Criteo TSV files (plain or ``.gz``).

    Global batches are consecutive runs of ``global_batch_size`` lines over the concatenated
    ``paths``; this rank yields lines ``local_batch_bounds(...)`` of each. The final short global
    batch is split the same way; it is dropped if ``drop_last`` or if it has fewer lines than
    ``world_size``, so that every rank yields the same number of batches.

    Dense features are ``log(1 + max(count, 0))`` (missing -> 0) as float32. Each categorical
    feature is a bag of one id ``int(hex, 16) % num_rows[f]``, or an empty bag when missing.
    The dense transform is the DLRM reference's (facebookresearch/dlrm, MLPerf); torchrec's Criteo
    preprocessing differs: ``BinaryCriteoUtils.tsv_to_npys`` takes ``log(count - m + 2)`` (m: the file's
    smallest count, missing -> 0) and gives a missing categorical the id ``0 % num_rows[f]`` where this
    reader gives an empty bag (a zero pooled vector); its NVTabular scripts take ``log(count + 3)``.

    ``num_workers`` processes make the batches (None: `default_num_workers`; 0: this process).
    ``num_dense``: the dense features the model takes (data.num_dense), refused unless Criteo's 13.
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
        num_workers: int | None = None,
        num_dense: int = CRITEO_NUM_DENSE,
    ) -> None:
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        self.paths = [os.fspath(p) for p in paths]
        if not self.paths:
            raise ArgumentError("paths", f"must name at least one Criteo file, got {self.paths}")
        for path in self.paths:
            if os.path.isdir(path):  # a day's folder given for its files: it exists, "not found" would mislead
                raise IsADirectoryError(f"Criteo path {path} is a directory: give its files "
                                        "(paths=[day_0, day_1, ...])")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"Criteo file not found: {path}")
        self.num_rows = [int(n) for n in num_rows]
        if len(self.num_rows) != CRITEO_NUM_SPARSE:
            raise ArgumentError(
                "num_rows", f"must have {CRITEO_NUM_SPARSE} entries (one per Criteo categorical feature), "
                f"got {len(self.num_rows)}"
            )
        if any(not 1 <= n < 2**63 for n in self.num_rows):  # ids are int64 (and taken mod num_rows as uint64)
            raise ArgumentError("num_rows", f"must all be in [1, 2**63), got {self.num_rows}")
        if num_dense != CRITEO_NUM_DENSE:  # else a shape mismatch in the dense arch, at the first step
            raise ArgumentError("num_dense", f"must be {CRITEO_NUM_DENSE} (Criteo lines hold {CRITEO_NUM_DENSE} dense "
                                             f"counts), got {num_dense}")
        self.feature_names = list(CRITEO_SPARSE_FEATURES if feature_names is None else feature_names)
        if len(self.feature_names) != CRITEO_NUM_SPARSE:
            raise ArgumentError("feature_names",
                                f"must have {CRITEO_NUM_SPARSE} entries, got {len(self.feature_names)}")
        local_batch_bounds(global_batch_size, rank, world_size)  # validates the split
        self.global_batch_size = global_batch_size
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        self.num_workers = default_num_workers() if num_workers is None else num_workers
        # YAML's true is an int (bool subclasses it): it would run 1 worker, not the default count
        if isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int) or self.num_workers < 0:
            raise ArgumentError("num_workers", f"must be an integer >= 0 (0: no worker processes), got {num_workers!r}")
        # Files too short for one batch would yield none, found only where they are first read (an evaluation's:
        # after trainer.eval_every steps); their first lines tell now.
        needed = global_batch_size if drop_last else world_size
        found = sum(1 for _ in islice(self._lines(), needed))
        if found < needed:
            raise ValueError(f"Criteo files {', '.join(self.paths)} hold {found} lines, fewer than one batch takes: "
                             f"{needed} ({'a whole global batch: drop_last' if drop_last else 'one per rank'})")

    def file_sizes(self) -> list[int]:
        """Each file's size in bytes. Every rank reads the whole files and takes its slice of each global batch:
        ranks on other nodes read their own copies, which must be the same files (build_dataset compares these),
        else one rank's batches end first and its peers wait for it in the next collective."""
        return [os.path.getsize(path) for path in self.paths]

    def _lines(self) -> Iterator[tuple[str, int, str]]:
        """(path, 1-based line number, line) over all files in order."""
        for path in self.paths:
            line_number = 0
            try:
                with _open_text(path) as f:
                    for line_number, line in enumerate(f, start=1):
                        yield path, line_number, line
            # a truncated .gz (EOFError), a corrupt one (zlib.error), a byte that is not UTF-8: say where
            except (OSError, EOFError, zlib.error, UnicodeDecodeError) as error:
                raise ValueError(f"{path}: cannot read past line {line_number}: {error}") from error

    def __iter__(self) -> Iterator[Batch]:
        return self.skipping(0)

    def skipping(self, batches: int) -> Iterator[Batch | None]:
        """One pass over the files as iter(self) makes it, its first `batches` batches read but not made: None in
        their place. A resume finds its step so (train/build.py's batch_stream): parsing a line costs ~10x reading
        it, and a step deep into a day of Criteo lies behind millions of lines.

        With workers, the DataLoader hands out their batches in turn, so in order; an error raised making a batch
        (a malformed line) is raised here as raised there, at that batch."""
        made = (DataLoader(_WorkerShare(self, batches), batch_size=None, num_workers=self.num_workers,
                           collate_fn=_as_sent) if self.num_workers else self._arrays_of_batches(batches))
        for arrays in made:
            if isinstance(arrays, Exception):  # a worker's, in the place of its batch
                raise arrays
            yield None if arrays is None else self._batch(*arrays)

    def _arrays_of_batches(self, skipped: int, worker: int = 0, workers: int = 1) -> Iterator[tuple | None]:
        """`_arrays` of batches `worker`, `worker + workers`, ... of `skipping(skipped)` (None for those skipped);
        the lines of all read, to find them."""
        lines = self._lines()
        for index in count():
            # Lines of other ranks, of other workers' batches and of the batches skipped are only read, not parsed.
            global_batch = list(islice(lines, self.global_batch_size))
            if len(global_batch) < self.global_batch_size:
                if self.drop_last or len(global_batch) < self.world_size:
                    return
            if index % workers != worker:
                continue
            if index < skipped:
                yield None
                continue
            start, stop = local_batch_bounds(len(global_batch), self.rank, self.world_size)
            yield self._arrays(global_batch[start:stop])

    def _arrays(self, lines: list[tuple[str, int, str]]) -> tuple[np.ndarray, ...]:
        """The batch of `lines` as numpy arrays (labels, dense features, KJT values, whether each bag has its id):
        what a worker sends, pickled by value (torch tensors would each pass a file descriptor: ~1 ms of the
        receiver's time a batch), in small types (int32 ids where every table allows, a bool per bag: half the
        bytes and a third of the transfer time of int64 ids and int32 lengths)."""
        parsed = _parse_canonical([line for _, _, line in lines], self.num_rows)
        if parsed is None:  # a line off the canonical form: int() decides, line by line, and names a bad one
            parsed = self._parse_each(lines)
        labels, counts, ids = parsed
        dense_features = torch.from_numpy(counts).log1p().float()
        # [B, 26] -> key-major [26, B]: KJT lengths/values list all samples of feature 0 first.
        ids = torch.from_numpy(ids).t()
        present = ids >= 0
        values = ids[present].to(torch.int32 if max(self.num_rows) <= 2**31 else torch.int64)
        return labels, dense_features.numpy(), values.numpy(), present.flatten().numpy()

    def _batch(self, labels: np.ndarray, dense_features: np.ndarray, values: np.ndarray, present: np.ndarray
               ) -> Batch:
        return Batch(
            dense_features=torch.from_numpy(dense_features),
            sparse_features=KeyedJaggedTensor.from_lengths_sync(
                keys=self.feature_names, values=torch.from_numpy(values).long(),
                lengths=torch.from_numpy(present).int()),
            labels=torch.from_numpy(labels),
        )

    def _parse_each(self, lines: list[tuple[str, int, str]]):
        """`_parse_canonical`'s arrays, made by `_parse_line`; a line it refuses is named with its file and line."""
        labels, dense, sparse = [], [], []
        for path, line_number, line in lines:
            try:
                label, dense_row, sparse_row = _parse_line(line, self.num_rows)
            except ValueError as e:
                raise ValueError(f"{path}:{line_number}: malformed Criteo line: {e}") from None
            labels.append(label)
            dense.append(dense_row)
            sparse.append(sparse_row)
        return np.array(labels, np.float32), np.array(dense, np.float64), np.array(sparse, np.int64)


def _as_sent(arrays):
    """The DataLoader's collate_fn: a worker's batch as it made it (the default turns numpy arrays into tensors)."""
    return arrays


class _WorkerShare(IterableDataset):
    """A DataLoader worker's batches of `reader.skipping(skipped)`: every num_workers-th from its id. An error
    raised making one comes in its place, as it is (the DataLoader would raise a copy, its message a traceback)."""

    def __init__(self, reader: CriteoTSV, skipped: int) -> None:
        self.reader, self.skipped = reader, skipped

    def __iter__(self) -> Iterator[Batch | None | Exception]:
        worker = get_worker_info()
        try:
            yield from self.reader._arrays_of_batches(self.skipped, worker.id, worker.num_workers)
        except Exception as error:  # noqa: BLE001: raised by skipping, in the main process
            yield error
