"""Refuse config keys that no code reads: Hydra's `+trainer.max_step=10` adds a key, a typo as readily as any other,
and the run would go on without it. A key of trainer / model / data / comm is known when some conf/<group>/*.yaml
sets it, a top-level key when conf/config.yaml does; the keys under a node with `_target_` are its class's
arguments, which the call of the class checks (`+trainer.dense_optimizer.momentum=0.9`, `+data.train.device=cuda`)."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Iterator

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


def known_keys(group: str) -> set[str]:
    """The dotted keys ("trainer.max_steps", "model.embedding_optimizer.lr") some conf/<group>/*.yaml sets."""
    known = set()
    for file in (CONF / group).glob("*.yaml"):
        node = OmegaConf.to_container(OmegaConf.load(file))
        node.pop("defaults", None)
        known.update(_paths(node, group))
    return known


def top_level_keys() -> set[str]:
    """The keys conf/config.yaml sets (seed, report; hydra, which a composition with the Hydra config holds) and
    the groups."""
    node = OmegaConf.to_container(OmegaConf.load(CONF / "config.yaml"))
    return (set(node) - {"defaults"}) | {p.name for p in CONF.iterdir() if p.is_dir()}


def _describe(key: str, known: set[str]) -> str:
    """An unknown key, the known one its name is closest to, and the known keys beside it."""
    parent, _, name = key.rpartition(".")
    siblings = sorted(k.rpartition(".")[2] for k in known if k.rpartition(".")[0] == parent)
    close = difflib.get_close_matches(name, siblings, n=1)
    prefix = f"{parent}." if parent else ""
    return (f"{key}{f' (did you mean {prefix}{close[0]}?)' if close else ''}; the known keys of "
            f"{parent or 'the config'}: {', '.join(siblings)}")


def check_config_keys(cfg: DictConfig) -> None:
    """Raise ValueError naming every key of cfg's trainer / model / data / comm that no conf file of its group sets,
    and every top-level key conf/config.yaml does not set, with the known keys beside it. Deterministic: under torchrun every rank raises the same error."""
    top = top_level_keys()
    unknown = [_describe(key, top) for key in cfg if key not in top]
    for group in CHECKED_GROUPS:
        if group in cfg:
            known = known_keys(group)
            values = OmegaConf.to_container(cfg[group], resolve=False)
            for key in _paths(values, group):
                parent = key.rsplit(".", 1)[0]
                if key not in known and (parent == group or parent in known):  # below an unknown key: named already
                    unknown.append(_describe(key, known))
    if unknown:
        raise ValueError(f"unknown config key(s), which no code reads (a `+` override adds any key): "
                         f"{' | '.join(unknown)}")
