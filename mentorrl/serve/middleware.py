"""ASGI middleware: the body limit, the bearer token and the handler threads."""

from __future__ import annotations

import hmac
from typing import Any, Mapping

from mentorrl.contract import json_depth
from mentorrl.serve.protocol import MAX_BODY_DEPTH, error_body, error_type


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


class ThreadLimitMiddleware:
    """ASGI middleware: lets at least ``threads`` sync handlers run at once. FastAPI runs a sync endpoint
    on anyio's default thread limiter (40 threads); a chat completion holds its thread while its turn is
    generated, so with more requests in flight than that the rest wait for a thread before they are even
    rendered, and the batcher never sees them together. The running loop's limiter is raised to
    ``threads`` (never lowered) when a request comes."""

    def __init__(self, app: Any, threads: int):
        self.app, self.threads = app, threads

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        import anyio.to_thread

        limiter = anyio.to_thread.current_default_thread_limiter()
        if limiter.total_tokens < self.threads:
            limiter.total_tokens = self.threads
        await self.app(scope, receive, send)


async def _reply(
    scope: Any, receive: Any, send: Any, status: int, message: str, headers: Mapping[str, str] | None = None
) -> None:
    from starlette.responses import JSONResponse

    response = JSONResponse(error_body(message, error_type(status)), status_code=status, headers=dict(headers or {}))
    if status == 413:
        response.headers["Connection"] = "close"  # the rest of the body is never read
    await response(scope, receive, send)


__all__ = ["BearerAuthMiddleware", "BodyLimitMiddleware", "ThreadLimitMiddleware"]
