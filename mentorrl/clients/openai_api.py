"""A client for black-box teachers behind the OpenAI chat-completions protocol (HTTP, ``httpx``).

- The base URL and model come from the config. The key is read from an environment variable
  (``api_key_env``), kept only in the request header and never in ``repr``, logs, metrics or
  the cache. A teacher that echoes the request back does not leak it either: every response
  body is scrubbed of the key and of ``Bearer`` / ``Authorization`` values before it is parsed,
  returned or cached.
- Every attempt has a total deadline of ``timeout_s``, from sending the request to the last
  byte of the body (the body is streamed and the deadline checked at every chunk; a read that
  stalls is cut by the same per-read limit), so a body dripped slowly cannot stretch it.
- Timeouts, connection errors, 429 and 5xx are retried with exponential backoff and jitter (a
  ``Retry-After`` header is honoured); every wait is at most ``backoff_max_s``. Other 4xx are
  not retried.
- A response body is bounded by ``max_response_bytes`` (decoded bytes, counted while streaming):
  a longer one is cut off, counted as ``oversize`` and skipped, never cached.
- A semaphore bounds the requests in flight across threads.
- Responses are cached on SQLite, keyed by a hash of the request (URL, model, messages and
  parameters; not the key).
- Malformed responses (not JSON, truncated, no choices, wrong fields, a body that does not
  decode as its ``Content-Encoding`` says) and structured output that fails its pydantic model
  are counted and give ``None``: the caller skips the sample. Nothing here raises on a
  teacher's bad behaviour.

:attr:`TeacherClient.stats` counts requests, retries, timeouts, rate limits, server errors,
failures, malformed and oversize responses and cache hits, for the run's metrics.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import sqlite3
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Sequence, TypeVar

import httpx
from pydantic import BaseModel, Field, ValidationError

from mentorrl.clients.config import ClientConfig

T = TypeVar("T", bound=BaseModel)
STAT_KEYS = (
    "requests",
    "retries",
    "timeouts",
    "rate_limited",
    "server_errors",
    "failures",
    "malformed",
    "oversize",
    "cache_hits",
    "invalid_structured",
)
REDACTED = "[REDACTED]"
# ``Bearer <token>`` anywhere, and the value of an ``Authorization`` header or field (``: v`` or ``": "v"``).
_BEARER = re.compile(r"(?i)(bearer\s+)(?:(?!bearer)[^\s\"'\\,;])+")
_AUTH_FIELD = re.compile(r"(?i)(\"?(?:proxy-)?authorization\"?\s*[:=]\s*\"?)([^\"\\\r\n]+)")


def scrub_secrets(text: str, key: str | None) -> str:
    """``text`` with the API key (as is and JSON-escaped) and every ``Bearer`` token or
    ``Authorization`` value replaced by ``[REDACTED]``. Pure; applied to every response body."""
    if key:
        for form in {key, json.dumps(key)[1:-1], key.replace("/", "\\/")}:
            text = text.replace(form, REDACTED)
    text = _BEARER.sub(lambda m: m.group(1) + REDACTED, text)

    def field(m: re.Match) -> str:
        value = m.group(2).strip()
        keep = value in (REDACTED, f"Bearer {REDACTED}") or value.lower() == f"bearer {REDACTED}".lower()
        return m.group(0) if keep else m.group(1) + REDACTED

    return _AUTH_FIELD.sub(field, text)


class _Oversize(Exception):
    """A response body longer than ``max_response_bytes``."""


class _Deadline(Exception):
    """An attempt past its total deadline."""


class _Chat(BaseModel):
    """The part of a chat-completions response the client reads."""

    class _Choice(BaseModel):
        class _Message(BaseModel):
            content: str | None = None
            tool_calls: list[dict[str, Any]] | None = None

        message: _Message

    choices: list[_Choice] = Field(min_length=1)


class ResponseCache:
    """request hash -> response JSON, on SQLite (safe across threads)."""

    def __init__(self, path: str | Path):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False)
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS responses (key TEXT PRIMARY KEY, body TEXT NOT NULL, created REAL NOT NULL)"
        )
        self._db.commit()
        self._lock = threading.Lock()

    def get(self, key: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT body FROM responses WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def delete(self, key: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM responses WHERE key = ?", (key,))
            self._db.commit()

    def put(self, key: str, body: str) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO responses (key, body, created) VALUES (?, ?, ?)", (key, body, time.time())
            )
            self._db.commit()

    def close(self) -> None:
        with self._lock:
            self._db.close()


class TeacherClient:
    """Chat completions from a black-box teacher; see the module docstring for the guarantees."""

    def __init__(
        self,
        config: ClientConfig | None = None,
        transport: httpx.BaseTransport | None = None,
        sleep=time.sleep,
        seed: int = 0,
    ):
        self.config = config or ClientConfig()
        key = os.environ.get(self.config.api_key_env) if self.config.api_key_env else None
        self._key = key or None  # kept only to scrub it out of response bodies
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._http = httpx.Client(
            base_url=self.config.base_url.rstrip("/"),
            headers=headers,
            timeout=self.config.timeout_s,
            transport=transport,
        )
        self._slots = threading.BoundedSemaphore(self.config.max_concurrency)
        self._cache = ResponseCache(self.config.cache_path) if self.config.cache_path else None
        self._sleep, self._rng = sleep, random.Random(seed)
        self._lock = threading.Lock()
        self.stats: Counter[str] = Counter({k: 0 for k in STAT_KEYS})

    def __repr__(self) -> str:  # never the key
        return f"TeacherClient(base_url={self.config.base_url!r}, model={self.config.model!r})"

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.stats[key] += n

    def request_key(self, messages: Sequence[dict[str, Any]], params: dict[str, Any]) -> str:
        who = (
            {"teacher": self.config.cache_namespace}
            if self.config.cache_namespace
            else {"base_url": self.config.base_url}
        )
        body = {**who, "model": self.config.model, "messages": list(messages), "params": params}
        return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()

    def _backoff(self, attempt: int, retry_after: str | None) -> float:
        c = self.config
        wait = c.backoff_s * 2 ** min(attempt, 64) * (0.5 + self._rng.random())  # jitter, then the cap
        if retry_after is not None:
            try:
                ra = float(retry_after)
                if math.isfinite(ra):
                    wait = max(wait, ra)
            except ValueError:
                pass
        return max(0.0, min(wait, c.backoff_max_s))

    def _read_body(self, r: httpx.Response, deadline: float) -> str:
        """The decoded body, streamed: at most ``max_response_bytes``, read before ``deadline``."""
        limit, size, parts = self.config.max_response_bytes, 0, []
        declared = r.headers.get("content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            raise _Oversize
        for chunk in r.iter_bytes():
            size += len(chunk)
            if size > limit:
                raise _Oversize
            parts.append(chunk)
            if time.monotonic() > deadline:
                raise _Deadline
        return scrub_secrets(b"".join(parts).decode(r.encoding or "utf-8", errors="replace"), self._key)

    def _post(self, payload: dict[str, Any]) -> str | None:
        """The response body of the first acceptable attempt, or None (counted) when every attempt
        failed or the answer was refused (undecodable or oversize: counted as such, not retried)."""
        c = self.config
        for attempt in range(c.max_retries + 1):
            if attempt:
                self._count("retries")
            self._count("requests")
            retry_after = None
            try:
                with self._slots:
                    deadline = time.monotonic() + c.timeout_s
                    with self._http.stream("POST", "/chat/completions", json=payload) as r:
                        status = r.status_code
                        if status == 429:
                            retry_after = r.headers.get("retry-after")
                        body = self._read_body(r, deadline) if status == 200 else None
            except (httpx.TimeoutException, _Deadline):
                self._count("timeouts")
            except httpx.DecodingError:  # e.g. "Content-Encoding: gzip" over bytes that are not gzip
                self._count("malformed")
                return None
            except _Oversize:
                self._count("oversize")
                return None
            except httpx.TransportError:
                self._count("server_errors")
            else:
                if status == 200:
                    return body
                if status == 429:
                    self._count("rate_limited")
                elif status >= 500:
                    self._count("server_errors")
                else:  # a client error: retrying the same request cannot help
                    self._count("failures")
                    return None
            if attempt < c.max_retries:
                self._sleep(self._backoff(attempt, retry_after))
        self._count("failures")
        return None

    def _response(self, messages: Sequence[dict[str, Any]], params: dict[str, Any]) -> _Chat | None:
        """The parsed response (from the cache or the server), or None when the teacher failed (counted)."""
        key = self.request_key(messages, params)
        body = self._cache.get(key) if self._cache else None
        cached = body is not None
        if cached:
            self._count("cache_hits")
        else:
            body = self._post({"model": self.config.model, "messages": list(messages), **params})
            if body is None:
                return None
        try:
            parsed = _Chat.model_validate_json(body)
        except ValidationError:
            self._count("malformed")
            return None
        if any(c.message.content is None and not c.message.tool_calls for c in parsed.choices):
            self._count("malformed")  # a choice that says nothing
            return None
        if self._cache is not None and not cached:  # only well-formed answers are kept
            self._cache.put(key, body)
        return parsed

    def chat(self, messages: Sequence[dict[str, Any]], **params: Any) -> str | None:
        """The first choice's text, or None when the teacher failed or answered malformed (counted)."""
        parsed = self._response(messages, params)
        if parsed is None:
            return None
        content = parsed.choices[0].message.content
        if content is None:
            self._count("malformed")
            return None
        return content

    def complete(self, messages: Sequence[dict[str, Any]], **params: Any) -> list[dict[str, Any]] | None:
        """Every choice's assistant message (``content`` and/or ``tool_calls``), e.g. ``n`` sampled
        next actions of an acting teacher; None when the teacher failed or answered malformed (counted)."""
        parsed = self._response(messages, params)
        if parsed is None:
            return None
        return [
            {"role": "assistant", "content": c.message.content, "tool_calls": c.message.tool_calls}
            for c in parsed.choices
        ]

    def structured(self, messages: Sequence[dict[str, Any]], schema: type[T], **params: Any) -> T | None:
        """The first choice parsed as ``schema`` (JSON, optionally inside a ```json fence), or None (counted)."""
        text = self.chat(messages, **params)
        if text is None:
            return None
        raw = text.strip()
        if raw.startswith("```"):
            raw = raw.strip("`").removeprefix("json").strip()
        try:
            return schema.model_validate_json(raw)
        except ValidationError:
            self._count("invalid_structured")
            self.forget(messages, **params)  # a later run asks again instead of replaying the bad answer
            return None

    def forget(self, messages: Sequence[dict[str, Any]], **params: Any) -> None:
        """Drop a cached response (e.g. one that parsed as chat but failed its schema)."""
        if self._cache is not None:
            self._cache.delete(self.request_key(messages, params))

    def close(self) -> None:
        self._http.close()
        if self._cache:
            self._cache.close()


__all__ = ["ClientConfig", "ResponseCache", "STAT_KEYS", "TeacherClient", "scrub_secrets"]
