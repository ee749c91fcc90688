"""Evaluation metrics over trajectories: success with a Wilson interval, tool success, turns."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Sequence

from mentorrl.trajectory import Trajectory


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval for a binomial proportion.

    No trial (``n == 0``) says nothing about the proportion: the interval is all of ``[0, 1]``
    (it used to be ``(0, 0)``, a certainty of failure). ``successes`` must lie in ``[0, n]``."""
    if n < 0 or not 0 <= successes <= max(n, 0):
        raise ValueError(f"wilson_interval: need 0 <= successes <= n, got successes={successes}, n={n}")
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def summarize(trajs: Sequence[Trajectory]) -> dict[str, Any]:
    n = len(trajs)
    succ = sum(bool(t.reward and t.reward.success) for t in trajs)
    calls = [c for t in trajs for c in t.tool_calls]
    lo, hi = wilson_interval(succ, n)
    out: dict[str, Any] = {
        "n": n,
        "success": succ / n if n else 0.0,
        "success_ci95": [lo, hi],
        "tool_success": sum(c.ok for c in calls) / len(calls) if calls else 1.0,
        "tool_calls": len(calls),
        "mean_turns": sum(t.num_turns for t in trajs) / n if n else 0.0,
        "mean_reward": sum(t.reward.total for t in trajs if t.reward) / n if n else 0.0,
        "violation_rate": sum(bool(t.reward and t.reward.violations) for t in trajs) / n if n else 0.0,
        "mean_policy_tokens": sum(t.num_policy_tokens for t in trajs) / n if n else 0.0,
    }
    groups: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        groups[t.family].append(t)
        groups[f"difficulty:{t.difficulty}"].append(t)
    out["by_group"] = {
        k: {"n": len(v), "success": sum(bool(t.reward and t.reward.success) for t in v) / len(v)} for k, v in sorted(groups.items())
    }
    return out
