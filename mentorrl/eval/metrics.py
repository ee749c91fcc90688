"""Evaluation metrics over trajectories: success with a Wilson interval, tool success, turns; and the
mean of a per-seed quantity with a Student-t interval (:func:`mean_interval`)."""

from __future__ import annotations

import math
import statistics
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
        k: {"n": len(v), "success": sum(bool(t.reward and t.reward.success) for t in v) / len(v)}
        for k, v in sorted(groups.items())
    }
    return out


# two-sided 95% Student-t quantiles by degrees of freedom (1..30); the normal 1.96 beyond
_T95 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)


def t95(dof: int) -> float:
    """The two-sided 95% quantile of Student's t with ``dof`` degrees of freedom (``dof >= 1``)."""
    if dof < 1:
        raise ValueError(f"t95: need dof >= 1, got {dof}")
    return _T95[dof - 1] if dof <= len(_T95) else 1.96


def mean_interval(values: Sequence[float]) -> dict[str, Any]:
    """Mean, sample sd and the Student-t 95% interval of the mean of per-seed values (e.g. a lift
    in points, or one arm minus another on the same seed). One value has no spread: ``sd`` and
    ``ci95`` are None. ``verdict`` says whether the interval excludes 0 ("higher" / "lower") or
    holds it ("no difference")."""
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("mean_interval: no values")
    if not all(math.isfinite(v) for v in vals):
        raise ValueError(f"mean_interval: non-finite value in {vals}")
    mean = statistics.fmean(vals)
    if len(vals) < 2:
        return {"n": 1, "mean": mean, "sd": None, "ci95": None, "verdict": "one seed: no interval"}
    sd = statistics.stdev(vals)
    half = t95(len(vals) - 1) * sd / math.sqrt(len(vals))
    lo, hi = mean - half, mean + half
    verdict = "higher" if lo > 0 else ("lower" if hi < 0 else "no difference")
    return {"n": len(vals), "mean": mean, "sd": sd, "ci95": (lo, hi), "verdict": verdict}
