"""Where the rollout engine runs a tool call or a verification: inline, or in its thread pool.

The pool lets a slow call (a network tool, a sandboxed test run) proceed beside the decoding of
the other rows, so it holds up only its own trajectory. For a call that takes a fraction of a
millisecond (an in-process SQLite query) the hand-off costs more than the call: the worker thread
waits for the interpreter lock the decode loop holds, and the switching shows up as CPU time
(issue 21 measured 0.5 CPU-s per 128-episode rollout of the orders task).

:class:`Dispatch` decides per *kind* of call (the environment's class and the tool's name, or
the verifier): a kind's first calls run in the pool, and its measured cost decides from then on.
It runs inline once its recent calls are cheap: median CPU time and median wall time at most
``inline_s``, and none of them longer than ``10 * inline_s`` in wall time. A call that waits on the
network or a subprocess uses little CPU but a long wall time, and stays in the pool; so does a kind
whose calls are usually quick but sometimes stall. A kind that turns slow goes back to the pool.
What an inline call costs the other rows is its own duration, like one more decode step; a tool
that can hang without warning should run with ``inline_s = 0`` (``rollout.inline_tool_ms: 0``),
which sends every call to the pool (the engine's behaviour before this module).
"""

from __future__ import annotations

import concurrent.futures as cf
import statistics
import threading
import time
from collections import deque
from typing import Any, Callable, Hashable

INLINE_TOOL_S = 0.005  # the default threshold (``rollout.inline_tool_ms: 5``)
WINDOW = 8  # recent calls per kind that decide
MIN_SAMPLES = 3  # a kind's first calls always run in the pool
WALL_FACTOR = 10.0
MAX_KINDS = 1024  # tool names are model-written: kinds beyond this are not measured (they run in the pool)


class CallCosts:
    """The measured (cpu_s, wall_s) of the last :data:`WINDOW` calls of each kind in this process, for at
    most :data:`MAX_KINDS` kinds (thread-safe). One instance, ``_COSTS``, serves every :class:`Dispatch`:
    what a kind costs is learnt across rollouts."""

    def __init__(self) -> None:
        self._samples: dict[Hashable, deque] = {}
        self._lock = threading.Lock()

    def record(self, kind: Hashable, cpu_s: float, wall_s: float) -> None:
        with self._lock:
            window = self._samples.get(kind)
            if window is None:
                if len(self._samples) >= MAX_KINDS:
                    return
                window = self._samples[kind] = deque(maxlen=WINDOW)
            window.append((cpu_s, wall_s))

    def recent(self, kind: Hashable) -> list[tuple[float, float]]:
        with self._lock:
            return list(self._samples.get(kind, ()))

    def forget(self) -> None:
        with self._lock:
            self._samples.clear()

    def __len__(self) -> int:
        return len(self._samples)


_COSTS = CallCosts()


def record(kind: Hashable, cpu_s: float, wall_s: float) -> None:
    _COSTS.record(kind, cpu_s, wall_s)


def runs_inline(kind: Hashable, inline_s: float) -> bool:
    """Whether calls of ``kind`` run inline now (see the module docstring)."""
    if inline_s <= 0:
        return False
    samples = _COSTS.recent(kind)
    if len(samples) < MIN_SAMPLES:
        return False
    cpu = statistics.median(s[0] for s in samples)
    wall = statistics.median(s[1] for s in samples)
    return cpu <= inline_s and wall <= inline_s and max(s[1] for s in samples) <= WALL_FACTOR * inline_s


def forget() -> None:
    """Drop every measurement (tests)."""
    _COSTS.forget()


class Dispatch:
    """Submit calls by kind: inline (a finished future) or to ``pool``, timing each call."""

    def __init__(self, pool: cf.Executor, inline_s: float):
        self.pool, self.inline_s = pool, inline_s
        self.stats = {"inline_calls": 0, "pool_calls": 0}

    def submit(self, kind: Hashable, fn: Callable[..., Any], *args: Any) -> cf.Future:
        if runs_inline(kind, self.inline_s):
            self.stats["inline_calls"] += 1
            fut: cf.Future = cf.Future()
            t0 = time.perf_counter()
            try:
                fut.set_result(fn(*args))
            except Exception as exc:  # noqa: BLE001 - the caller reads it from the future, as from the pool
                fut.set_exception(exc)
            wall = time.perf_counter() - t0
            record(kind, wall, wall)  # in the decode thread wall time is the call's own
            return fut
        self.stats["pool_calls"] += 1
        return self.pool.submit(_timed, kind, fn, args)


def _timed(kind: Hashable, fn: Callable[..., Any], args: tuple) -> Any:
    t0, c0 = time.perf_counter(), time.thread_time()
    try:
        return fn(*args)
    finally:
        record(kind, time.thread_time() - c0, time.perf_counter() - t0)


def _name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def tool_kind(episode: Any, name: str | None) -> tuple[str, str, str, str]:
    """A tool call's kind: the episode class (which may wrap ``run_tool``), the environment, the tool."""
    return ("tool", _name(episode), _name(episode.env), str(name))


def verify_kind(episode: Any) -> tuple[str, str, str]:
    return ("verify", _name(episode), _name(episode.env))
