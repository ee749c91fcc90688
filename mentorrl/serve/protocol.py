"""The chat-completions request body, its limits, and the OpenAI error shape."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

from mentorrl.chat import MessageError
from mentorrl.contract import MAX_JSON_DEPTH

DEFAULT_MAX_BODY_BYTES = 1_000_000
DEFAULT_MAX_TOKENS_CAP = 512
DEFAULT_MAX_BATCH = 32  # rows (the sum of the batched requests' n)
DEFAULT_BATCH_WINDOW_MS = 5.0
GREEDY_BELOW = 1e-5  # temperatures under this decode greedily, as vLLM does
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 64  # Hugging Face's stop-string matcher allocates vocab x length: keep it small
MAX_BODY_DEPTH = MAX_JSON_DEPTH + 8  # the request's own nesting around a tool call's arguments
MAX_TOP_LOGPROBS = 20  # OpenAI's bound
MAX_TOOLS = 128  # OpenAI's bound


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


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage and no choices."""

    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class ChatRequest(BaseModel):
    """The chat-completions request body. Unknown fields are ignored, as OpenAI-compatible servers do.

    ``tools`` (OpenAI function schemas, checked by :func:`mentorrl.serve.tools.check_tools`) are rendered
    into the prompt by the checkpoint's template; ``tool_choice`` is ``none``, ``auto``, ``required`` or
    a named function (:class:`mentorrl.serve.tools.ToolPolicy`). ``response_format`` and
    ``parallel_tool_calls`` are accepted and not enforced (a turn holds at most one call)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="echoed as the served model's name; any value is accepted")
    messages: list[ChatMessage] = Field(min_length=1)
    user: str | None = Field(None, max_length=256, description="the caller's id; in recording mode, the episode id")
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
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
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="needs logprobs: true")
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

    def top_k_logprobs(self) -> int | None:
        """None without ``logprobs``; else the number of alternatives per token (0..20). Raises
        :class:`APIError` (400) for ``top_logprobs`` without ``logprobs: true``."""
        if not self.logprobs:
            if self.top_logprobs:
                raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
            return None
        return self.top_logprobs or 0

    def check_stream_options(self) -> bool:
        """Whether a streamed reply ends with a usage chunk. Raises :class:`APIError` (400) for
        ``stream_options`` without ``stream: true``."""
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
        return bool(self.stream_options and self.stream_options.include_usage)


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


def error_type(status: int) -> str:
    """The OpenAI error type of an HTTP status."""
    return {401: "authentication_error", 404: "not_found_error"}.get(
        status, "server_error" if status >= 500 else "invalid_request_error"
    )


def validation_message(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
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


__all__ = [
    "APIError",
    "ChatMessage",
    "ChatRequest",
    "ContentPart",
    "DEFAULT_BATCH_WINDOW_MS",
    "DEFAULT_MAX_BATCH",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_TOKENS_CAP",
    "GREEDY_BELOW",
    "MAX_BODY_DEPTH",
    "MAX_STOP_CHARS",
    "MAX_STOP_STRINGS",
    "MAX_TOOLS",
    "MAX_TOP_LOGPROBS",
    "StreamOptions",
    "check_utf8",
    "error_body",
    "error_type",
    "validation_message",
]
