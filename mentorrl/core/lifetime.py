"""A process's lifetime: a child tied to its parent's (:func:`die_with_parent`), and the objects that live as
long as a run kept out of the cyclic collector's way while it runs (:func:`frozen_heap`)."""

from __future__ import annotations

import gc
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM, parent_pid: int | None = None) -> None:
    """In a child: ask Linux to send it ``sig`` when the process that started it dies, so a killed parent
    (SIGKILL included, where no cleanup runs) leaves nothing running behind it. With ``parent_pid`` (the
    parent's pid, known before the child started) a parent that died before the request was made is caught
    too: the child sends itself ``sig``. Elsewhere a no-op. (Linux ties this to the *thread* that started
    the child: start it from a thread that outlives it.)"""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except OSError:
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)


@contextmanager
def frozen_heap() -> Iterator[bool]:
    """Within it, the objects alive when it was entered (torch's and transformers' modules, functions and
    classes, the policy's modules: about 400,000 in a training process) are out of the cyclic collector's
    reach (``gc.freeze``), so its full collections scan only what was made since: in the demo's GRPO stage at
    one thread the collector's share of the stage's CPU went from 2.4-2.8% to 0.8-1.0% (docs/scaling.md,
    "The collector"). Garbage is collected first, so nothing dead is frozen, and everything is given
    back to the collector on the way out (``gc.unfreeze``): an object that dies later is collected then.
    Nested use leaves the outer one in charge. Yields whether this one froze. The collector's timing never
    changes a result (what it frees is unreachable)."""
    if gc.get_freeze_count() > 0:
        yield False  # someone else froze the heap: they unfreeze it
        return
    gc.collect()
    gc.freeze()
    try:
        yield True
    finally:
        gc.unfreeze()


__all__ = ["die_with_parent", "frozen_heap"]
