"""torchrec's state of a sharded collection: each table one entry of its global shape, whatever plan cut it.

As torchrec's ShardedEmbeddingBagCollection (1.8, its default ShardedTensor output):
  * model: `embedding_bags.<table>.weight` on every rank, a ShardedTensor [num_embeddings, embedding_dim] whose
    local shards are this rank's shards of the table (the whole table, column shards, row blocks) at their
    [row, column] offsets; none where the rank holds none of it (`TableShards`);
  * fused optimizer: `embedding_bags.<table>.weight` -> {"<table>.momentum1": row-wise Adagrad's accumulators} for
    each table this rank holds some of ({} for an SGD table), in torchrec's layout (its EmbeddingFusedOptimizer):
    [num_embeddings] by row for a whole table or its row blocks; [num_embeddings x column shards] for column
    shards, shard k's (by column) at row k * num_embeddings (`FusedTableOptimizer`).
The local shards are the tables' and accumulators' own storage, so torch.distributed.checkpoint loads into them in
place, and reshards: a checkpoint of one plan or world size, ours or stock torchrec's, loads under another.
Row-wise Adagrad keeps an accumulator per row of each column shard: that state loads under the same column cuts
only (row blocks, ranks and world size may differ), as in torchrec, whose state has the same keys and shapes.

Without a process group (a world of one, never initialised) there is no ShardedTensor; the entries are tensors of
the same global shapes: a table's storage where one shard holds it all, else a TablePieces over its shards (no
copy: torch.distributed.checkpoint writes and reads it piece by piece at global offsets, like a ShardedTensor's
local shards; any other op sees a copy of the whole table); an Adagrad table's accumulators (stored in torchrec's
layout: `momentum_storage`).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard as LocalShard
from torch.distributed._shard.sharded_tensor import ShardedTensor, ShardedTensorMetadata, TensorProperties
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.metadata import TensorProperties as StoredProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map
from torchrec import EmbeddingBagConfig
from torchrec.optim.fused import FusedOptimizer

from fused_dlrm.sparse.optimizer import EmbeddingOptimizer, EmbeddingOptimizerConfig
from fused_dlrm.sparse.plan import Shard, TableShardingPlan

# One piece of an entry: (plan rank, offsets, sizes) in the entry's global shape.
Layout = list[tuple[int, list[int], list[int]]]


def _sharded(size: list[int], layout: Layout, local: dict[tuple[int, ...], torch.Tensor], dtype: torch.dtype,
             group: dist.ProcessGroup | None, device: torch.device) -> ShardedTensor:
    """A ShardedTensor of global `size` cut as `layout`, whose local shards are `local` (this rank's storage, by
    offsets): built from the plan on each rank, without a collective (as torchrec builds its own). Every shard's
    placement names this rank's device: the metadata needs a peer's rank, not its device."""
    metadata = [ShardMetadata(shard_offsets=offsets, shard_sizes=sizes,
                              placement=f"rank:{rank if group is None else dist.get_global_rank(group, rank)}/{device}")
                for rank, offsets, sizes in layout]
    me = dist.get_rank()  # global, as the placements
    shards = [LocalShard(local[tuple(m.shard_offsets)], m) for m in metadata if m.placement.rank() == me]
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, ShardedTensorMetadata(metadata, torch.Size(size), TensorProperties(dtype=dtype)), process_group=group)


def copy_into(value: Any, local: dict[tuple[int, ...], torch.Tensor], size: list[int], what: str) -> None:
    """Copy a state_dict entry of global shape `size` into this rank's storage (`local`, by offsets), in place: a
    ShardedTensor holding this rank's pieces at their offsets (one of this plan's, which
    torch.distributed.checkpoint loaded into), a world of one's TablePieces (the same), or a whole tensor (an
    unsharded collection's, or another world of one's TablePieces, cut otherwise)."""
    if isinstance(value, DTensor):
        raise TypeError(f"{what}: a DTensor (torchrec's output_dtensor state) is not read here; give its full "
                        f"tensor, or load it through torch.distributed.checkpoint")
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{what}: expected a tensor or a ShardedTensor, got {type(value).__name__}")
    if list(value.size()) != size:
        raise ValueError(f"{what}: a {type(value).__name__} of shape {list(value.size())}, expected {size}")
    given = None  # the entry's pieces, by offsets, where it is in pieces
    if isinstance(value, ShardedTensor):
        given = {tuple(s.metadata.shard_offsets): s.tensor for s in value.local_shards()}
    elif isinstance(value, TablePieces):
        given = value.pieces
        if any(offsets not in given or given[offsets].shape != t.shape for offsets, t in local.items()):
            given, value = None, value.whole()  # cut otherwise: the table, once
    for offsets, tensor in local.items():
        source = value[_at(offsets, tensor)] if given is None else given.get(offsets)
        if source is None or source.shape != tensor.shape:
            raise ValueError(f"{what}: the ShardedTensor holds no local shard of {list(tensor.shape)} at "
                             f"{list(offsets)} on this rank (it is cut for another plan): load another plan's "
                             f"state through torch.distributed.checkpoint, into this state_dict (it reshards)")
        if source.data_ptr() != tensor.data_ptr():  # not this storage itself (a checkpoint loaded into it)
            tensor.copy_(source)


class TablePieces(torch.Tensor):
    """Without a process group (a world of one): the entry of a table held in several pieces (column shards, row
    blocks), a tensor of the table's global shape that holds no data of its own but the pieces (`pieces`, by
    offsets). torch.distributed.checkpoint writes and reads it piece by piece at the pieces' global offsets (its
    _Checkpointable hooks, as DTensor's), so a checkpoint neither copies the table nor reads it whole (a copy of each
    cut table would cost its memory again on its device), and stores the same global entry as a sharded run's: it
    resumes under any plan and world size. Any other use (an op, torch.save) sees the whole table: a copy (`whole`),
    into which a write is lost, as into any state_dict copy."""

    pieces: dict[tuple[int, ...], torch.Tensor]

    @staticmethod
    def __new__(cls, size: list[int], pieces: dict[tuple[int, ...], torch.Tensor], dtype: torch.dtype) -> TablePieces:
        entry = torch.Tensor._make_wrapper_subclass(cls, size, dtype=dtype, device=next(iter(pieces.values())).device)
        entry.pieces = pieces
        return entry

    def whole(self) -> torch.Tensor:
        """A copy of the table: the pieces put together."""
        whole = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        for offsets, tensor in self.pieces.items():
            whole[_at(offsets, tensor)] = tensor
        return whole

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(value: Any) -> Any:
            return value.whole() if isinstance(value, TablePieces) else value
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))

    # What torch does not dispatch for a subclass (or refuses for one): on the whole table.
    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.whole().__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        return self.whole()

    def numpy(self, *, force: bool = False) -> Any:
        return self.whole().numpy(force=force)

    def tolist(self) -> Any:
        return self.whole().tolist()

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"TablePieces({list(self.shape)}, pieces at {sorted(self.pieces)})"

    # torch.distributed.checkpoint's _Checkpointable protocol
    def __create_write_items__(self, fqn: str, entry: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk, StoredProperties.create_from_tensor(tensor), self.shape))
                for chunk, tensor in zip(self.__create_chunk_list__(), self.pieces.values())]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(offsets), tensor.shape) for offsets, tensor in self.pieces.items()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.pieces[tuple(index.offset)]


def _at(offsets: tuple[int, ...], piece: torch.Tensor) -> tuple[slice, ...]:
    """A piece's place in its entry."""
    return tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape))


class TableShards(nn.Module):
    """torchrec's `embedding_bags.<table>`: this rank's shards of one table, each a parameter named as its shard
    (`<table>`, `<table>_cols_<first>_to_<last>`, `<table>_rows_<first>_to_<last>`; none on a rank that holds none),
    and the state_dict entry `weight`, the whole table's ShardedTensor over them (the module docstring)."""

    def __init__(self, table: EmbeddingBagConfig, shards: Sequence[Shard], rank: int, weights: dict[str, torch.Tensor],
                 dtype: torch.dtype, group: dist.ProcessGroup | None, device: torch.device):
        """shards: every rank's shards of the table (plan order); weights: this rank's, by shard name, of `dtype`."""
        super().__init__()
        self._size = [table.num_embeddings, table.embedding_dim]
        self._layout = [(s.rank, [s.row, s.col], [s.num_rows(table), s.dim]) for s in shards]
        mine = [s for s in shards if s.rank == rank]
        for s in mine:
            self.register_parameter(s.name, nn.Parameter(weights[s.name], requires_grad=False))
        self._offsets = {s.name: (s.row, s.col) for s in mine}
        self._dtype, self._group, self._device = dtype, group, device

    def shard_weights(self) -> dict[str, nn.Parameter]:
        """This rank's shards of the table, by shard name."""
        return dict(self.named_parameters(recurse=False))

    def _local(self) -> dict[tuple[int, ...], torch.Tensor]:
        return {self._offsets[name]: weight.detach() for name, weight in self.named_parameters(recurse=False)}

    @property
    def weight(self) -> ShardedTensor | torch.Tensor:
        """The table's state_dict entry (without a process group its storage or a TablePieces: the module
        docstring)."""
        local = self._local()
        if dist.is_initialized():
            return _sharded(self._size, self._layout, local, self._dtype, self._group, self._device)
        if len(local) == 1:  # a world of one's whole table: its storage
            return next(iter(local.values()))
        return TablePieces(self._size, local, self._dtype)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        destination[prefix + "weight"] = self.weight

    def _load_from_state_dict(self, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        key = prefix + "weight"
        if strict:  # as nn.Module's: other keys under this module's prefix
            unexpected_keys += [k for k in state_dict if k.startswith(prefix) and k != key]
        if key not in state_dict:
            missing_keys.append(key)
            return
        with torch.no_grad():  # raised, not left in error_msgs: DMP's load_state_dict drops those
            copy_into(state_dict[key], self._local(), self._size, key)


def _momentum_layout(table: EmbeddingBagConfig, shards: Sequence[Shard]) -> tuple[list[int], Layout]:
    """torchrec's layout of a row-wise Adagrad table's accumulators (the module docstring): (global size, every
    rank's pieces); shards: the table's, plan order (by column, row blocks by row)."""
    rows = table.num_embeddings
    if shards[0].rows is not None:  # row blocks: the table's accumulator per row
        return [rows], [(s.rank, [s.row], [s.rows]) for s in shards]
    return [rows * len(shards)], [(s.rank, [k * rows], [rows]) for k, s in enumerate(shards)]


def _momentum_entry(table: EmbeddingBagConfig, plan: TableShardingPlan, rank: int, storage: torch.Tensor,
                    group: dist.ProcessGroup | None, device: torch.device) -> ShardedTensor | torch.Tensor:
    """A row-wise Adagrad table's state entry over its accumulators here (`momentum_storage`'s)."""
    if not dist.is_initialized():  # a world of one: the storage is the whole state
        return storage
    size, layout = _momentum_layout(table, [s for s in plan.shards if s.table == table.name])
    pieces = [tuple(offsets) for r, offsets, _ in layout if r == rank]
    return _sharded(size, layout, dict(zip(pieces, shard_momenta(table, plan, rank, storage).values())),
                    torch.float32, group, device)


def momentum_storage(tables: Sequence[EmbeddingBagConfig], plan: TableShardingPlan, rank: int,
                     optimizers: dict[str, EmbeddingOptimizerConfig], device: torch.device) -> dict[str, torch.Tensor]:
    """The accumulators of each row-wise Adagrad table this rank holds some of (zeros), by table: one tensor of its
    shards' here in plan order, which in a world of one is the table's whole state in torchrec's layout (the entry
    without a process group, loaded in place); `shard_momenta` cuts it."""
    storage = {}
    for t in tables:
        rows = [s.num_rows(t) for s in plan.shards_of(rank) if s.table == t.name]
        if rows and optimizers[t.name].name == "rowwise_adagrad":
            storage[t.name] = torch.zeros(sum(rows), dtype=torch.float32, device=device)
    return storage


def shard_momenta(table: EmbeddingBagConfig, plan: TableShardingPlan, rank: int,
                  storage: torch.Tensor) -> dict[str, torch.Tensor]:
    """A table's accumulators (`momentum_storage`'s) as its shards' here, by shard name: views of it."""
    mine = [s for s in plan.shards_of(rank) if s.table == table.name]
    return dict(zip([s.name for s in mine], storage.split([s.num_rows(table) for s in mine])))


class FusedTableOptimizer(FusedOptimizer):
    """The KeyedOptimizer DMP's `fused_optimizer` collects: a view of the lookup's optimizer, not a second one.

    One param group per setting of the tables this rank holds some of, {"params": the tables' weight entries,
    "lr": theirs}, as stock torchrec has one per TBE (it groups a rank's tables by their fused params; each TBE's
    EmbeddingFusedOptimizer has one group); a rank that holds no table has none. The update happens in the lookup's
    backward, so step() and zero_grad() only carry each group's lr (an LR scheduler edits param_groups) to its
    tables' shards in the lookup's optimizer, as torchrec's EmbeddingFusedOptimizer does for fbgemm; it takes effect
    from the next backward. Keys, state names and layout follow torchrec's (the module docstring), so state_dict()
    / load_state_dict() (in place) work as for torchrec's fused tables, and reshard through
    torch.distributed.checkpoint within the same column cuts.
    """

    def __init__(self, tables: Sequence[EmbeddingBagConfig], plan: TableShardingPlan, rank: int,
                 embedding_bags: nn.ModuleDict, optimizer: EmbeddingOptimizer, momentum: dict[str, torch.Tensor],
                 group: dist.ProcessGroup | None, device: torch.device):
        """momentum: `momentum_storage`'s, whose views the lookup's optimizer updates."""
        self._optimizer = optimizer
        params: dict[str, Any] = {}
        state: dict[Any, Any] = {}
        self._shards: dict[str, list[str]] = {}  # each held table's shards here, by name
        by_setting: dict[EmbeddingOptimizerConfig, list[str]] = {}
        for t in tables:
            mine = [s.name for s in plan.shards_of(rank) if s.table == t.name]
            if not mine:
                continue
            self._shards[t.name] = mine
            # A key, never read (the update is the lookup's): the table's entry, no copy of the table
            weight = embedding_bags[t.name].weight
            params[f"embedding_bags.{t.name}.weight"] = weight
            state[weight] = {}
            if t.name in momentum:
                state[weight][f"{t.name}.momentum1"] = _momentum_entry(t, plan, rank, momentum[t.name], group, device)
            by_setting.setdefault(optimizer.configs[mine[0]], []).append(t.name)
        self._group_tables = list(by_setting.values())  # each param group's tables, in param_groups' order
        groups = [{"params": [params[f"embedding_bags.{name}.weight"] for name in names], "lr": config.lr}
                  for config, names in by_setting.items()]
        super().__init__(params, state, groups)

    def _sync_lr(self) -> None:
        configs = self._optimizer.configs
        for group, names in zip(self.param_groups, self._group_tables, strict=True):
            for shard in (shard for name in names for shard in self._shards[name]):
                if configs[shard].lr != group["lr"]:  # a step's host time: most steps change nothing
                    self._optimizer.update(shard, lr=group["lr"])

    def zero_grad(self, set_to_none: bool = False) -> None:
        self._sync_lr()  # the tables have no .grad to zero

    def step(self, closure: Any = None) -> None:
        self._sync_lr()  # the update already happened in backward

    def update_hyper_parameters(self, params_dict: dict[str, Any]) -> None:
        """As fbgemm's TBEs do it for stock torchrec (CombinedOptimizer passes it on to each optimizer that has it,
        so every TBE of every group): "lr" and "eps" change every held table's update from the next backward (eps
        is unused by SGD tables) and leave param_groups as they are, so the next step() / zero_grad() puts each
        group's lr back; fbgemm's other names (beta1, weight_decay, ...) are refused (our optimizers have none)."""
        unknown = sorted(set(params_dict) - {"lr", "eps"})
        if unknown:
            raise NotImplementedError(f"setting hyper-parameter(s) {unknown} is not supported: the embedding "
                                      f"optimizers (exact SGD, exact row-wise Adagrad) take lr and eps")
        for name in self._optimizer.configs:
            self._optimizer.update(name, **params_dict)
