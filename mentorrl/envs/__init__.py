"""Environment registry: name -> (environment class, task source, scripted expert)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class EnvEntry:
    make_env: Callable[..., Any]
    make_tasks: Callable[[], Any]
    make_expert: Callable[[], Any]


def _orders() -> EnvEntry:
    from mentorrl.envs.orders import OrdersEnv, OrdersExpert, OrdersTasks

    return EnvEntry(OrdersEnv, OrdersTasks, OrdersExpert)


def _code() -> EnvEntry:
    from mentorrl.envs.code import CodeEnv, CodeExpert, CodeTasks, register_suites

    register_suites()  # its reward-hacking attacks and validation corruptions
    return EnvEntry(CodeEnv, CodeTasks, CodeExpert)


_REGISTRY: dict[str, Callable[[], EnvEntry]] = {"orders": _orders, "code": _code}


def register_env(name: str, factory: Callable[[], EnvEntry]) -> None:
    if name in _REGISTRY:
        raise ValueError(f"environment {name!r} is already registered")
    _REGISTRY[name] = factory


def get_env(name: str) -> EnvEntry:
    if name not in _REGISTRY:
        raise ValueError(f"unknown environment {name!r}; registered: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]()
