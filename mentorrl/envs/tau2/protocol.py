"""The parent side of the τ²-bench bridge: one child interpreter (:mod:`.child`) per environment,
spoken to in JSON lines over its pipes.

The child runs the user's clone, so its output is untrusted like a model's tool call: every reply
must arrive within a deadline, fit in :data:`MAX_REPLY_BYTES`, end with a newline, parse as one JSON
object and carry a boolean ``ok``. Anything else (a hang, a flood, garbage, an early exit) is a
:class:`ChildFailure` naming what happened, with the tail of the child's stderr; the child is killed
and the next episode starts a new one. Requests are bounded too (:data:`MAX_REQUEST_BYTES`).
"""

from __future__ import annotations

import collections
import json
import os
import select
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

CHILD = Path(__file__).with_name("child.py")
MAX_REPLY_BYTES = 4 * 1024 * 1024  # the hello reply carries every tool schema and the policy
MAX_REQUEST_BYTES = 1024 * 1024
STDERR_TAIL = 2000


class ChildFailure(RuntimeError):
    """The child process failed to answer properly (it is dead afterwards)."""


def child_env(clone: Path) -> dict[str, str]:
    """The child's environment: the parent's, with the clone's data directory and no network lookups."""
    env = dict(os.environ)
    env["TAU2_DATA_DIR"] = str(clone / "data")  # read once at the upstream package's import
    env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # the upstream import fetches a cost map otherwise
    env.setdefault("LOGURU_LEVEL", "WARNING")  # the upstream package logs every step at DEBUG otherwise
    env.pop("PYTHONPATH", None)
    return env


class Child:
    """A running child: :meth:`request` sends one op and returns its reply (a dict with ``ok``)."""

    def __init__(self, python: str, clone: Path, domain: str, start_timeout_s: float = 60.0, solo: bool = False):
        self.python, self.clone, self.domain = python, clone, domain
        try:
            self.proc = subprocess.Popen(
                [python, "-I", str(CHILD), str(clone), domain, *(["solo"] if solo else [])],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=child_env(clone),
                cwd=str(clone),
            )
        except OSError as e:
            raise ChildFailure(f"cannot start {python!r}: {e}") from None
        assert self.proc.stdin is not None and self.proc.stderr is not None
        os.set_blocking(self.proc.stdin.fileno(), False)  # a child that stops reading cannot block a request
        self._buf = b""
        self._tail: collections.deque[bytes] = collections.deque()
        self._tail_lock = threading.Lock()
        threading.Thread(target=self._drain_stderr, args=(self.proc.stderr,), daemon=True).start()
        self.start_timeout_s = start_timeout_s

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def _drain_stderr(self, stream: Any) -> None:
        """Read the child's stderr as it comes, keeping only its last bytes (memory and disk stay bounded)."""
        kept = 0
        try:
            for chunk in iter(lambda: stream.read1(65536), b""):
                with self._tail_lock:
                    self._tail.append(chunk)
                    kept += len(chunk)
                    while kept - len(self._tail[0]) >= STDERR_TAIL and len(self._tail) > 1:
                        kept -= len(self._tail.popleft())
        except (OSError, ValueError):
            pass

    def stderr_tail(self) -> str:
        time.sleep(0.05)  # let the drain thread catch the child's last words
        with self._tail_lock:
            data = b"".join(self._tail)
        return data[-STDERR_TAIL:].decode("utf-8", "replace").strip()

    def _fail(self, why: str) -> ChildFailure:
        self.kill()
        tail = self.stderr_tail()
        return ChildFailure(f"{why}" + (f"; its stderr ends with: {tail[-STDERR_TAIL:]}" if tail else ""))

    def request(self, op: str, timeout_s: float, **fields: Any) -> dict[str, Any]:
        if not self.alive:
            raise self._fail(f"the {self.domain} process has exited (code {self.proc.returncode})")
        line = json.dumps({"op": op, **fields}, ensure_ascii=False, default=str).encode() + b"\n"
        if len(line) > MAX_REQUEST_BYTES:
            raise ChildFailure(f"request {op!r} is {len(line)} bytes, over {MAX_REQUEST_BYTES}")
        deadline = time.monotonic() + timeout_s
        self._write_all(line, op, deadline)
        return parse_reply(self._read_line(op, deadline, timeout_s), op, self._fail)

    def _write_all(self, data: bytes, op: str, deadline: float) -> None:
        assert self.proc.stdin is not None
        fd, view = self.proc.stdin.fileno(), memoryview(data)
        while view:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([], [fd], [], left)[1]:
                raise self._fail(f"the {self.domain} process did not take the request {op!r} in time")
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:
                continue
            except OSError as e:
                raise self._fail(f"the {self.domain} process closed its input ({type(e).__name__})") from None

    def _read_line(self, op: str, deadline: float, timeout_s: float) -> bytes:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            if len(self._buf) > MAX_REPLY_BYTES:
                raise self._fail(f"reply to {op!r} is over {MAX_REPLY_BYTES} bytes without a line end")
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise self._fail(f"no reply to {op!r} within {timeout_s:g}s")
            chunk = os.read(fd, 65536)
            if not chunk:
                self.proc.wait(timeout=5)
                raise self._fail(f"the {self.domain} process exited (code {self.proc.returncode}) before replying")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        if len(line) > MAX_REPLY_BYTES:
            raise self._fail(f"reply to {op!r} is {len(line)} bytes, over {MAX_REPLY_BYTES}")
        return line

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                os.write(self.proc.stdin.fileno(), b'{"op": "bye"}\n')
                self.proc.wait(timeout=2)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass


def parse_reply(line: bytes, op: str, fail: Any) -> dict[str, Any]:
    """One reply line as a dict with a boolean ``ok``; anything else is ``fail(why)`` raised."""
    try:
        reply = json.loads(line.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise fail(f"reply to {op!r} is not JSON ({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
        raise fail(f"reply to {op!r} is not an object with a boolean 'ok'")
    return reply


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


__all__ = ["CHILD", "Child", "ChildFailure", "MAX_REPLY_BYTES", "MAX_REQUEST_BYTES", "child_env", "parse_reply"]
