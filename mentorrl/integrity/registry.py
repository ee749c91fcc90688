"""Per-environment registries of audit suites (attacks, corruptions): built-ins plus user registrations."""

from __future__ import annotations

from typing import Callable, Generic, Sequence, TypeVar

T = TypeVar("T")
Factory = Callable[[], Sequence[T]]


class SuiteRegistry(Generic[T]):
    """Maps an environment name to a factory of its suite; the factory runs when the suite is used."""

    def __init__(self, what: str, builtins: dict[str, Factory]):
        self.what = what
        self.builtins = dict(builtins)
        self.registered: dict[str, Factory] = {}

    def register(self, env_name: str, factory: Factory) -> None:
        if env_name in self.registered or env_name in self.builtins:
            raise ValueError(f"{self.what} for environment {env_name!r} are already registered")
        self.registered[env_name] = factory

    def get(self, env_name: str) -> list[T]:
        factory = self.registered.get(env_name) or self.builtins.get(env_name)
        if factory is None:
            known = ", ".join(sorted({*self.registered, *self.builtins}))
            raise ValueError(f"no {self.what} registered for environment {env_name!r}; registered: {known}")
        return list(factory())
