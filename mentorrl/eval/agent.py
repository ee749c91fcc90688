"""Agent evaluation metrics over trajectories: outcome, reliability, process, cost, safety, judges.

Everything here is a pure function of recorded :class:`~mentorrl.trajectory.Trajectory`
objects (several samples per task allowed, grouped by ``task_id``); the verifier's
``reward.success`` is the ground truth and a judge's verdict, when present, is only compared
with it. :func:`agent_metrics` reports every metric overall, per task family and per
difficulty.

Reliability over ``n`` samples of a task with ``c`` successes:

- pass@k (at least one of k tries succeeds; unbiased estimator, Chen et al. 2021):
  ``1 - C(n-c, k) / C(n, k)``;
- pass^k (all k tries succeed; tau-bench's reliability): ``C(c, k) / C(n, k)``;

both averaged over tasks. A k larger than the fewest samples any task in the group has is
not reported (the estimators are undefined there).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from pydantic import BaseModel, ConfigDict

from mentorrl.core import trace
from mentorrl.eval.metrics import wilson_interval
from mentorrl.trajectory import Trajectory


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class JudgeAgreement(_Out):
    """How a judge's verdicts line up with the verifier's (the verifier is the ground truth)."""

    n: int  # trajectories carrying a judge verdict
    threshold: float  # the judge "says success" when success_prob >= threshold
    agreement: float  # share of trajectories where judge and verifier agree
    kappa: float | None  # Cohen's kappa; None when undefined (both always say the same single label)
    judge_pass_verifier_fail: int  # the dangerous disagreement: judge fooled by a claim
    judge_fail_verifier_pass: int
    judge_success_rate: float  # share the judge calls successful
    mean_success_prob: float


class GroupMetrics(_Out):
    """All agent metrics for one group of trajectories (overall, a family or a difficulty)."""

    n: int  # trajectories
    n_tasks: int  # distinct task ids
    samples_per_task: int  # fewest samples any task in the group has
    success: float  # task success rate over trajectories (verifier)
    success_ci95: tuple[float, float]  # Wilson interval of ``success``
    pass_at_1: float  # mean over tasks of c / n
    pass_at_k: dict[int, float]  # unbiased pass@k for each reported k
    pass_hat_k: dict[int, float]  # pass^k (all k samples succeed) for each reported k
    tool_calls: int
    tool_success: float  # share of tool calls that succeeded (1.0 with no calls)
    invalid_call_rate: float  # share of tool calls that were malformed / unknown tool / bad arguments
    mean_steps: float  # policy turns per trajectory
    mean_total_tokens: float  # prompt + policy + observation tokens
    mean_policy_tokens: float
    mean_latency_s: float
    loop_rate: float  # share of trajectories that repeat identical calls (trace.is_loop)
    n_with_error: int  # trajectories with at least one failed tool call
    recovery_rate: float | None  # of those, share that later succeeded with a call and the task; None if none
    violation_rate: float  # share with a hard-constraint (safety) violation
    mean_reward: float
    judge: JudgeAgreement | None = None  # only when some trajectory carries a judge verdict


class AgentReport(_Out):
    overall: GroupMetrics
    by_family: dict[str, GroupMetrics]
    by_difficulty: dict[str, GroupMetrics]


# ------------------------------------------------------------ reliability ------
def _check_counts(n: int, c: int, k: int) -> None:
    if k < 1:
        raise ValueError(f"k must be >= 1, not {k}")
    if not 0 <= c <= n:
        raise ValueError(f"successes c={c} must lie in [0, n={n}]")
    if k > n:
        raise ValueError(f"k={k} exceeds the n={n} samples of the task")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one task: probability that k of its n samples, drawn without
    replacement, contain at least one success: ``1 - C(n-c, k) / C(n, k)``."""
    _check_counts(n, c, k)
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_hat_k(n: int, c: int, k: int) -> float:
    """pass^k for one task (tau-bench): probability that k of its n samples, drawn without
    replacement, are all successes: ``C(c, k) / C(n, k)``."""
    _check_counts(n, c, k)
    return math.comb(c, k) / math.comb(n, k)


@dataclass(frozen=True)
class TaskOutcome:
    """How the samples of one task went: n samples, c verifier successes, and the first success."""

    task_id: str
    n: int
    successes: int
    first_success: int | None  # 1-based sample index of the first success, None if none

    @property
    def rate(self) -> float:
        return self.successes / self.n if self.n else 0.0


def task_results(trajs: Iterable[Trajectory]) -> dict[str, TaskOutcome]:
    """task_id -> :class:`TaskOutcome`, in first-seen order, samples counted in the order given."""
    counts: dict[str, list] = {}
    for t in trajs:
        rec = counts.setdefault(t.task_id, [0, 0, None])
        rec[0] += 1
        if trace.is_success(t):
            rec[1] += 1
            rec[2] = rec[2] or rec[0]
    return {k: TaskOutcome(k, n, c, first) for k, (n, c, first) in counts.items()}


def task_outcomes(trajs: Iterable[Trajectory]) -> dict[str, tuple[int, int]]:
    """task_id -> (samples n, verifier successes c), in first-seen order."""
    return {k: (o.n, o.successes) for k, o in task_results(trajs).items()}


def mean_over_tasks(
    outcomes: dict[str, tuple[int, int]], k: int, estimator: Callable[[int, int, int], float]
) -> float | None:
    """Average ``estimator(n, c, k)`` over tasks; None when some task has fewer than k samples."""
    if not outcomes or any(n < k for n, _ in outcomes.values()):
        return None
    return sum(estimator(n, c, k) for n, c in outcomes.values()) / len(outcomes)


# ------------------------------------------------------------ judge vs verifier ------
def cohen_kappa(pairs: Sequence[tuple[bool, bool]]) -> float | None:
    """Cohen's kappa between two binary raters; None when chance agreement is 1 (undefined)."""
    n = len(pairs)
    if n == 0:
        return None
    observed = sum(a == b for a, b in pairs) / n
    pa = sum(a for a, _ in pairs) / n
    pb = sum(b for _, b in pairs) / n
    expected = pa * pb + (1 - pa) * (1 - pb)
    if expected >= 1.0 - 1e-12:
        return None
    return (observed - expected) / (1 - expected)


def judge_agreement(trajs: Sequence[Trajectory], threshold: float = 0.5) -> JudgeAgreement | None:
    """Compare judge verdicts with the verifier on the trajectories that carry both; None if none do."""
    judged = [t for t in trajs if t.judge is not None and t.reward is not None]
    if not judged:
        return None
    pairs = [(t.judge.success_prob >= threshold, trace.is_success(t)) for t in judged]
    n = len(pairs)
    return JudgeAgreement(
        n=n,
        threshold=threshold,
        agreement=sum(j == v for j, v in pairs) / n,
        kappa=cohen_kappa(pairs),
        judge_pass_verifier_fail=sum(j and not v for j, v in pairs),
        judge_fail_verifier_pass=sum(v and not j for j, v in pairs),
        judge_success_rate=sum(j for j, _ in pairs) / n,
        mean_success_prob=sum(t.judge.success_prob for t in judged) / n,
    )


# ------------------------------------------------------------ one group ------
def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def group_metrics(trajs: Sequence[Trajectory], ks: Sequence[int] = (1,), judge_threshold: float = 0.5) -> GroupMetrics:
    """Every metric for one group of trajectories. ``ks``: the k of pass@k / pass^k to report."""
    if any(k < 1 for k in ks):
        raise ValueError(f"every k must be >= 1, got {list(ks)}")
    n = len(trajs)
    outcomes = task_outcomes(trajs)
    succ = sum(trace.is_success(t) for t in trajs)
    calls = [c for t in trajs for c in t.tool_calls]
    recovered = [r for r in (trace.recovered_after_error(t) for t in trajs) if r is not None]
    at_k: dict[int, float] = {}
    hat_k: dict[int, float] = {}
    for k in sorted(set(ks)):
        p, q = mean_over_tasks(outcomes, k, pass_at_k), mean_over_tasks(outcomes, k, pass_hat_k)
        if p is not None and q is not None:
            at_k[k], hat_k[k] = p, q
    return GroupMetrics(
        n=n,
        n_tasks=len(outcomes),
        samples_per_task=min((m for m, _ in outcomes.values()), default=0),
        success=succ / n if n else 0.0,
        success_ci95=wilson_interval(succ, n),
        pass_at_1=_mean([c / m for m, c in outcomes.values()]),
        pass_at_k=at_k,
        pass_hat_k=hat_k,
        tool_calls=len(calls),
        tool_success=sum(c.ok for c in calls) / len(calls) if calls else 1.0,
        invalid_call_rate=sum(trace.invalid_calls(t) for t in trajs) / len(calls) if calls else 0.0,
        mean_steps=_mean([t.num_turns for t in trajs]),
        mean_total_tokens=_mean([trace.total_tokens(t) for t in trajs]),
        mean_policy_tokens=_mean([t.num_policy_tokens for t in trajs]),
        mean_latency_s=_mean([trace.latency_s(t) for t in trajs]),
        loop_rate=_mean([trace.is_loop(t) for t in trajs]),
        n_with_error=len(recovered),
        recovery_rate=sum(recovered) / len(recovered) if recovered else None,
        violation_rate=_mean([trace.has_violation(t) for t in trajs]),
        mean_reward=_mean([t.reward.total for t in trajs if t.reward is not None]) if n else 0.0,
        judge=judge_agreement(trajs, judge_threshold),
    )


def _grouped(trajs: Sequence[Trajectory], key: Callable[[Trajectory], str]) -> dict[str, list[Trajectory]]:
    groups: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        groups[key(t)].append(t)
    return dict(sorted(groups.items()))


def agent_metrics(trajs: Sequence[Trajectory], ks: Sequence[int] = (1,), judge_threshold: float = 0.5) -> AgentReport:
    """Every metric overall, per task family and per difficulty."""

    def metrics(group: Sequence[Trajectory]) -> GroupMetrics:
        return group_metrics(group, ks, judge_threshold)

    return AgentReport(
        overall=metrics(trajs),
        by_family={k: metrics(v) for k, v in _grouped(trajs, lambda t: t.family).items()},
        by_difficulty={k: metrics(v) for k, v in _grouped(trajs, lambda t: t.difficulty).items()},
    )


__all__ = [
    "AgentReport",
    "GroupMetrics",
    "JudgeAgreement",
    "agent_metrics",
    "cohen_kappa",
    "group_metrics",
    "judge_agreement",
    "mean_over_tasks",
    "pass_at_k",
    "pass_hat_k",
    "task_outcomes",
    "task_results",
    "TaskOutcome",
]
