"""MoE Transformer training on bytes of Python's stdlib: config, loss falls, exact resume, 2 and 4 gloo ranks,
corpus."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import sys
import sysconfig
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from fused_dlrm.data.batching import local_batch_bounds
from fused_dlrm.dist import DistEnv
from fused_dlrm.kernels.quant_codecs import CODECS
from fused_dlrm.kernels.quantized_allreduce import two_shot_error_bound
from fused_dlrm.tp.linear import RowParallelLinear
from fused_dlrm.train.checkpoint import NonFiniteLossError
from fused_dlrm.train.rundir import register_resolvers
from moe.data import ByteWindows, load_corpus, stdlib_corpus
from moe.routing import TopKRouter
import moe.train as moe_train
from moe.train import build_model, fused_moe_config, lr_schedule, train, weight_decay_groups
from moe.transformer import MoETransformer, expert_parameters
from world import run_torchrun, run_world

ROOT = Path(__file__).resolve().parents[1]
CPU = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)
SMALL = ["model=moe_transformer", "trainer.progress=false", "trainer.eval_every=0", "data.eval_batches=2",
         "data.size_bytes=300000"]

SAME_AS_ONE_PROCESS = SMALL + ["trainer.max_steps=10", "trainer.log_every=1", "trainer.checkpoint_every=0",
                               "model.aux_coeff=0", "model.z_coeff=0", "model.optimizer._target_=torch.optim.SGD",
                               "model.optimizer.lr=0.5"]
# 4 ranks, 2 experts each; a smaller step: the curve falls steadily.
FOUR_RANKS = SAME_AS_ONE_PROCESS + ["model.num_experts=8", "trainer.max_steps=8", "data.global_batch_size=16",
                                    "model.optimizer.lr=0.1"]


def config(*overrides: str):
    register_resolvers()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_config_composes_and_data_switches_with_the_model():
    cfg = config("model=moe_transformer")
    assert cfg.model.name == "moe_transformer" and cfg.data.path is None and cfg.data.seq_len == 64
    assert "train" not in cfg.data  # the bytes group, not synthetic
    assert config().data.train._target_.endswith("SyntheticCriteo")  # DLRM keeps its data


def test_fused_layers_are_sized_for_the_largest_share_of_a_batch():
    """comm=fused: max_tokens_per_rank is the most tokens a data-parallel rank's batch holds (5 samples over 2
    ranks: 3 on rank 0), so the fused forward never reads the counts on the host and no batch is refused."""
    cfg = config(*SMALL, "comm=fused", "data.global_batch_size=5")
    for world, tp_size in ((2, 1), (4, 2)):  # 2 data-parallel ranks either way
        cfg.model.tp_size = tp_size
        env = DistEnv(rank=1, world_size=world, local_rank=1, device=torch.device("cpu"), backend="gloo")
        most = max(stop - start for start, stop in (local_batch_bounds(5, r, 2) for r in range(2)))
        assert fused_moe_config(cfg, env).max_tokens_per_rank == most * cfg.data.seq_len == 3 * 64
    cfg.model.sequence_parallel = True  # each of the TP pair holds half of its slice's tokens
    assert fused_moe_config(cfg, env).max_tokens_per_rank == 3 * 64 // 2
    assert (fused_moe_config(cfg, env).dispatch, fused_moe_config(cfg, env).combine) == ("auto", "auto")
    cfg.comm.moe_combine = "rows"
    assert fused_moe_config(cfg, env).combine == "rows"
    assert fused_moe_config(config(*SMALL), CPU) is None  # comm=bulk


def test_a_batch_sequence_parallelism_cannot_cut_is_refused_before_any_collective():
    """9 samples over 2 data-parallel ranks (5 and 4) of 63 tokens: rank 0's 315 tokens do not halve. Every rank
    refuses at build time (no rank may enter a collective that another never joins)."""
    cfg = config(*SMALL, "model.tp_size=2", "model.sequence_parallel=true", "data.global_batch_size=9",
                 "data.seq_len=63")
    for rank in range(4):
        env = DistEnv(rank=rank, world_size=4, local_rank=rank, device=torch.device("cpu"), backend="gloo")
        with pytest.raises(ValueError, match="cuts each data-parallel rank's tokens into model.tp_size=2 equal "
                                             "parts: 5 samples x data.seq_len=63 do not split"):
            build_model(cfg, env)


def test_a_batch_of_fewer_samples_than_data_parallel_ranks_is_named_as_such_on_every_rank():
    """1 sample over 4 ranks in TP pairs: 2 data-parallel ranks, a TP pair sharing one slice. Refused at build time
    naming data.global_batch_size and the data-parallel ranks (world / model.tp_size); the refusal said "must be >=
    world_size (2)" of a world of 4, from the data (or, under sequence parallelism, this check's own split)."""
    for parallel in ("true", "false"):
        cfg = config(*SMALL, "model.tp_size=2", f"model.sequence_parallel={parallel}", "data.global_batch_size=1")
        for rank in range(4):
            env = DistEnv(rank=rank, world_size=4, local_rank=rank, device=torch.device("cpu"), backend="gloo")
            with pytest.raises(ValueError, match=r"^data.global_batch_size=1: expected a whole number of samples >= "
                                                 r"the 2 data-parallel ranks \(world size 4 / model.tp_size=2\): "
                                                 r"each takes a slice of the batch$"):
                build_model(cfg, env)


def test_a_tp_size_that_does_not_divide_the_world_is_named_as_such_on_every_rank():
    """model.tp_size=3 over 4 ranks is refused as the TP size, with the world it does not divide, on every rank
    before any collective: not as a batch that sequence parallelism cannot cut (4 // 3 = 1 data-parallel rank)."""
    for parallel in ("true", "false"):
        cfg = config(*SMALL, "model.tp_size=3", f"model.sequence_parallel={parallel}")
        for rank in range(4):
            env = DistEnv(rank=rank, world_size=4, local_rank=rank, device=torch.device("cpu"), backend="gloo")
            with pytest.raises(ValueError, match=r"^model.tp_size=3: expected a whole number >= 1 dividing the "
                                                 r"world size 4$"):
                build_model(cfg, env)


def test_experts_that_do_not_split_over_the_expert_parallel_ranks_are_named_as_such_on_every_rank():
    """model.num_experts over the ranks holding different tokens (world / model.tp_size, or under sequence
    parallelism the world): refused by its key on every rank before any collective (MoELayer's own refusal named
    "num_experts=... the expert-parallel world size", once the groups were made)."""
    for parallel, experts, ranks, why in (
            ("false", 3, 2, r"world size 4 / model.tp_size=2"),
            ("true", 6, 4, r"world size 4: model.sequence_parallel splits them over the world")):  # 6 would halve
        cfg = config(*SMALL, "model.tp_size=2", f"model.sequence_parallel={parallel}", f"model.num_experts={experts}")
        for rank in range(4):
            env = DistEnv(rank=rank, world_size=4, local_rank=rank, device=torch.device("cpu"), backend="gloo")
            with pytest.raises(ValueError, match=rf"^model.num_experts={experts}: expected a multiple of the {ranks} "
                                                 rf"expert-parallel ranks \({why}\)$"):
                build_model(cfg, env)


def test_loss_falls_and_metrics_are_logged(tmp_path, caplog):
    cfg = config(*SMALL, "trainer.max_steps=60", "trainer.log_every=10", "trainer.checkpoint_every=0")
    with caplog.at_level(logging.INFO, logger="moe.train"):
        result = train(cfg, CPU, tmp_path)
    losses = [loss for _, loss in result.losses]
    assert losses[-1] < losses[0] - 1.0 and losses[-1] < 3.0, losses  # from ~ln(256) = 5.5 per byte
    assert result.evals[-1]["eval_loss"] < 3.2, result.evals
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {"loss", "step_ms", "tokens_per_s", "load_balancing_loss", "z_loss",
            "expert_load_max_over_mean"} <= set(lines[0])
    assert lines[0]["lr"] == 0.003 and "grad_norm" not in lines[0]  # the defaults: a constant lr, no clipping
    assert lines[0]["step_ms"] * lines[0]["tokens_per_s"] / 1000 == pytest.approx(32 * 64)  # tokens per step
    assert re.fullmatch(r"step 10 loss \d+\.\d{5} lb [\d.]+ z [\d.]+ lr 0\.003 step_ms \d+\.\d tokens/s \d+ "
                        r"expert max/mean \d\.\d\d \d\.\d\d",
                        [r.getMessage() for r in caplog.records if r.name == "moe.train"][0])  # not torch's
    # every kept assignment is counted: global batch 32 x 64 tokens x top-2 x 10 steps per MoE layer
    assert [sum(layer) for layer in lines[0]["tokens_per_expert"]] == [32 * 64 * 2 * 10] * 2
    assert (tmp_path / "corpus.txt").stat().st_size == 300000


def test_the_lr_schedule_is_megatrons():
    """The lr of the step after `done` steps (Megatron's num_steps): a linear warm-up from 0, then a decay to
    min_lr at decay_steps (counted from step 0), min_lr after; constant: the lr after the warm-up."""
    def lrs(decay, done, decay_steps=12):
        schedule = OmegaConf.create({"warmup_steps": 4, "decay": decay, "decay_steps": decay_steps, "min_lr": 0.1})
        return [lr_schedule(schedule, 2.0, 100)(d) * 2.0 for d in done]

    warmup = [0.0, 0.5, 1.0, 1.5, 2.0]  # lr x done / warmup_steps: the first step's lr is 0, as Megatron's
    assert lrs("constant", [0, 1, 2, 3, 4, 5, 1000]) == warmup + [2.0, 2.0]
    # a quarter and half of the way from step 4 to 12; at and past 12 min_lr
    for decay, quarter in (("linear", 0.1 + 1.9 * 0.75), ("cosine", 0.1 + 1.9 * 0.5 * (1 + math.cos(math.pi / 4)))):
        assert lrs(decay, [0, 1, 2, 3, 4, 6, 8, 12, 13]) == pytest.approx(warmup + [quarter, 1.05, 0.1, 0.1],
                                                                       rel=1e-15), decay
    assert lrs("cosine", [52, 99], decay_steps=None) == pytest.approx([0.1 + 1.9 * 0.5, 0.1 + 1.9 * (1 - math.cos(
        math.pi / 96)) / 2])  # null: decay over trainer.max_steps (100)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resume_continues_the_exact_loss_curve(tmp_path, precision):
    """With a warm-up, a cosine decay and gradient clipping: the lr is a function of the step alone and the clip
    one of the step's gradients, so the resumed run's curve is the uninterrupted one's, bit for bit. bf16: the
    experts' weights step through the AdamW kernel that writes their compute copies (the interpreter here), whose
    state must come back from the checkpoint as torch's does."""
    common = SMALL + ["trainer.max_steps=24", "trainer.log_every=4", "trainer.checkpoint_every=8",
                      "data.global_batch_size=16", "model.moe_every=2", "model.shared_expert=true",
                      f"model.precision={precision}", "model.lr_schedule.warmup_steps=6",
                      "model.lr_schedule.decay=cosine", "model.lr_schedule.min_lr=0.0003", "model.clip_grad=0.5"]
    full = train(config(*common), CPU, tmp_path / "full")
    assert sorted(p.name for p in (tmp_path / "full" / "checkpoints").iterdir()) == ["step_16", "step_24"]
    resumed = train(config(*common, f"trainer.resume_from={tmp_path / 'full' / 'checkpoints' / 'step_16'}"),
                    CPU, tmp_path / "resumed")
    assert resumed.losses == [(s, l) for s, l in full.losses if s > 16]
    assert resumed.evals == full.evals

    def logged(run: str) -> list[tuple[int, float, float]]:
        lines = [json.loads(l) for l in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return [(l["step"], l["lr"], l["grad_norm"]) for l in lines if "loss" in l]

    full_log = logged("full")
    assert logged("resumed") == [entry for entry in full_log if entry[0] > 16]
    # the lr of each interval's last step (the step after step - 1 steps)
    schedule = lr_schedule(config(*common).model.lr_schedule, 0.003, 24)
    assert [lr for _, lr, _ in full_log] == [0.003 * schedule(step - 1) for step in (4, 8, 12, 16, 20, 24)]
    assert full_log[0][1] == 0.003 * (3 / 6) and 0.0003 < full_log[-1][1] < 0.0004  # warming up; near min_lr
    assert max(norm for _, _, norm in full_log) > 0.5  # the clip bites: the interval's mean pre-clip norm above it


def test_a_resume_whose_max_steps_would_move_the_lr_decay_is_refused(tmp_path):
    """decay_steps null decays over trainer.max_steps: a resume with more steps (what a run at its end is told to
    do) re-stretched the cosine, the lr jumping from near min_lr back to ~half the peak without a word. Refused,
    naming both settings of decay_steps; either given explicitly, the run goes on (the checkpoint's: continued
    exactly, past the decay at min_lr)."""
    common = SMALL + ["trainer.log_every=2", "trainer.checkpoint_every=8", "data.global_batch_size=8",
                      "model.lr_schedule.decay=cosine", "model.lr_schedule.min_lr=0.0003"]
    train(config(*common, "trainer.max_steps=8"), CPU, tmp_path / "first")
    more = [*common, "trainer.max_steps=12", f"trainer.resume_from={tmp_path / 'first' / 'checkpoints'}"]
    with pytest.raises(ValueError, match=re.escape(
            "decays the lr over 8 steps, this run over trainer.max_steps=12 (model.lr_schedule.decay_steps null): "
            "the lr of step 9 would jump from the checkpoint's schedule to this one's; set "
            "model.lr_schedule.decay_steps=8 to continue it, or =12 to stretch it over this run")):
        train(config(*more), CPU, tmp_path / "refused")
    train(config(*more, "model.lr_schedule.decay_steps=8"), CPU, tmp_path / "continued")
    lines = [json.loads(l) for l in (tmp_path / "continued" / "metrics.jsonl").read_text().splitlines()]
    assert [l["lr"] for l in lines if "lr" in l] == [0.0003, 0.0003]  # steps 10 and 12: past the decay
    train(config(*more, "model.lr_schedule.decay_steps=12"), CPU, tmp_path / "stretched")


def _gloo(rank: int, world: int) -> DistEnv:
    return DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")


def _same_curve_as_one_process(env: DistEnv, run_dir: Path, one_process_losses, overrides) -> list[float]:
    """Without the per-rank auxiliary losses a run over ranks computes the gradient of the same global-batch loss
    as one process: the same curve up to float summation order (SGD: Adam would hide a gradient scale error)."""
    losses = [l for _, l in train(config(*overrides), env, run_dir).losses]
    torch.testing.assert_close(losses, one_process_losses, rtol=2e-4, atol=2e-4)
    return losses


def _experts_split(rank: int, world: int, num_experts: int) -> None:
    layer = MoETransformer(num_experts=num_experts, seed=0).blocks[0].ffn
    local = num_experts // world
    assert layer.num_local_experts == local and layer.experts.first_expert == local * rank


def _two_ranks(rank: int, world: int, tmp: str, one_process_losses) -> None:
    env = _gloo(rank, world)
    tmp = Path(tmp)
    _same_curve_as_one_process(env, tmp / "no_aux", one_process_losses, SAME_AS_ONE_PROCESS)

    common = SMALL + ["trainer.max_steps=20", "trainer.log_every=5", "trainer.checkpoint_every=10",
                      "model.lr_schedule.warmup_steps=4", "model.lr_schedule.decay=linear", "model.clip_grad=0.3"]
    built = []  # the model train() trains, to compare its replicated parameters across ranks afterwards

    def recording_build_model(cfg, env):
        built.append(build_model(cfg, env))
        return built[-1]

    moe_train.build_model = recording_build_model
    try:
        full = train(config(*common), env, tmp / "full")
    finally:
        moe_train.build_model = build_model
    resumed = train(config(*common, f"trainer.resume_from={tmp}/full/checkpoints/step_10"), env, tmp / "r10")
    assert resumed.losses == [(s, l) for s, l in full.losses if s > 10]

    # experts split over the ranks, everything else identical on both after training
    _experts_split(rank, world, 4)
    mine = _replicated_checksum(built[0])
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    assert all(torch.equal(g, mine) for g in gathered)


def _replicated_checksum(model) -> torch.Tensor:
    experts = {id(p) for p in expert_parameters(model)}
    return torch.stack([p.detach().double().sum() for p in model.parameters() if id(p) not in experts])


def _replicas_agree(rank: int, world: int, tmp: str) -> None:
    """AdamW steps with the per-rank z-loss: the replicated parameters stay identical on every rank."""
    from moe.train import build_model, sync_gradients
    cfg = config(*SMALL)
    model = build_model(cfg, _gloo(rank, world))
    data = ByteWindows(stdlib_corpus(100_000), "train", 64, 8, rank, world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(3):
        inputs, targets = data.batch(step)
        logits, aux = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1)) + aux["z_loss"]
        optimizer.zero_grad()
        loss.backward()
        sync_gradients(model)
        optimizer.step()
    mine = _replicated_checksum(model)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    assert all(torch.equal(g, mine) for g in gathered)


def _four_ranks(rank: int, world: int, tmp: str, one_process_losses) -> None:
    losses = _same_curve_as_one_process(_gloo(rank, world), Path(tmp) / "four", one_process_losses, FOUR_RANKS)
    assert losses[-1] < losses[0] - 1.0, losses
    _experts_split(rank, world, 8)
    _replicas_agree(rank, world, tmp)


def test_two_ranks_match_one_process_resume_exactly_and_agree(tmp_path):
    one = train(config(*SAME_AS_ONE_PROCESS), CPU, tmp_path / "one")
    run_world(2, _two_ranks, str(tmp_path), [l for _, l in one.losses])


def _resume_at_another_tp_size(rank: int, world: int, tmp: str) -> None:
    from fused_dlrm.train.checkpoint import load_checkpoint, save_checkpoint

    sizes = dict(d_model=16, num_layers=2, num_heads=2, ffn=24, num_experts=4, seed=1)
    tp_group, dp_group = moe_train.tp_groups(2)
    written = MoETransformer(group=dp_group, tp_group=tp_group, **sizes)
    save_checkpoint(tmp, 1, written, torch.optim.SGD(written.parameters(), lr=0.1))
    model = MoETransformer(**sizes)  # tp_size 1, the same world
    with pytest.raises(ValueError, match=r"holds no \['model\.blocks\.0\.attn\.qkv\.shard_0_of_1'.* and holds "
                                         r"\['model\.blocks\.0\.attn\.out\.shard_0_of_2'.*: it was written for "
                                         r"another model, world size, model\.tp_size"):
        load_checkpoint(tmp, model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_resume_at_another_tp_size_is_refused_naming_it(tmp_path):
    """A checkpoint holds each TP projection's shards (shard_<r>_of_<tp>): a run at another model.tp_size, on the
    same world, finds none of its own and is refused on every rank; the refusal named only "another model or world
    size", neither of which had changed."""
    run_world(2, _resume_at_another_tp_size, str(tmp_path), timeout=300)


def _resume_at_another_sequence_parallel(rank: int, world: int, tmp: str) -> None:
    from fused_dlrm.train.checkpoint import load_checkpoint, save_checkpoint

    sizes = dict(d_model=16, num_layers=2, num_heads=2, ffn=24, num_experts=4, seed=1)
    tp_group, dp_group = moe_train.tp_groups(2)
    written = MoETransformer(group=dp_group, tp_group=tp_group, **sizes)  # every expert on each rank of the pair
    save_checkpoint(tmp, 1, written, torch.optim.SGD(written.parameters(), lr=0.1))
    model = MoETransformer(group=dp_group, tp_group=tp_group, sequence_parallel=True, **sizes)  # two each
    with pytest.raises(ValueError, match=r"holds no \['model\.blocks\.0\.ffn\.experts_0_to_1\..* and holds "
                                         r"\['model\.blocks\.0\.ffn\.experts_0_to_3\..*: it was written for "
                                         r"another model, world size, model\.tp_size or model\.sequence_parallel"):
        load_checkpoint(tmp, model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_resume_at_another_sequence_parallel_is_refused_naming_it(tmp_path):
    """model.sequence_parallel splits the experts over the world instead of the data-parallel ranks (other names
    in the checkpoint): a run that turns it on or off, on the same world at the same model.tp_size, is refused on
    every rank as written for "another model, world size or model.tp_size", none of which had changed."""
    run_world(2, _resume_at_another_sequence_parallel, str(tmp_path), timeout=300)


def test_four_ranks_match_one_process_and_agree(tmp_path):
    """Experts over 4 ranks (2 each): the loss curve of one process, falling; replicas identical."""
    one = train(config(*FOUR_RANKS), CPU, tmp_path / "one")
    run_world(4, _four_ranks, str(tmp_path), [l for _, l in one.losses])


def _four_ranks_sequence_parallel(rank: int, world: int, tmp: str, one_process_losses, overrides) -> None:
    _same_curve_as_one_process(_gloo(rank, world), Path(tmp) / "sp", one_process_losses, overrides)


def test_four_ranks_sequence_parallel_match_one_process(tmp_path):
    """tp_size 2 x 2 data-parallel ranks with sequence parallelism: every rank holds a quarter of the tokens (an
    uneven batch: 5 and 4 samples per data-parallel rank) and 2 of the 8 experts; the loss curve of one process
    (the gradients summed over the right group each: the projections' shards over the data-parallel one, the rest
    over the world)."""
    overrides = FOUR_RANKS + ["data.global_batch_size=9", "model.num_layers=3", "model.moe_every=2",
                              "model.shared_expert=true"]
    one = train(config(*overrides), CPU, tmp_path / "one")
    run_world(4, _four_ranks_sequence_parallel, str(tmp_path), [l for _, l in one.losses],
              overrides + ["model.tp_size=2", "model.sequence_parallel=true"])


class _NoStep:
    """An optimizer whose step leaves the parameters as they are: train_step's gradients stay to be read."""

    def __init__(self, params):
        self.params = list(params)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        pass


def _step_gradients_match_the_objective(rank: int, world: int) -> None:
    """train_step's gradients (auxiliary losses on) after sync_gradients: those of the objective it names, written
    out in float64 in one process: the global-batch mean cross-entropy plus each rank's auxiliary losses (over its
    own tokens, as Megatron's router) averaged over the ranks; of the experts, this rank's slice."""
    aux_coeff, z_coeff = 0.3, 0.05
    alone = [dist.new_group([r]) for r in range(world)][rank]  # the reference's: every expert, no exchange
    tokens = torch.randint(0, 256, (7, 9), generator=torch.Generator().manual_seed(9))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    # uneven slices with capacity drops, the gradients clipped; a rank without samples (its MoE layers route no
    # token)
    for samples, capacity_factor, clip_grad in (([3, 2, 2], 1.0, 0.5), ([4, 3, 0], None, None)):
        bounds = [0, *torch.tensor(samples).cumsum(0).tolist()]
        mine = slice(bounds[rank], bounds[rank + 1])
        kwargs = dict(d_model=16, num_layers=2, num_heads=2, ffn=24, num_experts=2 * world,
                      capacity_factor=capacity_factor, seed=3)
        model = MoETransformer(**kwargs).double()
        _, _, kept, norm = moe_train.train_step(model, _NoStep(model.parameters()), inputs[mine], targets[mine],
                                                aux_coeff, z_coeff, clip_grad=clip_grad)
        dropped = torch.tensor(2 * 2 * inputs[mine].numel() - int(sum(k.sum() for k in kept)))  # 2 layers, top 2
        dist.all_reduce(dropped)
        assert (dropped > 0) == (capacity_factor is not None), dropped

        reference = MoETransformer(group=alone, **kwargs).double()
        objective = 0
        for r in range(world):
            theirs = slice(bounds[r], bounds[r + 1])
            logits, aux = reference(inputs[theirs])
            ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), targets[theirs].reshape(-1),
                                                   reduction="sum") / targets.numel()
            objective = objective + ce + (aux_coeff * aux["load_balancing_loss"] + z_coeff * aux["z_loss"]) / world
        objective.backward()
        if clip_grad is None:
            assert norm is None  # not measured: a pass over every gradient that nothing needs
        else:  # the whole model's gradient as one vector: each rank's experts, the replicated parameters once
            reference_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip_grad)
            assert reference_norm > 2 * clip_grad  # the clip bites
            torch.testing.assert_close(norm, reference_norm, rtol=1e-12, atol=0)
        wanted = dict(reference.named_parameters())
        experts = {id(p) for p in expert_parameters(model)}
        for name, p in model.named_parameters():
            want = wanted[re.sub(r"experts_\d+_to_\d+", f"experts_0_to_{2 * world - 1}", name)].grad
            if id(p) in experts:
                want = want[2 * rank:2 * rank + 2]
            torch.testing.assert_close(p.grad, want, rtol=1e-8, atol=1e-12, msg=lambda m: f"{samples} {name}: {m}")


def test_three_ranks_step_gradients_are_the_objectives():
    """3 ranks (2 experts each), auxiliary losses on: the gradient semantics of a step, exactly (SGD curves, the
    other tests, leave the auxiliary losses out: they are per rank), and their clipping by the global norm."""
    run_world(3, _step_gradients_match_the_objective, timeout=600)


def _shard_of(reference: MoETransformer, name: str, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The gradient of the reference (one process, tp_size 1, every expert) for what `name` holds on TP rank
    tp_rank: its range of experts, its shard of a TP projection (a column-parallel one's parts, q / k / v or
    w1 / w3, each cut), the rest whole."""
    experts = re.fullmatch(r"(.+)\.experts_(\d+)_to_(\d+)\.(w13|w2)", name)
    if experts:  # the layer's experts, all of them in the reference
        layer, first, last, weight = experts.groups()
        return getattr(reference.get_submodule(layer).experts, weight).grad[int(first):int(last) + 1]
    if "shard_" not in name:
        return reference.get_parameter(name).grad
    module = name.rsplit(".", 1)[0]
    full = reference.get_parameter(f"{module}.shard_0_of_1").grad
    if isinstance(reference.get_submodule(module), RowParallelLinear):
        return full.chunk(tp_size, dim=1)[tp_rank]
    parts = 3 if module.endswith("qkv") else 2 if module.endswith("w13") else 1
    return torch.cat([part.chunk(tp_size)[tp_rank] for part in full.chunk(parts)])


def _tensor_parallel_step_gradients_and_clip(rank: int, world: int) -> None:
    """tp_size 2 x 2 data-parallel ranks of uneven slices (4 and 2 samples), auxiliary losses on, an MoE layer in
    every other of 3 layers with a shared expert; without sequence parallelism with a capacity that drops
    (policy "position"), with it dropless (there a capacity caps each rank's part of the slice, not the slice).
    Every gradient train_step leaves is the float64 gradient of one process's objective: the global-batch mean
    cross-entropy plus each data-parallel slice's auxiliary losses, averaged over the slices (under sequence
    parallelism the load balancing counts the TP group's choices, the slice's) - of a TP projection its shard,
    of the experts this rank's; the norm it clips by counts each value once (TP shards distinct over a TP group,
    experts over the ranks holding different tokens, everything else held by all), and every gradient is scaled
    by clip / (norm + 1e-6)."""
    aux_coeff, z_coeff = 0.3, 0.05
    tokens = torch.randint(0, 256, (6, 9), generator=torch.Generator().manual_seed(11))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    slices = [slice(0, 4), slice(4, 6)]  # each data-parallel rank's: a TP group's
    alone = [dist.new_group([r]) for r in range(world)][rank]  # the reference's: every expert, no exchange
    tp_group, dp_group = moe_train.tp_groups(2)
    for sequence_parallel, capacity_factor in ((False, 1.0), (True, None)):
        kwargs = dict(d_model=16, num_layers=3, num_heads=2, ffn=24, num_experts=8, moe_every=2,
                      shared_expert=True, capacity_factor=capacity_factor, drop_policy="position", seed=5)
        reference = MoETransformer(group=alone, **kwargs).double()
        objective = 0
        for theirs in slices:
            logits, aux = reference(inputs[theirs])
            ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), targets[theirs].reshape(-1),
                                                   reduction="sum") / targets.numel()
            objective = objective + ce + (aux_coeff * aux["load_balancing_loss"] + z_coeff * aux["z_loss"]) / 2
        objective.backward()
        reference_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
        model = MoETransformer(group=dp_group, tp_group=tp_group, sequence_parallel=sequence_parallel,
                               **kwargs).double()
        optimizer = _NoStep(model.parameters())
        mine = slices[rank // 2]
        _, _, kept, norm = moe_train.train_step(model, optimizer, inputs[mine], targets[mine], aux_coeff, z_coeff,
                                                clip_grad=1e9)  # measured, not clipped
        dropped = torch.tensor(2 * model.local_tokens(inputs[mine]).shape[0] - int(kept[0].sum()))  # top 2
        dist.all_reduce(dropped)
        assert (dropped > 0) == (capacity_factor is not None), dropped
        torch.testing.assert_close(norm, reference_norm, rtol=1e-12, atol=0)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, _shard_of(reference, name, rank % 2, 2), rtol=1e-10, atol=1e-15,
                                       msg=lambda m: f"sequence_parallel={sequence_parallel} {name}: {m}")
        unclipped = [p.grad.clone() for p in model.parameters()]
        _, _, _, norm = moe_train.train_step(model, optimizer, inputs[mine], targets[mine], aux_coeff, z_coeff,
                                             clip_grad=reference_norm.item() / 3)
        torch.testing.assert_close(norm, reference_norm, rtol=1e-12, atol=0)
        for p, grad in zip(model.parameters(), unclipped):
            torch.testing.assert_close(p.grad, grad * (reference_norm / 3 / (norm + 1e-6)), rtol=1e-12, atol=0)


def test_four_ranks_tensor_parallel_step_gradients_and_clip_by_the_whole_models_norm():
    run_world(4, _tensor_parallel_step_gradients_and_clip, timeout=600)


def _sync_keeps_each_parameter_within_its_own_bound(rank: int, world: int, tp_size: int) -> None:
    """sync_gradients with each codec: every parameter's gradient within the two-shot bound of that parameter
    all-reduced alone (its own blocks), around the float64 sum of the ranks' gradients. The gradients of one flat
    buffer differ by orders of magnitude (the router's ~1e-2 beside a norm's ~1e-5): a parameter packed into a
    larger one's block would lose its precision to the block's scale."""
    tokens = torch.randint(0, 256, (8, 9), generator=torch.Generator().manual_seed(3))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    tp_group, dp_group = moe_train.tp_groups(tp_size)
    mine = slice(2 * (rank // tp_size), 2 * (rank // tp_size) + 2)  # a TP group's ranks share their tokens
    model = MoETransformer(d_model=16, num_layers=2, num_heads=2, ffn=24, num_experts=4, shared_expert=True,
                           seed=5, group=dp_group, tp_group=tp_group, sequence_parallel=tp_size > 1)
    logits, aux = model(inputs[mine])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), model.local_tokens(targets[mine]).reshape(-1))
    (loss + 0.3 * aux["load_balancing_loss"] + 0.05 * aux["z_loss"]).backward()
    local = {p: p.grad.clone() for p in model.parameters()}
    names = {p: name for name, p in model.named_parameters()}
    for codec in CODECS:
        for p, grad in local.items():
            p.grad = grad.clone()
        moe_train.sync_gradients(model, codec)
        for _, params, group in model.gradient_groups():
            for p in params:
                ranks = [torch.empty_like(local[p]) for _ in range(dist.get_world_size(group))]
                dist.all_gather(ranks, local[p], group=group)  # every rank's gradient, before the sum
                exact = torch.stack(ranks).double().sum(0)
                error = (p.grad.double() - exact).abs()
                bound = two_shot_error_bound(ranks, codec).double()
                assert (error <= bound).all(), (codec, names[p], (error / exact.abs().max()).max().item())


@pytest.mark.parametrize("world, tp_size", [(2, 1), (4, 2)])  # 4: sequence parallelism, two gradient groups
def test_a_codec_keeps_each_parameters_gradient_within_its_own_blocks_bound(world, tp_size):
    run_world(world, _sync_keeps_each_parameter_within_its_own_bound, tp_size, timeout=600)


def an_inf_gradient_at_step(step: int):
    """A stand-in for sync_gradients (one process) that writes inf into a gradient of the embedding at `step`."""
    calls = []

    def sync(model, grad_allreduce):
        calls.append(None)
        if len(calls) == step:
            next(model.parameters()).grad[0, 0] = float("inf")

    return sync


def test_a_nonfinite_gradient_norm_stops_the_run(tmp_path, monkeypatch):
    """An inf gradient in the second step of an interval, its loss finite: clipping writes NaN into the weights, and
    the run stops at that interval's check (without it the run ended as if well, its weights NaN), naming the step
    of the norm (not the interval, nor a later step whose loss the NaN weights made NaN)."""
    monkeypatch.setattr(moe_train, "sync_gradients", an_inf_gradient_at_step(2))
    cfg = config(*SMALL, "trainer.max_steps=4", "trainer.log_every=4", "trainer.checkpoint_every=0",
                 "model.clip_grad=1.0")
    with pytest.raises(NonFiniteLossError, match=r"^gradient norm became NaN or inf at step 2; stopping\. Last good "
                                                 r"checkpoint: none$"):
        train(cfg, CPU, tmp_path)


def test_weights_diverged_by_the_last_step_stop_the_run_at_its_evaluation(tmp_path, monkeypatch):
    """An inf gradient in the last step, its loss finite, no clipping and no checkpoint: AdamW writes NaN into the
    weights after the last loss check, and the run's final evaluation, NaN, stops it naming the step (it ended as
    if well, its weights NaN, the NaN eval loss a log line)."""
    monkeypatch.setattr(moe_train, "sync_gradients", an_inf_gradient_at_step(4))
    cfg = config(*SMALL, "trainer.max_steps=4", "trainer.log_every=4", "trainer.checkpoint_every=0")
    with pytest.raises(NonFiniteLossError, match=r"eval loss became NaN or inf at step 4 .*; stopping\. Last good "
                                                 r"checkpoint: none"):
        train(cfg, CPU, tmp_path)


def test_replicated_parameters_stay_identical_over_ranks(tmp_path):
    run_world(2, _replicas_agree, str(tmp_path))


def test_stdlib_corpus_and_cache(tmp_path):
    first = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[0].read_bytes()
    corpus = stdlib_corpus(50_000)
    assert len(corpus) == 50_000 and corpus.startswith(first[:1000]) and corpus == stdlib_corpus(50_000)
    cache = tmp_path / "sub" / "corpus.txt"
    assert load_corpus(None, cache, 50_000) == corpus and cache.read_bytes() == corpus
    cache.write_bytes(b"x" * 60_000)  # an existing cache is read, not rebuilt: its first size_bytes
    assert load_corpus(None, cache, 50_000) == b"x" * 50_000
    cache.write_bytes(b"x" * 1000)  # one built for fewer bytes (another config's) is built again
    assert load_corpus(None, cache, 50_000) == corpus and cache.read_bytes() == corpus


def test_writers_of_one_cache_with_the_same_pid_each_write_their_own_file(tmp_path, monkeypatch):
    """Ranks on other hosts share the run directory's cache on a shared filesystem (agree_on_run_dir: rank 0's
    path), and in containers their processes often have the same pid: two threads (one pid) stand in for them,
    both written before either renames. With one temporary name per pid the second rename found no file
    (FileNotFoundError), which stopped the run at its start."""
    cache = tmp_path / "corpus.txt"
    both_written = threading.Barrier(2, timeout=60)
    replace = os.replace

    def replace_once_both_wrote(src, dst):
        both_written.wait()
        replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_once_both_wrote)
    with ThreadPoolExecutor(2) as pool:
        corpora = list(pool.map(lambda _: load_corpus(None, cache, 50_000), range(2)))
    assert corpora == [stdlib_corpus(50_000)] * 2 and cache.read_bytes() == corpora[0]
    assert [p.name for p in tmp_path.iterdir()] == ["corpus.txt"]  # no temporary file left


def test_a_stdlib_smaller_than_asked_is_all_of_it_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="moe.data"):
        corpus = stdlib_corpus(10**12)
    assert 0 < len(corpus) < 10**12
    assert f"hold {len(corpus)} bytes, fewer than data.size_bytes={10**12}" in caplog.text


def test_size_bytes_null_is_every_stdlib_source_and_the_finegrained_config_asks_for_no_more(tmp_path, caplog):
    """bytes_finegrained asked for 8 MB of a stdlib of 4.5-4.7 MB (Pythons 3.10-3.13): every run warned, trained on
    all of it, and built its cache again (a cache is read only when it holds the size asked). null asks for all of
    it, without a warning, and reads back the cache that holds all of it."""
    stdlib_bytes = sum(f.stat().st_size for f in Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    assert config("model=moe_transformer_finegrained").data.size_bytes is None
    assert config("model=moe_transformer").data.size_bytes <= stdlib_bytes
    cache = tmp_path / "corpus.txt"
    with caplog.at_level(logging.WARNING, logger="moe.data"):
        corpus = load_corpus(None, cache, None)
    assert len(corpus) == stdlib_bytes and corpus == stdlib_corpus(None) and cache.read_bytes() == corpus
    assert corpus.startswith(stdlib_corpus(50_000)) and not caplog.records
    cache.write_bytes(b"x" * stdlib_bytes)  # the whole corpus's size: read, not built again
    assert load_corpus(None, cache, None) == b"x" * stdlib_bytes


@pytest.mark.parametrize("size", [0, -5, 1.5e6, True])
def test_a_corpus_size_of_no_byte_count_is_refused(tmp_path, size):
    """-5 trained on the first module's source but its last 5 bytes, 1.5e6 failed in a slice, true was 1 byte."""
    with pytest.raises(ValueError, match=re.escape(f"data.size_bytes={size!r}: expected a byte count >= 1, or null")):
        load_corpus(None, tmp_path / "corpus.txt", size)


def test_batches_are_rank_slices_of_one_global_batch():
    corpus = bytes(range(256)) * 40
    whole = ByteWindows(corpus, "train", 16, 6, seed=3)
    parts = [ByteWindows(corpus, "train", 16, 6, rank=r, world_size=2, seed=3) for r in range(2)]
    inputs, targets = whole.batch(5)
    assert torch.equal(torch.cat([p.batch(5)[0] for p in parts]), inputs)
    assert torch.equal(inputs[:, 1:], targets[:, :-1]) and inputs.shape == (6, 16)
    assert not torch.equal(whole.batch(6)[0], inputs)
    eval_inputs, _ = ByteWindows(corpus, "eval", 16, 6, seed=3).batch(5)
    assert not torch.equal(eval_inputs, inputs)


def test_windows_of_no_bytes_and_eval_fractions_outside_0_1_are_refused():
    """Each was trained on without a word: seq_len 0 as a loss of 0 / 0 tokens, stopped as a divergence ("loss
    became NaN"); an eval fraction of 1.5 as a cut at -len / 2 (train on the first half, evaluate on the second)."""
    corpus = bytes(range(256)) * 40
    with pytest.raises(ValueError, match="seq_len=0: expected at least 1"):
        ByteWindows(corpus, "train", 0, 4)
    for fraction in (0.0, 1.0, 1.5, -0.5, float("nan")):
        with pytest.raises(ValueError, match=rf"eval_fraction={fraction}: expected a fraction in \(0, 1\)"):
            ByteWindows(corpus, "train", 16, 4, eval_fraction=fraction)
    assert ByteWindows(corpus, "eval", 16, 4, eval_fraction=0.5).data.numel() == len(corpus) // 2


def test_a_corpus_too_small_for_one_window_names_its_size_and_the_settings_that_cut_it():
    """It said "the eval part of the corpus has 50 bytes, fewer than seq_len + 1 = 65", of an empty file "the train
    part ... has 0 bytes": neither the corpus' size nor the keys that cut it (data.eval_fraction, data.seq_len)."""
    for corpus, split, part in ((bytes(1000), "eval", "data.eval_fraction=0.05 of its 1000 bytes) has 50 bytes"),
                                (b"", "train", "1 - data.eval_fraction=0.05 of its 0 bytes) has 0 bytes")):
        with pytest.raises(ValueError, match=re.escape(f"the {split} part of the corpus ({part}, fewer than one "
                                                       "window of data.seq_len + 1 = 65 bytes")):
            ByteWindows(corpus, split, 64, 4)


def test_missing_corpus_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        load_corpus(tmp_path / "missing.txt")
    cfg = config(*SMALL, "trainer.max_steps=5", f"data.path={tmp_path / 'missing.txt'}")
    with pytest.raises(FileNotFoundError, match="corpus file not found: .*missing.txt"):
        train(cfg, CPU, tmp_path)


def test_a_directory_as_the_corpus_path_is_named_as_one(tmp_path):
    """It read "corpus file not found: <dir>", of a path that exists."""
    with pytest.raises(IsADirectoryError, match=rf"^corpus path {re.escape(str(tmp_path))} is a directory: give the "
                                                r"corpus file itself \(data.path\)$"):
        load_corpus(tmp_path)


def _corpus_one_node_lacks(rank: int, world: int, tmp: str) -> None:
    path = f"{tmp}/corpus.txt" if rank == 0 else f"{tmp}/not_on_this_node.txt"  # a file one node's disk lacks
    missing = re.escape(f"corpus file not found: {tmp}/not_on_this_node.txt")
    with pytest.raises(FileNotFoundError if rank == 1 else ValueError,
                       match=missing if rank == 1 else rf"rank 0: rank\(s\) \[1\] cannot make their data from the corpus: "
                                                       rf"FileNotFoundError: {missing}"):
        train(config(*SMALL, "trainer.max_steps=2", f"data.path={path}"), _gloo(rank, world), Path(tmp) / f"r{rank}")
    dist.barrier()  # both raised: neither waits in a collective the other never joins (else run_world's timeout)


def test_a_corpus_one_node_lacks_stops_every_rank(tmp_path):
    (tmp_path / "corpus.txt").write_bytes(bytes(range(256)) * 1200)
    run_world(2, _corpus_one_node_lacks, str(tmp_path), timeout=120)


def _corpus_copies_that_differ(rank: int, world: int, tmp: str) -> None:
    """Each rank reads its own copy of the corpus (as ranks on other nodes do; so too the stdlib corpus of nodes with
    other Pythons): rank 1's holds other bytes of the same size. Each rank drew its slice of the windows from its
    own bytes, the global batch of no corpus, without a word."""
    path = Path(tmp) / f"copy_{rank}.txt"
    corpus = bytearray(bytes(range(256)) * 1200)
    corpus[5000] ^= rank  # one byte differs: the same size
    path.write_bytes(corpus)
    digest = r"\(blake2b [0-9a-f]{16}\)"
    with pytest.raises(ValueError, match=rf"rank {rank}: the corpus differs between ranks: rank 1's 307200 bytes "
                                         rf"{digest}, rank 0's 307200 bytes {digest} \(this rank's: .*copy_{rank}.txt"
                                         rf"\); every rank must train on the same"):
        train(config(*SMALL, "trainer.max_steps=2", f"data.path={path}"), _gloo(rank, world), Path(tmp) / f"r{rank}")


def test_corpus_copies_that_differ_between_ranks_are_refused(tmp_path):
    run_world(2, _corpus_copies_that_differ, str(tmp_path), timeout=120)


def _a_token_outside_the_vocabulary(rank: int, world: int) -> None:
    """Rank 1's batch holds a token id past the vocabulary (then one below 0): a step, an evaluation forward, and
    under sequence parallelism (rank 1's half of the shared batch), raise on every rank, naming rank 1 and the
    id; a good step follows on both ranks (neither was left inside a collective)."""
    kwargs = dict(d_model=16, num_layers=2, num_heads=2, ffn=24, num_experts=2 * world, seed=3)
    tokens = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(5))
    tp_group, dp_group = moe_train.tp_groups(world)
    for bad, model in ((300, MoETransformer(**kwargs)),
                       (-7, MoETransformer(group=dp_group, tp_group=tp_group, sequence_parallel=True, **kwargs))):
        batch = tokens.clone()
        if rank == 1 or model.sequence_parallel:  # SP: one batch for the TP group, the id in rank 1's rows
            batch[1, 4] = bad
        whose = f"token id {bad}" if rank == 1 else f"rank 1 has token id {bad}"
        message = rf"rank {rank}: {whose} in its batch, outside the vocabulary \[0, 256\)"
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(ValueError, match=message):
            moe_train.train_step(model, optimizer, batch[:, :-1], batch[:, 1:], 0.01, 0.001)
        with torch.no_grad(), pytest.raises(ValueError, match=message):
            model(batch)
        loss, *_ = moe_train.train_step(model, optimizer, tokens[:, :-1], tokens[:, 1:], 0.01, 0.001)
        assert loss.isfinite()


def test_a_token_outside_the_vocabulary_stops_every_rank():
    """Looked up as it is, the id raised an IndexError on rank 1 alone (a device-side assert on GPUs), its peer
    left in the MoE layer's exchange (gloo: 'Connection closed by peer' once rank 1 exited)."""
    run_world(2, _a_token_outside_the_vocabulary, timeout=240)


class _RaisedInBackward(torch.autograd.Function):
    """The MoE layer's output standing in for a refused call's: zeros, whose backward raises the refusal."""

    @staticmethod
    def forward(ctx, x, error):
        ctx.error = error
        return torch.zeros_like(x)

    @staticmethod
    def backward(ctx, grad):
        raise ctx.error


def _refusals_raised_in_backward() -> None:
    """MoE layers that raise a refusal in their backward, as the fused dispatch with max_tokens_per_rank does on
    NCCL (no forward reads the counts: the error word, read by the backward)."""
    from moe.layer import MoELayer

    forward = MoELayer.forward

    def raising_in_backward(self, x, *args, **kwargs):
        try:
            return forward(self, x, *args, **kwargs)
        except ValueError as error:  # every rank's, where the counts are read: deferred to the backward
            zeros = x.new_zeros(())
            return _RaisedInBackward.apply(x, error), {"load_balancing_loss": zeros, "z_loss": zeros,
                                                      "tokens_per_expert": x.new_zeros(self.num_experts)}

    MoELayer.forward = raising_in_backward


def _a_batch_one_tp_group_cannot_cut(rank: int, world: int, refusals_in_backward: bool) -> None:
    """Sequence parallelism over TP pairs {0, 1} and {2, 3}: the second pair's batch of 5 tokens does not halve, the
    first's does. Every rank raises, naming the pair's ranks and the cut (a forward, unless the refusal waits for
    the backward, and a step); a good step follows on every rank (none was left inside a collective)."""
    if refusals_in_backward:
        _refusals_raised_in_backward()
    kwargs = dict(d_model=16, num_layers=2, num_heads=2, ffn=24, num_experts=world, seed=3)
    tp_group, dp_group = moe_train.tp_groups(2)
    model = MoETransformer(group=dp_group, tp_group=tp_group, sequence_parallel=True, **kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(5))
    batch = tokens if rank < 2 else tokens[:1, :6]  # 5 tokens in, 5 targets
    whose = "" if rank >= 2 else "rank 2 has "
    message = (rf"^rank {rank}: {whose}a batch of 5 tokens, which model.sequence_parallel cannot cut into "
               rf"model.tp_size=2 equal parts$")
    if not refusals_in_backward:
        with torch.no_grad(), pytest.raises(ValueError, match=message):
            model(batch[:, :-1])
    with pytest.raises(ValueError, match=message):
        moe_train.train_step(model, optimizer, batch[:, :-1], batch[:, 1:], 0.01, 0.001)
    loss, *_ = moe_train.train_step(model, optimizer, tokens[:, :-1], tokens[:, 1:], 0.01, 0.001)
    assert loss.isfinite()


def test_a_batch_sequence_parallelism_cannot_cut_on_one_tp_group_stops_every_rank():
    """Only the TP group holding such a batch raised (MoETransformer.local_tokens); the others went on into the
    first MoE layer's exchange over the world and failed there ('Connection closed by peer' on gloo; on NCCL they
    would wait). train.py's build_model refuses such batches before any step; a caller of the model finds out
    here."""
    run_world(4, _a_batch_one_tp_group_cannot_cut, False, timeout=180)


def test_a_batch_one_tp_group_cannot_cut_stops_every_rank_where_the_backward_raises():
    """train_step cut its targets with local_tokens, which raised in the TP pair {2, 3} alone where the forward had
    returned (its refusal left to the backward), the others left in the loss' all-reduce over the world (gloo:
    connection closed; NCCL: a wait). The targets are now the forward's rows (none of a batch it ran empty): every
    rank computes its loss and reaches the backward, which raises on every rank."""
    run_world(4, _a_batch_one_tp_group_cannot_cut, True, timeout=180)


def test_a_token_outside_the_vocabulary_is_a_clear_error():
    model = MoETransformer(d_model=16, num_layers=2, num_heads=2, ffn=24, num_experts=4, seed=3)
    tokens = torch.randint(0, 256, (3, 5), generator=torch.Generator().manual_seed(4))
    for bad in (256, -1):
        batch = tokens.clone()
        batch[2, 1] = bad
        with pytest.raises(ValueError, match=rf"rank 0: token id {bad} in its batch, outside the vocabulary \[0, "):
            model(batch)
    assert model(tokens)[0].isfinite().all() and model(tokens[:0])[0].shape == (0, 5, 256)
    with pytest.raises(ValueError, match="^model.num_layers=1 with model.moe_every=2 makes no MoE layer"):
        MoETransformer(num_layers=1, moe_every=2)


def test_a_float64_model_computes_its_logits_and_loss_in_float64():
    """The tests' one-process references are float64 models: their logits (hence the cross-entropy and every
    gradient) stay float64. Cast to fp32 (what mixed precision wants), they were ~1e-8 off the model's own
    float64 head, so a comparison with a reference only held to fp32's rounding of identical values. Under
    mixed precision the logits still come out fp32."""
    model = MoETransformer(d_model=16, num_layers=2, num_heads=2, ffn=24, num_experts=4, seed=3).double()
    normed = []
    model.norm.register_forward_hook(lambda module, args, out: normed.append(out))
    logits, _ = model(torch.randint(0, 256, (3, 7), generator=torch.Generator().manual_seed(4)))
    assert logits.dtype == torch.float64
    torch.testing.assert_close(logits.reshape(21, 256), normed[0] @ model.embedding.weight.t(), rtol=0, atol=1e-15)
    bf16 = MoETransformer(d_model=16, num_layers=2, num_heads=2, ffn=24, num_experts=4, seed=3,
                          compute_dtype=torch.bfloat16)
    assert bf16(torch.randint(0, 256, (2, 5)))[0].dtype == torch.float32


def test_torchrun_two_processes(tmp_path):
    """train.py dispatches on model.name; both ranks train under torchrun (gloo), one run directory."""
    run_torchrun([*SMALL, "trainer.max_steps=10", "trainer.log_every=5", "trainer.checkpoint_every=10",
                  f"hydra.run.dir={tmp_path}/run"])
    run = tmp_path / "run"
    assert (run / "train_rank0.log").exists() and (run / "train_rank1.log").exists()
    assert sorted(p.name for p in (run / "checkpoints" / "step_10").glob("*.distcp")) == ["__0_0.distcp",
                                                                                       "__1_0.distcp"]
    lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines if "loss" in l] == [5, 10] and "eval_loss" in lines[-1]


@pytest.mark.parametrize("model,data", [("moe_transformer", "synthetic"), ("dlrm", "bytes")])
def test_a_data_group_of_the_other_model_is_refused(tmp_path, model, data):
    """`data=` on the command line overrides the model's own choice: another model's data group is refused before
    training, instead of failing late on a missing key (or training on the wrong data)."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "train.py", f"model={model}", f"data={data}", "trainer.max_steps=1",
                           f"hydra.run.dir={tmp_path}/run"], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert f"model.name={model} trains on data=" in done.stderr and f"not data={data}" in done.stderr, done.stderr


def test_fused_comm_is_refused_clearly_on_the_cpu(tmp_path):
    with pytest.raises(RuntimeError, match="comm=fused needs CUDA GPUs under torchrun"):
        train(config(*SMALL, "comm=fused", "trainer.max_steps=2"), CPU, tmp_path)
    with pytest.raises(ValueError, match="comm.transport=nvshmem: the MoE layers' fused dispatch and combine have "
                                         "the p2p transport only"):
        train(config(*SMALL, "comm=fused", "comm.transport=nvshmem", "trainer.max_steps=2"), CPU, tmp_path)


def test_bf16_mixed_precision_trains_with_fp32_weights(tmp_path):
    """model.precision=bf16: the loss falls as in fp32, the logits come out fp32, the parameters and their
    optimizer state stay fp32."""
    cfg = config(*SMALL, "model.precision=bf16", "trainer.max_steps=40", "trainer.log_every=10",
                 "trainer.checkpoint_every=0")
    result = train(cfg, CPU, tmp_path)
    losses = [loss for _, loss in result.losses]
    assert losses[-1] < losses[0] - 1.0 and losses[-1] < 3.2, losses
    model = build_model(cfg, CPU)
    assert model.compute_dtype == torch.bfloat16
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    logits, _ = model(torch.randint(0, 256, (2, 16)))
    assert logits.dtype == torch.float32


def test_weight_decay_spares_norm_gains_and_biases():
    """As Megatron's default: the configured AdamW decays the matrices (embedding, projections, router, experts)
    and leaves 1-D parameters (norm gains, biases) alone. A step on zero gradients moves a parameter by its decay
    alone: w -> w (1 - lr wd)."""
    cfg = config(*SMALL)
    model = build_model(cfg, CPU)
    optimizer = instantiate(cfg.model.optimizer, _partial_=True)(weight_decay_groups(model))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    shrink = 1 - cfg.model.optimizer.lr * cfg.model.optimizer.weight_decay
    kinds = set()
    for name, p in model.named_parameters():
        kinds.add(p.ndim >= 2)
        expected = before[name] * shrink if p.ndim >= 2 else before[name]
        torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=0, msg=name)
    assert kinds == {True, False}  # the model has both kinds


def test_bad_settings_are_refused_before_training(tmp_path):
    """Settings that would train something else than asked (a vocabulary below the bytes, a capacity that drops
    every assignment, a clip, loss coefficient or lr schedule of no meaning), fail late (a codec typo: first at the
    gradients' all-reduce, never in one process) or log NaN (an evaluation of no batch) are refused when the run
    starts."""
    for overrides, error in ((["model.vocab_size=128"], "model.vocab_size=128: the data are raw bytes"),
                             # named by their keys, not as the library's routing names its arguments
                             (["model.capacity_factor=0"], "^model.capacity_factor must be > 0"),
                             (["model.capacity_factor=-1.0"], "^model.capacity_factor must be > 0"),
                             (["model.capacity_factor=1.0", "model.drop_policy=prob"],
                              "^model.drop_policy must be one of"),
                             (["model.top_k=5"], r"^model.top_k must be in \[1, model.num_experts=4\], got 5$"),
                             (["model.moe_every=3"], "^model.moe_every must be 1 or 2, got 3$"),
                             (["model.num_layers=1", "model.moe_every=2"],
                              "^model.num_layers=1 with model.moe_every=2 makes no MoE layer$"),
                             (["model.num_heads=3"],
                              "^model.d_model=64 must split into model.num_heads=3 heads of an even size$"),
                             # no TP group: nothing to fuse (Megatron refuses --tp-comm-overlap at TP size 1 too)
                             (["model.tp_comm=fused", "model.precision=bf16"],
                              r"^model.tp_comm=fused with model.tp_size=1: "),
                             (["comm.grad_allreduce=q7"], "comm.grad_allreduce='q7': expected one of"),
                             (["data.eval_batches=0"], "data.eval_batches=0: expected a count >= 1: the evaluation needs"),
                             (["data.eval_batches=1.5"], "data.eval_batches=1.5: expected a count >= 1"),
                             (["data.seq_len=0"], "seq_len=0: expected at least 1"),
                             # a float failed deep in torch (randint, randn, view); YAML's true trained as 1
                             (["data.seq_len=16.5"], "data.seq_len=16.5: expected at least 1 byte per window, a whole"),
                             (["data.seq_len=true"], "data.seq_len=True: expected at least 1 byte per window"),
                             (["model.ffn=0"], "model.ffn=0: expected a whole number >= 1"),  # trained FFNs of nothing
                             (["model.num_heads=0"], "model.num_heads=0: expected a whole number >= 1"),
                             (["model.num_experts=4.0"], "model.num_experts=4.0: expected a whole number >= 1"),
                             (["model.top_k=true"], "model.top_k=True: expected a whole number >= 1"),
                             (["model.moe_every=true"], "model.moe_every=True: expected a whole number >= 1"),
                             (["model.tp_size=1.0"], "model.tp_size=1.0: expected a whole number >= 1"),
                             # named "comm must be one of", at the first projection built (comm is comm.mode's)
                             (["model.tp_comm=fusd"], r"model.tp_comm='fusd': expected one of \('bulk', 'fused'\)"),
                             (["model.vocab_size=256.5"], "model.vocab_size=256.5: expected a whole number >= 1"),
                             (["data.eval_fraction=1.5"], "eval_fraction=1.5: expected a fraction in \\(0, 1\\)"),
                             # a TypeError of '<' between int and NoneType / str, naming nothing
                             (["data.eval_fraction=null"], "eval_fraction=None: expected a fraction in \\(0, 1\\)"),
                             (["data.eval_fraction=a"], "eval_fraction='a': expected a fraction in \\(0, 1\\)"),
                             (["trainer.epochs=2"], "trainer.epochs is not supported \\(got 2\\)"),
                             (["model.clip_grad=-1.0"], "model.clip_grad=-1.0: expected a norm >= 0"),
                             (["model.clip_grad=nan"], "model.clip_grad=nan: expected a norm >= 0"),
                             # YAML's true clipped at a norm of 1, as the loss coefficients' weighed 1
                             (["model.clip_grad=true"], "model.clip_grad=True: expected a norm >= 0"),
                             # NaN stopped as a divergence ("loss became NaN"), null failed in the first step's
                             # product, a negative one trained towards imbalance, YAML's true weighed 1
                             (["model.aux_coeff=nan"], "model.aux_coeff=nan: expected a finite number >= 0"),
                             (["model.aux_coeff=null"], "model.aux_coeff=None: expected a finite number >= 0"),
                             (["model.aux_coeff=-0.01"], "model.aux_coeff=-0.01: expected a finite number >= 0"),
                             (["model.z_coeff=-1.0"], "model.z_coeff=-1.0: expected a finite number >= 0"),
                             (["model.z_coeff=true"], "model.z_coeff=True: expected a finite number >= 0"),
                             (["model.lr_schedule.warmup_steps=-1"], "warmup_steps=-1: expected a step count >= 0"),
                             (["model.lr_schedule.decay=cos"], "decay='cos': expected constant, linear or cosine"),
                             # YAML's true is an int (bool subclasses int): 1 step, unless refused
                             (["model.lr_schedule.warmup_steps=true"], "warmup_steps=True: expected a step count >= 0"),
                             (["model.lr_schedule.decay=linear", "model.lr_schedule.warmup_steps=2"],
                              r"decay_steps=2: expected a step count above warmup_steps=2 for a linear decay \(null: "
                              r"trainer.max_steps\)"),
                             (["model.lr_schedule.decay=cosine", "model.lr_schedule.decay_steps=true"],
                              r"decay_steps=True: expected a step count above warmup_steps=0 for a cosine decay"),
                             (["model.lr_schedule.min_lr=0.01"], "min_lr=0.01: expected 0 <= min_lr <= the "
                                                                 "optimizer's lr 0.003"),
                             # a TypeError of '<=' between int and NoneType, naming nothing
                             (["model.lr_schedule.min_lr=null"], "model.lr_schedule.min_lr=None: expected 0 <= min_lr "
                                                                 "<= the optimizer's lr 0.003")):
        with pytest.raises(ValueError, match=error):
            train(config(*SMALL, "trainer.max_steps=2", *overrides), CPU, tmp_path)
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        TopKRouter(8, 4, 2, capacity_factor=float("nan"))


def test_unknown_precision_and_fp32_with_fused_tp_are_clear_errors():
    with pytest.raises(ValueError, match="model.precision='fp8'"):
        build_model(config(*SMALL, "model.precision=fp8"), CPU)
    with pytest.raises(ValueError, match="tp_comm=fused computes .* in bf16 or fp16.*set model.precision=bf16"):
        MoETransformer(tp_group=object(), tp_comm="fused", compute_dtype=None)
    with pytest.raises(ValueError, match="tp_comm=fused computes"):
        MoETransformer(tp_group=object(), tp_comm="fused", compute_dtype=torch.float32)


def _bf16_two_ranks(rank: int, world: int, tmp: str, one_process_losses) -> None:
    losses = [l for _, l in train(config(*BF16_SGD), _gloo(rank, world), Path(tmp) / "bf16").losses]
    torch.testing.assert_close(losses[:7], one_process_losses[:7], rtol=5e-3, atol=0)


BF16_SGD = (*SAME_AS_ONE_PROCESS, "model.precision=bf16", "model.optimizer.lr=0.1")


def test_bf16_two_ranks_follow_the_one_process_curve(tmp_path):
    """bf16 rows through gloo's all-to-alls: the one-process bf16 curve. Rounding in other places (the experts'
    rows grouped otherwise) grows with the steps, and how fast depends on the CPU's bf16 kernels: below 1e-3 up to
    step 7 on the machines seen, then at step 8 ~1e-3 on earlier ones and 6e-3 on an AVX-512 one (2026-11-24), a
    few % after, so 7 steps are compared."""
    one = [l for _, l in train(config(*BF16_SGD), CPU, tmp_path / "one").losses]
    assert one[7] < one[0] - 1.0, one
    run_world(2, _bf16_two_ranks, str(tmp_path), one)
