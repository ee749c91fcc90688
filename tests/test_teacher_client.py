"""The black-box teacher client against a small local HTTP server that misbehaves on purpose:
timeouts, 429 then success, 500, truncated JSON, wrong schema, an empty choice list. No crash;
retries, skips and cache hits are counted; the key never leaves the request header."""

from __future__ import annotations

import contextlib
import json
import threading

import pytest
from pydantic import BaseModel

from mentorrl.clients.config import ClientConfig
from mentorrl.clients.openai_api import TeacherClient

GOOD = json.dumps({"choices": [{"message": {"role": "assistant", "content": '{"score": 0.75, "reason": "ok"}'}}]})


def client(url: str, route: str, **kw) -> TeacherClient:
    cfg = ClientConfig(
        base_url=f"{url}/{route}/v1",
        model="t",
        timeout_s=kw.pop("timeout_s", 2.0),
        max_retries=kw.pop("max_retries", 2),
        backoff_s=0.0,
        api_key_env="MENTORRL_TEST_KEY",
        **kw,
    )
    return TeacherClient(cfg, sleep=lambda s: None)


class Score(BaseModel):
    score: float
    reason: str


MSG = [{"role": "user", "content": "rate this"}]


def test_429_then_success_is_retried_and_parsed(server, monkeypatch):
    script, url = server
    monkeypatch.setenv("MENTORRL_TEST_KEY", "sk-secret-123")
    script.plans["rl"] = [(429, "{}", {"retry-after": "0"}, 0.0), (200, GOOD, {}, 0.0)]
    c = client(url, "rl")
    out = c.structured(MSG, Score)
    assert out == Score(score=0.75, reason="ok")
    assert c.stats["rate_limited"] == 1 and c.stats["retries"] == 1 and c.stats["failures"] == 0
    assert script.auth[-1] == "Bearer sk-secret-123"
    assert "sk-secret" not in repr(c) and "sk-secret" not in json.dumps(dict(c.stats))


def test_timeouts_and_500s_give_up_after_the_retries_without_raising(server):
    script, url = server
    script.plans["slow"] = [(200, GOOD, {}, 1.0)]
    script.plans["err"] = [(500, "oops", {}, 0.0)]
    slow = client(url, "slow", timeout_s=0.2, max_retries=1)
    assert slow.chat(MSG) is None
    assert slow.stats["timeouts"] == 2 and slow.stats["retries"] == 1 and slow.stats["failures"] == 1
    err = client(url, "err", max_retries=2)
    assert err.chat(MSG) is None
    assert err.stats["server_errors"] == 3 and script.hits["err"] == 3 and err.stats["failures"] == 1


@pytest.mark.parametrize(
    "body",
    [
        GOOD[: len(GOOD) // 2],
        json.dumps({"id": "x", "object": "chat.completion"}),
        json.dumps({"choices": []}),
        json.dumps({"choices": [{"message": {"content": None}}]}),
    ],
    ids=["truncated-json", "wrong-schema", "empty-choices", "no-content"],
)
def test_malformed_responses_are_counted_and_skipped(server, body):
    script, url = server
    script.plans["bad"] = [(200, body, {}, 0.0)]
    c = client(url, "bad")
    assert c.chat(MSG) is None
    assert c.stats["malformed"] == 1 and c.stats["retries"] == 0


def test_structured_output_that_fails_its_model_is_counted_and_not_replayed_from_the_cache(server, tmp_path):
    script, url = server
    wrong = json.dumps({"choices": [{"message": {"content": '{"score": "high"}'}}]})
    script.plans["s"] = [(200, wrong, {}, 0.0), (200, GOOD, {}, 0.0)]
    c = client(url, "s", cache_path=str(tmp_path / "cache.sqlite"))
    assert c.structured(MSG, Score) is None and c.stats["invalid_structured"] == 1
    assert c.structured(MSG, Score) == Score(score=0.75, reason="ok")  # asked again, not the cached bad answer
    assert script.hits["s"] == 2 and c.stats["cache_hits"] == 0


def test_client_errors_are_not_retried(server):
    script, url = server
    script.plans["auth"] = [(401, "{}", {}, 0.0)]
    c = client(url, "auth")
    assert c.chat(MSG) is None and script.hits["auth"] == 1 and c.stats["failures"] == 1


def test_cache_answers_a_repeated_request_and_holds_no_key(server, tmp_path, monkeypatch):
    script, url = server
    monkeypatch.setenv("MENTORRL_TEST_KEY", "sk-secret-456")
    script.plans["c"] = [(200, GOOD, {}, 0.0)]
    db = tmp_path / "cache.sqlite"
    c = client(url, "c", cache_path=str(db))
    first = c.chat(MSG, temperature=0.0)
    again = client(url, "c", cache_path=str(db))  # a new client (a restarted run) reads the same cache
    assert again.chat(MSG, temperature=0.0) == first and again.stats["cache_hits"] == 1
    assert script.hits["c"] == 1
    assert again.chat(MSG, temperature=0.5) == first and script.hits["c"] == 2  # other parameters: a new request
    assert b"sk-secret" not in db.read_bytes()


def test_a_cache_namespace_lets_a_teacher_on_a_new_address_reuse_its_answers(server, tmp_path):
    script, url = server
    script.plans["p1"] = [(200, GOOD, {}, 0.0)]
    script.plans["p2"] = [(200, GOOD, {}, 0.0)]
    db = str(tmp_path / "cache.sqlite")
    first = client(url, "p1", cache_path=db, cache_namespace="served:abc").chat(MSG, temperature=0.0)
    moved = client(url, "p2", cache_path=db, cache_namespace="served:abc")  # the same teacher, another port
    assert (
        moved.chat(MSG, temperature=0.0) == first and moved.stats["cache_hits"] == 1 and script.hits.get("p2", 0) == 0
    )
    other = client(url, "p2", cache_path=db, cache_namespace="served:def")  # another checkpoint: asked
    other.chat(MSG, temperature=0.0)
    assert other.stats["cache_hits"] == 0 and script.hits["p2"] == 1


def test_a_served_checkpoint_is_named_by_its_files(tmp_path):
    from mentorrl.train.recipes.blackbox import checkpoint_identity

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    name = checkpoint_identity(tmp_path)
    assert name.startswith("served:") and checkpoint_identity(tmp_path) == name
    (tmp_path / "model.safetensors").write_bytes(b"retrained weights")
    assert checkpoint_identity(tmp_path) != name


def test_concurrency_is_bounded(server):
    script, url = server
    script.plans["busy"] = [(200, GOOD, {}, 0.15)]
    c = client(url, "busy", max_concurrency=2)
    in_flight, peak, lock = [0], [0], threading.Lock()
    real = c._http.stream

    @contextlib.contextmanager
    def counting(*a, **kw):  # the client streams each response (deadline and size limit)
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        try:
            with real(*a, **kw) as r:
                yield r
        finally:
            with lock:
                in_flight[0] -= 1

    c._http.stream = counting
    threads = [threading.Thread(target=c.chat, args=([{"role": "user", "content": str(i)}],)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak[0] == 2 and script.hits["busy"] == 6


def test_client_config_rejects_bad_values_with_the_field_named():
    from pydantic import ValidationError

    for bad, field in (
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"timeout_s": -1}, "timeout_s"),
        ({"max_retries": -1}, "max_retries"),
        ({"retries": 3}, "retries"),
    ):
        with pytest.raises(ValidationError, match=field):
            ClientConfig(**bad)


# ----------------------------------------------------------- faults found by the independent check ---
@pytest.fixture()
def raw_server():
    """A real local HTTP server whose handler is given per test: ``(set_handler, base_url)``.

    ``set_handler(fn)``: ``fn(handler, request_body: bytes)`` writes the whole response itself
    (status line, headers, body), e.g. a body dripped byte by byte or one that echoes the headers."""
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    box: dict = {}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            try:
                box["fn"](self, body)
            except (BrokenPipeError, ConnectionResetError):
                pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield (lambda fn: box.__setitem__("fn", fn)), f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    time.sleep(0)


def test_a_200_whose_gzip_body_is_not_gzip_is_counted_and_skipped(server, tmp_path):
    script, url = server
    script.plans["gz"] = [(200, GOOD, {"content-encoding": "gzip"}, 0.0)]  # claims gzip, sends plain JSON
    c = client(url, "gz", cache_path=str(tmp_path / "cache.sqlite"))
    assert c.chat(MSG) is None  # no httpx.DecodingError out of chat()
    assert c.stats["malformed"] == 1 and c.stats["cache_hits"] == 0
    assert c.structured(MSG, Score) is None and c.stats["malformed"] == 2  # still not cached


def test_a_dripped_body_ends_at_the_total_deadline(raw_server):
    import time

    set_handler, url = raw_server
    stop = threading.Event()

    def drip(h, _body):
        h.send_response(200)
        h.send_header("content-type", "application/json")
        h.send_header("content-length", str(40))
        h.end_headers()
        for _ in range(40):  # a byte every 0.2 s: each read is quick, the whole body takes 8 s
            if stop.wait(0.2):
                return
            h.wfile.write(b" ")
            h.wfile.flush()

    set_handler(drip)
    c = client(url, "drip", timeout_s=1.0, max_retries=0)
    t0 = time.monotonic()
    try:
        assert c.chat(MSG) is None
        took = time.monotonic() - t0
    finally:
        stop.set()
    assert took < 1.6, f"a timeout_s=1 request took {took:.1f} s"
    assert c.stats["timeouts"] == 1 and c.stats["failures"] == 1


def test_backoff_with_jitter_never_exceeds_the_cap():
    cfg = ClientConfig(backoff_s=1.0, backoff_max_s=4.0, api_key_env=None)
    for seed in range(20):
        c = TeacherClient(cfg, seed=seed)
        waits = [c._backoff(a, None) for a in range(8)] + [c._backoff(a, "100") for a in range(3)]
        assert max(waits) <= 4.0, waits
        assert min(waits) >= 0.0
        c.close()


def test_an_oversize_response_is_refused_and_never_cached(server, tmp_path):
    script, url = server
    huge = json.dumps({"choices": [{"message": {"content": "x" * 50_000}}]})
    script.plans["big"] = [(200, huge, {}, 0.0)]
    db = tmp_path / "cache.sqlite"
    c = client(url, "big", cache_path=str(db), max_response_bytes=10_000)
    assert c.chat(MSG) is None
    assert c.stats["oversize"] == 1 and c.stats["failures"] == 0 and c.stats["retries"] == 0
    assert b"xxxxxxxxxx" not in db.read_bytes()
    assert c.chat(MSG) is None and script.hits["big"] == 2  # asked again, nothing was cached
    ok = client(url, "big", cache_path=str(tmp_path / "c2.sqlite"), max_response_bytes=100_000)
    assert ok.chat(MSG) == "x" * 50_000  # under the limit: answered as before
    with pytest.raises(Exception, match="max_response_bytes"):
        ClientConfig(max_response_bytes=0)


def test_an_oversize_body_without_a_length_is_cut_while_streaming(raw_server):
    set_handler, url = raw_server
    sent = []

    def endless(h, _body):  # no content-length, chunked-less close-delimited: an endless body
        h.send_response(200)
        h.send_header("content-type", "application/json")
        h.send_header("connection", "close")
        h.end_headers()
        for _ in range(2_000):
            h.wfile.write(b"x" * 4096)
            sent.append(1)

    set_handler(endless)
    c = client(url, "endless", max_response_bytes=20_000, max_retries=0)
    assert c.chat(MSG) is None and c.stats["oversize"] == 1


def test_a_teacher_echoing_the_request_headers_never_gets_the_key_into_the_cache(raw_server, tmp_path, monkeypatch):
    monkeypatch.setenv("MENTORRL_TEST_KEY", "sk-secret-789/abc")
    set_handler, url = raw_server

    def echo(h, _body):
        seen = "\n".join(f"{k}: {v}" for k, v in h.headers.items())
        body = json.dumps(
            {
                "choices": [{"message": {"content": "you sent:\n" + seen}}],
                "debug": {"authorization": h.headers.get("authorization")},
            }
        ).encode()
        h.send_response(200)
        h.send_header("content-type", "application/json")
        h.send_header("content-length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    set_handler(echo)
    db = tmp_path / "cache.sqlite"
    c = client(url, "echo", cache_path=str(db))
    text = c.chat(MSG)
    assert text is not None and "you sent" in text
    assert "sk-secret" not in text and "[REDACTED]" in text
    c.close()
    raw = db.read_bytes()
    assert b"sk-secret" not in raw and b"789" not in raw
    again = client(url, "echo", cache_path=str(db))
    assert again.chat(MSG) == text and again.stats["cache_hits"] == 1


def test_scrub_removes_the_key_wherever_it_is_echoed():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from mentorrl.clients.openai_api import scrub_secrets

    key = "sk-live/AbC123-xyz"

    @settings(max_examples=150, deadline=None)
    @given(
        st.lists(
            st.sampled_from(
                [
                    "plain",
                    key,
                    json.dumps(key),
                    f"Authorization: Bearer {key}",
                    '"authorization": "Basic dXNlcjpwYXNz"',
                    "bearer tok-9",
                    " ",
                    "\\n",
                    "\u00e9",
                ]
            ),
            max_size=8,
        )
    )
    def check(parts):
        out = scrub_secrets("".join(parts), key)
        assert key not in out and "AbC123" not in out and "dXNlcjpwYXNz" not in out and "tok-9" not in out

    check()
