"""torchrec swap-in: shard a stock `torchrec.EmbeddingBagCollection` with our sharded collection under DMP.

    model = DistributedModelParallel(
        model, sharders=[FusedEmbeddingBagCollectionSharder(optimizer=EmbeddingOptimizerConfig("rowwise_adagrad"))],
        device=torch.device("cpu"))

or, as with torchrec's own sharder, `FusedEmbeddingBagCollectionSharder(fused_params={"optimizer":
EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05})`, or apply_optimizer_in_backward on the EBC's parameters.

`FusedEmbeddingBagCollectionSharder` is a torchrec `BaseEmbeddingSharder`: it offers the planner table-wise,
column-wise and row-wise sharding with the FUSED kernel, turns the plan it is given into our `TableShardingPlan`, and
returns a `FusedShardedEBC`, a torchrec `ShardedModule` whose stages are our three seams:

    input_dist(ctx, kjt)       -> our input dist (KJT all-to-all)      wrapped as torchrec's KJTListSplitsAwaitable
    compute(ctx, dist_input)   -> our lookup (optimizer fused into its backward)
    output_dist(ctx, pooled)   -> our output dist (pooled all-to-all)  wrapped as a LazyAwaitable[KeyedTensor]
                                  then, with row-wise tables, the sum of each sample's row blocks (row_wise.py)

That is the interface DMP's forward (`ShardedModule.forward`) and `TrainPipelineSparseDist` (input_dist one batch
ahead, then `compute_and_output_dist`) call. The bulk seams communicate synchronously, so the awaitables are
already complete when returned: the pipeline still runs the next batch's input dist ahead (the order of the
collectives is the same on every rank), it just has nothing left to overlap.

What a swap for torchrec's EmbeddingBagCollectionSharder keeps:
  * weights: the owned tables (or their column shards, row blocks) start as copies of the unsharded EBC's (torchrec
    on the CPU re-initialises instead), those of an EBC on the meta device from their configs' init as torchrec's
    (U(weight_init_min, weight_init_max), or the config's init_fn: lookup.init_block), as reset_parameters()
    draws them again;
  * input: a KJT of the EBC's features in any order, and of other features, which it ignores (one KJT may feed
    several modules); per-sample weights take no gradient, so weights that require grad (a feature processor's:
    DMP gives the EBC inside a FeatureProcessedEmbeddingBagCollection to this sharder when no sharder of that
    module's is given) are refused at the batch in grad mode, on every rank (under no_grad no gradient is lost);
  * output: KeyedTensor [local batch, sum of dims] with the EBC's keys in the EBC's feature order; a weighted
    EBC's MEAN-pooled bag is sum(weight * row) / its size under every plan (fbgemm's TBE, so stock torchrec's
    table- and column-wise; its row-wise divides by the sum of the bag's weights instead), its rows' gradient
    weight * g / size (fbgemm's CPU backward leaves out the / size: stock's CPU tables move otherwise);
  * gradients: divided by the world size on the way back to the owners, as torchrec does by default
    (comm_ops.GRADIENT_DIVISION; set_gradient_division(False) gives the sum), like ShardedEmbeddingBagCollection;
  * optimizer: each table's, read as stock torchrec reads it (the sharder's fused_params, then
    apply_optimizer_in_backward's settings on the table's weight, then the fbgemm settings the plan's entry
    carries, from the planner's ParameterConstraints; `resolve_optimizer`), or given as our
    EmbeddingOptimizerConfig (per table or for all); tables may differ (exact SGD here, row-wise Adagrad there,
    other lrs); what we do not run (another optimizer, weight decay, momentum, an fp16 output) is refused, never
    replaced. Applied in backward; `fused_optimizer` is a torchrec KeyedOptimizer over the owned tables with one
    param group per setting (as torchrec's one per TBE), so DMP's fused_optimizer / CombinedOptimizer, LR changes
    through param_groups (an LR scheduler's), update_hyper_parameters and its state_dict work as for torchrec's
    fused tables;
  * state_dict: torchrec's, `embedding_bags.<table>.weight` for every table on every rank, a ShardedTensor of the
    whole table whose local shards are this rank's table, column shards or row blocks (their storage: a load
    copies in place), and the fused optimizer's `<table>.momentum1` in torchrec's layout (sharded_state.py): a
    torch.distributed.checkpoint of ours or of stock torchrec's loads under any plan or world size, the
    row-wise Adagrad state under the same column cuts (an accumulator per column shard, as torchrec's).

Which seams implement the stages is chosen by `comm`, in `build_seams`: "bulk" (torch.distributed all-to-alls)
or "fused" (CUDA: lookup and output dist as one kernel storing into peers' memory, run by
compute_and_output_dist; `compute` and `output_dist` alone then raise), or a FusedCommConfig (fused,
with its transport, programs and bounds on the waits).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor
from torchrec.distributed.embedding_sharding import KJTListSplitsAwaitable
from torchrec.distributed.embedding_types import BaseEmbeddingSharder, EmbeddingComputeKernel, KJTList
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionAwaitable
from torchrec.distributed.types import (
    Awaitable,
    LazyAwaitable,
    NoWait,
    ParameterSharding,
    ShardedModule,
    ShardingEnv,
    ShardingType,
)
from torchrec.distributed.utils import add_params_from_parameter_sharding, optimizer_type_to_emb_opt_type
from torchrec.modules.embedding_configs import DataType
from torchrec.optim.fused import EmptyFusedOptimizer, FusedOptimizerModule
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
from torchrec.streamable import Multistreamable

from fused_dlrm.sparse.fused_all_to_all import FusedCommConfig, FusedPooledAllToAll
from fused_dlrm.sparse.input_dist import OwnedBags
from fused_dlrm.sparse.lookup import PooledEmbeddingLookup
from fused_dlrm.sparse.optimizer import EmbeddingOptimizerConfig, TableOptimizers, per_table
from fused_dlrm.sparse.plan import Shard, TableShardingPlan, shard_name
from fused_dlrm.sparse.row_wise import RowBlockSum
from fused_dlrm.sparse.sharded_state import FusedTableOptimizer
from fused_dlrm.sparse.sharded_ebc import (ShardedEmbeddingBagCollection, divide_gradient_like_torchrec, shard_weight,
                                          torchrec_gradient_scale)

log = logging.getLogger(__name__)

COMMS = ("bulk", "fused")


def fused_comm_config(comm: str | FusedCommConfig) -> FusedCommConfig | None:
    """The fused exchange's settings that `comm` asks for: "bulk" none, "fused" the defaults, a FusedCommConfig
    (fused with its transport, programs and bounds on the waits) itself."""
    if isinstance(comm, FusedCommConfig):
        return comm
    if comm not in COMMS:
        raise ValueError(f"comm={comm!r} is unknown; expected one of {list(COMMS)} or a FusedCommConfig")
    return FusedCommConfig() if comm == "fused" else None


# ----------------------------------------------------------------------------------------------------------------
# The seams one comm implementation provides.


@dataclass
class Seams:
    """The three stages of one comm implementation, plus the tables they own on this rank."""

    input_dist: Callable[[KeyedJaggedTensor], OwnedBags]  # local batch, every feature -> owned features, global batch
    lookup: PooledEmbeddingLookup  # OwnedBags -> [global batch, owned dims]; updates the tables in backward
    # -> [local batch, all dims], EBC feature order (with row-wise tables: the wide row, their blocks' parts apart)
    output_dist: Callable[[torch.Tensor, list[int]], torch.Tensor]
    embedding_bags: nn.ModuleDict  # torchrec's `embedding_bags.<table>` (sharded_state.TableShards), every table
    shard_weights: dict[str, nn.Parameter]  # this rank's tables, column shards and row blocks, by shard name
    fused_optimizer: FusedTableOptimizer  # over the lookup's optimizer
    exchange: FusedPooledAllToAll | None  # comm="fused": lookup + output dist as one kernel
    row_block_sum: RowBlockSum | None  # the wide row -> the real one; None when no table is row-wise
    reset_parameters: Callable[[], None]  # this rank's shards back to their configs' init, in place


def build_seams(fused: FusedCommConfig | None, tables: list[EmbeddingBagConfig], optimizer: TableOptimizers,
                plan: TableShardingPlan, device: torch.device, group: dist.ProcessGroup | None,
                is_weighted: bool) -> Seams:
    """The stages of this rank: bulk (fused None) or fused with those settings (`fused_comm_config`); is_weighted:
    the EBC's (its input dist requires per-sample weights, or ignores them, as torchrec's EBC does, and checks them
    in its header: a bad batch raises on every rank).

    Bulk: our ShardedEmbeddingBagCollection already wires the bulk seams for a plan; take them apart rather than
    wire them a second time here. Its own forward is not used, and it is not registered as a submodule (the caller
    registers its `embedding_bags`, so state_dict keys are torchrec's `embedding_bags.<table>.weight`).
    Fused: the same collection built with its fused-exchange config runs lookup and output dist as one kernel;
    compute_and_output_dist calls it on the bags (torchrec's pipeline only calls the pair through
    compute_and_output_dist), keeping input dist, tables and optimizer.
    """
    core = ShardedEmbeddingBagCollection(tables, optimizer, device=device, group=group, plan=plan,
                                         comm=fused, is_weighted=is_weighted)
    return Seams(input_dist=core.input_dist, lookup=core.lookup,
                 output_dist=core.output_dist, embedding_bags=core.embedding_bags,
                 shard_weights=core.shard_weights, fused_optimizer=core.fused_optimizer, exchange=core.fused,
                 row_block_sum=core.row_block_sum, reset_parameters=core.reset_parameters)


def torchrec_in_backward_optimizer(config: EmbeddingOptimizerConfig) -> tuple[type[torch.optim.Optimizer], dict]:
    """(class, kwargs) for torchrec's apply_optimizer_in_backward that make its stock EmbeddingBagCollectionSharder
    run the same update as `config` (fbgemm's EXACT_SGD / EXACT_ROWWISE_ADAGRAD)."""
    if config.name == "sgd":
        return torch.optim.SGD, {"lr": config.lr}
    return RowWiseAdagrad, {"lr": config.lr, "eps": config.eps}


# ----------------------------------------------------------------------------------------------------------------
# The embedding optimizer from torchrec's settings.

# Stock torchrec's FUSED kernel, fbgemm's SplitTableBatchedEmbeddingBagsCodegen, takes a table's merged settings as
# keyword arguments: where neither fused_params nor apply_optimizer_in_backward gives one, its default applies.
FBGEMM_DEFAULTS: dict[str, Any] = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.01, "eps": 1e-8}
OUR_OPTIMIZERS = {EmbOptimType.EXACT_SGD: "sgd", EmbOptimType.EXACT_ROWWISE_ADAGRAD: "rowwise_adagrad"}
# Settings of fbgemm's that our optimizers and lookup lack, accepted at the values that leave the update and the
# output as ours (a user may write weight_decay=0.0 out; our fp16 / bf16 rows are rounded to nearest, fbgemm's
# stochastically unless stochastic_rounding=False; our output is fp32, as torchrec's DataType or fbgemm's SparseType
# says it); another value, or any other setting (a cache's, a bounds check's), is refused.
NEUTRAL_SETTINGS: dict[str, tuple] = {"weight_decay": (0.0,), "momentum": (0.0,), "stochastic_rounding": (False,),
                                      "output_dtype": (DataType.FP32, SparseType.FP32)}
SUPPORTED = ("EmbOptimType.EXACT_SGD (torch.optim.SGD, torchrec.optim.SGD) or EmbOptimType.EXACT_ROWWISE_ADAGRAD "
             "(torchrec.optim.RowWiseAdagrad), with learning_rate (lr) and eps")


def config_from_settings(settings: Mapping[str, Any], where: str) -> EmbeddingOptimizerConfig:
    """fbgemm's settings as stock torchrec merges them (optimizer, learning_rate, eps, ...; missing ones: fbgemm's
    defaults) -> our config; anything our optimizers do not run is refused, `where` naming whose settings."""
    unsupported = [f"{key}={value!r}" for key, value in settings.items() if key not in FBGEMM_DEFAULTS
                   and not (key in NEUTRAL_SETTINGS and value in NEUTRAL_SETTINGS[key])]
    if unsupported:
        neutral = ", ".join(f"{key}={' or '.join(map(repr, values))}" for key, values in NEUTRAL_SETTINGS.items())
        raise ValueError(f"{where}: {', '.join(unsupported)} not supported: FusedEmbeddingBagCollectionSharder runs "
                         f"{SUPPORTED} only (and these at no effect: {neutral})")
    merged = {**FBGEMM_DEFAULTS, **settings}
    name = OUR_OPTIMIZERS.get(merged["optimizer"])
    if name is None:
        raise ValueError(f"{where}: optimizer {merged['optimizer']!r} is not supported: "
                         f"FusedEmbeddingBagCollectionSharder runs {SUPPORTED}")
    try:
        return EmbeddingOptimizerConfig(name, lr=float(merged["learning_rate"]), eps=float(merged["eps"]))
    except ValueError as error:  # a negative or non-finite lr or eps
        raise ValueError(f"{where}: {error}") from None


def describe(config: EmbeddingOptimizerConfig) -> str:
    """The update `config` runs, in words: two configs that run the same one read alike (SGD has no eps)."""
    if config.name == "sgd":
        return f"exact SGD (lr={config.lr})"
    return f"exact row-wise Adagrad (lr={config.lr}, eps={config.eps})"


def in_backward_settings(table: str, weight: nn.Parameter) -> dict[str, Any]:
    """The settings apply_optimizer_in_backward put on a table's weight, as stock torchrec's
    create_sharding_infos_by_sharding_device_group reads them: the class as an EmbOptimType unless the kwargs name
    one, lr as learning_rate; {} for a weight without."""
    classes = getattr(weight, "_optimizer_classes", [None])
    kwargs = getattr(weight, "_optimizer_kwargs", [{}])
    if len(classes) != 1 or len(kwargs) != 1:
        raise ValueError(f"table {table!r}: apply_optimizer_in_backward was applied {len(classes)} times "
                         f"({[c.__name__ for c in classes]}): a table takes one optimizer")
    settings = dict(kwargs[0])  # a copy: stock torchrec adds "optimizer" to the weight's own dict
    if "lr" in settings:
        settings["learning_rate"] = settings.pop("lr")
    if classes[0] is not None and "optimizer" not in settings:
        try:
            settings["optimizer"] = optimizer_type_to_emb_opt_type(classes[0])
        except ValueError:
            raise ValueError(f"table {table!r}: apply_optimizer_in_backward({classes[0].__module__}."
                             f"{classes[0].__qualname__}) is not supported: FusedEmbeddingBagCollectionSharder runs "
                             f"{SUPPORTED}") from None
    return settings


def resolve_optimizer(module: EmbeddingBagCollection, fused_params: Mapping[str, Any],
                      optimizer: TableOptimizers | None,
                      params: Mapping[str, ParameterSharding]) -> dict[str, EmbeddingOptimizerConfig]:
    """Each table's optimizer, by table name.

    As stock torchrec's EmbeddingBagCollectionSharder gives its FUSED kernel: apply_optimizer_in_backward's settings
    on the table's weight over the sharder's fused_params over fbgemm's defaults (exact SGD, lr 0.01); the tables
    may differ. Over those, the fbgemm settings of the table's plan entry `params[table]` (the planner's
    ParameterConstraints: output_dtype, stochastic_rounding, cache_params, ...; stock torchrec's
    add_params_from_parameter_sharding), checked alike: what we do not run is refused, not ignored. `optimizer`
    (ours, for all tables or per table), where given, must run the same update wherever fused_params or
    apply_optimizer_in_backward say anything of the update: the optimizer, learning_rate or eps (else which one a
    user meant is a guess; settings at no effect, NEUTRAL_SETTINGS, and the plan's never choose the optimizer);
    where they say nothing it is used as it is. A per-table mapping names the tables of
    every EBC the sharder shards (DMP gives a model's EBCs all to the one sharder of their type): entries for other
    tables are theirs; a table of this EBC without one raises.
    """
    tables = [t.name for t in module.embedding_bag_configs()]
    if isinstance(optimizer, Mapping):
        optimizer = {name: config for name, config in optimizer.items() if name in tables}
    ours = None if optimizer is None else per_table(optimizer, tables)
    configs, differ = {}, {}
    for name in tables:
        settings = {**fused_params, **in_backward_settings(name, module.embedding_bags[name].weight)}
        merged = {**settings, **add_params_from_parameter_sharding({}, params[name])}
        theirs = config_from_settings(
            merged, f"table {name!r}: optimizer settings {merged} (the sharder's fused_params, then "
                    "apply_optimizer_in_backward's, then the plan's)")
        mine = theirs if ours is None else ours[name]
        if any(key in FBGEMM_DEFAULTS for key in settings) and describe(mine) != describe(theirs):
            differ.setdefault((describe(mine), describe(theirs)), []).append(name)
        configs[name] = mine
    if differ:
        raise ValueError("the sharder's optimizer differs from what torchrec's settings (fused_params, "
                         "apply_optimizer_in_backward) give: " + "; ".join(
                             f"optimizer={mine} for {names}, theirs: {theirs}" for (mine, theirs), names in
                             differ.items()) + ": give one of them, or both alike")
    return configs


# ----------------------------------------------------------------------------------------------------------------
# Plan conversion.


SHARDING_TYPES = (ShardingType.TABLE_WISE.value, ShardingType.COLUMN_WISE.value, ShardingType.ROW_WISE.value)
OFFERED_BY_DEFAULT = (ShardingType.TABLE_WISE.value, ShardingType.COLUMN_WISE.value)  # the sharder's default


def plan_from_torchrec(tables: list[EmbeddingBagConfig], params: Mapping[str, ParameterSharding],
                       world_size: int) -> TableShardingPlan:
    """torchrec's per-table ParameterSharding -> our TableShardingPlan; anything but table-wise, column-wise or row-wise
    with the FUSED kernel is refused. Empty row blocks (torchrec's planner gives a table with fewer rows than ranks
    some) are dropped; a table left with one block is table-wise."""
    names = [t.name for t in tables]
    extra = sorted(set(params) - set(names))
    if extra:
        raise ValueError(f"sharding plan names tables the EmbeddingBagCollection does not have: {extra}")
    shards: list[Shard] = []
    for t in tables:  # config order: the plan's, and so every rank's lookup column order
        ps = params.get(t.name)
        if ps is None:
            raise ValueError(f"sharding plan has no entry for table {t.name!r}; FusedEmbeddingBagCollectionSharder "
                             "shards every table of the collection")
        if ps.sharding_type not in SHARDING_TYPES:
            raise ValueError(f"table {t.name!r}: sharding type {ps.sharding_type!r} is not supported; "
                             f"FusedEmbeddingBagCollectionSharder shards {list(SHARDING_TYPES)}")
        if ps.compute_kernel != EmbeddingComputeKernel.FUSED.value:
            raise ValueError(f"table {t.name!r}: compute kernel {ps.compute_kernel!r} is not supported; the optimizer "
                             f"is always fused into backward ({EmbeddingComputeKernel.FUSED.value!r})")
        ranks = ps.ranks or []
        if ps.sharding_type == ShardingType.TABLE_WISE.value:
            if len(ranks) != 1:
                raise ValueError(f"table {t.name!r}: a table-wise table lives on exactly one rank, plan gives {ranks}")
            cuts = [(rank, 0, t.embedding_dim, 0, None) for rank in ranks]  # (rank, col, dim, row, rows)
        else:
            spec = getattr(ps.sharding_spec, "shards", None)
            kind = ps.sharding_type.replace("_", "-")
            if not spec or len(spec) != len(ranks):
                raise ValueError(f"table {t.name!r}: a {kind} entry needs one shard of its sharding_spec per "
                                 f"rank in {ranks}")
            if ps.sharding_type == ShardingType.COLUMN_WISE.value:
                if any(m.shard_offsets[0] != 0 or m.shard_sizes[0] != t.num_embeddings for m in spec):
                    raise ValueError(f"table {t.name!r}: column shards must hold all {t.num_embeddings} rows")
                cuts = [(rank, m.shard_offsets[1], m.shard_sizes[1], 0, None) for rank, m in zip(ranks, spec)]
            else:
                if any(m.shard_offsets[1] != 0 or m.shard_sizes[1] != t.embedding_dim for m in spec):
                    raise ValueError(f"table {t.name!r}: row blocks must hold all {t.embedding_dim} columns")
                cuts = [(rank, 0, t.embedding_dim, m.shard_offsets[0], m.shard_sizes[0])
                        for rank, m in zip(ranks, spec) if m.shard_sizes[0] != 0]
                if len(cuts) == 1 and cuts[0][3:] == (0, t.num_embeddings):  # the one block is the whole table
                    cuts = [(cuts[0][0], 0, t.embedding_dim, 0, None)]
        for rank, col, dim, row, rows in sorted(cuts, key=lambda cut: (cut[3], cut[1])):  # by row, then column
            if not 0 <= rank < world_size:
                raise ValueError(f"table {t.name!r}: rank {rank} outside a world of {world_size}")
            shards.append(Shard(t.name, rank, col, dim, shard_name(t, col, dim, row, rows), row, rows))
    plan = TableShardingPlan(world_size, tuple(shards))
    plan.check(tables)
    return plan


# ----------------------------------------------------------------------------------------------------------------
# What travels between the stages.


@dataclass
class ShardedEBCContext(Multistreamable):
    """Per-batch state from compute to output_dist: the local batch size of every rank, and the bag sizes that
    divide this rank's mean-pooled row-wise features (OwnedBags.pooling_divisors; None without such features)."""

    batch_sizes: list[int] = dataclasses.field(default_factory=list)
    pooling_divisors: torch.Tensor | None = None

    def record_stream(self, stream: torch.Stream) -> None:
        if self.pooling_divisors is not None:  # the batch sizes are host-side ints
            self.pooling_divisors.record_stream(stream)


@dataclass
class DistributedBags(Multistreamable):
    """Our OwnedBags made Multistreamable: the pipeline records the input dist's output on its CUDA streams."""

    bags: OwnedBags

    def record_stream(self, stream: torch.Stream) -> None:
        for t in (self.bags.values, self.bags.lengths, self.bags.weights, self.bags.pooling_divisors):
            if t is not None:
                t.record_stream(stream)


class FusedShardedEBC(ShardedModule[KJTList, torch.Tensor, KeyedTensor, ShardedEBCContext], FusedOptimizerModule):
    """A torchrec ShardedModule over our seams: table-wise, column-wise and row-wise, optimizer fused into backward.

    Owns the tables, column shards and row blocks `plan` gives this rank, initialised from `module`'s weights (when
    those are on the meta device, from their configs' init: lookup.init_block). Output: KeyedTensor [local batch, sum
    of dims] in the EBC's feature order.
    """

    def __init__(self, module: EmbeddingBagCollection, plan: TableShardingPlan, env: ShardingEnv,
                 optimizer: TableOptimizers, device: torch.device | None = None,
                 comm: str | FusedCommConfig = "bulk"):
        super().__init__(qcomm_codecs_registry=None)
        fused = fused_comm_config(comm)  # refused before anything is built
        self.comm = comm
        self._env = env
        tables = module.embedding_bag_configs()
        if env.world_size != plan.world_size:
            raise ValueError(f"plan is for {plan.world_size} ranks, the sharding env has {env.world_size}")
        seams = build_seams(fused, tables, optimizer, plan, torch.device(device or "cpu"), env.process_group,
                            module.is_weighted())
        self._input_dist = seams.input_dist
        self._output_dist = seams.output_dist
        self._lookup = seams.lookup
        self._exchange = seams.exchange
        self._row_block_sum = seams.row_block_sum
        self._reset_parameters = seams.reset_parameters
        self.embedding_bags = seams.embedding_bags
        self.shard_weights = seams.shard_weights
        self.plan = plan
        self.feature_names = [f for t in tables for f in t.feature_names]
        self._feature_dims = [t.embedding_dim for t in tables for _ in t.feature_names]

        with torch.no_grad():
            for shard in plan.shards_of(env.rank):
                weight = self.shard_weights[shard.name]
                # Like torchrec's fused tables: in_backward_optimizer_filter() keeps them out of dense optimizers.
                weight._in_backward_optimizers = [EmptyFusedOptimizer()]
                source = module.embedding_bags[shard.table].weight
                if source.is_meta:  # nothing to copy: keep our init (the config's, seeded per table)
                    log.info("table %s: unsharded weight is on the meta device, keeping our initialisation",
                             shard.name)
                    continue
                weight.copy_(shard_weight(source.detach(), shard))  # in place: the lookup holds this storage
        self._optim = seams.fused_optimizer

    # -- torchrec ShardedModule interface ------------------------------------------------------------------------

    def create_context(self) -> ShardedEBCContext:
        return ShardedEBCContext()

    def input_dist(self, ctx: ShardedEBCContext, features: KeyedJaggedTensor) -> Awaitable[Awaitable[KJTList]]:
        """Runs our input dist now; returns torchrec's awaitable-of-awaitable shape around the result.

        KJTListSplitsAwaitable is what TrainPipelineSparseDist fuses across modules (it reads `.awaitables`); our
        entries are plain NoWaits, so it just waits them, and compute() receives KJTList([DistributedBags]) both
        from the pipeline and from ShardedModule.forward. A bad batch (a weighted EBC's without weights, one with a
        variable batch size per feature, ...) raises in our input dist, after its header: on every rank.
        """
        bags = self._input_dist(features)
        return KJTListSplitsAwaitable([NoWait(NoWait(DistributedBags(bags)))], ctx)

    def compute(self, ctx: ShardedEBCContext, dist_input: KJTList) -> torch.Tensor:
        self._refuse_stage_alone("compute")
        bags = dist_input[0].bags
        ctx.batch_sizes = bags.batch_sizes  # output_dist sends each rank its samples back
        ctx.pooling_divisors = bags.pooling_divisors  # and divides their mean-pooled row-wise sums
        return self._lookup(bags)

    def output_dist(self, ctx: ShardedEBCContext, output: torch.Tensor) -> LazyAwaitable[KeyedTensor]:
        self._refuse_stage_alone("output_dist")
        values = divide_gradient_like_torchrec(self._output_dist(output, ctx.batch_sizes), self._env.world_size)
        values = self._real_row(values, ctx.pooling_divisors)
        # torchrec's own awaitable: a LazyAwaitable[KeyedTensor] that also supports kt["feature"] lazily.
        return EmbeddingBagCollectionAwaitable(awaitables=[NoWait(values)], embedding_dims=self._feature_dims,
                                               embedding_names=self.feature_names)

    def _refuse_stage_alone(self, stage: str) -> None:
        """comm=fused: the lookup and its output dist are one kernel, which only compute_and_output_dist runs (the
        module's forward and TrainPipelineSparseDist call it); a caller of the stages apart would silently run the
        bulk stages, never checked against the fused path's state. Every rank alike."""
        if self._exchange is not None:
            raise RuntimeError(f"{stage}: with comm=fused the lookup and its output dist are one kernel, run by "
                               f"compute_and_output_dist; a pipeline that calls compute and output_dist apart needs "
                               f"comm='bulk'")

    def compute_and_output_dist(self, ctx: ShardedEBCContext, input: KJTList) -> LazyAwaitable[KeyedTensor]:
        if self._exchange is None:
            return self.output_dist(ctx, self.compute(ctx, input))
        bags = input[0].bags
        values = self._real_row(self._exchange(bags, torchrec_gradient_scale(self._env.world_size)),
                                bags.pooling_divisors)
        return EmbeddingBagCollectionAwaitable(awaitables=[NoWait(values)], embedding_dims=self._feature_dims,
                                               embedding_names=self.feature_names)

    @property
    def backward_pushes(self) -> dict[str, int] | None:
        """comm=fused: how many backwards' gradients the consumer's kernel pushed, and how many the exchange's
        push kernel (FusedPooledAllToAll.backward_pushes); None for comm=bulk."""
        return None if self._exchange is None else dict(self._exchange.backward_pushes)

    @property
    def fused_optimizer(self) -> FusedTableOptimizer:
        return self._optim

    @property
    def unsharded_module_type(self) -> type[EmbeddingBagCollection]:
        return EmbeddingBagCollection

    def reset_parameters(self) -> None:
        """As torchrec's sharded collection's (DMP._reset_parameters calls it): this rank's tables, column shards and
        row blocks drawn from their configs' init again (lookup.init_block), in place; the optimizer state stays."""
        self._reset_parameters()

    # -- helpers --------------------------------------------------------------------------------------------------

    def _real_row(self, values: torch.Tensor, divisors: torch.Tensor | None) -> torch.Tensor:
        """The output dist's row -> [local batch, sum of dims]: with row-wise tables, each sample's row blocks'
        parts summed (mean-pooled ones divided by their bag sizes)."""
        return values if self._row_block_sum is None else self._row_block_sum(values, divisors)


def _refuse_other_modules(module: nn.Module) -> None:
    """DMP hands a sharder only modules of its module_type; a direct call may hand it another (an
    EmbeddingCollection's unpooled sequence embeddings have no pooled lookup here)."""
    if not isinstance(module, EmbeddingBagCollection):
        raise TypeError(f"FusedEmbeddingBagCollectionSharder shards torchrec's EmbeddingBagCollection only, not "
                        f"{type(module).__name__}: give DMP torchrec's own sharder for it (EmbeddingCollectionSharder "
                        f"for an EmbeddingCollection) next to this one")


class FusedEmbeddingBagCollectionSharder(BaseEmbeddingSharder[EmbeddingBagCollection]):
    """Shards `torchrec.EmbeddingBagCollection` table-wise, column-wise or row-wise with our module; the optimizer runs
    in backward.

    Other modules (an EmbeddingCollection) are not ours: DMP leaves them to the sharders given for them, or unsharded
    when there is none (torchrec's rule), and shard() refuses them with a TypeError. So does it refuse tables that
    our lookup cannot hold (lookup.check_table: quantized rows, pooling other than SUM / MEAN, torchrec's virtual
    key-value tables, enable_embedding_update, pruned or bucketized tables), naming the table and the setting.

    Each table's embedding optimizer (exact SGD or exact row-wise Adagrad, its lr and eps; tables may differ) comes
    from torchrec's settings, read as stock torchrec's EmbeddingBagCollectionSharder reads them, or from `optimizer`:
    fused_params: torchrec's {"optimizer": EmbOptimType.EXACT_SGD | EXACT_ROWWISE_ADAGRAD, "learning_rate": ...,
        "eps": ...} for every table; apply_optimizer_in_backward on a table's weight (torch.optim.SGD /
        torchrec.optim.SGD, torchrec.optim.RowWiseAdagrad; lr, eps) overrides it for that table.
    optimizer: our EmbeddingOptimizerConfig, for every table, or a mapping of each table's (of every EBC of the
    model: DMP hands them all to this sharder). Given with torchrec's settings, both must run the same update where
    torchrec's say anything of it (the optimizer, learning_rate, eps).
    Neither given: stock torchrec's default for its FUSED kernel, fbgemm's (exact SGD, lr 0.01). Anything else
    (another optimizer, weight_decay or momentum other than 0, other fbgemm settings, in fused_params or in the
    plan: the planner's ParameterConstraints' output_dtype, cache_params, ...) raises a ValueError naming the table
    and the setting (`resolve_optimizer`), at construction for fused_params, at shard() for the tables.
    comm: which input dist / lookup / output dist implementation: "bulk" (torch.distributed, any device) or "fused"
        (CUDA: lookup and output dist as one kernel), or a FusedCommConfig: fused with its settings (transport,
        num_programs, wait_timeout_spins, allocation_timeout_s; "fused" takes their defaults). Fused outputs live in
        the exchange's double buffer: valid until the module's next call (a peer running ahead may then store
        its call after next there; clone an output to keep it), the step's backward may read it until the call
        after next (a later one raises).
    sharding_types: what the planner is offered (a plan given to DMP may use any of SHARDING_TYPES, offered or not).
        Row-wise only when asked: offered it, torchrec's planner on the CPU cuts nearly every table into row blocks
        (stock torchrec's sharder makes small tables data-parallel there, which we do not offer), and row blocks
        cost time (docs/benchmarks.md, 12-02).
    """

    def __init__(self, optimizer: TableOptimizers | None = None, comm: str | FusedCommConfig = "bulk",
                 sharding_types: Sequence[str] = OFFERED_BY_DEFAULT, fused_params: dict[str, Any] | None = None):
        super().__init__(fused_params=fused_params, qcomm_codecs_registry=None)  # the planner reads fused_params too
        if not (optimizer is None or isinstance(optimizer, EmbeddingOptimizerConfig)
                or (isinstance(optimizer, Mapping) and all(isinstance(c, EmbeddingOptimizerConfig)
                                                           for c in optimizer.values()))):
            raise TypeError(f"optimizer must be an EmbeddingOptimizerConfig, a mapping of table names to them, or "
                            f"None; got {optimizer!r}")
        config_from_settings(fused_params or {}, f"fused_params {fused_params}")  # fail before planning
        fused_comm_config(comm)  # refused at construction, before planning
        unknown = sorted(set(sharding_types) - set(SHARDING_TYPES))
        if unknown or not sharding_types:
            raise ValueError(f"sharding_types {list(sharding_types)}: expected some of {list(SHARDING_TYPES)}")
        self.optimizer = optimizer
        self.comm = comm
        self.offered = list(sharding_types)

    @property
    def module_type(self) -> type[EmbeddingBagCollection]:
        return EmbeddingBagCollection

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return list(self.offered)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return [EmbeddingComputeKernel.FUSED.value] if sharding_type in self.offered else []

    def shardable_parameters(self, module: EmbeddingBagCollection) -> dict[str, nn.Parameter]:
        _refuse_other_modules(module)
        # As torchrec's EmbeddingBagCollectionSharder: plan entries are keyed by table name.
        return {name.split(".")[0]: param for name, param in module.embedding_bags.named_parameters()}

    def shard(self, module: EmbeddingBagCollection, params: Mapping[str, ParameterSharding], env: ShardingEnv,
              device: torch.device | None = None, module_fqn: str | None = None) -> FusedShardedEBC:
        _refuse_other_modules(module)
        # the plan first: resolve_optimizer reads each table's entry, which plan_from_torchrec checks
        plan = plan_from_torchrec(module.embedding_bag_configs(), params, env.world_size)
        try:
            optimizer = resolve_optimizer(module, self.fused_params or {}, self.optimizer, params)
        except ValueError as error:
            raise ValueError(f"{module_fqn or 'EmbeddingBagCollection'}: {error}") from None
        return FusedShardedEBC(module, plan, env, optimizer, device=device, comm=self.comm)
