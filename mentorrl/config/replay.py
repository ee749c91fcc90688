"""The replay buffer's section (:class:`mentorrl.replay.buffer.ReplayBuffer` is built from it)."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, field_validator

CATEGORIES: tuple[str, ...] = ("success", "failure", "hard")  # a replay entry's category


class ReplayConfig(BaseModel):
    """Capacity, sampling priorities, staleness and admission filters of a :class:`ReplayBuffer`."""

    model_config = ConfigDict(extra="forbid")

    capacity: int = Field(10_000, ge=1, description="most entries kept; the oldest (by insertion) are evicted")
    category_weights: dict[str, float] = Field(
        default_factory=lambda: {"success": 1.0, "failure": 0.5, "hard": 2.0},
        description="sampling weight per category; a category left out weighs 1.0, 0 never samples it",
    )
    staleness_decay: float = Field(
        1.0, gt=0.0, le=1.0, description="weight factor per policy version of age: decay ** (current - version)"
    )
    max_staleness: int | None = Field(
        None, ge=0, description="entries more than this many versions old are not sampled; null: keep all"
    )
    min_reward: float | None = Field(None, description="reject reward.total below this; null: no filter")
    max_tokens: int | None = Field(
        None, ge=0, description="reject num_policy_tokens above this unless the trajectory succeeded; null: no filter"
    )
    advantage_threshold: float | None = Field(
        None, ge=0.0, description="when add() gets an advantage, reject |advantage| below this; null: no filter"
    )

    @field_validator("category_weights")
    @classmethod
    def _known_nonnegative(cls, v: dict[str, float]) -> dict[str, float]:
        unknown = set(v) - set(CATEGORIES)
        if unknown:
            raise ValueError(f"unknown categories {sorted(unknown)}; expected a subset of {list(CATEGORIES)}")
        bad = {k: w for k, w in v.items() if not (w >= 0.0 and math.isfinite(w))}
        if bad:
            raise ValueError(f"category weights must be finite and >= 0, got {bad}")
        return v

    def weight_of(self, category: str) -> float:
        return self.category_weights.get(category, 1.0)


__all__ = ["CATEGORIES", "ReplayConfig"]
