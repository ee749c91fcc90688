"""The registries whose names a config checks at load time, held in the schema layer
(:class:`~mentorrl.config.registry.Registry`: one idiom for every extension point).

The runtime modules (:mod:`mentorrl.algos.advantages`, :mod:`mentorrl.algos.losses`, :mod:`mentorrl.envs`,
:mod:`mentorrl.rollout.backends`)
register into these same objects, so a config naming a user's estimator, loss or environment validates; the
built-in names are declared on each registry (a test keeps them equal to the runtime's), so validating a
config imports no runtime module. An environment may also come from an installed package's ``mentorrl.envs``
entry point, listed without importing it. Also here: the training-split guard (evaluation-only splits).
"""

from __future__ import annotations

from typing import Iterable

from mentorrl.config.registry import Registry, UnknownName

ADVANTAGE = "advantage estimator"
ENVIRONMENT = "environment"
POLICY_LOSS = "policy loss"
ROLLOUT_BACKEND = "rollout backend"

# The registries a config names entries of. The runtime modules fill them (mentorrl.algos.advantages,
# mentorrl.algos.losses, mentorrl.envs); the built-in names are declared here so that validating a config
# imports no runtime module (tests/test_plugins.py keeps them equal to what the runtime registers).
ADVANTAGES: Registry = Registry(ADVANTAGE, builtin=("grpo",))
POLICY_LOSSES: Registry = Registry(POLICY_LOSS, builtin=("clipped", "grpo", "masked_is"))
ENVIRONMENTS: Registry = Registry(
    ENVIRONMENT, builtin=("code", "orders", "tau2", "verifiers"), entry_points="mentorrl.envs"
)
ROLLOUT_BACKENDS: Registry = Registry(ROLLOUT_BACKEND, builtin=("hf", "vllm"))
REGISTRIES: dict[str, Registry] = {r.kind: r for r in (ADVANTAGES, POLICY_LOSSES, ENVIRONMENTS, ROLLOUT_BACKENDS)}
BUILTIN_NAMES: dict[str, tuple[str, ...]] = {kind: r.builtin for kind, r in REGISTRIES.items()}


def known_names(kind: str) -> list[str]:
    """Every name of ``kind`` a config may use, sorted."""
    return REGISTRIES[kind].names()


def check_registered(kind: str, name: str) -> str:
    """``name``, or a ValueError (:class:`~mentorrl.config.registry.UnknownName`) naming the registered
    names of ``kind``."""
    return REGISTRIES[kind].check(name)


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
    "ADVANTAGES",
    "BUILTIN_NAMES",
    "ENVIRONMENT",
    "ENVIRONMENTS",
    "HIDDEN_SPLITS",
    "HiddenSetError",
    "POLICY_LOSS",
    "POLICY_LOSSES",
    "REGISTRIES",
    "ROLLOUT_BACKEND",
    "ROLLOUT_BACKENDS",
    "UnknownName",
    "assert_trainable_splits",
    "check_registered",
    "known_names",
]
