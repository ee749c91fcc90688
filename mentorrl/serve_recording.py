"""Recording mode of ``mentorrl serve``: every chat completion recorded token in / token out for training.

A :class:`RecordingHook` sits beside the server's request handling: the chat-completions handler asks
it for the request's episode (:meth:`RecordingHook.episode_of`: the ``X-Mentorrl-Episode`` header, or
the request's ``user`` field; the task from ``X-Mentorrl-Task``), generates under its gate
(:meth:`RecordingHook.generating`: no generation while the learner updates the shared weights) with
the run's sampling settings (:meth:`RecordingHook.sampling`), and hands each choice's prompt ids,
sampled ids and behaviour log-probs to :meth:`RecordingHook.record`, which stores them with the
policy version in the :class:`~mentorrl.rollout.recorder.Recorder`.

:func:`add_recording_routes` adds the harness's side: ``POST /mentorrl/episodes/{id}/reward``
(``{"reward": float, "details": {...}}``) and ``GET /mentorrl/stats``, both behind the reward key: a
bearer token of their own, outside ``/v1`` (so a harness can hold it while the agent holds only the
API key), compared in constant time and never logged. :class:`BackgroundServer` serves an app on a daemon
thread of this process (the external stage's in-process server: it shares the policy object, so
new weights are served as soon as the learner writes them).
"""

from __future__ import annotations

import contextlib
import hmac
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

from mentorrl.rollout.recorder import Recorder, RecordError, check_id

EPISODE_HEADER = "x-mentorrl-episode"
TASK_HEADER = "x-mentorrl-task"
REWARD_PATH = "/mentorrl/episodes/{episode_id}/reward"  # outside /v1: its own key, not the API key


@dataclass(frozen=True)
class RunSampling:
    """The sampling a recording server uses whatever the request says (the learner's view of the behaviour
    policy): ``temperature`` (0: greedy, log-probs at 1), ``top_p``, and the most tokens per turn."""

    temperature: float
    top_p: float
    max_new_tokens: int


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

    # ---- requests -------------------------------------------------------------------------------
    def episode_of(self, headers: Mapping[str, str], user: str | None) -> tuple[str, str | None]:
        """(episode id, task id or None) of a request; a :class:`RecordError` (400) without one."""
        episode = headers.get(EPISODE_HEADER) or user
        if not episode:
            raise RecordError(400, "recording mode: send the episode id as the X-Mentorrl-Episode header (or `user`)")
        task = headers.get(TASK_HEADER)
        return check_id(episode, "episode id"), (check_id(task, "task id") if task else None)

    def note_override(self, temperature: float, top_p: float) -> None:
        """Count a request that asked for other sampling settings than the run's."""
        if (temperature, top_p) != (self.sampling.temperature, self.sampling.top_p):
            with self._cond:
                self.stats["overridden"] += 1

    @contextlib.contextmanager
    def generating(self) -> Iterator[None]:
        """Generate inside this: refused (503) while paused; :meth:`pause` waits for it to end."""
        with self._cond:
            if not self._open:
                self.stats["refused_paused"] += 1
                raise RecordError(503, "the policy is updating; retry after the round")
            self._in_flight += 1
            self.stats["requests"] += 1
        t0 = time.perf_counter()
        try:
            yield
        finally:
            with self._cond:
                self._in_flight -= 1
                self.stats["generate_s"] += time.perf_counter() - t0
                self._cond.notify_all()

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


def add_recording_routes(app: Any, hook: RecordingHook) -> None:
    """The reward and stats routes (see the module docstring); a wrong or missing key gets 401."""
    from fastapi import Request
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, ConfigDict, Field

    class RewardBody(BaseModel):
        model_config = ConfigDict(extra="forbid")
        reward: float = Field(allow_inf_nan=False)
        details: dict[str, Any] | None = None

    def refuse(status: int, message: str) -> JSONResponse:
        kind = "authentication_error" if status == 401 else "invalid_request_error"
        body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
        return JSONResponse(body, status_code=status, headers={"WWW-Authenticate": "Bearer"} if status == 401 else None)

    @app.post(REWARD_PATH)
    def post_reward(episode_id: str, body: RewardBody, request: Request) -> Any:
        if not hook.authorized(request.headers.get("authorization")):
            return refuse(401, "missing or invalid bearer token (Authorization: Bearer ...)")
        try:
            hook.recorder.set_reward(episode_id, body.reward, body.details)
        except RecordError as e:
            return refuse(e.status, str(e))
        return {"episode_id": episode_id, "reward": body.reward}

    @app.get("/mentorrl/stats")
    def stats(request: Request) -> Any:
        if not hook.authorized(request.headers.get("authorization")):
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
) -> tuple["BackgroundServer", RecordingHook]:
    """``model`` served in recording mode on a free port of ``host``, on a thread of this process
    (``/v1`` behind ``api_key``, the reward routes behind ``reward_key``), started; and its hook."""
    from mentorrl.serve import create_app

    hook = RecordingHook(recorder, reward_key, version, sampling)
    app = create_app(tokenizer, model, "mentorrl-policy", token=api_key, recording=hook)
    add_recording_routes(app, hook)
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
