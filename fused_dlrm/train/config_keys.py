"""Refuse config keys that no code reads, and switches that are not true or false. Hydra's `+trainer.max_step=10`
adds a key, a typo as readily as any other, and the run would go on without it; `model=dlrm +model.vocab_size=300`
adds a key only another model reads. A key of trainer / model / data / comm is known when the group's chosen option
(conf/<group>/<option>.yaml, with the options its defaults list extends) sets it, a top-level key when
conf/config.yaml does; the keys under a node with `_target_` are its class's arguments, which the call of the class
checks (`+trainer.dense_optimizer.momentum=0.9`, `data=criteo +data.train.drop_last=true`). A data option of the
other model (`model=moe_transformer data=synthetic`: `data=` overrides the model's own choice) is refused too: its
keys are all the other model's.

The chosen options are Hydra's record of them: the config's own `hydra` node (composed with return_hydra_config), or
the running @hydra.main job's (HydraConfig). A config composed without either (compose() in tests, a script) names
its options itself, in the field the code dispatches on (NAMED_BY): comm.mode (bulk | fused), model.name (dlrm:
model=dlrm or dlrm_paper), data.train._target_ (the dataset class; none: the byte corpus). Its keys are checked
against every option with that value (the error names them all): the same code reads what any of them sets. The
trainer group has no such field: all its options. A value no packaged option has (an option of the user's own) is
not checked, as with the record. (A guess from the config's keys alone would take comm=bulk holding all of
comm=fused's keys for comm=fused.)

A switch is a key the chosen options (all of them that set it) set to true or false, or conf/config.yaml does
(report): Hydra reads `trainer.progress=no` as the string 'no', which Python takes as true, so the user's off would
be on. Its value must be a bool (YAML's true / false / True / False); a key an option leaves null takes any value.
A class's argument (under a `_target_` node) the option sets to true or false is a switch too: torch.optim.Adam
takes `trainer.dense_optimizer.fused=no` and steps fused. Null passes there (None: the class's own default, as
torch's optimizers take fused=None)."""

from __future__ import annotations

import difflib
from functools import cache
from pathlib import Path
from typing import Iterator

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

CONF = Path(__file__).resolve().parents[2] / "conf"
CHECKED_GROUPS = ("trainer", "model", "data", "comm")
# Without Hydra's record: the field of each group that names the code reading its keys, and so its options
NAMED_BY = {"model": "name", "data": "train._target_", "comm": "mode"}
# model.name -> the packaged data options it trains on (a model or data option of the user's own is not checked)
DATA_GROUPS = {"dlrm": ("synthetic", "synthetic_paper", "criteo"), "moe_transformer": ("bytes", "bytes_finegrained")}


def _paths(node: dict, prefix: str, arguments: bool = False) -> Iterator[tuple[str, object]]:
    """The dotted keys of a plain dict with their values, nested ones too, but not those under a node with
    `_target_` (its class's arguments) unless `arguments`."""
    for key, value in node.items():
        path = f"{prefix}.{key}"
        yield path, value
        if isinstance(value, dict) and (arguments or "_target_" not in value):
            yield from _paths(value, path, arguments)


def options(group: str) -> list[str]:
    """The packaged options of a group: the names of conf/<group>/*.yaml."""
    return sorted(file.stem for file in (CONF / group).glob("*.yaml"))


def _option_node(group: str, option: str) -> DictConfig:
    """conf/<group>/<option>.yaml merged onto the options of its group its defaults list extends (dlrm_paper onto
    dlrm): the group's node as Hydra composes it, but for the options of other groups it picks."""
    node = OmegaConf.load(CONF / group / f"{option}.yaml")
    # a dict entry of the defaults list picks an option of another group (`override /data@_global_.data: bytes`)
    extended = [entry for entry in node.pop("defaults", []) if isinstance(entry, str) and entry != "_self_"]
    return OmegaConf.merge(*(_option_node(group, base) for base in extended), node)


@cache
def option_values(group: str, option: str) -> dict[str, object]:
    """The dotted keys ("model.num_rows", "model.embedding_optimizer.lr") the option of the group sets, with their
    values; its classes' arguments too ("trainer.dense_optimizer.fused"), which a config's keys are not checked
    against (`_group_errors` passes over them)."""
    return dict(_paths(OmegaConf.to_container(_option_node(group, option)), group, arguments=True))


@cache
def _top_level_node() -> dict:
    """conf/config.yaml without its defaults list: seed, report, hydra (which a composition with the Hydra config
    holds)."""
    node = OmegaConf.to_container(OmegaConf.load(CONF / "config.yaml"))
    del node["defaults"]
    return node


def top_level_keys() -> set[str]:
    """The keys conf/config.yaml sets and the groups."""
    return set(_top_level_node()) | {p.name for p in CONF.iterdir() if p.is_dir()}


def chosen_options(cfg: DictConfig) -> dict[str, list[str]]:
    """The packaged options each group's keys are checked against (none: an option of the user's own, not checked):
    the one Hydra's record names (cfg's own `hydra` node, else the running job's), or without a record the options
    whose NAMED_BY field has cfg's value (every option of a group without one)."""
    if OmegaConf.select(cfg, "hydra.runtime.choices") is not None:
        recorded = dict(cfg.hydra.runtime.choices)
    elif HydraConfig.initialized():
        recorded = dict(HydraConfig.get().runtime.choices)
    else:
        return {group: [option for option in options(group) if group not in NAMED_BY
                        or _named(group, option) == OmegaConf.select(cfg, f"{group}.{NAMED_BY[group]}")]
                for group in CHECKED_GROUPS}
    return {group: [recorded[group]] if recorded.get(group) in options(group) else [] for group in CHECKED_GROUPS}


@cache
def _named(group: str, option: str) -> object:
    """The value the option sets its group's NAMED_BY field to (None where it sets none: the byte corpus's data)."""
    return OmegaConf.select(_option_node(group, option), NAMED_BY[group])


def _either(group: str, names: list[str]) -> str:
    return " or ".join(f"{group}={name}" for name in names)


def _describe(key: str, known: set[str], chosen: str = "", elsewhere: str = "") -> str:
    """An unknown key, the known one its name is closest to, the options of its group that set it (`elsewhere`,
    rather than the `chosen` one) and the known keys beside it."""
    parent, _, name = key.rpartition(".")
    siblings = sorted(k.rpartition(".")[2] for k in known if k.rpartition(".")[0] == parent)
    close = difflib.get_close_matches(name, siblings, n=1)
    prefix = f"{parent}." if parent else ""
    return (f"{key}{f' is set by {elsewhere}, not {chosen}' if elsewhere else ''}"
            f"{f' (did you mean {prefix}{close[0]}?)' if close else ''}; the known keys of {parent or 'the config'}"
            f"{f' under {chosen}' if chosen else ''}: {', '.join(siblings)}")


def _group_errors(cfg: DictConfig, group: str, chosen: list[str]) -> list[str]:
    """The keys of cfg[group] none of the `chosen` options sets, described."""
    if not chosen:  # an option of the user's own (a config dir on hydra.searchpath): which keys it sets is not known
        return []
    keys = [key for key, _ in _paths(OmegaConf.to_container(cfg[group], resolve=False), group)]
    known = set().union(*(option_values(group, option) for option in chosen))
    errors = []
    for key in keys:
        parent = key.rpartition(".")[0]
        if key not in known and (parent == group or parent in known):  # below an unknown key: named already
            elsewhere = [option for option in options(group) if key in option_values(group, option)]
            errors.append(_describe(key, known, _either(group, chosen), _either(group, elsewhere)))
    return errors


def _check_data_group(cfg: DictConfig, data: list[str]) -> None:
    """Refuse a packaged data option of the other model (`data=` on the command line overrides the model's own
    choice), which would otherwise fail late on a key it lacks (`Missing key path`) or train on the other model's
    data. `data`: the chosen data options (`chosen_options`)."""
    model = OmegaConf.select(cfg, "model.name")
    if model in DATA_GROUPS and data and not set(data) & set(DATA_GROUPS[model]):
        raise ValueError(f"model.name={model} trains on {_either('data', list(DATA_GROUPS[model]))}, not "
                         f"{_either('data', data)} (leave data= out: the model picks its own)")


def _class_argument(key: str, values: dict[str, object]) -> bool:
    """Whether `key` of an option's `values` lies under a node with `_target_` (its class's argument)."""
    parts = key.split(".")
    return any(".".join(parts[:i] + ["_target_"]) in values for i in range(1, len(parts)))


def _switches(chosen: dict[str, list[str]]) -> dict[str, bool]:
    """The switches (see the module's doc) of a config whose groups' chosen options are `chosen`
    (`chosen_options`), sorted (the same order on every rank), each with whether null passes too: a class's
    argument, where None is the class's own default (torch's optimizers: fused=None)."""
    switches = {key: False for key, value in _top_level_node().items() if isinstance(value, bool)}
    for group in CHECKED_GROUPS:
        values = [option_values(group, option) for option in chosen[group]]
        switches |= {key: any(_class_argument(key, v) for v in values if key in v) for key in set().union(*values)
                     if all(isinstance(v[key], bool) for v in values if key in v)}
    return dict(sorted(switches.items()))


def _switch_errors(cfg: DictConfig, chosen: dict[str, list[str]]) -> list[str]:
    """`<key>=<value>: expected true or false` for each switch of cfg whose value is no bool, nor null where that
    passes (one it lacks, `~trainer.progress`, fails where it is read)."""
    absent, errors = object(), []
    for key, nullable in _switches(chosen).items():
        value = OmegaConf.select(cfg, key, default=absent)
        if value is not absent and not isinstance(value, bool) and not (nullable and value is None):
            expected = "true, false or null (the class's default)" if nullable else "true or false"
            errors.append(f"{key}={value!r}: expected {expected}")
    return errors


def check_config_keys(cfg: DictConfig) -> None:
    """Raise ValueError naming the other model's data option, or every key of cfg's trainer / model / data / comm
    that the group's chosen option does not set and every top-level key conf/config.yaml does not set, with the
    known keys beside it, and every switch that is not true or false. Deterministic: under torchrun every rank
    raises the same error."""
    top = top_level_keys()
    unknown = [_describe(key, top) for key in cfg if key not in top]
    chosen = chosen_options(cfg)
    _check_data_group(cfg, chosen["data"])
    for group in CHECKED_GROUPS:
        if group in cfg:
            unknown += _group_errors(cfg, group, chosen[group])
    problems = []
    if unknown:
        problems.append(f"unknown config key(s), which no code reads (a `+` override adds any key): "
                        f"{' | '.join(unknown)}")
    not_switches = _switch_errors(cfg, chosen)
    if not_switches:
        problems.append(" | ".join(not_switches))
    if problems:  # all at once, not one run for each
        raise ValueError("\n".join(problems))
