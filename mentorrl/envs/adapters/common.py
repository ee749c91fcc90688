"""What the adapters share: a seeded task source over a list of rows, an expert that says there is
none, registration under a name, and one background event loop for outside ``async`` code."""

from __future__ import annotations

import asyncio
import random
import threading
from typing import Any, Callable, Coroutine, Iterator, Sequence

from mentorrl.envs import EnvEntry, get_env, register_env
from mentorrl.envs.base import Action, Task

SPLITS = ("train", "heldout", "hidden")
SEED_BASE = {"train": 0, "heldout": 1 << 40, "hidden": 2 << 40}


class AdapterTasks:
    """``tasks(split, n, seed)`` over fixed rows per split: a seeded shuffle of the split's rows,
    repeated (each repeat a new task id and episode seed) until there are ``n``.

    ``rows[split]`` is a list of ``(prompt, reference)`` pairs; a split without rows is refused
    with a :class:`ValueError` naming the splits there are."""

    def __init__(self, name: str, rows: dict[str, Sequence[tuple[str, dict[str, Any]]]]):
        self.name = name
        self.rows = {k: list(v) for k, v in rows.items() if v}

    def tasks(self, split: str = "train", n: int = 64, seed: int = 0) -> list[Task]:
        if split not in self.rows:
            raise ValueError(f"environment {self.name!r} has no {split!r} split; it has {', '.join(self.rows)}")
        rows = self.rows[split]
        rng = random.Random(f"{self.name}/{split}/{seed}")
        out: list[Task] = []
        while len(out) < n:
            order = list(range(len(rows)))
            rng.shuffle(order)
            for i in order[: n - len(out)]:
                prompt, ref = rows[i]
                k = len(out)
                out.append(
                    Task(
                        id=f"{self.name}-{split}-{seed}-{k:05d}",
                        family=str(ref.get("family", self.name)),
                        split=split,
                        prompt=prompt,
                        seed=SEED_BASE.get(split, 3 << 40) + seed * 100_003 + k,
                        reference={**ref, "row": i},
                    )
                )
        return out


class NoExpert:
    """The expert of an adapted environment: there is none (SFT, RFT seeding and the reward audit
    need one; GRPO, PPO, evaluation and the black-box teachers do not)."""

    def __init__(self, name: str = "this environment"):
        self.name = name

    def act(self, task: Task) -> Iterator[Action]:
        raise NotImplementedError(
            f"{self.name} has no scripted expert: train it with RL stages (grpo, ppo) or a teacher, or pass "
            "make_expert= to the adapter's entry"
        )
        yield  # pragma: no cover - makes this a generator


def register_adapter(name: str, entry: Callable[[], EnvEntry]) -> None:
    """Register ``entry`` under ``name`` (``env: {name: ...}`` in a recipe). Registering the same name
    twice is a :class:`ValueError`, as :func:`mentorrl.envs.register_env` says."""
    register_env(name, entry)


def is_registered(name: str) -> bool:
    try:
        get_env(name)
    except ValueError:
        return False
    return True


class BackgroundLoop:
    """One event loop running on a daemon thread, started on first use (again if it was closed)."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def get(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._loop.is_closed():
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="mentorrl-adapters-loop", daemon=True).start()
                self._loop = loop
            return self._loop


_LOOP = BackgroundLoop()  # the one loop of run_async in this process


def run_async(value: Any, timeout_s: float | None = None) -> Any:
    """``value`` itself, or, when it is a coroutine, its result: run on one shared background event
    loop (so outside async code keeps one loop for its whole life, whichever thread calls)."""
    if not asyncio.iscoroutine(value):
        return value
    coro: Coroutine[Any, Any, Any] = value
    return asyncio.run_coroutine_threadsafe(coro, _LOOP.get()).result(timeout_s)


__all__ = ["AdapterTasks", "NoExpert", "register_adapter", "is_registered", "run_async", "SPLITS", "SEED_BASE"]
