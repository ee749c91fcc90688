"""Environment registry: name -> (environment class, task source, scripted expert, integrity suites).

An :class:`EnvEntry` also carries what the layers above need to know about the environment
without naming it: its reward-hacking attacks and validation corruptions (run by
:mod:`mentorrl.integrity`, types in :mod:`mentorrl.envs.suites`) and its mutating tools (read by
the flywheel's failure attribution).
"""

from __future__ import annotations

import functools
import importlib
import sys
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Callable, Sequence

from mentorrl.config.base import ConfigError
from mentorrl.config.names import ENVIRONMENTS
from mentorrl.config.plugins import ENV_GROUP
from mentorrl.config.process import Once


@dataclass(frozen=True)
class EnvEntry:
    make_env: Callable[..., Any]
    make_tasks: Callable[[], Any]
    make_expert: Callable[[], Any]
    attacks: Callable[[], Sequence[Any]] | None = None  # factory of its Attack suite (mentorrl.envs.suites)
    corruptions: Callable[[], Sequence[Any]] | None = None  # factory of its Corruption suite
    mutating_tools: tuple[str, ...] | None = None  # tools that change state; None: unknown


def _suite(module: str, name: str) -> Callable[[], Sequence[Any]]:
    """A suite factory that imports ``module`` only when the suite is asked for."""

    def load() -> Sequence[Any]:
        return getattr(importlib.import_module(module), name)()

    return load


def _orders() -> EnvEntry:
    from mentorrl.envs.orders import OrdersBackend, OrdersEnv, OrdersExpert, OrdersTasks

    return EnvEntry(
        OrdersEnv,
        OrdersTasks,
        OrdersExpert,
        attacks=_suite("mentorrl.envs.orders.suite", "orders_attacks"),
        corruptions=_suite("mentorrl.envs.orders.suite", "orders_corruptions"),
        mutating_tools=tuple(OrdersBackend.MUTATING),
    )


def _code() -> EnvEntry:
    from mentorrl.envs.code import CodeEnv, CodeExpert, CodeTasks

    return EnvEntry(
        CodeEnv,
        CodeTasks,
        CodeExpert,
        attacks=_suite("mentorrl.envs.code.attacks", "code_attacks"),
        corruptions=_suite("mentorrl.envs.code.attacks", "code_corruptions"),
        mutating_tools=("write_file",),
    )


def _needs_id(name: str) -> Callable[..., Any]:
    def refuse(*_: Any, **__: Any) -> Any:
        raise ConfigError(f"env.id: environment {name!r} loads an installed environment by id: set env.id")

    return refuse


def _verifiers() -> EnvEntry:
    """``env: {name: verifiers}`` without an id: an entry that says env.id is needed when used."""
    return EnvEntry(_needs_id("verifiers"), _needs_id("verifiers"), _needs_id("verifiers"))


def _needs_clone(*_: Any, **__: Any) -> Any:
    raise ConfigError("env.path: environment 'tau2' reads your clone of tau2-bench: set env.path and env.domain")


def _tau2() -> EnvEntry:
    """``env: {name: tau2}`` by name alone: its attack suite, and an entry that asks for the clone when used
    (:func:`resolve_env` builds the configured one)."""
    return EnvEntry(
        _needs_clone, _needs_clone, _needs_clone, attacks=_suite("mentorrl.envs.tau2.audit", "tau2_attacks")
    )


def _load_verifiers(env_id: str, args: dict[str, Any]) -> EnvEntry:
    from mentorrl.envs.adapters.verifiers_v1 import load_verifiers_entry

    return load_verifiers_entry(env_id, args)


for _name, _factory in (("orders", _orders), ("code", _code), ("verifiers", _verifiers), ("tau2", _tau2)):
    ENVIRONMENTS.register(_name, _factory)
# environments that load an installed environment by id: name -> (env.id, env.args) -> EnvEntry
_LOADERS: dict[str, Callable[[str, dict[str, Any]], EnvEntry]] = {"verifiers": _load_verifiers}


def register_env(name: str, factory: Callable[[], EnvEntry], replace: bool = False) -> None:
    """Register environment ``name`` (a factory ``() -> EnvEntry``) in the registry a config's ``env.name`` is
    checked against; a taken name is an error unless ``replace``."""
    ENVIRONMENTS.register(name, factory, replace=replace)


def _load_entry_point(name: str) -> None:
    """Register environment ``name`` from an installed package's ``mentorrl.envs`` entry point: the
    entry point is an environment factory (``() -> EnvEntry``), or a module whose import registers it."""
    for ep in metadata.entry_points(group=ENV_GROUP, name=name):
        obj = ep.load()
        if name not in ENVIRONMENTS and callable(obj):
            register_env(name, obj)
        return


def get_env(name: str) -> EnvEntry:
    if name not in ENVIRONMENTS:
        _load_entry_point(name)
    return ENVIRONMENTS.get(name)()


def resolve_env(env_cfg: Any) -> EnvEntry:
    """The run's environment from its ``env:`` section: ``get_env(name)``, or, for a loader such as
    ``verifiers`` with ``id`` (and ``args``) set, the installed environment it names, or for ``tau2`` the
    domain of the clone ``path`` names (checked here: :func:`mentorrl.envs.tau2.tau2_entry`). Bad input is a
    :class:`~mentorrl.config.ConfigError` naming ``env.id`` / ``env.args``, before the first step."""
    env_id, args = getattr(env_cfg, "id", None), getattr(env_cfg, "args", None) or {}
    if env_cfg.name == "tau2" and env_id is None and not args:
        from mentorrl.envs.tau2 import tau2_entry  # the configured clone (env.path, env.domain, ...)

        return tau2_entry(env_cfg)
    if env_id is None:
        if args:
            raise ConfigError(f"env.args: set only with env.id (environment {env_cfg.name!r})")
        return get_env(env_cfg.name)
    if env_cfg.name not in _LOADERS:
        raise ConfigError(
            f"env.id: environment {env_cfg.name!r} takes no id; environments loaded by id: {', '.join(sorted(_LOADERS))}"
        )
    return _LOADERS[env_cfg.name](env_id, args)


def env_factory(entry: EnvEntry, env_cfg: Any) -> Callable[[], Any]:
    """A picklable ``make_env`` for a run's environment: ``entry.make_env`` with the ``env:`` config
    section's arguments (``tool_timeout_s``, and ``latency`` when set). The workspace's environments
    and the Ray actors' are built by it."""
    extra: dict[str, Any] = {"latency": env_cfg.latency} if env_cfg.latency is not None else {}
    if getattr(env_cfg, "answer", "typed") != "typed":  # only environments with an answer mode take the argument
        warn_free_text()
        extra["answer"] = env_cfg.answer
    return functools.partial(entry.make_env, tool_timeout_s=env_cfg.tool_timeout_s, **extra)


FREE_TEXT_WARNING = (
    "WARNING env.answer: free_text -- the final answer is read by a heuristic sentence reader, which "
    "paraphrases have fooled in every red-team round; use env.answer: typed for training and evaluation "
    "(docs/integrity.md#free-text-mode)"
)


def warn_free_text() -> None:
    """Print, once per process, that the free-text answer reader is heuristic."""
    if _FREE_TEXT_WARNED.first():
        print(FREE_TEXT_WARNING, file=sys.stderr, flush=True)


_FREE_TEXT_WARNED = Once()


def registered_envs() -> list[str]:
    """The registered environment names (installed entry points included), sorted."""
    return ENVIRONMENTS.names()
