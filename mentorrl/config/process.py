"""Process-wide state, each piece owned by one explicit object (docs/architecture.md, "Run-time state").

A module never rebinds a global nor mutates a module-level container at run time (checked by
``tests/test_no_runtime_globals.py``); what must live as long as the process is held by an instance of
one of these small classes (or of a class of its own module), created once at import and never rebound:

* :class:`Once` -- a flag that is true the first time it is asked (a warning printed once, entry points
  loaded once);
* :class:`LRUCache` -- a bounded, thread-safe cache of values derived from their keys.

They live in the config package, the lowest layer, beside the registries (standard library only), so the
config's own modules (the plugin loader) and every runtime layer can use them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Once:
    """True from :meth:`first` the first time it is called in this process (thread-safe), then False."""

    def __init__(self) -> None:
        self._done = False
        self._lock = threading.Lock()

    def first(self) -> bool:
        with self._lock:
            done, self._done = self._done, True
        return not done

    @property
    def done(self) -> bool:
        return self._done


class LRUCache(Generic[K, V]):
    """The ``maxsize`` most recently used entries; ``on_evict(value)`` runs for each one dropped.

    ``lock`` (reentrant) is held by every method; a caller holds it across several calls to make
    them one step (e.g. read a template while no other thread evicts it)."""

    def __init__(self, maxsize: int, on_evict: Callable[[V], None] | None = None) -> None:
        self.maxsize = maxsize
        self.on_evict = on_evict
        self.lock = threading.RLock()
        self._entries: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        """The entry of ``key`` (now the most recent), or None."""
        with self.lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def setdefault(self, key: K, value: V) -> V:
        """The entry of ``key``, ``value`` when there was none (a racing first value is kept); the
        oldest entries past ``maxsize`` are dropped."""
        with self.lock:
            value = self._entries.setdefault(key, value)
            self._entries.move_to_end(key)
            while len(self._entries) > self.maxsize:
                old = self._entries.popitem(last=False)[1]
                if self.on_evict is not None:
                    self.on_evict(old)
            return value

    def clear(self) -> None:
        with self.lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries


__all__ = ["LRUCache", "Once"]
