"""Recording mode of ``mentorrl serve``: every chat completion recorded token in / token out for training.

A :class:`RecordingHook` sits beside the server's request handling (``create_app(recording=hook)``):
the chat-completions handler passes it each request with its episode id (the ``X-Mentorrl-Episode``
header, or the request's ``user`` field) and task id (``X-Mentorrl-Task``, optional);
:meth:`RecordingHook.complete` refuses what cannot be recorded (no or unknown episode, ``n > 1``),
samples it as an in-process rollout turn samples (:func:`run_sampling_update`: the run's temperature,
top-p and ``max_new_tokens``; no stop strings, no seed, ``tool_choice: auto``), and lets the server answer
under its gate (:meth:`RecordingHook.generating`: no generation while the learner updates the
shared weights). The server's ``on_completion`` (:meth:`RecordingHook.on_completion`) then stores the
prompt ids as rendered, the sampled ids, their behaviour log-probs and the policy version in the
:class:`~mentorrl.rollout.recorder.Recorder`, under the request's episode (a context variable of
the request's thread).

:func:`add_recording_routes` adds the harness's side: ``POST /mentorrl/episodes/{id}/reward``
(``{"reward": float, "details": {...}}``) and ``GET /mentorrl/stats``, both behind the reward key: a
bearer token of their own, outside ``/v1`` (so a harness can hold it while the agent holds only the
API key), compared in constant time and never logged. :class:`BackgroundServer` serves an app on a daemon
thread of this process (the external stage's in-process server: it shares the policy object, so
new weights are served as soon as the learner writes them).
"""

from __future__ import annotations

import contextlib
import contextvars
import hmac
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from pydantic import BaseModel, ConfigDict, Field

from mentorrl.rollout.recorder import Recorder, RecordError, check_id

EPISODE_HEADER = "X-Mentorrl-Episode"
TASK_HEADER = "X-Mentorrl-Task"
_EPISODE: contextvars.ContextVar[tuple[str, str | None]] = contextvars.ContextVar("mentorrl_recorded_episode")
REWARD_PATH = "/mentorrl/episodes/{episode_id}/reward"  # outside /v1: its own key, not the API key


@dataclass(frozen=True)
class RunSampling:
    """The sampling a recording server uses whatever the request says (the learner's view of the behaviour
    policy): ``temperature`` (0: greedy, log-probs at 1), ``top_p``, and the most tokens per turn."""

    temperature: float
    top_p: float
    max_new_tokens: int


def run_sampling_update(req: Any, sampling: RunSampling) -> dict[str, Any]:
    """The fields of ``req`` that differ from the contract's sampling, with the contract's values
    (empty when the request already samples as a rollout turn does)."""
    want = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_tokens": sampling.max_new_tokens,
        "max_completion_tokens": None,
        "stop": None,
        "seed": None,
        "tool_choice": None,
    }
    have = {k: getattr(req, k) for k in want}
    if have["tool_choice"] == "auto":
        have["tool_choice"] = None
    asked = have["max_completion_tokens"] or have["max_tokens"]
    # no limit, or one at or over the run's (the server caps it there): the turn's budget is the run's
    have["max_tokens"] = sampling.max_new_tokens if asked is None or asked >= sampling.max_new_tokens else asked
    have["max_completion_tokens"] = None
    update = {k: v for k, v in want.items() if have[k] != v}
    if "max_tokens" in update:  # the newer name wins in the server: clear it too
        update["max_completion_tokens"] = None
    return update


class RecordingHook:
    """What the server does differently in recording mode (see the module docstring).

    ``version``: the current policy version (the learner's); ``key``: the bearer key of the reward routes."""

    def __init__(self, recorder: Recorder, key: str, version: Callable[[], int], sampling: RunSampling):
        if not key:
            raise ValueError("recording mode needs a non-empty key")
        self.recorder, self._key, self.version, self.sampling = recorder, key.encode(), version, sampling
        self._cond = threading.Condition()
        self._open, self._in_flight = True, 0
        self.stats = {"generate_s": 0.0, "requests": 0, "overridden": 0, "refused_paused": 0}
        self.batcher: Any = None  # the server's Batcher (start_recording_server sets it)

    # ---- requests -------------------------------------------------------------------------------
    def complete(self, req: Any, ids: tuple[str | None, str | None], answer: Callable[[Any], Any]) -> Any:
        """Answer ``req`` (``answer(req)``: the server's own handling, plain or streamed) as a recorded
        completion of the episode ``ids`` = (episode id, task id or None), with the run's sampling; an
        :class:`APIError` for a request that cannot be recorded (no or unknown episode, ``n > 1``) or
        while paused. A streamed reply holds the gate until its last chunk."""
        from mentorrl.serve.protocol import APIError

        try:
            episode = check_id(ids[0] or "", "episode id (the X-Mentorrl-Episode header, or `user`)")
            task = check_id(ids[1], "task id (X-Mentorrl-Task)") if ids[1] else None
            self.recorder.check_open(episode, task)
            if req.n != 1:
                raise RecordError(400, "one choice per request (n=1): an episode is one conversation")
            t0 = self._enter()
        except RecordError as e:
            raise APIError(e.status, f"recording mode: {e}") from None
        streamed = False
        try:
            token = _EPISODE.set((episode, task))
            try:
                reply = answer(self._run_sampling(req))
            finally:
                _EPISODE.reset(token)
            if hasattr(reply, "body_iterator"):  # a streamed reply: generated (and recorded) as it is sent
                reply.body_iterator, streamed = self._tagged(reply.body_iterator, (episode, task), t0), True
            return reply
        except RecordError as e:
            raise APIError(e.status, f"recording mode: {e}") from None
        finally:
            if not streamed:
                self._exit(t0)

    def _run_sampling(self, req: Any) -> Any:
        """``req`` sampled as a rollout turn samples (counted when it asked for anything else): the run's
        temperature and top-p, the run's ``max_new_tokens`` per turn (a shorter ``max_tokens`` would cut
        the turn where an in-process rollout does not), no stop strings (a rollout stops on the
        contract's stop tokens only), no seed (a seeded request repeats its draws: a task's group would
        collapse to one sample) and ``tool_choice: auto`` (``none`` bans the call tag, ``required`` and a
        named function prefill the call's opening: each changes what the policy would sample)."""
        update = run_sampling_update(req, self.sampling)
        if update:
            with self._cond:
                self.stats["overridden"] += 1
        return req.model_copy(update=update) if update else req

    async def _tagged(self, chunks: Any, ids: tuple[str, str | None], t0: float) -> Any:
        """A streamed reply's chunks (Starlette's async iterator, each chunk produced on a worker thread
        in a copy of the sending task's context) with the episode set in that context, so the reply's
        completion is recorded into it; the gate is released when the stream ends or is dropped."""
        _EPISODE.set(ids)  # the sending task's own context: the request ends with it
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            self._exit(t0)

    def chain(self, on_completion: Callable[[Any], None] | None) -> Callable[[Any], None]:
        """The server's ``on_completion``: record, then ``on_completion`` (if any)."""

        def record(c: Any) -> None:
            self.on_completion(c)
            if on_completion is not None:
                on_completion(c)

        return record

    def on_completion(self, c: Any) -> None:
        """Record an answered request (a :class:`mentorrl.serve.Completion`) into the episode it was asked for."""
        ids = _EPISODE.get(None)
        if ids is None:  # not a recorded request
            return
        sample = c.samples[0]
        if sample.logprobs is None:
            raise RecordError(500, "the generator gave no log-probs for a recorded completion")
        lps = [t.logprob for t in sample.logprobs]
        self.record(ids[0], ids[1], c.prompt_ids, sample.token_ids, lps, self.version())

    def record(
        self,
        episode_id: str,
        task_id: str | None,
        prompt_ids: Sequence[int],
        completion_ids: Sequence[int],
        logprobs: Sequence[float],
        version: int,
    ) -> dict[str, Any]:
        return self.recorder.record_completion(episode_id, task_id, prompt_ids, completion_ids, logprobs, version)

    def _enter(self) -> float:
        """Count a generation in; a :class:`RecordError` (503) while paused."""
        with self._cond:
            if not self._open:
                self.stats["refused_paused"] += 1
                raise RecordError(503, "the policy is updating; retry after the round")
            self._in_flight += 1
            self.stats["requests"] += 1
        return time.perf_counter()

    def _exit(self, t0: float) -> None:
        with self._cond:
            self._in_flight -= 1
            self.stats["generate_s"] += time.perf_counter() - t0
            self._cond.notify_all()

    @contextlib.contextmanager
    def generating(self) -> Iterator[None]:
        """Generate inside this: refused (503) while paused; :meth:`pause` waits for it to end."""
        t0 = self._enter()
        try:
            yield
        finally:
            self._exit(t0)

    # ---- the gate -------------------------------------------------------------------------------
    def pause(self, timeout_s: float = 600.0) -> bool:
        """Refuse new generations and wait (up to ``timeout_s``) for those in flight; True when none is left."""
        with self._cond:
            self._open = False
            return self._cond.wait_for(lambda: self._in_flight == 0, timeout=timeout_s)

    def resume(self) -> None:
        with self._cond:
            self._open = True

    # ---- auth -------------------------------------------------------------------------------------
    def authorized(self, header: str | None) -> bool:
        scheme, _, given = (header or "").strip().partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self._key)


class RewardBody(BaseModel):
    """The body of a reward post: the episode's reward and, optionally, the verifier's details."""

    model_config = ConfigDict(extra="forbid")

    reward: float = Field(allow_inf_nan=False)
    details: dict[str, Any] | None = None


def add_recording_routes(app: Any, hook: RecordingHook) -> None:
    """The reward and stats routes (see the module docstring); a wrong or missing key gets 401."""
    from fastapi import Header
    from fastapi.responses import JSONResponse

    def refuse(status: int, message: str) -> JSONResponse:
        kind = "authentication_error" if status == 401 else "invalid_request_error"
        body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
        return JSONResponse(body, status_code=status, headers={"WWW-Authenticate": "Bearer"} if status == 401 else None)

    @app.post(REWARD_PATH)
    def post_reward(episode_id: str, body: RewardBody, authorization: str | None = Header(None)) -> Any:
        if not hook.authorized(authorization):
            return refuse(401, "missing or invalid bearer token (Authorization: Bearer ...)")
        try:
            hook.recorder.set_reward(episode_id, body.reward, body.details)
        except RecordError as e:
            return refuse(e.status, str(e))
        return {"episode_id": episode_id, "reward": body.reward}

    @app.get("/mentorrl/stats")
    def stats(authorization: str | None = Header(None)) -> Any:
        if not hook.authorized(authorization):
            return refuse(401, "missing or invalid bearer token (Authorization: Bearer ...)")
        return {"recorder": hook.recorder.counters(), "server": dict(hook.stats), "policy_version": hook.version()}


def start_recording_server(
    tokenizer: Any,
    model: Any,
    recorder: Recorder,
    sampling: RunSampling,
    version: Callable[[], int],
    api_key: str,
    reward_key: str,
    host: str = "127.0.0.1",
    max_batch: int | None = None,
) -> tuple["BackgroundServer", RecordingHook]:
    """``model`` served in recording mode on a free port of ``host``, on a thread of this process
    (``/v1`` behind ``api_key``, the reward routes behind ``reward_key``), started; and its hook.
    ``max_batch``: the batcher's rows in flight (default :data:`~mentorrl.serve.protocol.DEFAULT_MAX_BATCH`);
    give it the agents' concurrency, so every episode's turn can join the same passes."""
    from mentorrl.serve import create_app

    hook = RecordingHook(recorder, reward_key, version, sampling)
    from mentorrl.serve.protocol import DEFAULT_MAX_BATCH

    app = create_app(
        tokenizer,
        model,
        "mentorrl-policy",
        token=api_key,
        max_new_tokens_cap=sampling.max_new_tokens,
        recording=hook,
        max_batch=max_batch or DEFAULT_MAX_BATCH,
    )
    add_recording_routes(app, hook)
    hook.batcher = app.state.served.batcher  # its generate calls' wall time: the stage's generation share
    return BackgroundServer(app, host).start(), hook


class BackgroundServer:
    """``app`` served by uvicorn on a daemon thread, on a free port of ``host`` (loopback by default)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", log_level: str = "warning"):
        import uvicorn

        from mentorrl.serve import base_url, bind_socket, server_config

        self.sock = bind_socket(host, 0)
        self.url = base_url(self.sock)  # ends in /v1
        self.server = uvicorn.Server(server_config(app, log_level))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, name="mentorrl-serve", daemon=True
        )

    def start(self, timeout_s: float = 60.0) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


__all__ = [
    "BackgroundServer",
    "EPISODE_HEADER",
    "REWARD_PATH",
    "RecordingHook",
    "RunSampling",
    "TASK_HEADER",
    "add_recording_routes",
    "start_recording_server",
]
