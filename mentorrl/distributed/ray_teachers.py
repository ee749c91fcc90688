"""White-box OPD teachers on Ray actors (``distributed: {backend: ray, teacher_workers: K}``).

Each teacher of the OPD stage is served by ``K`` :class:`TeacherActor` s (one CPU each). Every actor
loads the teacher's checkpoint itself (from the path: on a cluster, a directory every node can read),
so no teacher weights travel through the object store. A step's trajectories are split into
contiguous shares (:func:`~mentorrl.distributed.ray_workers.shares`), one per actor, sent as one
object each; each actor runs :func:`mentorrl.opd.scoring.teacher_row` on its share, the very
function the learner's process runs without actors, so the signals are the same numbers.

Faults: an actor that dies mid-step is killed (if only unreachable), replaced by a new one that
loads the checkpoint, and its share is scored again, so no trajectory goes without its signal or
gets two. An error raised inside the scoring itself (mentorrl's own code) is raised in the driver.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import ray
import torch
from ray.exceptions import GetTimeoutError, RayTaskError

from mentorrl.config import ConfigError, DistributedConfig, TeacherConfig
from mentorrl.distributed.ray_workers import (
    ACTOR_START_TIMEOUT_S,
    actor_options,
    gather_shares,
    init_ray,
    kill_actor,
    shares,
)
from mentorrl.trajectory import Trajectory

TEACHER_ACTOR_CPUS = 1.0  # a teacher actor runs its forward passes with one torch thread


@ray.remote(num_cpus=TEACHER_ACTOR_CPUS)
class TeacherActor:
    """One copy of a teacher, loaded from its checkpoint; scores shares of trajectories."""

    def __init__(self, path: str, student_tokenizer, teacher: TeacherConfig):
        from mentorrl.opd.scoring import teacher_from_checkpoint

        torch.set_num_threads(1)
        self.teacher = teacher_from_checkpoint(Path(path), student_tokenizer, teacher)

    def ping(self) -> int:
        import os

        return os.getpid()

    def row(self, trajs: list[Trajectory], top_k: int | None, skip_cross: bool) -> list:
        from mentorrl.opd.scoring import teacher_row

        return teacher_row(self.teacher, trajs, top_k, skip_cross)


def check_cpus(dist: DistributedConfig, teachers: int) -> None:
    """``teacher_workers`` actors per teacher must find free CPUs now (a Ray actor without one waits forever):
    the cluster's free CPUs, after the actors already running (idle rollout actors of an earlier stage too)."""
    init_ray(dist)
    need = teachers * dist.teacher_workers * TEACHER_ACTOR_CPUS
    free = ray.available_resources().get("CPU", 0.0)
    if free < need:
        raise ConfigError(
            f"distributed.teacher_workers: {dist.teacher_workers} actors for each of {teachers} "
            f"teacher(s) need {need:g} free CPUs, the Ray cluster has {free:g} free "
            f"({ray.cluster_resources().get('CPU', 0.0):g} in all; rollout actors of earlier stages "
            "keep theirs until the process ends, or mentorrl.distributed.ray_workers.kill_idle_actors())"
        )


class RayTeacher:
    """A teacher served by ``dist.teacher_workers`` actors; :meth:`row` is :func:`teacher_row` over them."""

    def __init__(self, dist: DistributedConfig, path: Path, student_tokenizer, teacher: TeacherConfig):
        init_ray(dist)
        self.dist, self.name = dist, teacher.name
        self._args = (str(path), student_tokenizer, teacher)
        self.actors = [self._new_actor() for _ in range(dist.teacher_workers)]
        self.replaced = 0
        try:  # fail with a reason, not a hang, when the cluster has no free CPU for them
            ray.get([a.ping.remote() for a in self.actors], timeout=ACTOR_START_TIMEOUT_S)
        except GetTimeoutError as e:
            self.close()
            raise RuntimeError(
                f"teacher {self.name!r}: its {len(self.actors)} actor(s) did not start in "
                f"{ACTOR_START_TIMEOUT_S:.0f} s; check `ray status` for free CPUs"
            ) from e

    def _new_actor(self):
        return TeacherActor.options(**actor_options()).remote(*self._args)

    def row(self, trajs: Sequence[Trajectory], top_k: int | None, skip_cross: bool = False) -> list[tuple[Any, ...]]:
        """``teacher_row(teacher, trajs, top_k, skip_cross)``, scored by the actors in contiguous shares."""
        trajs = list(trajs)
        parts = [(i, p) for i, p in enumerate(shares(len(trajs), len(self.actors))) if len(p)]

        def submit(i: int, part: range):
            return self.actors[i].row.remote(trajs[part.start : part.stop], top_k, skip_cross)

        def retryable(i: int, e: BaseException) -> None:
            if isinstance(e, RayTaskError):  # raised inside the scoring (mentorrl's own code): it would again
                raise e

        def replace(i: int, e: BaseException) -> None:  # the actor is gone (killed, OOM, node lost)
            kill_actor(self.actors[i])
            self.actors[i] = self._new_actor()
            self.replaced += 1

        out = gather_shares(parts, submit, retryable, replace, self.dist.actor_restarts, f"teacher {self.name!r}")
        return [x for i, _ in parts for x in out[i]]

    def close(self) -> None:
        for a in self.actors:
            kill_actor(a)
        self.actors = []
