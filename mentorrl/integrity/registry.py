"""Per-environment registries of audit suites (attacks, corruptions): the suite an environment's
:class:`~mentorrl.envs.EnvEntry` carries, plus user registrations for environments without one."""

from __future__ import annotations

from typing import Callable, Generic, Sequence, TypeVar

T = TypeVar("T")
Factory = Callable[[], Sequence[T]]


class SuiteRegistry(Generic[T]):
    """Maps an environment name to a factory of its suite; the factory runs when the suite is used."""

    def __init__(self, what: str, field: str):
        self.what = what
        self.field = field  # the EnvEntry attribute holding an environment's own suite
        self.registered: dict[str, Factory] = {}

    def builtin(self, env_name: str) -> Factory | None:
        """The suite the registered environment ``env_name`` carries (None: none, or no such environment)."""
        from mentorrl.envs import get_env, registered_envs

        if env_name not in registered_envs():
            return None
        return getattr(get_env(env_name), self.field)

    def register(self, env_name: str, factory: Factory) -> None:
        if env_name in self.registered or self.builtin(env_name) is not None:
            raise ValueError(f"{self.what} for environment {env_name!r} are already registered")
        self.registered[env_name] = factory

    def get(self, env_name: str) -> list[T]:
        factory = self.registered.get(env_name) or self.builtin(env_name)
        if factory is None:
            from mentorrl.envs import get_env, registered_envs

            own = {n for n in registered_envs() if getattr(get_env(n), self.field) is not None}
            known = ", ".join(sorted({*self.registered, *own}))
            raise ValueError(f"no {self.what} registered for environment {env_name!r}; registered: {known}")
        return list(factory())
