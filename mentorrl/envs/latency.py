"""Seeded, heavy-tailed tool latency, so the straggler effect can be measured on one machine.

Real agent tools (search, databases, sandboxes) have long-tailed latency: most calls are fast
and a few take many times the median. :class:`LatencyModel` describes the distribution
(log-normal or Pareto, optionally per tool); :class:`LatencySampler` draws one delay per call
from an RNG seeded by the model's seed and the episode's seed, so the same task sees the
same delays whatever the thread timing. The delay is slept *inside* the tool call, so the
tool timeout applies to it like to any slow tool.
"""

from __future__ import annotations

import math
import random
import threading
from collections import Counter
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class LatencyModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["lognormal", "pareto"] = Field("lognormal", description="distribution of the per-call delay")
    median_s: float = Field(0.02, gt=0, description="median delay in seconds")
    sigma: float = Field(1.0, gt=0, description="log-normal: std of log(delay); 1.0 puts P99 at ~10x the median")
    alpha: float = Field(1.5, gt=0, description="Pareto tail index; smaller is heavier (alpha <= 2: infinite variance)")
    max_s: float = Field(30.0, gt=0, description="cap on one delay")
    seed: int = Field(0, description="combined with each episode's seed")
    per_tool: dict[str, float] = Field(default_factory=dict, description="multiplier of the delay per tool name")
    repeats: Literal["independent", "same"] = Field(
        "independent", description="independent: each episode of a task draws its own delays (the k-th episode of a "
                                   "task in this process uses stream k); same: every episode of a task sees the same")

    def quantile(self, q: float) -> float:
        """The delay at quantile ``q`` of the (uncapped, unscaled) distribution."""
        if self.kind == "lognormal":
            from statistics import NormalDist

            return self.median_s * math.exp(self.sigma * NormalDist().inv_cdf(q))
        scale = self.median_s / 2 ** (1 / self.alpha)  # Pareto with this median
        return scale / (1 - q) ** (1 / self.alpha)


_occurrences: Counter = Counter()
_occurrences_lock = threading.Lock()


def _next_occurrence(key: tuple) -> int:
    with _occurrences_lock:
        k = _occurrences[key]
        _occurrences[key] += 1
        return k


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
        occurrence = 0 if self.model.repeats == "same" else _next_occurrence((self.model.seed, task_seed))
        self.reset(task_seed, occurrence)

    def __call__(self, tool: str) -> float:
        m = self.model
        if m.kind == "lognormal":
            d = m.median_s * math.exp(m.sigma * self.rng.gauss(0.0, 1.0))
        else:
            scale = m.median_s / 2 ** (1 / m.alpha)
            d = scale / (1.0 - self.rng.random()) ** (1 / m.alpha)
        return min(m.max_s, d * m.per_tool.get(tool, 1.0))
