"""The learner in its own Ray actor (``distributed: {backend: ray, learner_actor: true}``).

``mentorrl train`` then only launches: it starts (or joins) Ray and runs the whole recipe (learner,
optimiser, evaluation, checkpoints, replay buffer, the run directory) inside a :class:`LearnerActor`
that Ray places wherever ``learner_cpus`` / ``learner_gpus`` are free, e.g. on a GPU node of a cluster,
while the launching process may sit on a CPU-only head node. The actor starts the rollout (and
teacher, environment) actors itself, exactly as the launching process would without it.

- The run directory is written by the actor, on its node (relative paths resolve against the
  launching process's working directory, which must exist there too: a shared file system on a
  cluster). ``--resume`` continues from it as always.
- The actor's output reaches the launching terminal through Ray's log forwarding.
- An error in the recipe (a broken config, a corrupt checkpoint) is raised in the launching process
  as its own type, so the CLI's exit codes are unchanged. The actor is owned by the launching process:
  if that dies, Ray ends the actor (and the actors it started) with it.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import ray
from ray.exceptions import RayTaskError

from mentorrl.distributed.ray_workers import ACTOR_ENV, init_ray


@ray.remote
class LearnerActor:
    """Runs one recipe; ``where`` tells which node and process it runs in."""

    def where(self) -> dict[str, Any]:
        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    def run(
        self, run_recipe: Callable[..., dict], cfg_json: dict, resume: bool, show_progress: bool, cwd: str
    ) -> dict[str, Any]:
        from mentorrl.config import RunConfig

        if os.path.isdir(cwd):
            os.chdir(cwd)
        cfg = RunConfig.model_validate(cfg_json)
        return run_recipe(cfg, resume=resume, show_progress=show_progress)


def learner_actor_options(cfg) -> dict[str, Any]:
    d = cfg.distributed
    fixed = 0 if cfg.threads == "auto" else cfg.threads  # auto: the CPUs the actor is given
    threads = str(fixed or max(1, int(d.learner_cpus)))
    env = {**ACTOR_ENV, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    return {"num_cpus": d.learner_cpus, "num_gpus": d.learner_gpus, "runtime_env": {"env_vars": env}}


def run_in_learner_actor(
    run_recipe: Callable[..., dict], cfg, resume: bool = False, show_progress: bool = True
) -> dict[str, Any]:
    """``run_recipe(cfg)`` (:func:`mentorrl.train.pipeline.run_recipe`, passed in: it is pickled by reference)
    inside a :class:`LearnerActor`; returns its result with ``learner`` (node id, pid)."""
    init_ray(cfg.distributed)
    actor = LearnerActor.options(**learner_actor_options(cfg)).remote()
    try:
        where = ray.get(actor.where.remote())
        result = ray.get(actor.run.remote(run_recipe, cfg.model_dump(mode="json"), resume, show_progress, os.getcwd()))
    except RayTaskError as e:  # the recipe's own error, itself (a ConfigError stays a ConfigError, with its message)
        cause = getattr(e, "cause", None)
        raise (cause if isinstance(cause, BaseException) else e.as_instanceof_cause()) from None
    finally:
        ray.kill(actor, no_restart=True)
    return {**result, "learner": where}
