"""A served black-box teacher on a Ray actor (``distributed: {backend: ray, teacher_workers: K >= 1}`` with
``blackbox.teacher.serve``).

The black-box stage reaches its teacher only through the OpenAI chat-completions protocol. Without Ray it
starts ``mentorrl serve`` as a subprocess of the learner on 127.0.0.1. Here a :class:`ServeActor`, placed by
Ray where a CPU is free, starts that same subprocess on its own node and hands back the URL:

- on the learner's node the server binds 127.0.0.1, as without Ray;
- on another node it binds that node's address (``--allow-remote``): the learner has to reach it;
- either way it requires a bearer token, fresh for every server (``secrets.token_urlsafe``), given to the
  server through its environment and to the learner's client through an environment variable of the
  learner's process; it is never written to the config, the logs or the response cache (whose key is
  the checkpoint's identity, not the URL).

When the stage ends the server is stopped and the actor killed; if the learner dies, Ray ends the actor and
the server goes with it (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import Iterator, Sequence

import ray
from ray.exceptions import GetTimeoutError

from mentorrl.config import DistributedConfig
from mentorrl.distributed.ray_workers import ACTOR_START_TIMEOUT_S, actor_options, init_ray, kill_actor

TOKEN_ENV = "MENTORRL_SERVED_TEACHER_TOKEN"  # in the server's environment and in the learner's process


@ray.remote(num_cpus=1)
class ServeActor:
    """Runs one ``mentorrl serve`` subprocess on this actor's node."""

    def __init__(self):
        self._cm = None

    def node(self) -> tuple[str, str]:
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def start(self, path: str, host: str, token: str, extra_args: list[str], timeout_s: float) -> str:
        from mentorrl.serve import is_loopback, serve_subprocess

        args = ["--host", host] + ([] if is_loopback(host) else ["--allow-remote"]) + list(extra_args)
        self._cm = serve_subprocess(
            path, token_env=TOKEN_ENV, extra_args=args, env={TOKEN_ENV: token}, timeout_s=timeout_s
        )
        return self._cm.__enter__()

    def stop(self) -> None:
        cm, self._cm = self._cm, None
        if cm is not None:
            cm.__exit__(None, None, None)


@contextlib.contextmanager
def serve_on_actor(
    dist: DistributedConfig, path: Path, extra_args: Sequence[str] = (), timeout_s: float = 300.0
) -> Iterator[tuple[str, str]]:
    """Serve the checkpoint at ``path`` from a :class:`ServeActor`; yields ``(base URL, name of the variable
    holding its token in this process)``."""
    init_ray(dist)
    actor = ServeActor.options(**actor_options()).remote()
    token = secrets.token_urlsafe(24)
    try:
        try:
            node, ip = ray.get(actor.node.remote(), timeout=ACTOR_START_TIMEOUT_S)
        except GetTimeoutError as e:
            raise RuntimeError(
                f"the served teacher's actor did not start in {ACTOR_START_TIMEOUT_S:.0f} s; check "
                "`ray status` for a free CPU"
            ) from e
        host = "127.0.0.1" if node == ray.get_runtime_context().get_node_id() else ip
        url = ray.get(actor.start.remote(str(path), host, token, list(extra_args), timeout_s))
        os.environ[TOKEN_ENV] = token
        yield url, TOKEN_ENV
    finally:
        os.environ.pop(TOKEN_ENV, None)
        try:
            ray.get(actor.stop.remote(), timeout=60)
        except Exception:  # noqa: BLE001 -- the actor is going anyway
            pass
        kill_actor(actor)
