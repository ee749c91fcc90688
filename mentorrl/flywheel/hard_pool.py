"""Hard-task pool: failed tasks come back to later rollouts more often.

Notes: “把 bad case 作为 Hard Task Pool，提高这些任务在后续 Rollout 中的采样概率” -- a failed task
is a seed for new on-policy rollouts, not a fixed training example. The pool keeps a decayed
failure score per task id:

* every :meth:`HardTaskPool.update` first multiplies all scores by ``decay`` (old failures
  fade), then adds 1 per failed trajectory and multiplies a task's score by
  ``1 - success_relief`` per successful one; entries under ``min_score`` are dropped;
* :meth:`HardTaskPool.sample` draws tasks with weight ``1 + boost * score`` (1 for tasks not
  in the pool), and never lets pooled tasks take more than ``max_share`` of a draw, so the
  rest of the task distribution keeps being trained on.

Sampling is deterministic given the ``random.Random`` (or seed) passed in, and the pool's
state round-trips through :meth:`state_dict` / :meth:`load_state_dict` for checkpoints.
"""

from __future__ import annotations

import math
import random
from typing import Any, Iterable, Sequence

from pydantic import BaseModel, ConfigDict

from mentorrl.config import HardPoolConfig
from mentorrl.core import trace
from mentorrl.envs.base import Task
from mentorrl.trajectory import Trajectory

STATE_VERSION = 1


class PoolEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    score: float = 0.0
    failures: int = 0
    attempts: int = 0
    last_update: int = 0


class HardTaskPool:
    """Failed task ids with decayed scores; samples tasks with a raised rate for them."""

    def __init__(self, config: HardPoolConfig | None = None):
        self.config = config or HardPoolConfig()
        self.entries: dict[str, PoolEntry] = {}
        self.updates = 0

    # ------------------------------------------------------------------ recording --
    def update(self, trajectories: Iterable[Trajectory]) -> None:
        """Decay all scores, then record the failures and successes of one batch."""
        cfg = self.config
        self.updates += 1
        for e in self.entries.values():
            e.score *= cfg.decay
        for t in trajectories:
            entry = self.entries.get(t.task_id)
            if trace.is_success(t):
                if entry is not None:
                    entry.score *= 1.0 - cfg.success_relief
                    entry.attempts += 1
                continue
            if entry is None:
                entry = self.entries[t.task_id] = PoolEntry()
            entry.score = min(cfg.max_score, entry.score + 1.0)
            entry.failures += 1
            entry.attempts += 1
            entry.last_update = self.updates
        self.entries = {k: e for k, e in self.entries.items() if e.score >= cfg.min_score}

    def score(self, task_id: str) -> float:
        e = self.entries.get(task_id)
        return e.score if e is not None else 0.0

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, task_id: object) -> bool:
        return task_id in self.entries

    def hard_task_ids(self) -> list[str]:
        """Pooled task ids, highest score first."""
        return sorted(self.entries, key=lambda k: (-self.entries[k].score, k))

    # ------------------------------------------------------------------- sampling --
    def weight(self, task_id: str) -> float:
        return 1.0 + self.config.boost * self.score(task_id)

    def sample(
        self, tasks: Sequence[Task], n: int, rng: random.Random | int | None = None, replace: bool | None = None
    ) -> list[Task]:
        """Draw ``n`` tasks, pooled tasks at a raised rate, at most ``floor(max_share * n)`` of them
        from the pool (more only if the others run out).

        ``replace``: draw with replacement (default: only when ``n`` exceeds the number of tasks).
        """
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n == 0:
            return []
        if not tasks:
            raise ValueError("cannot sample from an empty task list")
        replace = n > len(tasks) if replace is None else replace
        if not replace and n > len(tasks):
            raise ValueError(f"cannot draw {n} distinct tasks from {len(tasks)}")
        rng = rng if isinstance(rng, random.Random) else random.Random(rng)
        weights = [self.weight(t.id) for t in tasks]
        hard = [t.id in self.entries for t in tasks]
        quota = math.floor(self.config.max_share * n)
        available = [True] * len(tasks)
        out: list[Task] = []
        n_hard = 0
        for _ in range(n):
            allow_hard = n_hard < quota
            idx = [i for i in range(len(tasks)) if available[i] and (allow_hard or not hard[i])]
            if not idx:  # only pooled tasks are left: the cap yields to the requested size
                idx = [i for i in range(len(tasks)) if available[i]]
            i = _weighted_choice(idx, weights, rng)
            out.append(tasks[i])
            n_hard += hard[i]
            if not replace:
                available[i] = False
        return out

    # --------------------------------------------------------------- checkpointing --
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "config": self.config.model_dump(),
            "updates": self.updates,
            "entries": {k: e.model_dump() for k, e in sorted(self.entries.items())},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"hard-task pool state version {state.get('version')!r}; expected {STATE_VERSION}")
        self.config = HardPoolConfig.model_validate(state["config"])
        self.updates = int(state["updates"])
        self.entries = {k: PoolEntry.model_validate(v) for k, v in state["entries"].items()}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "HardTaskPool":
        pool = cls()
        pool.load_state_dict(state)
        return pool


def _weighted_choice(idx: list[int], weights: list[float], rng: random.Random) -> int:
    total = sum(weights[i] for i in idx)
    x = rng.random() * total
    for i in idx:
        x -= weights[i]
        if x < 0:
            return i
    return idx[-1]  # rounding


__all__ = ["HardPoolConfig", "HardTaskPool", "PoolEntry"]
