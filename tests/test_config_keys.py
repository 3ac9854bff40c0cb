"""Config keys no code reads are refused (fused_dlrm/train/config_keys.py): a `+trainer.<typo>=...` override adds a
key, as `model=dlrm +model.vocab_size=300` adds one only another model reads; every model's train (train.py's), the
report and the benchmarks (compose_config) refuse them instead of running without them. So are switches that are
not true or false (`trainer.progress=no`: the string 'no', which Python takes as true)."""

import subprocess
import sys
from pathlib import Path

import pytest

import moe.train
from fused_dlrm.train import loop
from fused_dlrm.train.build import compose_config
from fused_dlrm.train.config_keys import CONF, check_config_keys
from test_training import CPU, config  # config: Hydra's compose() alone, no record of the chosen options

ROOT = Path(__file__).resolve().parents[1]
# every packaged option of each group, under the model whose data it is (config_keys.DATA_GROUPS)
OPTIONS = ([[f"model={m.stem}"] for m in sorted((CONF / "model").glob("*.yaml"))]
           + [["model=dlrm", f"data={d}"] for d in ("synthetic", "synthetic_paper", "criteo")]
           + [["model=moe_transformer", f"data={d}"] for d in ("bytes", "bytes_finegrained")]
           + [[f"comm={c.stem}"] for c in sorted((CONF / "comm").glob("*.yaml"))])
# all of comm=fused's keys under comm=bulk: the config's keys are comm=fused's, its comm.mode is bulk
FUSED_KEYS_UNDER_BULK = [f"+comm.{key}=1" for key in ("transport", "num_programs", "wait_timeout_spins",
                                                        "moe_dispatch", "moe_combine")]


@pytest.mark.parametrize("overrides", OPTIONS + [
    ["data=criteo", "+data.train.drop_last=true"],  # keys under a `_target_` node are its class's arguments
    ["+trainer.dense_optimizer.momentum=0.9", "trainer.dense_optimizer._target_=torch.optim.SGD",
     "~trainer.dense_optimizer.fused"],
    ["model=moe_transformer", "+model.optimizer.betas=[0.9,0.95]"],
    ["report=true", "seed=3", "model.num_rows=[10,20]", "trainer.max_steps=2"],
    # switches: YAML's true / false / True / False are bools
    ["report=True", "trainer.progress=False", "trainer.direct_step=false", "trainer.tf32=true"],
    ["model=moe_transformer", "model.shared_expert=True", "model.sequence_parallel=false"],
    # a class's switch left to the class's own default: torch's optimizers take fused=None (foreach where it can)
    ["trainer.dense_optimizer.fused=null"],
    ["model=moe_transformer", "model.optimizer.fused=null"],
], ids=" ".join)
def test_the_packaged_configs_and_their_keys_are_accepted(overrides):
    compose_config(overrides)
    check_config_keys(config(*overrides))  # against the options its own fields name


@pytest.mark.parametrize("overrides,said", [
    (["+trainer.max_step=3"], r"trainer.max_step \(did you mean trainer.max_steps\?\); the known keys of trainer "
                              r"under trainer=default: batches_ahead, .*max_steps, .*tf32$"),
    (["+model.embedding_optimizer.momentum=0.9"], r"model.embedding_optimizer.momentum; the known keys of "
                                                  r"model.embedding_optimizer under model=dlrm: eps, lr, name$"),
    (["+data.typo.deeper=1", "+comm.backedn=gloo"],
     r"data.typo; the known keys of data under data=synthetic: .* \| comm.backedn \(did you mean comm.backend\?\); "
     r"the known keys of comm under comm=bulk: allocation_timeout_s, backend, grad_allreduce, mode$"),
    # keys another option of the group sets, which the chosen one's code never reads
    (["+model.vocab_size=300"], r"model.vocab_size is set by model=moe_transformer or "
                                r"model=moe_transformer_finegrained, not model=dlrm; the known keys of model under "
                                r"model=dlrm: column_shards, .*row_shards$"),
    (["model=dlrm_paper", "+model.optimizer.lr=1"], r"model.optimizer is set by model=moe_transformer or "
                                                    r"model=moe_transformer_finegrained, not model=dlrm_paper \(did you "
                                                    r"mean model.embedding_optimizer\?\); "),
    (["model=moe_transformer", "+data.train.device=cuda"], r"data.train is set by data=criteo or data=synthetic or "
                                                           r"data=synthetic_paper, not data=bytes; "),
    (FUSED_KEYS_UNDER_BULK, r"comm.transport is set by comm=fused, not comm=bulk; .* \| comm.num_programs is set by "
                            r"comm=fused, not comm=bulk; "),
    (["+sed=1"], r"sed \(did you mean seed\?\); the known keys of the config: comm, data, hydra, model, report, "
                 r"seed, trainer$"),
])
def test_keys_no_conf_file_sets_are_refused(overrides, said):
    with pytest.raises(ValueError, match=r"^unknown config key\(s\), which no code reads \(a `\+` override adds any "
                                         r"key\): " + said):
        compose_config(overrides)


@pytest.mark.parametrize("overrides,said", [
    (["+model.vocab_size=300"], r"model.vocab_size is set by model=moe_transformer or "
                                r"model=moe_transformer_finegrained, not model=dlrm or model=dlrm_paper; "),
    (["model=moe_transformer", "+model.num_rows=10"], r"model.num_rows is set by model=dlrm or model=dlrm_paper, not "
                                                      r"model=moe_transformer or model=moe_transformer_finegrained "
                                                      r"\(did you mean model.num_layers\?\); "),
    (["+comm.transport=p2p"], r"comm.transport is set by comm=fused, not comm=bulk; "),
    # the config's keys are comm=fused's, but its comm.mode=bulk runs the bulk code, which reads none of them
    (FUSED_KEYS_UNDER_BULK, r"comm.transport is set by comm=fused, not comm=bulk; .* \| comm.num_programs is set by "
                            r"comm=fused, not comm=bulk; "),
    (["+data.num_workers=2"], r"data.num_workers is set by data=criteo, not data=synthetic or data=synthetic_paper "),
    (["model=moe_transformer", "+data.num_sparse=3"],
     r"data.num_sparse is set by data=criteo or data=synthetic or data=synthetic_paper, not data=bytes or "
     r"data=bytes_finegrained; "),
    (["+trainer.max_step=3"], r"trainer.max_step \(did you mean trainer.max_steps\?\); the known keys of trainer "
                              r"under trainer=default: "),
], ids=lambda value: " ".join(value) if isinstance(value, list) else "")
def test_a_config_without_hydras_record_is_checked_against_the_options_its_fields_name(overrides, said):
    """compose() without the `hydra` node, outside a Hydra job: comm.mode, model.name and data.train._target_ name
    the options (all those with the config's value)."""
    with pytest.raises(ValueError, match=r"^unknown config key\(s\).*: " + said):
        check_config_keys(config(*overrides))


def test_without_hydras_record_a_value_no_packaged_option_has_is_not_checked():
    """comm.mode of an option of the user's own: its keys are not known here (with the record: the same)."""
    check_config_keys(config("comm.mode=mine", "+comm.setting=1"))


# Hydra reads `trainer.progress=no` as the string 'no', which Python takes as true: every switch the chosen options set
# to true or false (and conf/config.yaml's report) is refused unless it is true or false, all of them at once
@pytest.mark.parametrize("overrides,said", [
    (["trainer.progress=no", "report=maybe"],
     r"report='maybe': expected true or false \| trainer.progress='no': expected true or false$"),
    # DLRM's switches; a number or null is no switch either
    (["trainer.direct_step=off", "trainer.cuda_graphs=1", "trainer.tf32=null"],
     r"trainer.cuda_graphs=1: expected true or false \| trainer.direct_step='off': expected true or false \| "
     r"trainer.tf32=None: expected true or false$"),
    (["model=moe_transformer", "model.shared_expert=no", "model.sequence_parallel='false'"],
     r"model.sequence_parallel='false': expected true or false \| model.shared_expert='no': expected true or false$"),
    (["model=moe_transformer_finegrained", "model.shared_expert=0"], r"model.shared_expert=0: expected true or false$"),
    # a class's argument the option sets to true or false: torch.optim.Adam(fused='no') steps fused
    (["trainer.dense_optimizer.fused=no"],
     r"trainer.dense_optimizer.fused='no': expected true, false or null \(the class's default\)$"),
    (["model=moe_transformer", "model.optimizer.fused=off"],
     r"model.optimizer.fused='off': expected true, false or null \(the class's default\)$"),
], ids=lambda value: " ".join(value) if isinstance(value, list) else "")
def test_switches_that_are_not_true_or_false_are_refused(overrides, said):
    with pytest.raises(ValueError, match="^" + said):
        compose_config(overrides)
    with pytest.raises(ValueError, match="^" + said):  # without Hydra's record: the options its fields name
        check_config_keys(config(*overrides))


def test_unknown_keys_and_switches_that_are_not_true_or_false_are_named_at_once():
    with pytest.raises(ValueError, match=r"^unknown config key\(s\).*: trainer.max_step \(did you mean .*\n"
                                         r"trainer.progress='no': expected true or false$"):
        compose_config(["+trainer.max_step=3", "trainer.progress=no"])


SHORT = ["trainer.max_steps=1", "trainer.eval_every=0", "trainer.checkpoint_every=0", "trainer.progress=false",
         "data.eval_batches=1"]


@pytest.mark.parametrize("train,model", [(loop.train, "model=dlrm"), (moe.train.train, "model=moe_transformer")],
                         ids=["dlrm", "moe_transformer"])
def test_every_models_train_refuses_a_typo_or_a_switch_before_training(tmp_path, train, model):
    """A test or script calling a model's train directly, not train.py. (A short run, should the typo be taken.)"""
    small = ["model.num_rows=100", "data.global_batch_size=8"] if model == "model=dlrm" else ["data.size_bytes=20000"]
    with pytest.raises(ValueError, match=r"^unknown config key\(s\).*: trainer.max_step \(did you mean"):
        train(config(model, *SHORT, *small, "+trainer.max_step=1"), CPU, tmp_path)
    with pytest.raises(ValueError, match=r"^trainer.header_ahead='no': expected true or false$"):
        train(config(model, *SHORT, *small, "trainer.header_ahead=no"), CPU, tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_train_py_refuses_a_typo_before_training(tmp_path):
    """Against the options Hydra's job records as chosen: all of comm=fused's keys under comm=bulk (closest
    to comm=fused without the record). (A short run, should the keys be taken: the test then fails on its exit
    status, not on a timeout.)"""
    done = subprocess.run([sys.executable, "train.py", "+trainer.max_step=1", *FUSED_KEYS_UNDER_BULK, *SHORT,
                           "model.num_rows=100", "data.global_batch_size=8", f"hydra.run.dir={tmp_path}/run"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "unknown config key(s)" in done.stderr and "trainer.max_step (did you mean" in done.stderr, done.stderr
    assert "comm.transport is set by comm=fused, not comm=bulk" in done.stderr, done.stderr


def test_a_composition_with_the_hydra_config_is_accepted():
    """The standalone report composes with Hydra's own node (`hydra`): a top-level key of conf/config.yaml."""
    cfg = compose_config(["trainer.max_steps=2"], return_hydra_config=True)
    assert "hydra" in cfg and cfg.trainer.max_steps == 2
    assert "hydra" not in compose_config([])  # composed with it to check the keys against its record, then dropped
    with pytest.raises(ValueError, match=r"^unknown config key\(s\).*: sed \(did you mean seed\?\)"):
        compose_config(["+sed=1"], return_hydra_config=True)


@pytest.mark.parametrize("model,data,trains_on", [
    ("moe_transformer", "synthetic", "data=bytes or data=bytes_finegrained"),
    ("dlrm", "bytes", "data=synthetic or data=synthetic_paper or data=criteo"),
])
def test_a_data_group_of_the_other_model_is_refused_by_every_entry_point(model, data, trains_on):
    """`data=` overrides the model's own choice: the report and the benchmarks (compose_config) and a model's train
    refuse another model's data group at once, as train.py does, rather than after building the model, on a key
    that data group lacks (`Missing key path`)."""
    said = rf"^model.name={model} trains on {trains_on}, not data={data} \(leave data= out"
    with pytest.raises(ValueError, match=said):
        compose_config([f"model={model}", f"data={data}"])
    # without Hydra's record (compose() alone): the data options its data.train._target_ names
    with pytest.raises(ValueError, match=rf"^model.name={model} trains on {trains_on}, not data="):
        check_config_keys(config(f"model={model}", f"data={data}"))


@pytest.mark.parametrize("train,model", [(loop.train, "model=dlrm"), (moe.train.train, "model=moe_transformer")],
                         ids=["dlrm", "moe_transformer"])
@pytest.mark.parametrize("seed", ["abc", "1.5", "null", "true", "-1", "1000000000000000"])
def test_every_models_train_refuses_a_seed_that_torch_cannot_take(tmp_path, train, model, seed):
    """A seed that is no whole number, or one whose tables' seeds (x 100_003) overflow torch's 64 bits, failed deep in
    the model's initialisation ("invalid literal for int()", "manual_seed expected a long", "Overflow when unpacking
    long long"), naming no key; YAML's true was seed 1."""
    small = ["model.num_rows=100", "data.global_batch_size=8"] if model == "model=dlrm" else ["data.size_bytes=20000"]
    with pytest.raises(ValueError, match=r"^seed=.*: expected a whole number in \[0, 2\*\*32\)$"):
        train(config(model, *SHORT, *small, f"seed={seed}"), CPU, tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists()
