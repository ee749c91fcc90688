"""The FastAPI app: ``POST /v1/chat/completions`` (plain or streamed), ``GET /v1/models``, ``GET /health``."""

from __future__ import annotations

import json
import queue
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from mentorrl.chat import MessageError, message_pieces_of
from mentorrl.serve.generation import DONE, Batcher, ContinuousBatcher, GenRequest, PolicyGenerator, Sample
from mentorrl.serve.middleware import BearerAuthMiddleware, BodyLimitMiddleware, ThreadLimitMiddleware
from mentorrl.serve.protocol import (
    DEFAULT_BATCH_WINDOW_MS,
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_TOKENS_CAP,
    APIError,
    ChatRequest,
    check_utf8,
    error_body,
    error_type,
    validation_message,
)
from mentorrl.serve.render import ChatRenderer
from mentorrl.serve.responses import (
    ChoiceStream,
    TokenTexts,
    call_id,
    finish_reason,
    logprob_entry,
    logprobs_of,
    tool_call_deltas,
    turn_message,
    usage_of,
)
from mentorrl.serve.tools import ToolPolicy, check_tools, tool_policy

HANDLER_THREADS_SPARE = 40  # handler threads beyond max_batch (anyio's default): requests rendered or answered
STREAM_POLL_S = 1.0  # how often a streaming reply checks its queue (the batcher always ends it with DONE)


@dataclass
class Completion:
    """One answered request, token in / token out: what a recording of the server needs.

    ``prompt_ids``: the prompt as rendered and generated from (a forced call's opening included);
    ``prefill``: that opening's text; ``samples``: the ``n`` :class:`~mentorrl.serve.generation.Sample` s
    (sampled ids, behaviour log-probs, text); ``messages``: the choices' assistant messages."""

    id: str
    model: str
    created: int
    prompt_ids: list[int]
    prefill: str
    samples: list[Sample]
    messages: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Served:
    """What a request needs from the app: the generator, its batcher, the model's name, the hooks."""

    gen: PolicyGenerator
    batcher: Batcher | ContinuousBatcher
    model_name: str
    texts: TokenTexts
    on_completion: Callable[[Completion], None] | None = None


@dataclass
class Plan:
    """A checked, rendered request, ready for the batcher."""

    req: ChatRequest
    gen_req: GenRequest
    policy: ToolPolicy
    top_k: int | None  # None: no logprobs
    include_usage: bool
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))


def create_app(
    tokenizer: Any,
    model: Any,
    model_name: str,
    token: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_new_tokens_cap: int = DEFAULT_MAX_TOKENS_CAP,
    max_batch: int = DEFAULT_MAX_BATCH,
    batch_window_ms: float = DEFAULT_BATCH_WINDOW_MS,
    on_completion: Callable[[Completion], None] | None = None,
    tool_format: str = "auto",
    recording: Any = None,
    decoder: str = "auto",
    continuous: bool = True,
    retain_rows: int | None = None,
):
    """The FastAPI app serving ``model`` as ``model_name`` (see :mod:`mentorrl.serve`).

    ``token``: when set, every ``/v1`` request needs ``Authorization: Bearer <token>``.
    ``max_new_tokens_cap``: the most tokens one reply may have (``max_tokens`` is clipped to it).
    ``max_batch``, ``batch_window_ms``: the batcher's rows in flight (per batch) and wait for more.
    ``on_completion``: called with each answered request's :class:`Completion` (on the request's thread).
    ``tool_format``: the rendering (``auto``: from the tokenizer's chat template, :class:`ChatRenderer`).
    ``recording``: a :class:`mentorrl.serve.recording.RecordingHook`: recording mode (every completion
    recorded into its episode, the run's sampling; see that module).
    ``decoder``: what decodes a batch (:class:`PolicyGenerator`: auto, slots, hf, hf_generate).
    ``continuous``: on the slot decoder, serve with a :class:`ContinuousBatcher` (requests join the
    running decode loop between passes); False, or another decoder: a :class:`Batcher` (each batch
    decoded to its end). ``retain_rows``: the continuous batcher's retained rows, KV kept for a later
    request that continues their context (default ``max_batch``; 0: none)."""
    from fastapi import FastAPI, Header
    from fastapi.responses import StreamingResponse

    if token is not None and not token:
        raise ValueError("token must be a non-empty string or None")
    if recording is not None:
        on_completion = recording.chain(on_completion)
    gen = PolicyGenerator(tokenizer, model, max_new_tokens_cap, ChatRenderer(tokenizer, tool_format), decoder)
    if continuous and gen.decoder_kind() == "slots":
        batcher: Batcher | ContinuousBatcher = ContinuousBatcher(gen, max_batch, batch_window_ms / 1000, retain_rows)
    else:
        batcher = Batcher(gen, max_batch, batch_window_ms / 1000)
    served = Served(gen, batcher, model_name, TokenTexts(tokenizer), on_completion)
    created = int(time.time())
    app = FastAPI(title="mentorrl serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.served = served
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
    def chat_completions(
        req: ChatRequest,
        x_mentorrl_episode: str | None = Header(None, max_length=256),
        x_mentorrl_task: str | None = Header(None, max_length=256),
    ) -> Any:
        def respond(req: ChatRequest) -> Any:
            if req.stream:
                plan = plan_request(served, req)
                return StreamingResponse(stream_completion(served, plan), media_type="text/event-stream")
            return chat_completion(served, req)

        if recording is not None:  # the episode (and task) a recorded completion belongs to
            return recording.complete(req, (x_mentorrl_episode or req.user, x_mentorrl_task), respond)
        return respond(req)

    app.add_middleware(BodyLimitMiddleware, max_body_bytes=max_body_bytes)
    app.add_middleware(ThreadLimitMiddleware, threads=max_batch + HANDLER_THREADS_SPARE)  # waiting turns hold threads
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
        message, param = validation_message(exc.errors())
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Any, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            error_body(str(exc.detail), error_type(exc.status_code)),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(APIError)
    async def _api(request: Any, exc: APIError) -> JSONResponse:
        return JSONResponse(error_body(exc.message, exc.type, exc.param), status_code=exc.status)

    @app.exception_handler(Exception)
    async def _crash(request: Any, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error ({type(exc).__name__})", "server_error"), status_code=500)


def plan_request(served: Served, req: ChatRequest) -> Plan:
    """``req`` checked and rendered. Raises :class:`APIError` (400, naming the parameter) for bad input."""
    gen, renderer = served.gen, served.gen.renderer
    stop = req.stop_strings()
    top_k = req.top_k_logprobs()
    include_usage = req.check_stream_options()
    tools = check_tools(req.tools)
    policy = tool_policy(req.tool_choice, tools)
    try:
        messages = [m.as_dict() for m in req.messages]
        for i, m in enumerate(messages):
            for piece in message_pieces_of(m):
                check_utf8(piece, f"messages[{i}]")
        pieces = renderer.prompt_pieces(messages, tools)
        prefill = renderer.prefill(policy)
        prompt_ids = renderer.prompt_ids(pieces + renderer.turn_pieces(prefill))
    except (MessageError, ValueError) as e:
        raise APIError(400, str(e), param="messages") from None
    gen_req = gen.request(
        prompt_ids,
        req.n,
        req.temperature,
        req.top_p,
        req.max_completion_tokens or req.max_tokens,
        req.seed,
        stop,
        top_logprobs=top_k or 0,
        banned=tuple(renderer.banned_ids(policy)),
        prefill=prefill,
        events=queue.Queue() if req.stream else None,
    )
    return Plan(req, gen_req, policy, top_k, include_usage)


def final_choices(served: Served, plan: Plan, samples: list[Sample]) -> list[tuple[dict[str, Any], str]]:
    """Each sample's (assistant message, finish reason)."""
    out = []
    for i, s in enumerate(samples):
        text = plan.gen_req.prefill + s.text
        message, is_call = turn_message(served.gen.renderer, plan.policy, text, call_id(plan.req.seed, i, text))
        out.append((message, finish_reason(s, is_call)))
    return out


def record(served: Served, plan: Plan, samples: list[Sample], messages: list[dict[str, Any]]) -> None:
    if served.on_completion is not None:
        g = plan.gen_req
        served.on_completion(
            Completion(plan.id, served.model_name, plan.created, list(g.prompt_ids), g.prefill, samples, messages)
        )


def chat_completion(served: Served, req: ChatRequest) -> dict[str, Any]:
    """The ``/v1/chat/completions`` response to a non-streamed ``req``: its ``n`` replies."""
    plan = plan_request(served, req)
    samples = served.batcher.submit(plan.gen_req)
    finals = final_choices(served, plan, samples)
    record(served, plan, samples, [m for m, _ in finals])
    choices = [
        {
            "index": i,
            "message": message,
            "finish_reason": reason,
            "logprobs": logprobs_of(s.logprobs, served.texts) if plan.top_k is not None else None,
        }
        for i, ((message, reason), s) in enumerate(zip(finals, samples))
    ]
    return {
        "id": plan.id,
        "object": "chat.completion",
        "created": plan.created,
        "model": served.model_name,
        "choices": choices,
        "usage": usage_of(len(plan.gen_req.prompt_ids), samples),
    }


def sse(obj: Any) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class ChunkWriter:
    """``chat.completion.chunk`` events of one streamed reply."""

    def __init__(self, plan: Plan, model_name: str):
        self.base = {"id": plan.id, "object": "chat.completion.chunk", "created": plan.created, "model": model_name}
        self.usage = {"usage": None} if plan.include_usage else {}
        self.logprobs = plan.top_k is not None

    def __call__(
        self, index: int, delta: dict[str, Any], entries: list | None = None, reason: str | None = None
    ) -> str:
        lp = {"content": entries or []} if self.logprobs and entries is not None else None
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
        return sse({**self.base, "choices": [choice], **self.usage})


def stream_completion(served: Served, plan: Plan) -> Iterator[str]:
    """The streamed reply to ``plan``: a role chunk per choice, content (and log-prob) chunks as tokens
    come, then each choice's rest, tool calls and finish reason, the usage chunk when asked, ``[DONE]``."""
    g, gen = plan.gen_req, served.gen
    streams = [ChoiceStream(gen.renderer, plan.policy, g.prefill, g.stop, gen.stop_ids) for _ in range(g.n)]
    chunk = ChunkWriter(plan, served.model_name)
    future = served.batcher.enqueue(g)
    for i in range(g.n):
        yield chunk(i, {"role": "assistant", "content": ""})
    while True:
        try:
            event = g.events.get(timeout=STREAM_POLL_S)
        except queue.Empty:
            continue
        if event == DONE:
            break
        _, row, token_id, entry = event
        for i in range(g.n) if g.greedy else (row,):
            yield from _token_chunk(served, chunk, streams[i], i, token_id, entry)
    try:
        samples = future.result()
    except Exception as e:  # the batch failed: an error event, as OpenAI sends one mid-stream
        yield sse(error_body(f"internal error ({type(e).__name__})", "server_error"))
        return
    yield from _final_chunks(served, plan, chunk, streams, samples)
    yield "data: [DONE]\n\n"


def _token_chunk(
    served: Served, chunk: ChunkWriter, stream: ChoiceStream, i: int, token_id: int, entry: Any
) -> Iterator[str]:
    delta = stream.token(token_id)
    if delta is None:
        return
    entries = None
    if chunk.logprobs and entry is not None:
        entries = [logprob_entry(entry, served.texts)]
        stream.sent += 1
    if delta or entries:
        yield chunk(i, {"content": delta}, entries)


def _final_chunks(
    served: Served, plan: Plan, chunk: ChunkWriter, streams: list[ChoiceStream], samples: list[Sample]
) -> Iterator[str]:
    finals = final_choices(served, plan, samples)
    record(served, plan, samples, [m for m, _ in finals])
    for i, ((message, reason), s) in enumerate(zip(finals, samples)):
        rest = streams[i].finish(message)
        entries = None
        if chunk.logprobs and s.logprobs is not None and len(s.logprobs) > streams[i].sent:
            entries = [logprob_entry(e, served.texts) for e in s.logprobs[streams[i].sent :]]
        if rest or entries:
            yield chunk(i, {"content": rest}, entries)
        for delta in tool_call_deltas(message):
            yield chunk(i, delta)
        yield chunk(i, {}, reason=reason)
    if plan.include_usage:
        yield sse({**chunk.base, "choices": [], "usage": usage_of(len(plan.gen_req.prompt_ids), samples)})


__all__ = [
    "Completion",
    "Plan",
    "Served",
    "add_error_handlers",
    "chat_completion",
    "create_app",
    "plan_request",
    "stream_completion",
]
