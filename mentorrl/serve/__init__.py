"""An OpenAI-compatible chat-completions server for a local policy.

The server speaks the OpenAI chat-completions protocol and renders every conversation the way the
checkpoint's chat template does (:mod:`mentorrl.serve.render`): the contract's ChatML
(:func:`mentorrl.chat.prompt_pieces`) for checkpoints with the contract's template, the checkpoint's own
tool-aware template (hermes, llama3_json) otherwise; ``tools`` are rendered into the prompt, and a
generated call comes back as ``tool_calls``. Message content, tool names, descriptions and schemas are
plain text: a literal ``<|im_end|>`` or ``<|im_start|>`` in them never becomes a control token, so a client
cannot forge turns.

* ``POST /v1/chat/completions`` (``stream: true`` sends server-sent ``chat.completion.chunk`` events),
  ``GET /v1/models``, ``GET /health``.
* ``tool_choice``: ``none``, ``auto``, ``required`` and a named function (:mod:`mentorrl.serve.tools`).
* ``logprobs`` / ``top_logprobs`` (0-20): ``log_softmax(logits / T)`` of each sampled token, the
  behaviour log-prob a rollout records (:mod:`mentorrl.serve.generation`).
* Bad requests get a 4xx with an OpenAI-style body ``{"error": {"message", "type", "param", ...}}``;
  FastAPI's validation errors are answered with **400** in that shape, not 422.
* Optional bearer token on every ``/v1`` route (401 without it; ``/health`` stays open).
* Request bodies over ``max_body_bytes`` get 413, checked from Content-Length and while
  reading the body; a body nested deeper than ``MAX_BODY_DEPTH`` gets 400. Text with a lone
  surrogate (``"\\ud800"``, which is not UTF-8) in a message, a tool or a stop string gets 400; so do
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
  request repeats exactly whatever it is batched with, streamed or not, up to floating-point
  effects of padding.
* Every answered request is available token in / token out (:class:`Completion`: the prompt ids as
  rendered, each choice's sampled ids and behaviour log-probs) through ``create_app(on_completion=...)``.

Build the app with :func:`create_app` (tests use ``fastapi.testclient.TestClient``); start a
real server in a subprocess with :func:`serve_subprocess`. The ``mentorrl serve`` command itself is
:mod:`mentorrl.cli.serve`.
"""

from mentorrl.serve.app import Completion, add_error_handlers, chat_completion, create_app, plan_request
from mentorrl.serve.generation import (
    Batcher,
    ContinuousBatcher,
    GenRequest,
    PolicyGenerator,
    RowSampler,
    RowStreamer,
    Sample,
    TokenLogprob,
    group_requests,
    row_generator,
)
from mentorrl.serve.middleware import BearerAuthMiddleware, BodyLimitMiddleware
from mentorrl.serve.protocol import (
    DEFAULT_BATCH_WINDOW_MS,
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_TOKENS_CAP,
    GREEDY_BELOW,
    MAX_BODY_DEPTH,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOOLS,
    MAX_TOP_LOGPROBS,
    APIError,
    ChatMessage,
    ChatRequest,
    check_utf8,
    error_body,
)
from mentorrl.serve.render import ChatRenderer
from mentorrl.serve.server import (
    LOG_LEVELS,
    READY_PREFIX,
    RedactQueryFilter,
    base_url,
    bind_socket,
    is_loopback,
    redact_query,
    run_server,
    serve_subprocess,
    server_config,
)
from mentorrl.serve.tools import ToolPolicy, check_tools, tool_policy

__all__ = [
    "APIError",
    "Batcher",
    "ContinuousBatcher",
    "BearerAuthMiddleware",
    "BodyLimitMiddleware",
    "ChatMessage",
    "ChatRenderer",
    "ChatRequest",
    "Completion",
    "DEFAULT_BATCH_WINDOW_MS",
    "DEFAULT_MAX_BATCH",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_TOKENS_CAP",
    "GREEDY_BELOW",
    "GenRequest",
    "LOG_LEVELS",
    "MAX_BODY_DEPTH",
    "MAX_STOP_CHARS",
    "MAX_STOP_STRINGS",
    "MAX_TOOLS",
    "MAX_TOP_LOGPROBS",
    "PolicyGenerator",
    "READY_PREFIX",
    "RedactQueryFilter",
    "RowSampler",
    "RowStreamer",
    "Sample",
    "TokenLogprob",
    "ToolPolicy",
    "add_error_handlers",
    "base_url",
    "bind_socket",
    "chat_completion",
    "check_tools",
    "check_utf8",
    "create_app",
    "error_body",
    "group_requests",
    "is_loopback",
    "plan_request",
    "redact_query",
    "row_generator",
    "run_server",
    "serve_subprocess",
    "server_config",
    "tool_policy",
]
