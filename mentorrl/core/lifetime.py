"""A child process's lifetime tied to its parent's."""

from __future__ import annotations

import os
import signal
import sys

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


__all__ = ["die_with_parent"]
