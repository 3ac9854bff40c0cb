"""The communicating layers of the DLRM a config trains, with its real shapes, in both modes.

bulk: comm.mode=bulk with plain all-reduces of the dense gradients (one per dense arch, as its ArchNode makes it);
fused: comm.mode=fused (the configured fused settings, or conf/comm/fused.yaml's defaults when the run is bulk) with
the configured comm.grad_allreduce. Both models are built from the same config and seed and fed the same first
training batch. A config train/loop.py's train refuses is refused here too, by the same checks (check_config,
build_data, build_model), those of the settings only training reads (its length, cadence, evaluation) included;
not those of the run's files (a checkpoint directory holding later steps, trainer.resume_from's checkpoint).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from fused_dlrm.dist import DistEnv
from fused_dlrm.kernels.batch_header import FIRST_COUNT
from fused_dlrm.report.layers import (STEP, CommLayer, Mode, bytes_of, counted, forward_backward, fused_or_reason,
                                      grad_allreduce_layer, no_fused_path, no_grad)
from fused_dlrm.sparse.fused_all_to_all import FusedCommConfig
from fused_dlrm.train.build import batch_stream, build_model, dense_parameters
from fused_dlrm.train.graphed_step import dense_step
from fused_dlrm.train.loop import build_data, check_config, features_of, make_train_step, pull_batch


def with_comm(cfg: DictConfig, mode: str) -> DictConfig:
    """cfg with its comm group switched to `mode` (bulk or fused), as described in the module docstring."""
    c = OmegaConf.to_container(cfg, resolve=True)
    if mode == "bulk":
        c["comm"] = {**c["comm"], "mode": "bulk", "grad_allreduce": "nccl"}
    else:
        c["comm"] = {**asdict(FusedCommConfig()), **c["comm"], "mode": "fused"}
    return OmegaConf.create(c)


class _Run:
    """One model of the report (bulk or fused), its dense optimizer and the first training batch on the device."""

    def __init__(self, cfg: DictConfig, env: DistEnv):
        self.env = env
        self.model = build_model(cfg, env)
        self.sparse = self.model.sparse_arch.embedding_bag_collection
        self.optimizer = instantiate(cfg.trainer.dense_optimizer, params=dense_parameters(self.model))
        self.step = dense_step(self.optimizer, cfg.trainer.cuda_graphs, env.device)  # as the training loop's
        self.train_step = make_train_step(self.model, self.optimizer, self.step, env.world_size,
                                          cfg.trainer.direct_step)  # the loop's
        # as the loop makes and distributes it: a batch one rank could not make (a malformed line in its slice)
        # raises in the input dist on every rank, not on that rank alone while the others wait there for it
        train_data, _ = build_data(cfg, env)  # the eval data checked as training checks it
        self.batch = pull_batch(batch_stream(train_data, 0, cfg.data.get("steps_per_epoch")), env.device)
        self.bags = self.sparse.bags_of(features_of(self.batch))

    def lookup_modes(self, grad: torch.Tensor) -> Mode:
        exchange = lambda: self.sparse.pooled(self.bags)  # the fused exchange, or lookup + all-to-all (+ row blocks)
        return {"fwd": no_grad(exchange), "fwd_bwd": forward_backward(exchange, grad)}

    def step_modes(self) -> Mode:
        b = self.batch
        return {"fwd": no_grad(lambda: self.model(b.dense_features, b.sparse_features)),
                "fwd_bwd": lambda: self.train_step(b)}


def dlrm_layers(cfg: DictConfig, env: DistEnv, run_dir: Path) -> list[CommLayer]:
    check_config(cfg)  # what training refuses is not timed
    reason = no_fused_path(env)
    bulk = _Run(with_comm(cfg, "bulk"), env)
    fused = None if reason else _Run(with_comm(cfg, "fused"), env)
    sparse, kjt, bags = bulk.sparse, bulk.batch.sparse_features, bulk.bags
    rank, world = env.rank, env.world_size
    local_batch, global_batch = bags.batch_sizes[rank], bags.global_batch
    m = cfg.model

    # input dist: the indices (weights, lengths) of a feature leave this rank once for every shard of its table that
    # another rank holds (of a row-wise table: each index for its row block's rank); the lengths travel in the
    # indices' dtype; before them the header (sizes and checks), one row of int64 to every other rank
    input_dist = sparse.input_dist
    keys = list(kjt.keys())
    sent_keys, sent_lengths = input_dist.sent_keys(kjt)
    per_key = sent_lengths.sum(dim=1).tolist()
    copies = {k: sum(feats.count(k) for r, feats in enumerate(input_dist.features_of_rank) if r != rank)
              for k in sent_keys}
    index_bytes = kjt.values().element_size()
    weights = None if input_dist.is_weighted is False else kjt.weights_or_none()
    value_bytes = index_bytes + (0 if weights is None else weights.element_size())
    sent = (sum((n * value_bytes + local_batch * index_bytes) * copies[k] for k, n in zip(sent_keys, per_key))
            + (world - 1) * (FIRST_COUNT + input_dist.width) * 8)
    dtype = lambda t: str(t.dtype).removeprefix("torch.")
    input_dist_layer = CommLayer(
        "sparse input dist (KJT all-to-all)",
        f"{local_batch} samples x {len(keys)} features, {kjt.values().numel():,} {dtype(kjt.values())} indices"
        + ("" if weights is None else f" with {dtype(weights)} weights") + " on this rank",
        {"fwd": sent}, {"fwd": lambda: input_dist(kjt)},
        "no fused input dist yet: both modes run this bulk all-to-all (sizes known on the host)")

    # lookup + output dist: the owner's pooled rows for other ranks' samples go out; their gradients come back (the
    # columns of every row block's part, with row-wise tables: a wider row than the output's)
    my_dim = sparse.lookup.output_dim
    total_dim = sum(t.embedding_dim * len(t.feature_names) for t in sparse.embedding_bag_configs())
    wide_dim = sum(map(sum, sparse.output_dist.dims_of_rank))
    grad = torch.randn(local_batch, total_dim, device=env.device)
    forward_bytes = (global_batch - local_batch) * my_dim * 4
    backward_bytes = local_batch * (wide_dim - my_dim) * 4
    rows = f"{m.num_rows:,}" if isinstance(m.num_rows, int) else f"{min(m.num_rows):,}..{max(m.num_rows):,}"
    tables = counted(len(keys), "table", "tables")
    shards = sparse.plan.shards
    # every table cut into row blocks (one too small to cut stays whole) or every one into column shards, or none
    cut = "" if len(shards) == len(sparse.embedding_bag_configs()) else \
        f" in {len(shards)} {'row blocks' if any(s.rows is not None for s in shards) else 'column shards'}"
    lookup = CommLayer(
        "embedding lookup + output dist (pooled all-to-all)",
        f"{tables}{cut} ({len(sparse.shard_weights)} here) x {rows} rows x D={m.embedding_dim} {m.data_type}, "
        f"pooled [{global_batch} x {my_dim}] here -> [{local_batch} x {total_dim}] per rank",
        {"fwd": forward_bytes, "fwd_bwd": forward_bytes + backward_bytes},
        bulk.lookup_modes(grad), fused_or_reason(reason, lambda: fused.lookup_modes(grad)))

    # each dense arch's ArchNode all-reduces its own flat gradient buffer (models/arch_nodes.py): two calls, not one
    # of every dense parameter (a codec pads each call's chunks; each call pays its latency)
    allreduces = [grad_allreduce_layer([p.numel() for p in arch.forward.params], cfg.comm.grad_allreduce, env,
                                       reason, cfg.comm.allocation_timeout_s, name=f"gradient all-reduce ({what})")
                  for what, arch in (("dense arch", bulk.model.dense_arch), ("over arch", bulk.model.over_arch))]

    def step_bytes(mode: str) -> dict[str, int]:
        return {"fwd": sent + forward_bytes,
                "fwd_bwd": sent + forward_bytes + backward_bytes
                + sum(bytes_of(allreduce, mode)["fwd_bwd"] for allreduce in allreduces)}

    step = CommLayer(
        STEP, f"global batch {global_batch} over {world} rank(s)", step_bytes("bulk"),
        bulk.step_modes(), fused_or_reason(reason, lambda: fused.step_modes()), fused_bytes_sent=step_bytes("fused"))
    return [input_dist_layer, lookup, *allreduces, step]
