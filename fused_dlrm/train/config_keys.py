"""Refuse config keys that no code reads: Hydra's `+trainer.max_step=10` adds a key, a typo as readily as any other,
and the run would go on without it; `model=dlrm +model.vocab_size=300` adds a key only another model reads. A key of
trainer / model / data / comm is known when the group's chosen option (conf/<group>/<option>.yaml, with the options
its defaults list extends) sets it, a top-level key when conf/config.yaml does; the keys under a node with `_target_`
are its class's arguments, which the call of the class checks (`+trainer.dense_optimizer.momentum=0.9`,
`+data.train.device=cuda`).

The chosen options are Hydra's record of them: the config's own `hydra` node (composed with return_hydra_config), or
the running @hydra.main job's (HydraConfig). A config composed without either (compose() in tests) is checked
against the options whose keys are closest to its own (fewest keys added or missing): a key is refused when none of
them sets it."""

from __future__ import annotations

import difflib
from functools import cache
from pathlib import Path
from typing import Iterator

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

CONF = Path(__file__).resolve().parents[2] / "conf"
CHECKED_GROUPS = ("trainer", "model", "data", "comm")


def _paths(node: dict, prefix: str) -> Iterator[str]:
    """The dotted keys of a plain dict, nested ones too, but not those under a node with `_target_`."""
    for key, value in node.items():
        path = f"{prefix}.{key}"
        yield path
        if isinstance(value, dict) and "_target_" not in value:
            yield from _paths(value, path)


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
def option_keys(group: str, option: str) -> frozenset[str]:
    """The dotted keys ("model.num_rows", "model.embedding_optimizer.lr") the option of the group sets."""
    return frozenset(_paths(OmegaConf.to_container(_option_node(group, option)), group))


def top_level_keys() -> set[str]:
    """The keys conf/config.yaml sets (seed, report; hydra, which a composition with the Hydra config holds) and
    the groups."""
    node = OmegaConf.to_container(OmegaConf.load(CONF / "config.yaml"))
    return (set(node) - {"defaults"}) | {p.name for p in CONF.iterdir() if p.is_dir()}


def recorded_choices(cfg: DictConfig) -> dict | None:
    """Hydra's record of the option chosen for each group: cfg's own `hydra` node, else the running job's."""
    if OmegaConf.select(cfg, "hydra.runtime.choices") is not None:
        return dict(cfg.hydra.runtime.choices)
    if HydraConfig.initialized():
        return dict(HydraConfig.get().runtime.choices)
    return None


def closest_options(group: str, keys: set[str]) -> list[str]:
    """The options of a group whose keys differ least from `keys` (a config's, composed without Hydra's record)."""
    distance = {option: len(keys ^ option_keys(group, option)) for option in options(group)}
    return [option for option in options(group) if distance[option] == min(distance.values())]


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


def _group_errors(cfg: DictConfig, group: str, choices: dict | None) -> list[str]:
    """The keys of cfg[group] its chosen option does not set, described."""
    keys = list(_paths(OmegaConf.to_container(cfg[group], resolve=False), group))
    if choices is None:
        chosen = closest_options(group, set(keys))
    elif choices.get(group) in options(group):
        chosen = [choices[group]]
    else:  # an option of the user's own (a config dir on hydra.searchpath): which keys it sets is not known here
        return []
    known = set().union(*(option_keys(group, option) for option in chosen))
    errors = []
    for key in keys:
        parent = key.rpartition(".")[0]
        if key not in known and (parent == group or parent in known):  # below an unknown key: named already
            elsewhere = [option for option in options(group) if key in option_keys(group, option)]
            errors.append(_describe(key, known, _either(group, chosen), _either(group, elsewhere)))
    return errors


def check_config_keys(cfg: DictConfig) -> None:
    """Raise ValueError naming every key of cfg's trainer / model / data / comm that the group's chosen option does
    not set, and every top-level key conf/config.yaml does not set, with the known keys beside it. Deterministic:
    under torchrun every rank raises the same error."""
    top = top_level_keys()
    unknown = [_describe(key, top) for key in cfg if key not in top]
    choices = recorded_choices(cfg)
    for group in CHECKED_GROUPS:
        if group in cfg:
            unknown += _group_errors(cfg, group, choices)
    if unknown:
        raise ValueError(f"unknown config key(s), which no code reads (a `+` override adds any key): "
                         f"{' | '.join(unknown)}")
