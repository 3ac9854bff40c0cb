"""The tables one rank owns: pooled lookups over the global batch, with the optimizer fused into backward.

The weights are updated in place by the lookup's backward (as fbgemm's TBE does), so they are parameters that
require no gradient: dense optimizers and DDP never see them, and no [rows, dim] gradient is ever materialised.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torchrec import EmbeddingBagConfig, PoolingType

from fused_dlrm.kernels.embedding_backward import (BackwardTables, embedding_backward_reference,
                                                  launch_embedding_backward, optimizer_settings,
                                                  plan_embedding_backward)
from fused_dlrm.kernels.peer_tiles import default_num_programs, plan_peer_tiles
from fused_dlrm.kernels.pooled_embedding import FeatureTable, PooledEmbeddingLaunch, pooled_embedding_reference
from fused_dlrm.sparse.input_dist import OwnedBags
from fused_dlrm.sparse.optimizer import EmbeddingOptimizer, TableOptimizers


# A table's initialisation is defined in chunks of this many rows, each drawn from a generator of its own, so that
# any rows of it can be drawn without the rest (a row block on its rank). Read at call time (tests shrink it).
INIT_CHUNK_ROWS = 1 << 18

# Chunk c > 0 of a table seeded s is seeded s + c * _CHUNK_SEED_STEP (mod 2^64), not s + c: that is chunk 0 of the
# table seeded s + c (table_seeds gives a collection's tables consecutive seeds). The CPU generator keeps a seed's low
# 32 bits, so chunk c of seed s and chunk c' of seed s' share a generator only if s - s' = (c' - c) * step (mod 2^32):
# never within one table (the step is odd), and across tables never while their seeds differ by less than 170034
# and the chunk numbers stay below 16384 (4e9 rows), as k * step (mod 2^32) stays that far from 0 for 0 < |k| <
# 16384 (tests/test_table_init.py). CUDA's generator keeps all 64 bits: never while the seeds differ by less than
# the step.
_CHUNK_SEED_STEP = 0x9E3779B9  # 2^32 / the golden ratio, odd: its multiples stay far from 0 (mod 2^32)


def init_chunk_seed(seed: int, chunk: int) -> int:
    """The seed of chunk `chunk`'s generator: chunk 0's is the table's own (a table of one chunk is drawn as it was
    before chunks existed), a later one's derived from (seed, chunk)."""
    return seed if chunk == 0 else (seed + chunk * _CHUNK_SEED_STEP) % 2**64


def custom_init(config: EmbeddingBagConfig) -> Callable[[torch.Tensor], object] | None:
    """The table's init_fn unless it is the config's own, U(weight_init_min, weight_init_max) (EmbeddingBagConfig
    sets it when none is given), which init_block draws itself; None for the config's own."""
    init = config.init_fn
    own = (isinstance(init, functools.partial) and init.func is torch.nn.init.uniform_ and not init.args
           and init.keywords == {"a": config.get_weight_init_min(), "b": config.get_weight_init_max()})
    return None if init is None or own else init


def init_block(config: EmbeddingBagConfig, seed: int, device: torch.device, row: int = 0, rows: int | None = None,
               col: int = 0, dim: int | None = None) -> torch.Tensor:
    """Rows [row, row + rows) and columns [col, col + dim) of the table's initialisation (None: to the table's end):
    torchrec's, U(weight_init_min, weight_init_max), each +-sqrt(1/num_embeddings) when not set, drawn in chunks of
    INIT_CHUNK_ROWS rows, each full width [chunk rows, embedding_dim] from its own generator (init_chunk_seed), so
    every block and column shard of a table holds the same values as the table drawn whole. Only the chunks the rows
    overlap are drawn, one at a time into the result: at most the result and one chunk are alive. A config with an
    init_fn of its own (`custom_init`) has it applied to the block, as stock torchrec applies it to each of its
    shards (drawn from the global generator: the block's values then depend on the plan)."""
    num_rows, width = config.num_embeddings, config.embedding_dim
    rows = num_rows - row if rows is None else rows
    dim = width - col if dim is None else dim
    if not (0 <= row <= row + rows <= num_rows and 0 <= col <= col + dim <= width):
        raise ValueError(f"table {config.name} ([{num_rows}, {width}]) has no rows [{row}, {row + rows}) and "
                         f"columns [{col}, {col + dim})")
    init = custom_init(config)
    if init is not None:
        block = torch.empty(rows, dim, device=device)
        init(block)  # in place, as torchrec calls it
        return block
    chunk_rows = INIT_CHUNK_ROWS
    bound = (1.0 / num_rows) ** 0.5  # not get_weight_init_max's math.sqrt: a last bit apart for some row counts
    low = -bound if config.weight_init_min is None else config.weight_init_min
    high = bound if config.weight_init_max is None else config.weight_init_max
    out = None
    for c in range(row // chunk_rows, -(-(row + rows) // chunk_rows) if rows else 0):  # the chunks overlapping the rows
        start = c * chunk_rows
        chunk = torch.empty(min(chunk_rows, num_rows - start), width, device=device)
        chunk.uniform_(low, high, generator=torch.Generator(device=device).manual_seed(init_chunk_seed(seed, c)))
        if (start, len(chunk), col, dim) == (row, rows, 0, width):  # the block is this one chunk
            return chunk
        if out is None:
            out = torch.empty(rows, dim, device=device)
        first, stop = max(row, start), min(row + rows, start + len(chunk))
        out[first - row:stop - row] = chunk[first - start:stop - start, col:col + dim]
        del chunk  # before the next one is drawn
    return torch.empty(0, dim, device=device) if out is None else out


def init_table(config: EmbeddingBagConfig, seed: int, device: torch.device) -> torch.Tensor:
    """The whole table's initialisation (init_block); a table of at most INIT_CHUNK_ROWS rows is one draw of
    [rows, dim] from a generator seeded `seed`."""
    return init_block(config, seed, device)


class _LookupWithFusedUpdate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, lookup: "PooledEmbeddingLookup", bags: OwnedBags):
        ctx.lookup, ctx.bags = lookup, bags
        return lookup.pool(bags)

    @staticmethod
    def backward(ctx, grad):
        ctx.lookup.apply_gradient(ctx.bags, grad)
        return None, None, None


# torchrec's table settings whose tables are not plain tables of num_embeddings rows indexed by the ids as given:
# (setting, what torchrec does with it)
UNSUPPORTED_TABLE_SETTINGS = (
    ("use_virtual_table", "torchrec's key-value kernels hold those tables, of ids in a virtual space"),
    ("enable_embedding_update", "torchrec's key-value kernels hold the tables DMP.write() updates"),
    ("num_embeddings_post_pruning", "torchrec's shards then hold that many rows, the ids remapped by its pruning"),
    ("total_num_buckets", "torchrec's bucketized row-wise sharding (zero-collision hashing) places those rows"),
)


def check_table(t: EmbeddingBagConfig) -> None:
    """What the lookup can hold: FP32 / FP16 / BF16 rows of a plain table of num_embeddings rows (none of
    UNSUPPORTED_TABLE_SETTINGS), SUM or MEAN pooling."""
    if t.data_type.name not in ("FP32", "FP16", "BF16"):
        raise NotImplementedError(f"table {t.name}: tables must be FP32, FP16 or BF16, got {t.data_type}")
    for setting, why in UNSUPPORTED_TABLE_SETTINGS:
        value = getattr(t, setting, None)
        if value not in (None, False):
            raise NotImplementedError(f"table {t.name}: {setting}={value} is not supported: the tables here are "
                                      f"plain tables of num_embeddings rows ({why})")
    if t.pooling not in (PoolingType.SUM, PoolingType.MEAN):
        raise ValueError(f"table {t.name}: pooling must be SUM or MEAN, got {t.pooling}")


class PooledEmbeddingLookup(nn.Module):
    """Owns some tables; maps an `OwnedBags` to the pooled embeddings [global_batch, sum of feature dims]; its
    backward updates each table by its optimizer (`optimizer`: one for every table, or each table's by name)."""

    def __init__(self, tables: list[EmbeddingBagConfig], weights: dict[str, torch.Tensor],
                 optimizer: TableOptimizers, device: torch.device, momentum: dict[str, torch.Tensor] | None = None):
        super().__init__()
        for t in tables:
            check_table(t)
        self.tables = {t.name: t for t in tables}
        self.weights = weights  # registered by the owning collection, not here
        # (feature, table) in output column order: tables in plan order, each table's features in config order.
        self.features = [(f, t.name) for t in tables for f in t.feature_names]
        self.optimizer = EmbeddingOptimizer(optimizer, weights, momentum)  # momentum: EmbeddingOptimizer's
        self._feature_pooling = [(t, self.is_mean(t)) for _, t in self.features]  # (table, mean-pooled) per column
        self._kernel_features: FeatureTable | None = None  # built on the first GPU lookup
        self._kernel_launches: dict = {}  # global batch size -> the GPU lookup's launch (its tile plan bound)
        self.kernel_programs: int | None = None  # persistent programs of the GPU lookup; None: 32 per SM
        self._backward_tables: BackwardTables | None = None  # built on the first GPU backward
        self._settings: tuple[int, torch.Tensor] | None = None  # (optimizer version, its settings on the GPU)
        # A leaf that requires grad: it makes autograd call our backward, which updates the tables.
        self._anchor = torch.empty(0, device=device, requires_grad=True)

    @property
    def output_dim(self) -> int:
        return sum(self.tables[t].embedding_dim for _, t in self.features)

    def forward(self, bags: OwnedBags) -> torch.Tensor:
        if [f for f, _ in self.features] != bags.features:
            raise ValueError(f"lookup owns features {[f for f, _ in self.features]}, got bags of {bags.features}")
        # Grad mode alone decides, not train() / eval(): fbgemm's TBE updates in its backward in either mode, so a
        # backward through an output made in eval mode (dropout off while fine-tuning) trains the tables there too.
        if torch.is_grad_enabled():
            return _LookupWithFusedUpdate.apply(self._anchor, self, bags)
        return self.pool(bags)

    def pool(self, bags: OwnedBags) -> torch.Tensor:
        """[global batch, owned dims] in fp32: the Triton kernel on GPUs, the pure-torch reference on the CPU."""
        if self._anchor.device.type == "cuda" and self.features:
            return self._pool_with_kernel(bags)
        columns = []
        for i, (_, table) in enumerate(self.features):
            values, lengths, weights = bags.feature_bags(i)
            columns.append(pooled_embedding_reference(self.weights[table], values, lengths, weights,
                                                      self.is_mean(table)))
        if not columns:
            return torch.empty(bags.global_batch, 0, device=self._anchor.device)
        return torch.cat(columns, dim=1)

    def _pool_with_kernel(self, bags: OwnedBags) -> torch.Tensor:
        """The fused kernel's compute without communication: one destination, this rank's own output."""
        device = self._anchor.device
        if self._kernel_features is None:
            dims = [self.tables[t].embedding_dim for _, t in self.features]
            self._kernel_features = FeatureTable([self.weights[t] for _, t in self.features],
                                                 [sum(dims[:i]) for i in range(len(dims))],
                                                 [self.is_mean(t) for _, t in self.features], device)
        launch = self._kernel_launches.get(bags.global_batch)
        if launch is None:  # built once per batch size: its tensors are host-to-device copies
            plan = plan_peer_tiles(0, [(0, bags.global_batch)], [(0, len(self.features))],
                                   self._kernel_features.block_rows,
                                   self.kernel_programs or default_num_programs(device), device)
            launch = self._kernel_launches[bags.global_batch] = PooledEmbeddingLaunch(
                self._kernel_features, plan, bags.global_batch, torch.zeros(1, dtype=torch.int64, device=device),
                self.output_dim)
        out = torch.empty(bags.global_batch, self.output_dim, device=device)
        # The output's address reaches the kernel as a fill's argument: no host-to-device copy to wait for.
        launch(bags.values, bags.csr_offsets(), bags.weights, torch.full((1,), out.data_ptr(), device=device))
        return out

    @torch.no_grad()
    def apply_gradient(self, bags: OwnedBags, grad: torch.Tensor) -> None:
        """Sum each table's row gradients over its features and apply the optimizer: on GPUs two Triton launches
        for all tables (no host sync), on the CPU the per-table torch reference. Either way the optimizer
        state stays in `self.optimizer.momentum` (the collection's fused optimizer reads it there)."""
        if self._anchor.device.type != "cuda":
            embedding_backward_reference(bags, grad, self.optimizer, self._feature_pooling)
            return
        launch_embedding_backward(bags, grad, self._kernel_tables(), self._kernel_settings(), bags.backward_plan)

    @torch.no_grad()
    def plan_backward(self, bags: OwnedBags) -> None:
        """Make the bags' backward plan now (GPUs; the sort and segments of plan_embedding_backward, on the current
        stream), for apply_gradient to use: the batch thread calls it ahead, off the backward's critical path."""
        if self._anchor.device.type == "cuda" and self.features:
            bags.backward_plan = plan_embedding_backward(bags, self._kernel_tables())

    def _kernel_tables(self) -> BackwardTables:
        """The GPU backward's tables: built on first use (its device tensors cost a sync each), again only if a
        table or its momentum moved (a plan made with the older one stays valid: it reads the layout only)."""
        names = list(self.tables)
        weights = [self.weights[n] for n in names]
        momentum = [self.optimizer.momentum.get(n) for n in names]  # None: an SGD table
        tables = self._backward_tables
        if tables is None or not tables.describes(weights, momentum):
            features = self._feature_pooling
            tables = self._backward_tables = BackwardTables(weights, momentum, [names.index(t) for t, _ in features],
                                                            [mean for _, mean in features], self._anchor.device)
        return tables

    def _kernel_settings(self) -> torch.Tensor:
        """Each table's (lr, eps) on the GPU: copied again only when the optimizer's settings changed (an LR
        scheduler's step, update_hyper_parameters), without a host sync."""
        version = self.optimizer.version
        if self._settings is None or self._settings[0] != version:
            configs = self.optimizer.configs
            self._settings = version, optimizer_settings([configs[n] for n in self.tables], self._anchor.device)
        return self._settings[1]

    def is_mean(self, table: str) -> bool:
        return self.tables[table].pooling == PoolingType.MEAN
