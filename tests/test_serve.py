"""`mentorrl serve`: the OpenAI-compatible server renders the contract's text, answers bad
requests with 4xx in OpenAI's error shape, enforces its token and body limit, and runs as a
real subprocess that prints its URL and stops cleanly."""

from __future__ import annotations

import asyncio
import copy
import json
import select
import signal
import subprocess
import sys
import time
import threading
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from cli_helpers import cli_output, cli_with
from mentorrl.chat import assistant_message, prompt_text
from mentorrl.contract import IM_END
from mentorrl.serve import READY_PREFIX, BodyLimitMiddleware, create_app, is_loopback, register, serve_subprocess

URL = "/v1/chat/completions"
TOKEN = "s3cret-token-value"
TOOL_CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a support agent. Tools: get_order(order_id)."},
    {"role": "user", "content": "Where is order 7?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_order", "arguments": '{"order_id": 7}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"status": "shipped"}'},
]
USER_ONLY = [{"role": "user", "content": "Where is order 7?"}]


def assert_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    return err


class Recording:
    """A model proxy that records the prompt ids each ``generate`` call receives."""

    def __init__(self, model: Any):
        self.model, self.inputs = model, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def generate(self, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.inputs.append(input_ids[0].tolist())
        return self.model.generate(input_ids=input_ids, **kwargs)


class ScriptedModel(torch.nn.Module):
    """``generate`` appends a fixed continuation (cut to max_new_tokens) to every sequence."""

    def __init__(self, script: list[int], max_positions: int = 4096):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.config = SimpleNamespace(max_position_embeddings=max_positions)
        self.script, self.calls = script, []

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, num_return_sequences: int = 1,
                 **kwargs: Any) -> torch.Tensor:
        self.calls.append(dict(max_new_tokens=max_new_tokens, num_return_sequences=num_return_sequences, **kwargs))
        new = torch.tensor([self.script[:max_new_tokens]] * num_return_sequences, dtype=torch.long)
        return torch.cat([input_ids.repeat(num_return_sequences, 1), new], dim=1)


@pytest.fixture(scope="module")
def biased_model(model):
    """The tiny model with a random LM-head bias: greedy decoding writes text, not only newlines."""
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    m.lm_head.bias = torch.nn.Parameter(torch.randn(m.lm_head.weight.shape[0], generator=g) * 3)
    m.eval()
    return m


@pytest.fixture(scope="module")
def client(tokenizer, model):
    return TestClient(create_app(tokenizer, model, "tiny"))


def encode(tokenizer, messages) -> list[int]:
    return list(tokenizer.encode(prompt_text(messages), add_special_tokens=False))


# ------------------------------------------------------------------ round trip ------
def test_chat_completion_shape_usage_and_n(client, tokenizer):
    r = client.post(URL, json={"model": "anything", "messages": USER_ONLY, "max_tokens": 5, "n": 3, "seed": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == "tiny" and isinstance(body["created"], int)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for c in body["choices"]:
        assert c["message"]["role"] == "assistant"
        assert c["finish_reason"] in ("stop", "length", "tool_calls")
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(encode(tokenizer, USER_ONLY))
    assert 3 <= usage["completion_tokens"] <= 15
    if all(c["finish_reason"] == "length" for c in body["choices"]):
        assert usage["completion_tokens"] == 15
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_seeded_requests_repeat_exactly_even_concurrently(client):
    req = {"messages": USER_ONLY, "max_tokens": 6, "n": 2, "seed": 7, "temperature": 1.0}
    first = client.post(URL, json=req).json()["choices"]
    results: list[Any] = [None] * 4

    def call(i: int) -> None:
        results[i] = client.post(URL, json=req).json()["choices"]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(r == first for r in results)
    other = client.post(URL, json={**req, "seed": 8}).json()["choices"]
    assert other != first


def test_greedy_reply_is_what_the_model_writes_from_the_contract_text(tokenizer, biased_model):
    rec = Recording(biased_model)
    c = TestClient(create_app(tokenizer, rec, "tiny"))
    r = c.post(URL, json={"messages": TOOL_CONVERSATION, "temperature": 0, "max_tokens": 8, "n": 2,
                          "tools": [{"type": "function", "function": {"name": "get_order"}}]})
    assert r.status_code == 200, r.text
    prompt = encode(tokenizer, TOOL_CONVERSATION)
    assert rec.inputs == [prompt]  # the server rendered exactly the contract's text (tool call included)
    stops = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.eos_token_id]
    out = biased_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8, eos_token_id=stops,
                                pad_token_id=tokenizer.pad_token_id)[0, len(prompt):].tolist()
    turn = out[:next((i for i, t in enumerate(out) if t in stops), len(out))]
    expected = assistant_message(tokenizer.decode(turn, skip_special_tokens=False))
    body = r.json()
    assert expected.get("content")  # a non-trivial reply
    assert [ch["message"] for ch in body["choices"]] == [expected, expected]
    assert body["usage"]["prompt_tokens"] == len(prompt)


def test_tool_call_reply_finish_reasons_stop_strings_and_cap(tokenizer):
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    call = tokenizer.encode('<tool_call>{"name": "get_order", "arguments": {"order_id": 7}}</tool_call>',
                            add_special_tokens=False)
    scripted = ScriptedModel(call + [im_end, 5, 6])
    c = TestClient(create_app(tokenizer, scripted, "scripted", max_new_tokens_cap=200))
    body = c.post(URL, json={"messages": USER_ONLY, "n": 2, "temperature": 0.5, "top_p": 0.9}).json()
    msg = body["choices"][0]["message"]
    assert msg["content"] is None and msg["tool_calls"][0]["function"]["name"] == "get_order"
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"order_id": 7}
    assert [ch["finish_reason"] for ch in body["choices"]] == ["tool_calls", "tool_calls"]
    assert body["usage"]["completion_tokens"] == 2 * (len(call) + 1)  # the stop token counts, the rest does not
    kw = scripted.calls[-1]
    assert kw["do_sample"] and kw["temperature"] == 0.5 and kw["top_p"] == 0.9 and kw["top_k"] == 0
    assert im_end in kw["eos_token_id"] and kw["pad_token_id"] == tokenizer.pad_token_id
    assert kw["num_return_sequences"] == 2

    text = tokenizer.encode("The order shipped. Anything else?", add_special_tokens=False)
    scripted.script = text + [im_end]
    body = c.post(URL, json={"messages": USER_ONLY, "stop": ["Anything"]}).json()
    assert body["choices"][0] == {"index": 0, "message": {"role": "assistant", "content": "The order shipped."},
                                  "finish_reason": "stop", "logprobs": None}
    body = c.post(URL, json={"messages": USER_ONLY, "max_tokens": 3}).json()
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 3
    c.post(URL, json={"messages": USER_ONLY, "max_tokens": 10_000})
    assert scripted.calls[-1]["max_new_tokens"] == 200  # clipped to the server's cap


def test_models_and_health(client):
    assert client.get("/health").json() == {"status": "ok"}
    data = client.get("/v1/models").json()
    assert data["object"] == "list" and [m["id"] for m in data["data"]] == ["tiny"]


# ------------------------------------------------------------------ bad input ------
BAD_BODIES = {
    "invalid JSON": '{"messages": [',
    "not an object": "[1, 2]",
    "missing messages": json.dumps({"model": "m"}),
    "empty messages": json.dumps({"messages": []}),
    "unknown role": json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}),
    "content not text": json.dumps({"messages": [{"role": "user", "content": 5}]}),
    "tool call arguments not JSON": json.dumps({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}),
    "tool call without a name": json.dumps({"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]}),
    "n=0": json.dumps({"messages": USER_ONLY, "n": 0}),
    "n=17": json.dumps({"messages": USER_ONLY, "n": 17}),
    "temperature=-1": json.dumps({"messages": USER_ONLY, "temperature": -1}),
    "max_tokens=0": json.dumps({"messages": USER_ONLY, "max_tokens": 0}),
    "stream": json.dumps({"messages": USER_ONLY, "stream": True}),
}


@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_malformed_bodies_get_400_with_the_error_shape(client, case):
    r = client.post(URL, content=BAD_BODIES[case], headers={"content-type": "application/json"})
    err = assert_error(r, 400)
    assert err["type"] == "invalid_request_error"
    if case == "unknown role":
        assert "wizard" in err["message"]
    if case == "invalid JSON":
        assert "JSON" in err["message"]


def test_prompt_longer_than_the_context_is_a_400(client):
    r = client.post(URL, json={"messages": [{"role": "user", "content": "order " * 3000}], "max_tokens": 2})
    assert "context" in assert_error(r, 400)["message"]


def test_unknown_routes_and_methods_keep_the_error_shape(client):
    assert_error(client.get("/v1/nope"), 404)
    assert_error(client.get(URL), 405)


# ---------------------------------------------------------------- token, size ------
def test_bearer_token(tokenizer, model):
    c = TestClient(create_app(tokenizer, model, "tiny", token=TOKEN))
    req = {"messages": USER_ONLY, "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"},
                    {"Authorization": f"Bearer {TOKEN}x"}):
        r = c.post(URL, json=req, headers=headers)
        assert assert_error(r, 401)["type"] == "authentication_error"
        assert TOKEN not in r.text and r.headers["www-authenticate"] == "Bearer"
        assert_error(c.get("/v1/models", headers=headers), 401)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert c.post(URL, json=req, headers=auth).status_code == 200
    assert c.get("/v1/models", headers=auth).status_code == 200
    assert c.get("/health").status_code == 200  # open, for liveness probes
    assert_error(c.post(URL, content="{", headers=auth), 400)  # authenticated, then validated


def test_oversized_bodies_get_413(tokenizer, model):
    c = TestClient(create_app(tokenizer, model, "tiny", max_body_bytes=2000))
    big = {"messages": [{"role": "user", "content": "x" * 5000}]}
    assert "2000" in assert_error(c.post(URL, json=big), 413)["message"]  # honest Content-Length
    raw = json.dumps(big).encode()

    def chunks():
        for i in range(0, len(raw), 500):
            yield raw[i:i + 500]

    assert_error(c.post(URL, content=chunks(), headers={"content-type": "application/json"}), 413)  # chunked
    small = {"messages": USER_ONLY, "max_tokens": 2}
    assert c.post(URL, json=small).status_code == 200
    sent = json.dumps(small).encode()
    assert c.post(URL, content=iter([sent[:10], sent[10:]]), headers={"content-type": "application/json"}
                  ).status_code == 200  # a small chunked body is reassembled


def _asgi_call(app: Any, headers: list[tuple[bytes, bytes]], chunks: list[bytes]) -> tuple[int, bytes]:
    messages = [{"type": "http.request", "body": b, "more_body": i < len(chunks) - 1} for i, b in enumerate(chunks)]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": URL, "headers": headers, "query_string": b""}
    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_body_limit_does_not_trust_content_length():
    seen: list[bytes] = []

    async def inner(scope, receive, send):
        msg = await receive()
        seen.append(msg["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    app = BodyLimitMiddleware(inner, max_body_bytes=1000)
    status, body = _asgi_call(app, [(b"content-length", b"10")], [b"a" * 800, b"b" * 800])  # a lying header
    assert status == 413 and json.loads(body)["error"]["message"] and seen == []
    status, _ = _asgi_call(app, [], [b"a" * 600, b"b" * 600])  # no header at all
    assert status == 413 and seen == []
    status, _ = _asgi_call(app, [(b"content-length", b"abc")], [b"{}"])
    assert status == 400
    status, body = _asgi_call(app, [], [b"a" * 500, b"b" * 500])  # exactly the limit passes, reassembled
    assert (status, body) == (200, b"ok") and seen == [b"a" * 500 + b"b" * 500]


# ------------------------------------------------------------------------ CLI ------
def test_is_loopback():
    assert all(is_loopback(h) for h in ("127.0.0.1", "::1", "localhost", "[::1]", "127.0.0.2"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "example.com", ""))


@pytest.fixture(scope="module")
def cli():
    return cli_with(register)


def test_cli_refuses_remote_hosts_without_allow_remote(cli, tiny_model_dir):
    res = CliRunner().invoke(cli, ["serve", str(tiny_model_dir), "--host", "0.0.0.0"])
    assert res.exit_code == 2 and "--allow-remote" in cli_output(res)


def test_cli_bad_model_dir_and_missing_token_exit_2(cli, tmp_path, tiny_model_dir, monkeypatch):
    res = CliRunner().invoke(cli, ["serve", str(tmp_path / "missing")])
    assert res.exit_code == 2 and "not a directory" in cli_output(res)
    monkeypatch.delenv("MENTORRL_TEST_UNSET", raising=False)
    res = CliRunner().invoke(cli, ["serve", str(tiny_model_dir), "--token-env", "MENTORRL_TEST_UNSET"])
    assert res.exit_code == 2 and "MENTORRL_TEST_UNSET" in cli_output(res)
    monkeypatch.setenv("MENTORRL_TEST_EMPTY", "")
    res = CliRunner().invoke(cli, ["serve", str(tiny_model_dir), "--token-env", "MENTORRL_TEST_EMPTY", "--port", "0"])
    assert res.exit_code == 2
    res = CliRunner().invoke(cli, ["serve", str(tmp_path), "--port", "0"])  # a directory without a checkpoint
    assert res.exit_code == 2 and "cannot load" in cli_output(res)


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, "no ready line in time"
    return proc.stdout.readline()


def test_subprocess_serves_and_stops_cleanly_on_sigterm(tiny_model_dir):
    proc = subprocess.Popen([sys.executable, "-m", "mentorrl.cli", "serve", str(tiny_model_dir), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        line = _read_line(proc, 120)
        assert line.startswith(READY_PREFIX), line
        url = line[len(READY_PREFIX):].strip()
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        r = httpx.post(url + "/chat/completions", json={"messages": USER_ONLY, "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_serve_subprocess_helper_with_a_token(tiny_model_dir):
    env = {"MENTORRL_TEST_TOKEN": TOKEN}
    with serve_subprocess(tiny_model_dir, token_env="MENTORRL_TEST_TOKEN", env=env, timeout_s=120) as url:
        req = {"messages": TOOL_CONVERSATION, "max_tokens": 3}
        assert httpx.post(url + "/chat/completions", json=req, timeout=60).status_code == 401
        r = httpx.post(url + "/chat/completions", json=req, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
        assert r.status_code == 200
    with pytest.raises(httpx.TransportError):  # the server is gone
        httpx.get(url.removesuffix("/v1") + "/health", timeout=5)


def test_serve_subprocess_reports_a_server_that_does_not_start(tmp_path):
    with pytest.raises(RuntimeError, match="exited with code 2"):
        with serve_subprocess(tmp_path / "missing", timeout_s=60):
            pass


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_a_server_started_by_a_run_dies_with_the_run_even_on_sigkill(tiny_model_dir):
    """A training run that is SIGKILLed runs no cleanup; its served teacher must not outlive it."""
    parent = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom mentorrl.serve import serve_subprocess\n"
                               f"with serve_subprocess({str(tiny_model_dir)!r}) as url:\n"
                               "    print(url, flush=True)\n    time.sleep(600)\n"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        url = _read_line(parent, 120).strip()
        assert httpx.get(url.removesuffix("/v1") + "/health", timeout=30).status_code == 200
        parent.kill()
        parent.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                httpx.get(url.removesuffix("/v1") + "/health", timeout=2)
            except httpx.TransportError:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the server outlived the SIGKILLed run that started it")
    finally:
        if parent.poll() is None:
            parent.kill()
