"""A curriculum task source for self-evolving loops: it raises the difficulty level when the
windowed success rate exceeds ``raise_above`` and lowers it when it drops below ``lower_below``.

Levels are lists of tasks, easiest first (for ``orders``, e.g. normal single-action families,
normal multi-action families, adversarial tasks). After every level change the window starts
empty, so a level is judged only on its own outcomes. The state round-trips through
``state_dict`` / ``load_state_dict`` for resumable runs.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any, Sequence


class Curriculum:
    def __init__(
        self,
        levels: Sequence[Sequence[Any]],
        raise_above: float = 0.6,
        lower_below: float = 0.2,
        window: int = 64,
        start: int = 0,
        seed: int = 0,
    ):
        if not levels or any(len(level) == 0 for level in levels):
            raise ValueError("a curriculum needs at least one level, and every level needs tasks")
        if not 0.0 <= lower_below < raise_above <= 1.0:
            raise ValueError(f"need 0 <= lower_below < raise_above <= 1, got {lower_below}, {raise_above}")
        if window < 1 or not 0 <= start < len(levels):
            raise ValueError("window must be >= 1 and start a valid level")
        self.levels = [list(level) for level in levels]
        self.raise_above, self.lower_below, self.window = raise_above, lower_below, window
        self.level = start
        self.outcomes: deque[bool] = deque(maxlen=window)
        self.history: list[tuple[int, int]] = []  # (outcomes seen so far, new level)
        self.seen = 0
        self.rng = random.Random(seed)

    def sample(self, n: int) -> list[Any]:
        """``n`` tasks from the current level (with replacement when the level is smaller)."""
        pool = self.levels[self.level]
        return self.rng.sample(pool, n) if n <= len(pool) else [self.rng.choice(pool) for _ in range(n)]

    @property
    def success_rate(self) -> float | None:
        return sum(self.outcomes) / len(self.outcomes) if self.outcomes else None

    def observe(self, successes: Sequence[bool]) -> int:
        """Record verified outcomes of the current level's tasks; returns the (possibly new) level."""
        for s in successes:
            self.outcomes.append(bool(s))
            self.seen += 1
            if len(self.outcomes) < self.window:
                continue
            rate = self.success_rate
            move = 1 if rate > self.raise_above else (-1 if rate < self.lower_below else 0)
            new = min(max(self.level + move, 0), len(self.levels) - 1)
            if new != self.level:
                self.level = new
                self.outcomes.clear()
                self.history.append((self.seen, new))
        return self.level

    def state_dict(self) -> dict[str, Any]:
        return {
            "level": self.level,
            "outcomes": list(self.outcomes),
            "history": self.history,
            "seen": self.seen,
            "rng": self.rng.getstate(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.level, self.seen = state["level"], state["seen"]
        self.outcomes = deque(state["outcomes"], maxlen=self.window)
        self.history = [tuple(h) for h in state["history"]]
        rng_state = state["rng"]
        self.rng.setstate((rng_state[0], tuple(rng_state[1]), rng_state[2]))
