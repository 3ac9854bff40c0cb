"""ShardedEmbeddingBagCollection: torchrec's EmbeddingBagCollection interface, tables sharded over ranks (table-wise,
column-wise or row-wise: plan.py).

forward(KeyedJaggedTensor of the local batch) -> KeyedTensor [local batch, sum of feature dims], in three seams
that the fused kernels replace: input dist (KJT all-to-all) -> lookup (owned tables, whole global batch) ->
output dist (pooled all-to-all), then, with row-wise tables, the sum of each sample's row blocks (row_wise.py).
The tables are updated by the lookup's backward (see lookup.py). state_dict and fused_optimizer are torchrec's
ShardedEmbeddingBagCollection's (sharded_state.py): a checkpoint loads under another plan or world size.

The input dist's entry points (bags_of, prefetch_header, prefetch, the batch thread's function) take a batch's KJT or,
for a batch this rank could not make, the error raised making it (`FeaturesOrError`): that rank's input dist then
sends a header saying it has no batch where the batch's would go (BulkInputDist.start_failed), so that every rank
raises at that batch instead of the others waiting in its all-to-alls.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor
from torchrec.distributed.comm_ops import get_gradient_division

from fused_dlrm.dist.env import input_stream
from fused_dlrm.sparse.fused_all_to_all import FusedCommConfig, build_fused_exchange
from fused_dlrm.sparse.input_dist import BulkInputDist, OwnedBags, PendingHeader
from fused_dlrm.sparse.lookup import PooledEmbeddingLookup, check_table, init_block
from fused_dlrm.sparse.optimizer import TableOptimizers, per_table
from fused_dlrm.sparse.output_dist import BulkOutputDist
from fused_dlrm.sparse.plan import FeatureSlice, Shard, TableShardingPlan, plan_sharding
from fused_dlrm.sparse.row_wise import RowBlockSum
from fused_dlrm.sparse.sharded_state import FusedTableOptimizer, TableShards, momentum_storage, shard_momenta


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def torchrec_gradient_scale(world_size: int) -> float:
    """torchrec's pooled all-to-all divides the gradient it returns to the owners by the world size
    (comm_ops.GRADIENT_DIVISION, on by default), so tables see the mean over ranks of the per-rank gradients; so do
    we, and a model keeps its training dynamics when it swaps sharders. The switch is read at every forward; the
    fused exchange applies the scale in its push, the bulk path in `divide_gradient_like_torchrec`."""
    return 1.0 / world_size if world_size > 1 and get_gradient_division() else 1.0


def divide_gradient_like_torchrec(values: torch.Tensor, world_size: int) -> torch.Tensor:
    """values, whose gradient is multiplied by `torchrec_gradient_scale` in the backward."""
    scale = torchrec_gradient_scale(world_size)
    return values if scale == 1.0 else _ScaleGradient.apply(values, scale)


# A batch's features, or the error that making the batch raised on this rank (the module docstring says why)
FeaturesOrError = KeyedJaggedTensor | Exception

_DTYPES = {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}


def table_seeds(tables: list[EmbeddingBagConfig], seed: int) -> dict[str, int]:
    """The seed of each table's initialisation (init_block): from its place in the config, not from the plan."""
    return {t.name: seed * 100_003 + i for i, t in enumerate(tables)}


def refuse_mixed_dtypes(plan: TableShardingPlan, tables: list[EmbeddingBagConfig]) -> None:
    """On GPUs a rank's lookup and embedding update are one launch each, over tables of one dtype: a plan that puts
    tables of two dtypes on one rank is refused here, on every rank (each checks every rank's shards), not at that
    rank's first batch while its peers wait for it in the output dist."""
    by_name = {t.name: t for t in tables}
    for rank in range(plan.world_size):
        dtypes = {by_name[s.table].data_type.name: s.table for s in plan.shards_of(rank)}
        if len(dtypes) > 1:
            raise ValueError(f"the plan puts tables of {len(dtypes)} dtypes on rank {rank} "
                             f"({', '.join(f'{t}: {d}' for d, t in sorted(dtypes.items()))}); on GPUs a rank's tables "
                             f"share one dtype: give the tables one data_type, or a plan that keeps the dtypes on "
                             f"separate ranks")


class ShardedEmbeddingBagCollection(nn.Module):
    def __init__(self, tables: list[EmbeddingBagConfig], optimizer: TableOptimizers,
                 device: torch.device | str = "cpu", group: dist.ProcessGroup | None = None,
                 plan: TableShardingPlan | None = None, seed: int = 0, comm: FusedCommConfig | None = None,
                 is_weighted: bool | None = None):
        """optimizer: one for every table, or each table's by name (its column shards and row blocks take it);
        plan: None for table-wise (plan_sharding's); comm: None for the bulk-synchronous path
        (torch.distributed all-to-alls), or the fused exchange's settings (CUDA only): lookup and output dist then
        run as one kernel that stores into peers' memory; is_weighted: whether the tables take per-sample weights,
        as torchrec's EmbeddingBagCollection(is_weighted=) (True: required, False: ignored), or None: a batch's
        weights are used when every rank's KJT has them (BulkInputDist)."""
        super().__init__()
        for t in tables:  # before anything is made of them
            check_table(t)
        optimizers = per_table(optimizer, [t.name for t in tables])
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.plan = plan or plan_sharding(tables, self.world_size)
        if self.plan.world_size != self.world_size:
            raise ValueError(f"plan is for {self.plan.world_size} ranks, the process group has {self.world_size}")
        self.plan.check(tables)
        if torch.device(device).type == "cuda":
            refuse_mixed_dtypes(self.plan, tables)
        self._configs = list(tables)
        self.feature_names = [f for t in tables for f in t.feature_names]
        shared = {f: [t.name for t in tables for g in t.feature_names if g == f] for f in self.feature_names
                  if self.feature_names.count(f) > 1}
        if shared:  # the input dist sends a feature's bags to its one table's shards
            raise ValueError("a feature may feed one table only (torchrec's shared features, output keys "
                             "'<feature>@<table>', are not supported): "
                             + "; ".join(f"{f!r} feeds tables {names}" for f, names in shared.items()))
        self._feature_dims = [t.embedding_dim for t in tables for _ in t.feature_names]

        slices = self.plan.feature_slices(tables)
        features_of_rank = [[s.feature for s in mine] for mine in slices]
        row_wise = self.plan.row_wise_columns(tables)
        # Row-wise tables: their blocks' parts of a pooled row travel in a wider row, summed after the output dist.
        self.row_block_sum = RowBlockSum(sum(self._feature_dims), row_wise) if row_wise else None
        device = self.device = torch.device(device)
        # On GPUs the input dist has a communicator of its own: NCCL runs one group's collectives in issue order,
        # so a prefetched batch's all-to-alls (and the host, which waits for their sizes) would queue behind the
        # running step's collectives instead of overlapping the step.
        self._group = group
        self.input_dist = BulkInputDist(features_of_rank, {f: (t.name, t.num_embeddings) for t in tables
                                                           for f in t.feature_names},
                                        self._own_group() if device.type == "cuda" else group,
                                        self.plan.row_blocks(tables), [c.feature for c in row_wise if c.mean],
                                        is_weighted, device=device)
        self._seeds = table_seeds(tables, seed)
        weights = {s.name: self._initial_shard(s) for s in self.plan.shards_of(self.rank)}
        # torchrec's `embedding_bags.<table>`, every table on every rank, holding this rank's shards of it; its
        # state_dict entry is the whole table's (sharded_state.py).
        self.embedding_bags = nn.ModuleDict({t.name: TableShards(t, [s for s in self.plan.shards if s.table == t.name],
                                                                 self.rank, weights, _DTYPES[t.data_type.name],
                                                                 group, device) for t in tables})
        self.shard_weights = {name: weight for t in self.embedding_bags.values()
                              for name, weight in t.shard_weights().items()}  # this rank's shards, by shard name
        momentum = momentum_storage(tables, self.plan, self.rank, optimizers, device)
        self.lookup = PooledEmbeddingLookup(self.plan.shard_configs(tables, self.rank),
                                            {n: w.data for n, w in self.shard_weights.items()},
                                            {s.name: optimizers[s.table] for s in self.plan.shards_of(self.rank)},
                                            device, {name: view for t in tables if t.name in momentum
                                                     for name, view in shard_momenta(t, self.plan, self.rank,
                                                                                     momentum[t.name]).items()})
        self.fused_optimizer = FusedTableOptimizer(tables, self.plan, self.rank, self.embedding_bags,
                                                   self.lookup.optimizer, momentum, group, device)
        self.output_dist = BulkOutputDist([[s.dim for s in mine] for mine in slices], _column_order(slices), group)
        self._prefetched: tuple[FeaturesOrError, object, torch.cuda.Event | None] | None = None
        self._from_thread: list[tuple[FeaturesOrError, object, torch.cuda.Event | None]] = []  # in batch order
        self._from_thread_lock = threading.Lock()
        self._pending_header: tuple[FeaturesOrError, object] | None = None
        self._side_stream = None
        self.global_batch_size = 0  # samples over all ranks in the last forward's batch (its input dist's header)
        self.fused = None
        if comm is not None:
            self.fused = build_fused_exchange(self.lookup, slices, comm, group, device)

    def _initial_shard(self, shard: Shard) -> torch.Tensor:
        """A shard's rows and columns of its table's initialisation, so that the plan does not change the model
        (unless the config has an init_fn of its own); init_block draws only the chunks of rows the shard overlaps,
        never a whole table cut into blocks."""
        table = next(t for t in self._configs if t.name == shard.table)
        return init_block(table, self._seeds[table.name], self.device, shard.row, shard.num_rows(table), shard.col,
                          shard.dim).to(_DTYPES[table.data_type.name])

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """This rank's shards back to their initialisation, in place (the lookup holds their storage); the optimizer
        state stays: as torchrec's ShardedEmbeddingBagCollection.reset_parameters."""
        for s in self.plan.shards_of(self.rank):
            self.shard_weights[s.name].copy_(self._initial_shard(s))

    def _own_group(self) -> dist.ProcessGroup | None:
        """A new communicator over this collection's ranks (made on every rank at the same point): one group's
        collectives run in the order they are issued, so the input dist's own lets its all-to-alls overlap the
        step's instead of queueing behind them. In a world of one, the collection's group (no collectives)."""
        if self.world_size == 1:
            return self._group
        return dist.new_group(dist.get_process_group_ranks(self._group or dist.group.WORLD))

    def input_dist_on_thread(self) -> Callable[[FeaturesOrError], None]:
        """A function for a thread that makes batches ahead (train/batches_ahead.py's `prepare`): it distributes one
        batch's input there, on the thread's current stream (on GPUs also the lookup's backward plan of the bags:
        sort and segments), and leaves the bags for that batch's forward here, so that this host time leaves the
        threads that enqueue the step (the loop's, and autograd's backward). Its input dist has a
        communicator of its own, made now on every rank: the thread's all-to-alls then never interleave with the
        main thread's (an evaluation's) in different orders on different ranks. Call it on every rank; the thread
        must run it on the same batches everywhere (a bad batch raises there, on every rank; so does one that a
        rank could not make, for which that rank's thread calls it with the error: BatchesAhead's prepare_failed)."""
        input_dist = BulkInputDist(self.input_dist.features_of_rank, self.input_dist.tables, self._own_group(),
                                   self.input_dist.row_blocks, self.input_dist.mean_row_wise,
                                   self.input_dist.is_weighted, device=self.device)

        def distribute(features: FeaturesOrError) -> None:
            bags, ready = input_dist.finish(self._start(input_dist, features)), None
            if bags.values.is_cuda:
                self.lookup.plan_backward(bags)  # the backward's sort and segments, here rather than in it
                ready = torch.cuda.Event()  # what the forward waits for
                ready.record()
            with self._from_thread_lock:
                self._from_thread.append((features, bags, ready))
        return distribute

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._configs

    def bags_of(self, features: FeaturesOrError) -> OwnedBags:
        """The owned bags of a batch: distributed ahead (prefetch, the batch thread), else now; the global batch
        size noted from their header. Given the error of a batch this rank could not make, the input dist's
        collectives run all the same and it raises, on every rank (a loop whose forward distributes calls this in
        that forward's place)."""
        bags = self._take_prefetched(features)
        if bags is None:
            bags = self.input_dist.finish(self._start(self.input_dist, features))
        self.global_batch_size = bags.global_batch
        return bags

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        values = self.pooled(self.bags_of(features))
        return KeyedTensor(keys=self.feature_names, length_per_key=self._feature_dims, values=values, key_dim=1)

    def pooled(self, bags: OwnedBags) -> torch.Tensor:
        """The batch's pooled embeddings [local batch, sum of dims] (config feature order) from its owned bags: the
        fused exchange, or the lookup and the output dist's all-to-all, then the row blocks' sum where tables are
        row-wise; in grad mode (train or eval), with autograd's backward to the tables."""
        if self.fused is not None:
            pooled = self.fused(bags, torchrec_gradient_scale(self.world_size))
        else:
            pooled = divide_gradient_like_torchrec(self.output_dist(self.lookup(bags), bags.batch_sizes),
                                                   self.world_size)
        return pooled if self.row_block_sum is None else self.row_block_sum(pooled, bags.pooling_divisors)

    def prefetch_header(self, features: FeaturesOrError) -> None:
        """Start a batch's input dist further ahead: only its header all-to-all (sizes and checks) and the header's
        copy to the host, on the side stream on GPUs; nothing waits. The `prefetch` of this batch, a step later,
        then finds the sizes on the host instead of waiting for them. Same calling rules as `prefetch`."""
        with self._on_side_stream():
            self._pending_header = (features, self._start(self.input_dist, features))

    def prefetch(self, features: FeaturesOrError) -> None:
        """Distribute a coming batch's input now, on a side stream on GPUs, so that forward(features) finds its
        bags ready, as torchrec's TrainPipelineSparseDist does: call it after the current step's backward, on
        every rank at the same point (the all-to-alls must be issued in the same order everywhere). A bad batch
        raises here, on every rank (the input dist checks it), and so does a batch that a rank could not make (that
        rank passes the error instead of the features). If `prefetch_header(features)` came first, only the rest of
        the input dist is left to do."""
        pending, self._pending_header = self._pending_header, None
        with self._on_side_stream():
            if pending is None or pending[0] is not features:
                pending = (features, self._start(self.input_dist, features))
            bags, ready = self.input_dist.finish(pending[1]), None
            if bags.values.is_cuda:  # what the forward waits for: not a header started on this stream later
                ready = torch.cuda.Event()
                ready.record()
            self._prefetched = (features, bags, ready)

    def _start(self, input_dist: BulkInputDist, features: FeaturesOrError) -> PendingHeader:
        """`input_dist`'s start of a batch, or of the failure to make it (its header says "no batch": every rank's
        finish raises)."""
        if isinstance(features, Exception):
            return input_dist.start_failed(features)
        return input_dist.start(features)

    def drop_prefetched(self) -> None:
        """Forget the bags (and a header) distributed ahead for batches that will not be forwarded (a run's end)."""
        self._prefetched = self._pending_header = None
        with self._from_thread_lock:
            self._from_thread.clear()

    def _on_side_stream(self):
        """The input dist's stream: on GPUs a side stream of the collection's device (where the input dist runs; a
        KJT on another device is refused there) that first waits for the stream current here (where the KJT was
        made); on the CPU, nothing to switch (torch.cuda.stream(None) does nothing)."""
        if self.device.type != "cuda":
            return torch.cuda.stream(None)
        self._side_stream = self._side_stream or input_stream(self.device)
        self._side_stream.wait_stream(torch.cuda.current_stream())
        return torch.cuda.stream(self._side_stream)

    def _take_prefetched(self, features: FeaturesOrError):
        """The bags of `features` if distributed ahead (prefetch, or the batch thread's), else None."""
        if self._prefetched is not None and self._prefetched[0] is features:
            (_, bags, ready), self._prefetched = self._prefetched, None
        else:
            with self._from_thread_lock:  # batches come in order: those before this one were never forwarded
                mine = next((i for i, (kjt, _, _) in enumerate(self._from_thread) if kjt is features), None)
                if mine is None:
                    return None
                _, bags, ready = self._from_thread[mine]
                del self._from_thread[:mine + 1]
        if ready is not None:  # made on the side stream, read on this one
            main = torch.cuda.current_stream()
            main.wait_event(ready)
            bags.record_stream(main)
        return bags


def shard_weight(weight: torch.Tensor, shard: Shard) -> torch.Tensor:
    """A shard's own table: a copy of its rows and columns of the whole table's weight (the whole one itself when
    table-wise), as the sharder takes it from torchrec's unsharded table (the collection draws its shards alone:
    init_block). A copy, not a view: a row block's rows are contiguous in the whole table, and a view would keep
    all of it alive."""
    rows = weight.shape[0] if shard.rows is None else shard.rows
    if (shard.row, rows, shard.col, shard.dim) == (0, weight.shape[0], 0, weight.shape[1]):
        return weight
    return weight[shard.row:shard.row + rows, shard.col:shard.col + shard.dim].clone(
        memory_format=torch.contiguous_format)


def _column_order(slices: list[list[FeatureSlice]]) -> list[int]:
    """For each output column in config feature order, its column in the rank-grouped layout (every rank's
    slices side by side, as the pooled all-to-all delivers them)."""
    order = [0] * sum(s.dim for mine in slices for s in mine)
    grouped = 0
    for s in (s for mine in slices for s in mine):
        order[s.col:s.col + s.dim] = range(grouped, grouped + s.dim)
        grouped += s.dim
    return order
