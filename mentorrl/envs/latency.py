"""Seeded, heavy-tailed tool latency, so the straggler effect can be measured on one machine.

Real agent tools (search, databases, sandboxes) have long-tailed latency: most calls are fast
and a few take many times the median. :class:`LatencyModel` describes the distribution
(log-normal or Pareto, optionally per tool); :class:`LatencySampler` draws one delay per call
from an RNG seeded by the model's seed and the episode's seed, so the same task sees the
same delays whatever the thread timing. The delay is slept *inside* the tool call, and it
counts towards the tool timeout by its drawn value, not by the clock: a delay of at least
``env.tool_timeout_s`` is a timeout (the caller waits the timeout, the tool never runs), a
shorter one never causes one, so whether a call times out never depends on the machine's load.

With ``repeats: independent`` the k-th episode of a task *in this process* draws stream k: the
same in two uninterrupted runs of one configuration, but a resumed run (a new process) and each
Ray rollout actor count afresh, so their delays, and the timeouts they decide, may differ from
an uninterrupted single-process run's.
"""

from __future__ import annotations

import math
import random
import threading
from collections import Counter

from mentorrl.config.env import LatencyModel


class Occurrences:
    """How many episodes of each (latency seed, task seed) this process started (thread-safe)."""

    def __init__(self) -> None:
        self._counts: Counter = Counter()
        self._lock = threading.Lock()

    def next(self, key: tuple) -> int:
        """The number of earlier calls with ``key``."""
        with self._lock:
            k = self._counts[key]
            self._counts[key] += 1
            return k


_OCCURRENCES = Occurrences()


class LatencySampler:
    """Draws the delay of each tool call; call :meth:`reset` with the episode's seed first."""

    def __init__(self, model: LatencyModel):
        self.model = model
        self.rng = random.Random(model.seed)

    def reset(self, episode_seed: int, occurrence: int = 0) -> None:
        self.rng = random.Random(f"{self.model.seed}:{episode_seed}:{occurrence}")

    def start_episode(self, task_seed: int) -> None:
        """Reset for a new episode of the task with ``task_seed``, following ``model.repeats``.

        With ``independent`` (default) the samples of a GRPO group each draw their own delays,
        as calls to a real tool would; a group whose members all stalled together would hide
        the straggler effect being measured."""
        occurrence = 0 if self.model.repeats == "same" else _OCCURRENCES.next((self.model.seed, task_seed))
        self.reset(task_seed, occurrence)

    def __call__(self, tool: str) -> float:
        m = self.model
        if m.kind == "lognormal":
            d = m.median_s * math.exp(m.sigma * self.rng.gauss(0.0, 1.0))
        else:
            scale = m.median_s / 2 ** (1 / m.alpha)
            d = scale / (1.0 - self.rng.random()) ** (1 / m.alpha)
        return min(m.max_s, d * m.per_tool.get(tool, 1.0))
