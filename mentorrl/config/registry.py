"""One registry idiom for every extension point: losses, advantages, stages, OPD terms, black-box recipes,
environments and rollout backends.

A :class:`Registry` maps names to the objects that implement them. The rules are the same everywhere:

* registering a name that is taken is a :class:`DuplicateName` error, unless the caller says
  ``replace=True`` (re-registering the very same object is a no-op, so a module imported twice is fine);
* looking up an unknown name is an :class:`UnknownName` error (a ``ValueError``) that lists what is known;
* the config's allowed names are the registry's own: :meth:`Registry.names` (the registered names, the
  ``builtin`` names declared here so that validating a config imports no runtime module, and the names of an
  entry-point group that installed packages declare). A test keeps each registry's ``builtin`` names equal
  to what its runtime module registers.

The registries themselves live in this schema-layer module (it imports only the standard library), so the
config validators and the runtime modules read and fill the same object.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any, Callable, Generic, Iterable, Iterator, TypeVar

T = TypeVar("T")
_MISSING: Any = object()


class DuplicateName(ValueError):
    """A name registered twice without ``replace=True``."""


class UnknownName(ValueError):
    """A name no registry entry, built-in name or installed entry point provides."""


class Registry(Generic[T]):
    """Names -> implementations of one ``kind`` of extension (see the module docstring).

    ``builtin``: names the runtime registers when its module is imported, declared so that a config can be
    validated without importing it; ``entry_points``: an entry-point group whose names installed packages
    declare (listed without importing them); ``reserved``: names that may not be registered, with why."""

    def __init__(
        self,
        kind: str,
        builtin: Iterable[str] = (),
        entry_points: str | None = None,
        reserved: dict[str, str] | None = None,
    ):
        self.kind, self.builtin, self.entry_points = kind, tuple(builtin), entry_points
        self.reserved: dict[str, str] = dict(reserved or {})
        self._items: dict[str, T] = {}

    # ---- registering ---------------------------------------------------------------------------
    def register(self, name: str, obj: T = _MISSING, *, replace: bool = False) -> Any:
        """Register ``obj`` under ``name`` and return it; without ``obj``, a decorator that does so."""
        if obj is _MISSING:
            return lambda o: self.register(name, o, replace=replace)
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} name must be a non-empty string, got {name!r}")
        if name in self.reserved:
            raise ValueError(f"{self.kind} name {name!r} is reserved: {self.reserved[name]}")
        held = self._items.get(name, _MISSING)
        if held is not _MISSING and held is not obj and not replace:
            raise DuplicateName(
                f"{self.kind} {name!r} is already registered ({_describe(held)}); pass replace=True to replace it"
            )
        self._items[name] = obj
        return obj

    def reserve(self, name: str, why: str) -> None:
        """Refuse ``name`` from now on (e.g. a config section that is not an entry of this registry)."""
        self.reserved[name] = why

    def unregister(self, name: str) -> T | None:
        """Forget ``name`` (a test's toy entry); returns what it held."""
        return self._items.pop(name, None)

    # ---- reading -------------------------------------------------------------------------------
    def get(self, name: str) -> T:
        """The implementation of ``name``; :class:`UnknownName` listing the known names otherwise."""
        try:
            return self._items[name]
        except (KeyError, TypeError):
            raise UnknownName(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        """Every name a config may use: registered, built-in and declared by installed packages."""
        known = set(self._items) | set(self.builtin)
        if self.entry_points:
            known.update(ep.name for ep in metadata.entry_points(group=self.entry_points))
        return sorted(known)

    def check(self, name: str) -> str:
        """``name`` if a config may use it (a pydantic validator's body), else :class:`UnknownName`."""
        if name in self._items or name in self.names():
            return name
        raise UnknownName(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())}")

    def __delitem__(self, name: str) -> None:
        if self.unregister(name) is None:
            raise KeyError(name)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def items(self):
        return self._items.items()

    def values(self):
        return self._items.values()

    def keys(self):
        return self._items.keys()

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {sorted(self._items)})"


def _describe(obj: Any) -> str:
    mod, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{mod}.{name}" if mod and name else type(obj).__name__


def registrar(registry: Registry, key: Callable[[Any], str] | None = None, replace: bool = False):
    """A decorator that registers its object in ``registry`` under ``key(obj)`` (e.g. a class's ``name``)."""

    def deco(obj):
        return registry.register(key(obj) if key else obj.__name__, obj, replace=replace)

    return deco


__all__ = ["DuplicateName", "Registry", "UnknownName", "registrar"]
