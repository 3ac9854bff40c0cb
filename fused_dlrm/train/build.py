"""Build the model, optimizers and data streams a run needs from its Hydra config."""

from __future__ import annotations

from itertools import count
from typing import Iterator, Sequence

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import get_class
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from torch import nn
from torchrec import EmbeddingBagConfig
from torchrec.datasets.utils import Batch

from fused_dlrm.config_checks import ArgumentError, check_comm_mode, check_count
from fused_dlrm.data import local_batch_bounds
from fused_dlrm.dist import DistEnv
from fused_dlrm.dist.env import check_device_name, check_same_on_every_rank, raise_on_every_rank
from fused_dlrm.dist.symmetric import check_allocation_timeout
from fused_dlrm.models.arch_nodes import dense_arch_nodes
from fused_dlrm.models.dlrm import build_dlrm, make_tables
from fused_dlrm.sparse import EmbeddingOptimizerConfig, plan_sharding
from fused_dlrm.sparse.fused_all_to_all import FusedCommConfig
from fused_dlrm.train.config_keys import CONF, check_config_keys
from fused_dlrm.train.rundir import register_resolvers


def compose_config(overrides: Sequence[str], return_hydra_config: bool = False) -> DictConfig:
    """The config train.py would run with these overrides, composed from the repository's conf/ (for entry points
    that are not @hydra.main: the report, the benchmarks); keys no code reads refused, as a model's train refuses
    them, against the options Hydra records as chosen (in the `hydra` node, dropped unless return_hydra_config)."""
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
    check_config_keys(cfg)
    if not return_hydra_config:
        with open_dict(cfg):
            del cfg["hydra"]
    return cfg


def feature_names(data_cfg: DictConfig) -> list[str]:
    # YAML's true would be one feature; 0 failed in torchrec's assert, naming no key
    check_count("data.num_sparse", data_cfg.num_sparse, 1, "a whole number >= 1 of sparse features")
    return [f"cat_{i}" for i in range(data_cfg.num_sparse)]


def table_rows(cfg: DictConfig) -> list[int]:
    """model.num_rows as one table size per sparse feature: one number is every table's. A float failed in list(), a
    string was one table per character, and a list of another length named no key."""
    rows, features = cfg.model.num_rows, len(feature_names(cfg.data))
    if not isinstance(rows, ListConfig):
        check_count("model.num_rows", rows, 1, f"a whole number of rows >= 1 or a list of one per sparse feature "
                                               f"(data.num_sparse={features})")
        return [rows] * features
    if len(rows) != features:
        raise ValueError(f"model.num_rows={list(rows)}: {len(rows)} table sizes for data.num_sparse={features} sparse "
                         f"features")
    return list(rows)


def config_tables(cfg: DictConfig) -> list[EmbeddingBagConfig]:
    """The embedding tables of cfg's DLRM, one per sparse feature."""
    m = cfg.model
    return make_tables(feature_names(cfg.data), table_rows(cfg), m.embedding_dim, m.pooling, m.data_type)


def embedding_optimizers(cfg: DictConfig, tables: list[EmbeddingBagConfig]) -> dict[str, EmbeddingOptimizerConfig]:
    """Each table's optimizer from model.embedding_optimizer: its name, lr and eps each one value for every table or,
    as model.num_rows, a list with one per sparse feature (rowwise_adagrad for some tables, sgd for others)."""
    settings = OmegaConf.to_container(cfg.model.embedding_optimizer, resolve=True)
    for key, value in settings.items():
        if isinstance(value, list) and len(value) != len(tables):
            raise ValueError(f"model.embedding_optimizer.{key}: {len(value)} values for {len(tables)} tables (one per "
                             f"sparse feature, or one for every table)")
    configs = {}
    for i, table in enumerate(tables):
        mine = {key: value[i] if isinstance(value, list) else value for key, value in settings.items()}
        try:
            configs[table.name] = EmbeddingOptimizerConfig(**mine)
        except ValueError as error:  # an unknown name, a negative or non-finite lr or eps
            raise ValueError(f"model.embedding_optimizer of table {table.name} ({mine}): {error}") from None
    return configs


def check_layer_widths(key: str, widths: object) -> None:
    """An arch's layer widths: a width of 0 trained a layer of nothing (its inputs ignored); an empty list, one
    number or a float failed in omegaconf or torch, naming no key."""
    if (not isinstance(widths, ListConfig) or not widths
            or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in widths)):
        shown = list(widths) if isinstance(widths, ListConfig) else widths
        raise ValueError(f"{key}={shown!r}: expected a list of layer widths, whole numbers >= 1")


def build_model(cfg: DictConfig, env: DistEnv) -> nn.Module:
    m = cfg.model
    tables = config_tables(cfg)  # their settings checked (model.embedding_dim: a width, before it is compared)
    # before build_dlrm allocates: every rank plans alike, so a refused cut is raised on all
    plan = plan_sharding(tables, env.world_size, m.column_shards, m.row_shards, prefix="model.")
    check_layer_widths("model.dense_arch", m.dense_arch)
    check_layer_widths("model.over_arch", m.over_arch)
    if m.dense_arch[-1] != m.embedding_dim:  # the interaction takes the bottom MLP's output as one more embedding
        raise ValueError(f"model.dense_arch={list(m.dense_arch)} must end in model.embedding_dim={m.embedding_dim}")
    # a float or YAML's true failed in torch (the dense arch's Linear, or the data's randn), naming no key
    check_count("data.num_dense", cfg.data.num_dense, 1, "a whole number >= 1 of dense features")
    check_allocation_timeout(cfg.comm.allocation_timeout_s)  # before build_dlrm allocates the tables
    model = build_dlrm(tables, cfg.data.num_dense, m.dense_arch, m.over_arch,
                       embedding_optimizers(cfg, tables), env.device, seed=cfg.seed,
                       comm=fused_comm(cfg.comm),
                       plan=plan)
    graph_batch = None
    if cfg.trainer.cuda_graphs and env.device.type == "cuda":  # captured at the rank's training batch size
        start, stop = local_batch_bounds(cfg.data.global_batch_size, env.rank, env.world_size)
        graph_batch = stop - start
    # data-parallel dense arches
    return dense_arch_nodes(model, cfg.comm.grad_allreduce, graph_batch, cfg.comm.allocation_timeout_s)


def fused_comm(comm: DictConfig) -> FusedCommConfig | None:
    """None for comm=bulk; the fused exchange's settings for comm=fused."""
    check_comm_mode(comm.mode)
    if comm.mode == "bulk":
        return None
    return FusedCommConfig(transport=comm.transport, num_programs=comm.num_programs,
                           wait_timeout_spins=comm.wait_timeout_spins, allocation_timeout_s=comm.allocation_timeout_s)


def dense_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Everything the dense optimizer steps: the tables require no grad, their optimizer runs in backward."""
    return [p for p in model.parameters() if p.requires_grad]


def build_dataset(cfg: DictConfig, split: str, env: DistEnv):
    """The train or eval dataset: `cfg.data.<split>` names its class (`_target_`) and its own arguments; a `device`
    of auto is the model's (env.device)."""
    names = feature_names(cfg.data)
    rows = table_rows(cfg)
    # by its key (the datasets name their argument, or a world size of one rank only)
    check_count("data.global_batch_size", cfg.data.global_batch_size, env.world_size,
                f"a whole number of samples >= the world size {env.world_size}: each rank takes a slice of the batch")
    unset = [k for k in cfg.data[split] if OmegaConf.is_missing(cfg.data[split], k)]
    if unset:  # to_container would pass the marker on as the string "???" (a file of that name, not found)
        raise ValueError(f"data.{split}.{unset[0]} must be given, e.g. data.train.paths=[train.tsv] "
                         "data.eval.paths=[eval.tsv]")
    kwargs = {k: v for k, v in OmegaConf.to_container(cfg.data[split], resolve=True).items() if k != "_target_"}
    device = str(kwargs.get("device", "cpu"))
    check_device_name(f"data.{split}.device", device)
    if device == "auto":  # where the model is: no host time per batch on GPUs (conf/data/synthetic.yaml)
        kwargs["device"] = env.device
    elif device.startswith("cuda") and env.device.type != "cuda":
        # batches made on a GPU for a model on the host would meet it only in the dense arch, as a device mismatch
        raise ValueError(f"data.{split}.device={kwargs['device']} makes the batches on a GPU, but the model is on "
                         f"{env.device}: set data.{split}.device=cpu (or trainer.device=cuda)")
    # Called directly rather than through hydra's instantiate, so errors (a missing file) reach the user unwrapped;
    # on every rank, since a file one node lacks fails there alone (the others would wait in the next collective).
    try:
        dataset, problem = get_class(cfg.data[split]._target_)(
            num_rows=rows, feature_names=names, global_batch_size=cfg.data.global_batch_size, rank=env.rank,
            world_size=env.world_size, **kwargs), None
    except ArgumentError as error:  # a refused argument: named by its key here where it is one of data.<split>'s
        dataset, problem = None, error
        if error.argument in kwargs:
            problem = ValueError(f"data.{split}.{error.argument} {error.problem}")
            problem.__cause__ = error  # raised outside this block: the class's traceback kept
    except Exception as error:  # noqa: BLE001: raised here, and named on every other rank
        dataset, problem = None, error
    raise_on_every_rank(problem, f"cannot make their data.{split} dataset")
    if hasattr(dataset, "file_sizes"):
        # copies on other nodes: one cut short would end that rank's batches first, and its peers would wait for it
        sizes = dataset.file_sizes()
        check_same_on_every_rank(f"{sizes} bytes", f"data.{split}'s files differ",
                                 f"{dataset.paths} of {sizes} bytes", "every rank must read the same files")
    return dataset


def batch_stream(dataset, start_step: int, steps_per_epoch: int | None, epochs: int | None = None
                 ) -> Iterator[tuple[int, Batch]]:
    """(epoch, batch) from global step `start_step` on, to the end of `epochs` epochs (endless without).

    Step-indexed datasets (`batch(step)`, epochs of `steps_per_epoch` steps; without steps_per_epoch every step is
    of epoch 0 and `epochs` ends nothing, trainer.max_steps does) resume exactly; streamed ones (files)
    are replayed pass after pass and the batches before `start_step` are skipped, read but not made where the
    dataset offers `skipping(batches)` (CriteoTSV: not parsed); so a resume needs the checkpoint's global batch size
    (load_checkpoint refuses another). The stream ends with the last
    epoch rather than with a batch of the next one: whether a run goes on past a batch is then known without
    that batch, also on a rank that could not make it (train/loop.py).
    """
    if hasattr(dataset, "batch"):
        for step in (range(start_step, epochs * steps_per_epoch) if epochs is not None and steps_per_epoch
                     else count(start_step)):
            yield (step // steps_per_epoch if steps_per_epoch else 0), dataset.batch(step)
        return
    step = 0
    for epoch in count() if epochs is None else range(epochs):
        produced = False
        skipped = max(0, start_step - step)  # read but not made where the dataset can (files: lines not parsed)
        for batch in dataset.skipping(skipped) if hasattr(dataset, "skipping") else dataset:
            produced = True
            if step >= start_step:
                yield epoch, batch
            step += 1
        if not produced:
            raise ValueError("the dataset produced no batch: is the file empty or smaller than one global batch?")


def to_device(batch: Batch, device: torch.device) -> Batch:
    """The batch on `device`; from the host through pinned memory (a pageable copy waits for the GPU to drain)."""
    if device.type != "cuda":
        return batch
    if batch.labels.device.type == "cpu":
        batch = batch.pin_memory()
    return batch.to(device, non_blocking=True)
