"""Input distribution: each rank's KeyedJaggedTensor (its local batch, every feature) -> each owner's bags.

After it, every rank holding a table (or a column shard of one: plan.py) holds the bags of that table's features
for every sample of the global batch, in source-rank order (rank 0's samples first); a feature whose table is cut
into column shards travels to each shard's rank, one whose table is cut into row blocks is cut first, each block's
indices going to its rank only (sparse/row_wise.py). Bulk-synchronous, with torch.distributed:
  1. a header all-to-all: local batch size, what is wrong with the batch (missing or repeated keys, values that
     disagree with the lengths or the per-sample weights, out-of-range indices, or no batch at all: this rank could
     not make it), whether per-sample weights travel, and the value count of each feature per destination (sizes
     must be known on the host);
  2. one all-to-all of lengths and values (3. per-sample weights, when the batches have them: every rank's or
     none, else every rank raises before it).
One host sync: the header sent and the header received, read together. Everything else stays on the device: the
regroups before and after the exchange are one kernel each on GPUs (kernels/segment_gather.py; not a split + cat
per feature, whose host time grows with the feature count), and the checks of the batch ride in the header, so
that a bad batch raises on every rank at the same point instead of leaving the others waiting in a collective.
So does a batch that one rank could not make (a malformed file line, a read error): that rank starts the input
dist with the error in the batch's place (`start_failed`), its header says it has no batch, and `finish` raises
on every rank (there the error itself, elsewhere one naming the rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import torch
import torch.distributed as dist
from torchrec import KeyedJaggedTensor

from fused_dlrm.dist.alltoall import all_to_all_v, exchange_counts
from fused_dlrm.dist.host_copy import PendingHostCopy
from fused_dlrm.kernels import dtype_code
from fused_dlrm.kernels.batch_header import (BAD_KEYS, BATCH, EXTRA_VALUES, FIRST_COUNT, INDEX_DTYPES, INDICES,
                                             NO_BATCH, NOT_READ, OUT_OF_RANGE, WEIGHT_DTYPES, WEIGHTS, batch_header,
                                             dtype_described, out_of_range, tensor_dtype_code, value_keys)
from fused_dlrm.kernels.segment_gather import gather_segments
from fused_dlrm.sparse.plan import RowBlock
from fused_dlrm.sparse.row_wise import RowBuckets


@dataclass
class OwnedBags:
    """The bags of the features one rank owns, over the global batch (CSR, feature-major)."""

    features: list[str]
    values: torch.Tensor  # [N] int64: feature 0's bags for all samples, then feature 1's, ...
    lengths: torch.Tensor  # [num_features, global_batch] bag sizes
    weights: torch.Tensor | None  # [N] per-sample weights, or None
    feature_value_offsets: list[int]  # host: feature f's values are values[o[f]:o[f+1]]
    batch_sizes: list[int]  # local batch size of every source rank; their sum is the global batch
    # [local batch, mean-pooled row-wise features]: this rank's own samples' bag sizes, which divide the sums of
    # their row blocks' parts (row_wise.RowBlockSum); None without such features
    pooling_divisors: torch.Tensor | None = None
    _csr_offsets: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    # The lookup's backward plan of these bags, when made ahead (PooledEmbeddingLookup.plan_backward): it needs
    # only the bags, so the batch thread makes it and the backward does not.
    backward_plan: object | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def global_batch(self) -> int:
        return sum(self.batch_sizes)

    def csr_offsets(self) -> torch.Tensor:
        """[num_features * global_batch + 1] start of every bag in `values` (feature-major), as kernels take it;
        computed once per batch (the forward and a re-run forward share it)."""
        if self._csr_offsets is None:
            offsets = torch.zeros(self.lengths.numel() + 1, dtype=torch.int64, device=self.values.device)
            torch.cumsum(self.lengths.reshape(-1), 0, out=offsets[1:])
            self._csr_offsets = offsets
        return self._csr_offsets

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Made on another stream (a side stream, a thread's), read on `stream`: keep the allocator off every
        tensor of these bags (and of what was made of them ahead) until `stream`'s work so far is done."""
        for t in (self.values, self.lengths, self.weights, self.pooling_divisors, self._csr_offsets):
            if t is not None:
                t.record_stream(stream)
        if self.backward_plan is not None:
            self.backward_plan.record_stream(stream)

    def feature_bags(self, f: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(values, lengths, weights) of the f-th owned feature."""
        a, b = self.feature_value_offsets[f], self.feature_value_offsets[f + 1]
        weights = None if self.weights is None else self.weights[a:b]
        return self.values[a:b], self.lengths[f], weights


@dataclass
class _KeyPlan:
    """What one KJT key order needs, on the device, built once: the send regroup and the header's layout."""
    perm: torch.Tensor | None  # the keys in rank-grouped order, None when the KJT already has that order
    header_keys: torch.Tensor  # [world, width]: the key of each destination's feature f (num_keys: zero padding)
    rows: torch.Tensor  # [num_keys]: the table size behind each key (valid indices are [0, rows))
    recv_order: torch.Tensor  # received (source, feature) segments in (feature, source) order
    # With row-wise tables: the cut of the KJT (perm and header_keys are then over its keys), and a header_keys of
    # padding only, for the checks of the uncut batch
    buckets: RowBuckets | None = None
    no_keys: torch.Tensor | None = None


@dataclass
class _Sent:
    """A batch as it travels: the KJT's tensors, or those of its cut by row block (sparse/row_wise.py)."""
    values: torch.Tensor
    lengths: torch.Tensor  # [keys, local batch] int64
    counts: torch.Tensor  # values per key
    weights: torch.Tensor | None


def raised_on_every_rank(error: BaseException) -> bool:
    """Whether `error` is a bad or missing batch's, which `finish` raised on every rank at the same batch (the
    exchanged headers decide it): the ranks' collectives are still in step, so a caller may run more of them (the
    loop: the step before's cadence) before raising it. Any other error may be this rank's alone."""
    return getattr(error, "raised_on_every_rank", False)


@dataclass
class PendingHeader:
    """A batch whose header all-to-all is under way (`BulkInputDist.start`, or `start_failed`: no KJT, the error
    raised making it): what `finish` needs of it."""

    kjt: KeyedJaggedTensor | None
    plan: _KeyPlan | None
    problem: str  # what is wrong with the KJT's keys (BAD_KEYS), lengths' shape, weights' count (EXTRA_VALUES), or ''
    counts: torch.Tensor | None  # values per key of the KJT (its errors are reported on it)
    sent: _Sent | None  # what travels: the KJT's, or its cut
    pooling_divisors: torch.Tensor | None  # OwnedBags.pooling_divisors
    recv: torch.Tensor  # the headers received, on the device
    both: PendingHostCopy  # the headers sent and received, on their way to the host
    failure: Exception | None = None  # start_failed's: why this rank has no batch (NO_BATCH), raised by `finish`


class BulkInputDist:
    """Input distribution with torch.distributed all-to-alls (gloo on CPU, NCCL on GPU).

    features_of_rank[r]: the features rank r receives, in its lookup's order (a feature may go to several ranks,
    and to one rank several times: once per column shard of its table there); tables: for every feature, (table
    name, rows). A KJT may hold keys that no table reads, in any order, as torchrec's EmbeddingBagCollection reads
    its own features of a KJT that may feed other modules too: they are checked with the batch (values against
    lengths) but neither sent nor held against a table. A KJT without one of the tables' features, or with a key
    twice, raises KeyError, one whose values disagree with its lengths or its per-sample weights, whose values or
    weights are not one-dimensional, whose batch size varies by feature (torchrec's variable batch), or whose
    values, lengths or weights are on another device than the collection ValueError, and indices outside [0, rows)
    IndexError: on every rank; so do per-sample weights
    that some ranks' KJTs have and others' lack (ValueError; `is_weighted`), and weights that require grad in grad mode
    (no gradient reaches them: a feature processor's would never train; ValueError). A batch that a rank could
    not make (`start_failed`) raises its error there and RuntimeError on the other ranks."""

    def __init__(self, features_of_rank: list[list[str]], tables: dict[str, tuple[str, int]],
                 group: dist.ProcessGroup | None = None, row_blocks: dict[str, list[RowBlock]] | None = None,
                 mean_row_wise: Sequence[str] = (), is_weighted: bool | None = None, *,
                 device: torch.device | str):
        """row_blocks: the row-wise features' blocks (plan.row_blocks; the ranks receive the blocks' features);
        mean_row_wise: those whose bag sizes the bags carry (OwnedBags.pooling_divisors), in that order;
        is_weighted: the per-sample weights the tables take, as torchrec's EmbeddingBagCollection(is_weighted=):
        True, every KJT must have them; False, they are ignored (not sent); None, a batch's weights are sent when
        the KJTs have them, and every rank's must then have them; device: the collection's, where the headers are
        made and every KJT must be ("cuda": the current GPU, as tensors made there)."""
        self.features_of_rank = features_of_rank
        device = torch.device(device)
        self.device = torch.device("cuda", torch.cuda.current_device()) if device == torch.device("cuda") else device
        self.tables = tables
        self.group = group
        self.is_weighted = is_weighted
        self.row_blocks, self.mean_row_wise = row_blocks or {}, list(mean_row_wise)
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.send_order = [f for feats in features_of_rank for f in feats]  # rank-grouped feature order
        self.width = max(len(feats) for feats in features_of_rank)
        self._plans: dict[tuple, _KeyPlan] = {}

    def _plan(self, keys: list[str], device: torch.device) -> tuple[_KeyPlan | None, str]:
        """(the plan of this key order, '') or (None, why these keys cannot be distributed). Checked and built
        once per key order: the check alone costs ~0.1 ms of host time per batch at 128 features."""
        plan = self._plans.get((tuple(keys), device))
        if plan is not None:
            return plan, ""
        unknown = sorted(set(keys) - set(self.tables))  # read by no table: not sent (see the class docstring)
        missing = sorted(set(self.tables) - set(keys))
        repeated = sorted({k for k in keys if keys.count(k) > 1})
        if missing or repeated:
            return None, (f"KeyedJaggedTensor keys do not match the tables' features: unknown {unknown}, missing "
                          f"{missing}" + (f", repeated {repeated}" if repeated else ""))
        buckets = RowBuckets.of(keys, self.row_blocks, self.mean_row_wise, device) if self.row_blocks else None
        sent_keys = keys if buckets is None else buckets.keys
        index = {k: i for i, k in enumerate(sent_keys)}
        perm = [index[f] for f in self.send_order]
        header = [[index[f] for f in feats] + [len(sent_keys)] * (self.width - len(feats))
                  for feats in self.features_of_rank]
        # Built once per key order: a host list turned into a device tensor is a copy that waits for the GPU.
        # Received values are (source, feature)-major; the lookup wants (feature, source)-major.
        mine, world = len(self.features_of_rank[self.rank]), len(self.features_of_rank)
        recv_order = [s * mine + f for f in range(mine) for s in range(world)]
        plan = _KeyPlan(perm=None if perm == list(range(len(sent_keys))) else torch.tensor(perm, device=device),
                        header_keys=torch.tensor(header, device=device),
                        rows=torch.tensor([self.tables[k][1] if k in self.tables else NOT_READ for k in keys],
                                          device=device),
                        recv_order=torch.tensor(recv_order, device=device), buckets=buckets,
                        no_keys=None if buckets is None else torch.full((world, self.width), len(keys), device=device))
        self._plans[(tuple(keys), device)] = plan
        return plan, ""

    def __call__(self, kjt: KeyedJaggedTensor) -> OwnedBags:
        return self.finish(self.start(kjt))

    def sent_keys(self, kjt: KeyedJaggedTensor) -> tuple[list[str], torch.Tensor]:
        """The keys and lengths [keys, local batch] of `kjt` as they travel: cut by row block where tables are
        row-wise (each block's key goes to its rank only), else the KJT's own (what a report counts)."""
        keys, lengths = list(kjt.keys()), kjt.lengths().view(len(kjt.keys()), kjt.stride()).long()
        plan, problem = self._plan(keys, kjt.values().device)
        if plan is None:
            raise KeyError(problem)
        if plan.buckets is None:
            return keys, lengths
        return plan.buckets.keys, plan.buckets.cut(kjt.values(), lengths, None)[1]

    def start(self, kjt: KeyedJaggedTensor) -> PendingHeader:
        """The header all-to-all of a batch, and its copy to the host, enqueued; nothing waits. `finish` does the
        rest, on the same stream, any time later: a batch's header can be exchanged a step before its values."""
        device = self.device  # not the KJT's: a header on another device than its peers' could not travel
        keys, values, local_batch = list(kjt.keys()), kjt.values(), kjt.stride()
        plan, problem = self._plan(keys, device)
        weights = None if self.is_weighted is False else kjt.weights_or_none()
        elsewhere = [(what, t.device) for what, t in (("values", values), ("lengths", kjt.lengths()),
                                                      ("per-sample weights", weights))
                     if t is not None and t.device != device]
        # a column [N, 1] would broadcast in the header's checks and fail in its owners' lookups alone
        not_flat = [f"{what} are of shape {list(t.shape)}" for what, t in (("values", values),
                                                                         ("per-sample weights", weights))
                    if t is not None and t.dim() != 1]
        if plan is not None and elsewhere:
            problem = (f"the KeyedJaggedTensor's {elsewhere[0][0]} are on {elsewhere[0][1]}, the sharded collection "
                       f"on {device}: move the batch to {device} (KeyedJaggedTensor.to)")
        elif plan is not None and kjt.variable_stride_per_key():
            problem = (f"the KeyedJaggedTensor has a variable batch size per feature (torchrec's variable batch, "
                       f"stride_per_key {kjt.stride_per_key()}), which the sharded collection does not take: every "
                       "feature needs one bag per sample")
        elif plan is not None and not_flat:
            problem = f"the KeyedJaggedTensor's {not_flat[0]}, not one dimension (one per value)"
        elif plan is not None and kjt.lengths().numel() != len(keys) * local_batch:
            problem = (f"the KeyedJaggedTensor has {kjt.lengths().numel()} lengths for {len(keys)} keys x stride "
                       f"{local_batch}")
        elif plan is not None and weights is not None and weights.numel() != values.numel():
            # the weights' regroups and all-to-all are sized by the values: caught here, not on this rank alone
            problem = f"the KeyedJaggedTensor has {weights.numel()} per-sample weights for {values.numel()} values"
        elif plan is not None and weights is not None and weights.requires_grad and torch.is_grad_enabled():
            # the lookup passes no gradient to the weights (stock torchrec's does): they would never train
            problem = ("the KeyedJaggedTensor's per-sample weights require grad (a feature processor's, as in a "
                       "FeatureProcessedEmbeddingBagCollection), but the sharded collection passes no gradient to "
                       "them: shard that module with torchrec's FeatureProcessedEmbeddingBagCollectionSharder, or "
                       "make the weights without autograd")
        counts = sent = divisors = None
        if problem:  # a header that only says what is wrong, as every rank must send one
            header = self._flag_header(BAD_KEYS if plan is None else EXTRA_VALUES)
        else:
            lengths = kjt.lengths().view(len(keys), local_batch).long()
            counts = lengths.sum(dim=1)  # values per key
            sent = _Sent(values, lengths, counts, weights)
            if plan.buckets is None:  # one kernel on GPUs
                header = batch_header(values, counts, plan.rows, plan.header_keys, local_batch,
                                      tensor_dtype_code(weights))
            else:  # the checks of the uncut batch, the counts of its cut
                header = batch_header(values, counts, plan.rows, plan.no_keys, local_batch, tensor_dtype_code(weights))
                cut_values, cut_lengths, cut_weights = plan.buckets.cut(values, lengths, sent.weights)
                cut_counts = cut_lengths.sum(dim=1)
                header[:, FIRST_COUNT:] = torch.cat([cut_counts, cut_counts.new_zeros(1)])[plan.header_keys]
                sent = _Sent(cut_values, cut_lengths, cut_counts, cut_weights)
                divisors = plan.buckets.pooling_divisors(lengths)
            # a negative length can leave the sum of lengths equal to the value count: flagged as a disagreement
            header[:, EXTRA_VALUES].abs_().add_((lengths < 0).any())
        recv, both = self._exchange(header)
        return PendingHeader(kjt, plan, problem, counts, sent, divisors, recv, both)

    def start_failed(self, error: Exception) -> PendingHeader:
        """`start` for a batch this rank could not make (`error`, raised making it: a malformed line, a read error)
        while the other ranks made theirs and start its input dist: a header that says this rank has no batch takes
        the batch's place in the all-to-all, and `finish` raises `error` here and an error naming this rank on the
        others, instead of leaving them waiting for a header that never comes."""
        recv, both = self._exchange(self._flag_header(NO_BATCH))
        return PendingHeader(kjt=None, plan=None, problem="", counts=None, sent=None, pooling_divisors=None,
                             recv=recv, both=both, failure=error)

    def _flag_header(self, column: int) -> torch.Tensor:
        """A header that only says what is wrong (`column` set), for a batch that cannot travel."""
        header = torch.zeros(len(self.features_of_rank), FIRST_COUNT + self.width, dtype=torch.int64,
                             device=self.device)
        header[:, column] = 1
        return header

    def _exchange(self, header: torch.Tensor) -> tuple[torch.Tensor, PendingHostCopy]:
        """The header all-to-all enqueued: the headers received, and those sent and received on their way to the
        host (`finish` waits for this copy only)."""
        recv = exchange_counts(header, self.group)
        return recv, PendingHostCopy(torch.cat([header, recv]))

    def finish(self, pending: PendingHeader) -> OwnedBags:
        """The rest of `start`'s batch: its checks, then lengths, values and weights exchanged and regrouped."""
        world = len(self.features_of_rank)
        both = pending.both.get().tolist()  # the host sync (none left when the copy has long ended)
        sent_header, recv_header = both[:world], both[world:]
        try:
            self._raise_for_bad_input(recv_header, pending)
        except Exception as error:
            error.raised_on_every_rank = True  # (the headers decided it, alike on every rank: `raised_on_every_rank`)
            raise
        kjt, plan, recv, local_batch = pending.kjt, pending.plan, pending.recv, pending.kjt.stride()
        sent = pending.sent
        values, lengths, counts, weights = sent.values, sent.lengths, sent.counts, sent.weights

        mine = self.features_of_rank[self.rank]
        batch_sizes = [row[BATCH] for row in recv_header]
        counts_from = [row[FIRST_COUNT:FIRST_COUNT + len(mine)] for row in recv_header]  # [source][feature]
        values_to = [sum(row[FIRST_COUNT:]) for row in sent_header]
        values_from = [sum(row) for row in counts_from]

        # Regroup the key-major KJT so each destination's features are one contiguous run.
        send_lengths, send_values, send_weights = lengths, values, weights
        if plan.perm is not None:
            send_lengths = lengths[plan.perm]
            total = sum(values_to)
            send_values = gather_segments(values, counts, plan.perm, total)
            send_weights = None if send_weights is None else gather_segments(send_weights, counts, plan.perm, total)

        # Lengths and values in one all-to-all (a collective's host time less per batch): each destination's
        # lengths (in the values' dtype for the trip), then its values.
        send_length_splits = [len(feats) * local_batch for feats in self.features_of_rank]
        recv_length_splits = [len(mine) * b for b in batch_sizes]
        send = torch.cat([part for pair in zip(send_lengths.reshape(-1).to(send_values.dtype).split(send_length_splits),
                                               send_values.split(values_to)) for part in pair])
        received = all_to_all_v(send, [a + b for a, b in zip(send_length_splits, values_to)],
                                [a + b for a, b in zip(recv_length_splits, values_from)], self.group)
        parts = received.split([n for pair in zip(recv_length_splits, values_from) for n in pair])
        recv_values = torch.cat(parts[1::2])
        recv_weights = None if send_weights is None else all_to_all_v(send_weights, values_to, values_from, self.group)
        if recv_weights is not None:  # the GPU kernels read weight i at ptr + i; in a world of one without a
            recv_weights = recv_weights.contiguous()  # regroup a KJT's strided weights come here as they are

        per_source_lengths = [chunk.view(len(mine), b) for chunk, b in zip(parts[0::2], batch_sizes)]
        owned_lengths = torch.cat(per_source_lengths, dim=1).to(lengths.dtype)
        values, weights = recv_values, recv_weights
        if world > 1 and len(mine) > 1:  # with one source or one feature the two orders are the same
            received = recv[:, FIRST_COUNT:FIRST_COUNT + len(mine)].reshape(-1)  # (source, feature) segments
            values = gather_segments(recv_values, received, plan.recv_order, recv_values.numel())
            weights = None if recv_weights is None else gather_segments(recv_weights, received, plan.recv_order,
                                                                        recv_values.numel())
        offsets = list(accumulate((sum(per_source) for per_source in zip(*counts_from)), initial=0))  # [feature]
        return OwnedBags(features=mine, values=values, lengths=owned_lengths, weights=weights,
                         feature_value_offsets=offsets, batch_sizes=batch_sizes,
                         pooling_divisors=pending.pooling_divisors)

    def _raise_for_bad_input(self, recv_header: list[list[int]], pending: PendingHeader) -> None:
        """Every rank raises when any rank's batch is bad or missing (the header carries each source's verdict): the
        rank whose batch it is says what is wrong with it (a missing one: the error raised making it), the others
        name that rank (the same kind of error for a bad batch, RuntimeError for a missing one); then the weights'
        checks (`_raise_for_weights`)."""
        kjt, problem, counts, plan = pending.kjt, pending.problem, pending.counts, pending.plan
        for column, error, what in (
                (NO_BATCH, RuntimeError, "could not make their batch"),
                (BAD_KEYS, KeyError, "sent KeyedJaggedTensors whose keys do not match the tables"),
                (EXTRA_VALUES, ValueError, "sent KeyedJaggedTensors whose values, lengths or weights disagree"),
                (OUT_OF_RANGE, IndexError, "sent out-of-range indices")):
            bad = [s for s, row in enumerate(recv_header) if row[column]]
            if not bad:
                continue
            if self.rank not in bad:
                raise error(f"rank {self.rank}: rank(s) {bad} {what} (their error says more)")
            if column == NO_BATCH:
                raise pending.failure
            if column == BAD_KEYS or (column == EXTRA_VALUES and problem):
                raise error(f"rank {self.rank}: {problem}")
            values = kjt.values()
            if column == EXTRA_VALUES and (kjt.lengths() < 0).any():
                key, sample = (int(i) for i in (kjt.lengths().view(len(kjt.keys()), -1) < 0).nonzero()[0])
                raise error(f"rank {self.rank}: feature '{kjt.keys()[key]}' has a negative length "
                            f"{int(kjt.lengths().view(len(kjt.keys()), -1)[key, sample])} at sample {sample}")
            if column == EXTRA_VALUES:
                raise error(f"rank {self.rank}: the KeyedJaggedTensor has {values.numel()} values but its lengths "
                            f"sum to {int(counts.sum())}")
            keys = value_keys(values, counts)
            i = int(out_of_range(values, plan.rows[keys]).nonzero()[0])
            key = kjt.keys()[int(keys[i])]
            table, rows = self.tables[key]
            raise error(f"rank {self.rank}: feature '{key}' has index {int(values[i])}, outside table '{table}' "
                        f"of {rows} rows")
        self._raise_for_dtypes([int(row[INDICES]) for row in recv_header], INDEX_DTYPES, "indices")
        self._raise_for_weights([int(row[WEIGHTS]) for row in recv_header])

    def _raise_for_weights(self, codes: list[int]) -> None:
        """Every rank raises, before the weights' all-to-all (which a rank without weights would not join, and whose
        buffers every rank sizes in its own dtype), when a weighted collection gets a KJT without weights (that rank
        says so, the others name it); with is_weighted=None, when some ranks' KJTs have weights and others' not (no
        rank is wrong alone: every rank names both sides); or when the weights that travel differ in dtype, or are
        not floating point. codes: each source's header's WEIGHTS code (`tensor_dtype_code`)."""
        without = [s for s, code in enumerate(codes) if not code]
        if without and not (len(without) == len(codes) and not self.is_weighted):
            weighted = "the EmbeddingBagCollection is weighted (is_weighted=True)"
            if self.is_weighted and self.rank in without:
                raise ValueError(f"rank {self.rank}: {weighted} but the KeyedJaggedTensor has no weights")
            if self.is_weighted:
                raise ValueError(f"rank {self.rank}: rank(s) {without} sent KeyedJaggedTensors without per-sample "
                                 f"weights, but {weighted} (their error says more)")
            raise ValueError(f"rank {self.rank}: rank(s) {[s for s, code in enumerate(codes) if code]} sent "
                             f"per-sample weights and rank(s) {without} did not: the EmbeddingBagCollection "
                             "(is_weighted=None) takes a batch's weights when every rank's KeyedJaggedTensor has "
                             "them (is_weighted=True requires them, False ignores them)")
        self._raise_for_dtypes(codes, WEIGHT_DTYPES, "weights")

    def _raise_for_dtypes(self, codes: list[int], dtypes: tuple[torch.dtype, ...], what: str) -> None:
        """Every rank raises, naming each rank's dtype, when the sources' `what` (their header's `dtype_code`, 0
        for none) differ in dtype or are of none of `dtypes`: their all-to-all sizes its buffers in each rank's own
        dtype."""
        if len(set(codes)) > 1 or not set(codes) <= {0, *(dtype_code(d) for d in dtypes)}:
            sent = ", ".join(f"rank {s}: {dtype_described(code, dtypes, what)}" for s, code in enumerate(codes))
            raise ValueError(f"rank {self.rank}: {what} must be of one of "
                             f"{', '.join(str(d).removeprefix('torch.') for d in dtypes)}, the same on every rank "
                             f"({sent})")
