"""Registered names the config checks at load time, held in the schema layer.

The runtime registries (:mod:`mentorrl.algos.advantages`, :mod:`mentorrl.envs`) add every name they
register here, so a config naming a user's estimator or environment validates; the built-in names are
listed below (a test keeps them equal to the runtime registries), so validating a config imports no
runtime module. An environment may also come from an installed package's ``mentorrl.envs`` entry
point, listed without importing it. Also here: the training-split guard (evaluation-only splits).
"""

from __future__ import annotations

from importlib import metadata
from typing import Iterable

ADVANTAGE = "advantage estimator"
ENVIRONMENT = "environment"
BUILTIN_NAMES: dict[str, tuple[str, ...]] = {ADVANTAGE: ("grpo",), ENVIRONMENT: ("code", "orders", "tau2", "verifiers")}
ENTRY_POINT_GROUPS = {ENVIRONMENT: "mentorrl.envs"}  # kinds whose names installed packages may also declare

_REGISTERED: dict[str, set[str]] = {kind: set(names) for kind, names in BUILTIN_NAMES.items()}


def register_name(kind: str, name: str) -> None:
    """Record that the runtime registry of ``kind`` now holds ``name`` (called by that registry)."""
    _REGISTERED.setdefault(kind, set()).add(name)


def unregister_name(kind: str, name: str) -> None:
    _REGISTERED.get(kind, set()).discard(name)


def entry_point_names(group: str) -> list[str]:
    """The names installed packages declare in entry-point ``group`` (nothing is imported)."""
    return [ep.name for ep in metadata.entry_points(group=group)]


def known_names(kind: str) -> list[str]:
    """Every name of ``kind`` a config may use, sorted."""
    names = set(_REGISTERED.get(kind, ()))
    if kind in ENTRY_POINT_GROUPS:
        names.update(entry_point_names(ENTRY_POINT_GROUPS[kind]))
    return sorted(names)


def check_registered(kind: str, name: str) -> str:
    """``name``, or a ValueError naming the registered names of ``kind``."""
    if name in _REGISTERED.get(kind, ()):
        return name
    known = known_names(kind)
    if name not in known:
        raise ValueError(f"unknown {kind} {name!r}; registered: {', '.join(known)}")
    return name


# ---------------------------------------------------------------- task splits ------
HIDDEN_SPLITS = frozenset({"hidden", "novel_wording"})  # evaluation-only splits


class HiddenSetError(ValueError):
    """Raised when hidden evaluation tasks are about to be used for training."""


def assert_trainable_splits(splits: Iterable[str]) -> None:
    """Refuse split names that are evaluation-only (``hidden``, ``novel_wording``). Call it on a config's
    training splits."""
    bad = sorted({s for s in splits if s in HIDDEN_SPLITS})
    if bad:
        what = "the hidden evaluation set" if bad[0] == "hidden" else "an evaluation-only stress set"
        raise HiddenSetError(f"split {bad[0]!r} is {what} and is never used for training; pick another split")


__all__ = [
    "ADVANTAGE",
    "BUILTIN_NAMES",
    "ENVIRONMENT",
    "HIDDEN_SPLITS",
    "HiddenSetError",
    "assert_trainable_splits",
    "check_registered",
    "entry_point_names",
    "known_names",
    "register_name",
    "unregister_name",
]
