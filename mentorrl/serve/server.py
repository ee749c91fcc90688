"""Running the app: loopback checks, the listening socket, the redacted access log, uvicorn, and
:func:`serve_subprocess` (a real ``mentorrl serve`` in a child process)."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from mentorrl.core.lifetime import die_with_parent

READY_PREFIX = "mentorrl serve: listening on "
LOOPBACK_NAMES = ("localhost",)
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# An idle connection is kept this long (uvicorn's default is 5 s): longer than a client keeps its own idle
# connections (httpx: 5 s), so the client closes first and never sends on a connection the server is closing;
# and longer than a training round's pause, so the agents' connections outlive it rather than reconnect at once.
KEEP_ALIVE_S = 65
BACKLOG = 2048  # connections waiting to be accepted (uvicorn's own default); more agents than this reconnect


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host.strip().lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free port)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def base_url(sock: socket.socket) -> str:
    """``http://HOST:PORT/v1`` for a bound socket."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}/v1" if ":" in host else f"http://{host}:{port}/v1"


def redact_query(path: str) -> str:
    """``path`` without its query string's content: ``/v1/models?access_token=x`` -> ``/v1/models?[redacted]``."""
    head, sep, query = path.partition("?")
    return f"{head}?[redacted]" if sep and query else head


class RedactQueryFilter(logging.Filter):
    """A filter for uvicorn's access logger: the logged path loses its query string (tokens)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple):
            record.args = tuple(redact_query(a) if isinstance(a, str) and "?" in a else a for a in args)
        return True


def server_config(app: Any, log_level: str = "info") -> Any:
    """The ``uvicorn.Config`` for ``app``, with query strings redacted from the access log
    (installed after uvicorn configures its loggers)."""
    import uvicorn

    config = uvicorn.Config(
        app, lifespan="off", log_level=log_level, timeout_graceful_shutdown=30, timeout_keep_alive=KEEP_ALIVE_S
    )
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactQueryFilter) for f in access.filters):
        access.addFilter(RedactQueryFilter())
    return config


def run_server(app: Any, sock: socket.socket, ready_line: str, log_level: str = "info") -> int:
    """Serve ``app`` on ``sock`` until SIGTERM / SIGINT; print ``ready_line`` (flushed) once serving.

    Returns 0 after a graceful shutdown on a signal."""
    import uvicorn

    class _Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if not self.should_exit:
                print(ready_line, flush=True)

    config = server_config(app, log_level)
    stopped: list[int] = []
    # uvicorn re-raises the signal it shut down on; catch that re-raise so the exit is a clean 0.
    previous = {s: signal.signal(s, lambda sig, frame: stopped.append(sig)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        _Server(config).run(sockets=[sock])
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        sock.close()
    return 0


# ------------------------------------------------------------ subprocess helper ------
@contextlib.contextmanager
def serve_subprocess(
    model_dir: str | Path,
    token_env: str | None = None,
    extra_args: Sequence[str] = (),
    *,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 120.0,
) -> Iterator[str]:
    """Run ``mentorrl serve MODEL_DIR --port 0`` in a subprocess; yield its base URL (ending in ``/v1``).

    ``token_env`` names the variable holding the token (set it in ``env`` or the environment).
    Raises ``RuntimeError`` (with the server's stderr) if it exits or is not ready within
    ``timeout_s``; the process is terminated (then killed) on exit."""
    args = [sys.executable, "-m", "mentorrl.cli", "serve", str(model_dir), "--port", "0", "--log-level", "warning"]
    if token_env is not None:
        args += ["--token-env", token_env]
    args += list(extra_args)
    with tempfile.TemporaryFile(mode="w+b") as errlog:
        proc = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=errlog,
            stdin=subprocess.DEVNULL,
            text=True,
            env={**os.environ, **(env or {})},
            preexec_fn=die_with_parent,
        )
        lines: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:  # read stdout on a thread: a blocking readline has no timeout, a full pipe stalls
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        try:
            yield _wait_ready(proc, lines, errlog, timeout_s)
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=15)
            if proc.stdout is not None:
                proc.stdout.close()


def _wait_ready(proc: subprocess.Popen, lines: queue.Queue[str | None], errlog: Any, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"mentorrl serve did not come up within {timeout_s:.0f} s{_tail(errlog)}")
        try:
            line = lines.get(timeout=min(left, 0.5))
        except queue.Empty:
            continue
        if line is None:
            code = proc.wait(timeout=15)
            raise RuntimeError(f"mentorrl serve exited with code {code} before it was ready{_tail(errlog)}")
        m = re.match(re.escape(READY_PREFIX) + r"(\S+)", line.strip())
        if m:
            return m.group(1)


def _tail(errlog: Any, n: int = 2000) -> str:
    errlog.flush()
    errlog.seek(0)
    text = errlog.read().decode(errors="replace")[-n:]
    return f"; its stderr ends:\n{text}" if text.strip() else ""


__all__ = [
    "LOG_LEVELS",
    "READY_PREFIX",
    "RedactQueryFilter",
    "base_url",
    "bind_socket",
    "is_loopback",
    "redact_query",
    "run_server",
    "serve_subprocess",
    "server_config",
]
