"""The example agent's worker keeps one connection per thread, never closing one as surplus.

httpcore's sync pool (1.0.9) closes idle connections beyond ``max_keepalive_connections`` and can close one it
has just handed to a waiting request, whose reply is then never read (encode/httpcore#1110: a rollout step of
128 episodes stalled 120 s on one such request). With the pool sized to the worker's threads no connection is
ever surplus: the invariant checked here is that N threads making many requests open at most N connections
(a surplus close shows up as a reconnect), against a real keep-alive server."""

from __future__ import annotations

import http.server
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "examples"))


class _KeepAlive(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive

    def do_POST(self):  # noqa: N802 - the stdlib's name
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        body = b"{}"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


class _Counting(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.connections = 0
        self._lock = threading.Lock()

    def process_request(self, request, client_address):
        with self._lock:
            self.connections += 1
        super().process_request(request, client_address)


def _connections_opened(http_client, threads: int, per_thread: int) -> int:
    server = _Counting(("127.0.0.1", 0), _KeepAlive)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/reward"
    barrier = threading.Barrier(threads)

    def work(_):
        barrier.wait()  # every thread at once: the pool holds `threads` connections together
        for _ in range(per_thread):
            http_client.post(url, json={"reward": 1.0}).raise_for_status()

    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(work, range(threads)))
        return server.connections
    finally:
        server.shutdown()
        server.server_close()


def test_worker_clients_keep_a_connection_per_thread(monkeypatch):
    import orders_agent

    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")  # as mentorrl sets it for the agent
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")

    threads = 24
    client, http = orders_agent.worker_clients(threads)
    try:
        pool = http._transport._pool
        assert pool._max_keepalive_connections >= threads and pool._max_connections >= threads
        openai_pool = client._client._transport._pool
        assert openai_pool._max_keepalive_connections >= threads
        assert _connections_opened(http, threads, 15) <= threads
    finally:
        http.close()
        client.close()


def test_a_smaller_keep_alive_pool_reconnects():
    """The cheap fake this catches: with fewer keep-alive slots than threads (httpx's default, 20) the pool
    closes connections as surplus and opens new ones: more connections than threads."""
    import httpx

    threads = 24
    with httpx.Client(limits=httpx.Limits(max_connections=100, max_keepalive_connections=4)) as small:
        assert _connections_opened(small, threads, 15) > threads
