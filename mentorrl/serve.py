"""An OpenAI-compatible chat-completions server for a local policy.

The server speaks the OpenAI chat-completions protocol and renders every conversation with
:func:`mentorrl.chat.prompt_pieces` and :class:`mentorrl.contract.ChatEncoder`, so a request
sees exactly the ChatML the policy was trained on; a generated turn comes back through
:func:`mentorrl.chat.assistant_message` (``tool_calls`` for a well-formed ``<tool_call>``, else
``content``). Message content is plain text: a literal ``<|im_end|>`` or ``<|im_start|>`` in it
never becomes a control token, so a client cannot forge turns.

* ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``.
* Bad requests get a 4xx with an OpenAI-style body ``{"error": {"message", "type", ...}}``;
  FastAPI's validation errors are answered with **400** in that shape, not 422.
* Optional bearer token on every ``/v1`` route (401 without it; ``/health`` stays open).
* Request bodies over ``max_body_bytes`` get 413, checked from Content-Length and while
  reading the body; a body nested deeper than ``MAX_BODY_DEPTH`` gets 400. Text with a lone
  surrogate (``"\ud800"``, which is not UTF-8) in a message or a stop string gets 400; so do
  more than ``MAX_STOP_STRINGS`` stop strings or one over ``MAX_STOP_CHARS`` characters.
* The access log shows paths without their query string (``?[redacted]``): a token passed
  as ``?access_token=...`` never reaches the log.
* Dynamic batching: one worker thread owns the model; concurrent requests are queued and
  generated together, left-padded, in one ``model.generate`` call (up to ``--max-batch`` rows,
  the sum of their ``n``; the first waits up to ``--batch-window-ms`` for company). Requests
  with another ``max_tokens`` budget or other ``stop`` strings go in a call of their own.
  ``--max-batch 1`` serves one request at a time.
* Sampling is per row (:class:`RowSampler`: temperature, top-p, then Gumbel noise from the
  row's own generator, seeded from the request's ``seed`` and the sample's index), so a seeded
  request repeats exactly whatever it is batched with, up to floating-point effects of padding.

Build the app with :func:`create_app` (tests use ``fastapi.testclient.TestClient``); start a
real server in a subprocess with :func:`serve_subprocess`. The ``mentorrl serve`` command itself is
:mod:`mentorrl.cli.serve`.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
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
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

from mentorrl.chat import MessageError, assistant_message, message_pieces_of, prompt_pieces
from mentorrl.contract import IM_END, MAX_JSON_DEPTH, ChatEncoder, json_depth

DEFAULT_MAX_BODY_BYTES = 1_000_000
DEFAULT_MAX_TOKENS_CAP = 512
DEFAULT_MAX_BATCH = 32  # rows (the sum of the batched requests' n)
DEFAULT_BATCH_WINDOW_MS = 5.0
READY_PREFIX = "mentorrl serve: listening on "
LOOPBACK_NAMES = ("localhost",)
GREEDY_BELOW = 1e-5  # temperatures under this decode greedily, as vLLM does
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 64  # Hugging Face's stop-string matcher allocates vocab x length: keep it small
MAX_BODY_DEPTH = MAX_JSON_DEPTH + 8  # the request's own nesting around a tool call's arguments


# ------------------------------------------------------------------- request ------
class ContentPart(BaseModel):
    """One part of a list-valued message content; only ``{"type": "text", "text": ...}`` renders."""

    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """An OpenAI chat message. The role is checked when rendering (an unknown role is a 400)."""

    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The message as :func:`mentorrl.chat.prompt_text` takes it (text parts joined)."""
        msg = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            if any(p.type != "text" for p in self.content):
                raise MessageError(f"{self.role} message: only text content parts are supported")
            msg["content"] = "".join(p.text or "" for p in self.content)
        return msg


class ChatRequest(BaseModel):
    """The chat-completions request body. Unknown fields are ignored, as OpenAI-compatible servers do.

    ``tools`` and ``tool_choice`` are accepted and ignored: the policy learned its tools from
    the system prompt, which the client sends as the first message. ``response_format`` is
    accepted and not enforced.
    """

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="echoed as the served model's name; any value is accepted")
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 means greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1, description="capped by the server and by the context")
    max_completion_tokens: int | None = Field(None, ge=1, description="the newer name of max_tokens; wins if both")
    n: int = Field(1, ge=1, le=16)
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="equal requests with a seed give equal answers")
    stop: str | list[str] | None = Field(
        None,
        description=f"up to {MAX_STOP_STRINGS} strings of at most "
        f"{MAX_STOP_CHARS} characters; the text ends before the first one",
    )
    stream: bool = False
    response_format: dict[str, Any] | None = None

    def stop_strings(self) -> list[str]:
        """The non-empty stop strings. Raises :class:`APIError` (400) for too many, too long or
        not UTF-8 (a lone surrogate)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        stops = [s for s in stops if s]
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(400, f"stop: at most {MAX_STOP_STRINGS} strings, got {len(stops)}", param="stop")
        for i, s in enumerate(stops):
            if len(s) > MAX_STOP_CHARS:
                raise APIError(
                    400,
                    f"stop[{i}]: {len(s)} characters; a stop string may have at most {MAX_STOP_CHARS}",
                    param="stop",
                )
            check_utf8(s, "stop")
        return stops


def check_utf8(text: str, param: str) -> None:
    """:class:`APIError` (400) when ``text`` cannot be UTF-8 (JSON's ``\\ud800`` escapes give lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(
            400,
            f"{param}: text holds a lone surrogate ({text[e.start]!r} at character {e.start}); send valid Unicode",
            param=param,
        ) from None


# -------------------------------------------------------------------- errors ------
class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def error_body(
    message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The OpenAI error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _error_type(status: int) -> str:
    return {401: "authentication_error", 404: "not_found_error"}.get(
        status, "server_error" if status >= 500 else "invalid_request_error"
    )


def _validation_message(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    """FastAPI's validation errors -> one readable message and the first offending parameter."""
    parts, param = [], None
    for e in errors:
        if e.get("type") == "json_invalid":
            detail = (e.get("ctx") or {}).get("error")
            return "request body is not valid JSON" + (f" ({detail})" if detail else ""), None
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        param = param or loc or None
        parts.append(f"{loc or 'body'}: {e.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts[:5]) + (f" (+{len(parts) - 5} more)" if len(parts) > 5 else ""), param


# --------------------------------------------------------------- middleware ------
class BodyLimitMiddleware:
    """ASGI middleware: 413 for a request body over ``max_body_bytes``; 400 for one nested deeper
    than :data:`MAX_BODY_DEPTH` (JSON parsers recurse: a deep body must never reach them).

    A declared Content-Length over the limit is refused before reading; otherwise the body is
    read (and counted) here, up to the limit, and replayed to the app, so a lying or missing
    Content-Length (chunked transfer) cannot get a larger body through."""

    def __init__(self, app: Any, max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        from starlette.datastructures import Headers

        declared = Headers(scope=scope).get("content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                await _reply(scope, receive, send, 400, "invalid Content-Length header")
                return
            if int(declared) > self.max_body_bytes:
                await _reply(scope, receive, send, 413, self._too_large())
                return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await _reply(scope, receive, send, 413, self._too_large())
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body, replayed = b"".join(chunks), False
        if body and json_depth(body.decode("utf-8", "replace")) > MAX_BODY_DEPTH:
            await _reply(scope, receive, send, 400, f"request body is nested deeper than {MAX_BODY_DEPTH} levels")
            return

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                return await receive()  # wait for the client to disconnect
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def _too_large(self) -> str:
        return f"request body is larger than {self.max_body_bytes} bytes"


class BearerAuthMiddleware:
    """ASGI middleware: 401 for a request under ``prefix`` without ``Authorization: Bearer <token>``.

    Runs before the body is read; compares in constant time; the token never appears in a reply."""

    def __init__(self, app: Any, token: str, prefix: str = "/v1"):
        self.app, self._token, self.prefix = app, token.encode(), prefix

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path == self.prefix or path.startswith(self.prefix + "/")):
            from starlette.datastructures import Headers

            scheme, _, given = Headers(scope=scope).get("authorization", "").strip().partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self._token):
                await _reply(
                    scope,
                    receive,
                    send,
                    401,
                    "missing or invalid bearer token (Authorization: Bearer ...)",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                return
        await self.app(scope, receive, send)


async def _reply(
    scope: Any, receive: Any, send: Any, status: int, message: str, headers: Mapping[str, str] | None = None
) -> None:
    from starlette.responses import JSONResponse

    response = JSONResponse(error_body(message, _error_type(status)), status_code=status, headers=dict(headers or {}))
    if status == 413:
        response.headers["Connection"] = "close"  # the rest of the body is never read
    await response(scope, receive, send)


# ---------------------------------------------------------------- generation ------
Turn = tuple[str, int, str]  # (text before the stop, tokens generated, finish reason)


@dataclass
class GenRequest:
    """One request's generation: its prompt, ``n`` and settings; ``future`` receives its ``n`` turns."""

    prompt_ids: list[int]
    n: int
    temperature: float
    top_p: float
    budget: int  # max_new_tokens, already within the cap and the context
    seed: int | None
    stop: tuple[str, ...]
    future: Future = field(default_factory=Future, repr=False)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW  # a tiny temperature would overflow the logits

    @property
    def rows(self) -> int:
        """Rows in a batch: greedy turns are all equal, so they are generated once."""
        return 1 if self.greedy else self.n

    @property
    def key(self) -> tuple[int, tuple[str, ...]]:
        """Requests with equal keys can share one ``generate`` call (sampling is done per row)."""
        return self.budget, self.stop


class PolicyGenerator:
    """Generation for the server: left-padded batched ``model.generate``, the contract's stop tokens.

    Sampling is plain temperature / top-p sampling over the full vocabulary (top-k off, no
    repetition penalty), whatever the checkpoint's ``generation_config`` says, so the server
    samples the distribution a rollout samples. It is done per row by :class:`RowSampler`, so a
    seeded request's turns do not depend on the requests batched with it."""

    def __init__(self, tokenizer: Any, model: Any, max_new_tokens_cap: int = DEFAULT_MAX_TOKENS_CAP):
        self.tokenizer, self.model, self.max_new_tokens_cap = tokenizer, model, max_new_tokens_cap
        stops = {tokenizer.convert_tokens_to_ids(IM_END), tokenizer.eos_token_id}
        unk = getattr(tokenizer, "unk_token_id", None)
        self.stop_ids = sorted(i for i in stops if i is not None and i != unk)
        if not self.stop_ids:
            raise ValueError(f"tokenizer has neither {IM_END} nor an eos token: a turn could never end")
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]
        self.pad_id = int(pad)
        self.max_positions = _max_positions(model, tokenizer)
        self.encoder = ChatEncoder(tokenizer)

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The conversation's ids; content is plain text, control tokens come from the template.
        Raises :class:`MessageError` for a message that cannot be rendered."""
        return self.encoder.pieces(prompt_pieces(messages))

    def request(
        self,
        prompt_ids: list[int],
        n: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int | None,
        seed: int | None = None,
        stop: Sequence[str] = (),
    ) -> GenRequest:
        """The :class:`GenRequest` for ``n`` turns after ``prompt_ids``. Raises :class:`APIError` (400)
        when the prompt leaves no room in the model's context."""
        budget = min(max_new_tokens or self.max_new_tokens_cap, self.max_new_tokens_cap)
        if self.max_positions is not None:
            room = self.max_positions - len(prompt_ids)
            if room < 1:
                raise APIError(
                    400,
                    f"the prompt is {len(prompt_ids)} tokens; the model's context is "
                    f"{self.max_positions} tokens, which leaves no room for a reply",
                    param="messages",
                )
            budget = min(budget, room)
        return GenRequest(list(prompt_ids), n, temperature, top_p, budget, seed, tuple(stop))

    def run(self, batch: Sequence[GenRequest]) -> list[list[Turn]]:
        """Each request's ``n`` turns, from one ``model.generate`` call over all their rows.

        The requests must share a :attr:`GenRequest.key`. Prompts are left-padded, with an
        attention mask. A turn's finish reason is "stop" (a stop token or string) or "length"."""
        import torch
        from transformers import LogitsProcessorList

        budget, stop = batch[0].key
        rows = [(req, i) for req in batch for i in range(req.rows)]
        width = max(len(req.prompt_ids) for req in batch)
        device = next(self.model.parameters()).device
        ids = torch.tensor(
            [[self.pad_id] * (width - len(r.prompt_ids)) + r.prompt_ids for r, _ in rows],
            dtype=torch.long,
            device=device,
        )
        mask = torch.tensor(
            [[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r, _ in rows],
            dtype=torch.long,
            device=device,
        )
        sampler = RowSampler(
            [r.temperature for r, _ in rows],
            [r.top_p for r, _ in rows],
            [None if r.greedy else row_generator(r.seed, i, device) for r, i in rows],
            device,
        )
        kwargs: dict[str, Any] = dict(  # greedy over the sampler's scores; the checkpoint's other defaults neutralised
            max_new_tokens=budget,
            eos_token_id=self.stop_ids,
            pad_token_id=self.pad_id,
            do_sample=False,
            num_beams=1,
            num_return_sequences=1,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            min_length=0,
            logits_processor=LogitsProcessorList([sampler]),
        )
        if stop:
            kwargs.update(stop_strings=list(stop), tokenizer=self.tokenizer)
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        turns = [self._finish(row, stop) for row in out[:, width:].tolist()]
        replies, start = [], 0
        for req in batch:
            replies.append(turns[start : start + req.rows] * (req.n // req.rows))
            start += req.rows
        return replies

    def _finish(self, row: list[int], stop: Sequence[str]) -> Turn:
        end = next((i for i, t in enumerate(row) if t in self.stop_ids), None)
        ids = row if end is None else row[:end]
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
        if cut >= 0:  # a stop string ended the row: what follows it is padding (a stop token when pad is one)
            while ids and ids[-1] == self.pad_id:
                ids = ids[:-1]
            return text[:cut], len(ids), "stop"
        if end is not None:
            return text, end + 1, "stop"
        return text, len(row), "length"


class RowSampler:
    """A logits processor that samples inside a greedy ``generate``, each row on its own.

    A sampled row's logits are divided by its temperature, cut to its top-p nucleus (the rollouts'
    cut, :func:`mentorrl.rollout.sampling.nucleus`) and
    perturbed with Gumbel noise from its own generator, so the greedy argmax samples
    softmax(logits / T) over the nucleus (the Gumbel-max trick) and a row's draws depend on
    its generator alone, not on the rest of the batch. Greedy rows (no generator) are left alone."""

    def __init__(self, temperatures: Sequence[float], top_ps: Sequence[float], generators: Sequence[Any], device: Any):
        import torch

        self.rows = [r for r, g in enumerate(generators) if g is not None]
        self.generators = [generators[r] for r in self.rows]
        self.temperature = torch.tensor([[temperatures[r]] for r in self.rows], device=device)
        self.top_p = torch.tensor([[top_ps[r]] for r in self.rows], device=device)
        self.nucleus = any(top_ps[r] < 1.0 for r in self.rows)

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        if not self.rows:
            return scores
        logits = scores[self.rows] / self.temperature
        if self.nucleus:
            from mentorrl.rollout.sampling import nucleus

            logits = nucleus(logits.log_softmax(dim=-1), self.top_p)  # the rollouts' cut (a row shift: same argmax)
        scores = scores.clone()
        scores[self.rows] = logits + _gumbel(logits.shape[1], self.generators)
        return scores


def row_generator(seed: int | None, index: int, device: Any) -> Any:
    """The ``torch.Generator`` of sample ``index`` of a request: seeded from (seed, index), or at random."""
    import torch

    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int.from_bytes(hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest(), "little"))
    return g


def _gumbel(size: int, generators: Sequence[Any]) -> Any:
    """One row of standard Gumbel noise (-log E, E ~ Exp(1)) per generator, drawn from it."""
    import torch

    rows = []
    for g in generators:
        e = torch.empty(size, device=g.device).exponential_(generator=g)
        rows.append(-e.clamp_min_(torch.finfo(e.dtype).tiny).log())
    return torch.stack(rows)


class Batcher:
    """One worker thread owns the model and serves the queued requests in batches.

    The worker takes the first pending request, then more for up to ``window_s`` or until
    ``max_batch`` rows (a request is ``n`` rows, a greedy one 1; one larger than ``max_batch``
    runs alone). The requests that can share a ``generate`` call (equal :attr:`GenRequest.key`)
    run together; an error reaches every request of its call, and the worker goes on.
    ``max_batch=1`` serves one request at a time."""

    def __init__(
        self, gen: PolicyGenerator, max_batch: int = DEFAULT_MAX_BATCH, window_s: float = DEFAULT_BATCH_WINDOW_MS / 1000
    ):
        if max_batch < 1 or window_s < 0:
            raise ValueError("max_batch must be at least 1 and window_s not negative")
        self.gen, self.max_batch, self.window_s = gen, max_batch, window_s
        self._queue: queue.Queue[GenRequest] = queue.Queue()
        self._held: GenRequest | None = None  # taken from the queue, but it did not fit the last batch
        threading.Thread(target=self._work, name="mentorrl-serve-batcher", daemon=True).start()

    def submit(self, req: GenRequest) -> list[Turn]:
        """Queue ``req`` and wait for its turns (an error from its batch is raised here)."""
        self._queue.put(req)
        return req.future.result()

    def _work(self) -> None:
        while True:
            for group in group_requests(self._collect()):
                self._run(group)

    def _collect(self) -> list[GenRequest]:
        batch = [self._held or self._queue.get()]
        self._held = None
        rows, deadline = batch[0].rows, time.monotonic() + self.window_s
        while rows < self.max_batch:
            try:
                req = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if rows + req.rows > self.max_batch:
                self._held = req
                break
            batch.append(req)
            rows += req.rows
        return batch

    def _run(self, group: list[GenRequest]) -> None:
        try:
            replies = self.gen.run(group)
        except Exception as e:  # each request of the call answers a 500
            for req in group:
                req.future.set_exception(e)
            return
        for req, turns in zip(group, replies):
            req.future.set_result(turns)


def group_requests(batch: Sequence[GenRequest]) -> list[list[GenRequest]]:
    """``batch`` split into the groups that can share a ``generate`` call, in order of arrival."""
    groups: dict[tuple[int, tuple[str, ...]], list[GenRequest]] = {}
    for req in batch:
        groups.setdefault(req.key, []).append(req)
    return list(groups.values())


def _max_positions(model: Any, tokenizer: Any) -> int | None:
    """The model's context length, if it says."""
    n = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(n, int) and n > 0:
        return n
    n = getattr(tokenizer, "model_max_length", None)
    return n if isinstance(n, int) and 0 < n < 10**7 else None


# ----------------------------------------------------------------------- app ------
def create_app(
    tokenizer: Any,
    model: Any,
    model_name: str,
    token: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_new_tokens_cap: int = DEFAULT_MAX_TOKENS_CAP,
    max_batch: int = DEFAULT_MAX_BATCH,
    batch_window_ms: float = DEFAULT_BATCH_WINDOW_MS,
):
    """The FastAPI app serving ``model`` as ``model_name`` (see the module docstring).

    ``token``: when set, every ``/v1`` request needs ``Authorization: Bearer <token>``.
    ``max_new_tokens_cap``: the most tokens one reply may have (``max_tokens`` is clipped to it).
    ``max_batch``, ``batch_window_ms``: the :class:`Batcher`'s rows per batch and wait for more."""
    from fastapi import FastAPI

    if token is not None and not token:
        raise ValueError("token must be a non-empty string or None")
    gen = PolicyGenerator(tokenizer, model, max_new_tokens_cap)
    batcher = Batcher(gen, max_batch, batch_window_ms / 1000)
    created = int(time.time())
    app = FastAPI(title="mentorrl serve", docs_url=None, redoc_url=None, openapi_url=None)
    add_error_handlers(app)

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "mentorrl"}],
        }

    @app.post("/v1/chat/completions")
    def chat_completions(req: ChatRequest) -> dict[str, Any]:
        return chat_completion(gen, batcher, model_name, req)

    app.add_middleware(BodyLimitMiddleware, max_body_bytes=max_body_bytes)
    if token is not None:
        app.add_middleware(BearerAuthMiddleware, token=token)  # added last: runs first, before the body is read
    return app


def add_error_handlers(app: Any) -> None:
    """Every error ``app`` answers, as an OpenAI-style error body: invalid requests (400), HTTP errors,
    :class:`APIError` and, for anything else, a 500 that names only the exception's type."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Any, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc.errors())
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Any, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            error_body(str(exc.detail), _error_type(exc.status_code)),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(APIError)
    async def _api(request: Any, exc: APIError) -> JSONResponse:
        return JSONResponse(error_body(exc.message, exc.type, exc.param), status_code=exc.status)

    @app.exception_handler(Exception)
    async def _crash(request: Any, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error ({type(exc).__name__})", "server_error"), status_code=500)


def chat_completion(gen: PolicyGenerator, batcher: Batcher, model_name: str, req: ChatRequest) -> dict[str, Any]:
    """The ``/v1/chat/completions`` response to ``req``: its ``n`` replies, generated through ``batcher``."""
    if req.stream:
        raise APIError(400, "stream=true is not supported; send stream=false", param="stream")
    stop = req.stop_strings()
    try:
        messages = [m.as_dict() for m in req.messages]
        for i, m in enumerate(messages):
            for piece in message_pieces_of(m):
                check_utf8(piece, f"messages[{i}]")
        prompt_ids = gen.prompt_ids(messages)
    except MessageError as e:
        raise APIError(400, str(e), param="messages") from None
    turns = batcher.submit(
        gen.request(
            prompt_ids, req.n, req.temperature, req.top_p, req.max_completion_tokens or req.max_tokens, req.seed, stop
        )
    )
    choices = []
    for i, (turn, _, reason) in enumerate(turns):
        message = assistant_message(turn)
        if reason == "stop" and message.get("tool_calls"):
            reason = "tool_calls"
        choices.append({"index": i, "message": message, "finish_reason": reason, "logprobs": None})
    completion = sum(count for _, count, _ in turns)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": completion,
            "total_tokens": len(prompt_ids) + completion,
        },
    }


# ---------------------------------------------------------------- the server ------
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
        sock.listen(128)
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

    config = uvicorn.Config(app, lifespan="off", log_level=log_level, timeout_graceful_shutdown=30)
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
            preexec_fn=_die_with_parent,
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


def _die_with_parent() -> None:
    """In the child, before exec: ask Linux to SIGTERM it when the process that started it dies,
    so a killed training run (SIGKILL included, where no cleanup runs) leaves no server behind.
    Elsewhere a no-op: the context manager still stops it on any normal exit. (Linux ties this to
    the *thread* that started the child: start it from a thread that outlives its use.)"""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass


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
    "APIError",
    "Batcher",
    "BearerAuthMiddleware",
    "BodyLimitMiddleware",
    "ChatMessage",
    "ChatRequest",
    "GenRequest",
    "MAX_BODY_DEPTH",
    "MAX_STOP_CHARS",
    "MAX_STOP_STRINGS",
    "PolicyGenerator",
    "READY_PREFIX",
    "RedactQueryFilter",
    "RowSampler",
    "base_url",
    "bind_socket",
    "check_utf8",
    "create_app",
    "error_body",
    "group_requests",
    "is_loopback",
    "redact_query",
    "row_generator",
    "run_server",
    "serve_subprocess",
    "server_config",
]
