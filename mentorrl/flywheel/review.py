"""Review sampling for trajectories that have no user feedback.

Notes (“没有用户反馈时如何有效抽检”): random.sample fills a review queue with easy successes.
Instead the queue is built in four passes, each deterministic for a given seed:

1. **Mandatory** -- every trajectory whose final answer claims success
   (:func:`~mentorrl.core.trace.claims_success`) while the verifier says it failed. These are
   the failure modes the evaluation system does not see; they are always queued, even past
   the budget. (With ``flags_mandatory`` the uncertainty and anomaly flags are mandatory too.)
2. **Bucket minimums** -- trajectories are bucketed by (family, success, tools used, length
   band); every bucket gets at least ``per_bucket_min`` items (a smaller bucket is taken
   whole), drawn by risk weight inside the bucket. Coverage is a guarantee, so this pass may
   also exceed the budget.
3. **Flags** -- judge-uncertain trajectories (success probability inside ``uncertainty_band``)
   and anomalies (repeated calls, consecutive tool errors, steps or tokens above the batch's
   P99), highest risk first, while the budget lasts.
4. **Risk sampling** -- the rest of the budget by weighted sampling without replacement,
   weight = product of the risk factors that apply (failure, long, tool error, high tokens,
   low judge confidence, hard-constraint violation).

Each queue entry lists every reason that applies to it, its risk score and a short summary.
"""

from __future__ import annotations

import math
import random
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mentorrl.core import trace
from mentorrl.trajectory import Trajectory, read_models_jsonl, write_models_jsonl

DISAGREEMENT = "claimed_success_verifier_failed"


class RiskWeights(BaseModel):
    """Multiplicative sampling weights (notes: failure x5, long x3, tool error x3, tokens x2, judge x4)."""

    model_config = ConfigDict(extra="forbid")

    failure: float = Field(5.0, gt=0.0)
    long: float = Field(3.0, gt=0.0)
    tool_error: float = Field(3.0, gt=0.0)
    high_tokens: float = Field(2.0, gt=0.0)
    low_judge_confidence: float = Field(4.0, gt=0.0)
    violation: float = Field(3.0, gt=0.0)


class ReviewConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    budget: int = Field(50, ge=0, description="target queue size (mandatory items and bucket minimums may exceed it)")
    per_bucket_min: int = Field(2, ge=0, description="items per bucket; smaller buckets are taken whole")
    seed: int = 0
    weights: RiskWeights = Field(default_factory=RiskWeights)
    length_edges: tuple[int, int] = Field((2, 4), description="turn counts that end the short and medium bands")
    high_tokens_quantile: float = Field(0.9, gt=0.0, lt=1.0, description="tokens above this batch quantile are 'high'")
    judge_confidence_threshold: float = Field(
        0.7, ge=0.5, le=1.0, description="a judge is unconfident when max(p, 1 - p) is below this"
    )
    uncertainty_band: tuple[float, float] = Field(
        (0.4, 0.6), description="judge success probabilities flagged as uncertain"
    )
    repeated_calls_min: int = Field(2, ge=1, description="anomaly: at least this many calls repeat an earlier one")
    consecutive_errors_min: int = Field(2, ge=1, description="anomaly: at least this many tool errors in a row")
    length_quantile: float = Field(
        0.99, gt=0.0, lt=1.0, description="anomaly: steps or tokens above this batch quantile"
    )
    flags_mandatory: bool = Field(False, description="queue uncertain and anomalous trajectories even past the budget")

    @model_validator(mode="after")
    def _ordered(self) -> "ReviewConfig":
        lo, hi = self.uncertainty_band
        if not 0.0 <= lo <= hi <= 1.0:
            raise ValueError(f"uncertainty_band must satisfy 0 <= lo <= hi <= 1, got {self.uncertainty_band}")
        if self.length_edges[0] > self.length_edges[1]:
            raise ValueError(f"length_edges must be increasing, got {self.length_edges}")
        return self


class ReviewSummary(BaseModel):
    model_config = ConfigDict(extra="forbid")

    final_answer: str | None
    tools: list[str]
    reward: float | None
    success: bool
    violations: list[str]
    finish_reason: str
    num_turns: int
    tokens: int
    judge_success_prob: float | None = None


class ReviewEntry(BaseModel):
    """One trajectory in the review queue."""

    model_config = ConfigDict(extra="forbid")

    trajectory_id: str
    task_id: str
    family: str
    bucket: str
    reasons: list[str]
    risk_score: float
    risk_factors: list[str]
    summary: ReviewSummary


# ------------------------------------------------------------ batch statistics ----
def quantile(values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile (a value of the sample; 0.0 for an empty sample)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return float(ordered[max(0, math.ceil(q * len(ordered)) - 1)])


@dataclass(frozen=True)
class BatchStats:
    """Batch-relative thresholds: anomalies are judged against the batch they came in."""

    p_steps: float
    p_tokens: float
    high_tokens: float

    @classmethod
    def of(cls, trajs: Sequence[Trajectory], config: ReviewConfig) -> "BatchStats":
        steps = [float(t.num_turns) for t in trajs]
        tokens = [float(trace.total_tokens(t)) for t in trajs]
        return cls(
            p_steps=quantile(steps, config.length_quantile),
            p_tokens=quantile(tokens, config.length_quantile),
            high_tokens=quantile(tokens, config.high_tokens_quantile),
        )


# ------------------------------------------------------------- per trajectory -----
def bucket_key(traj: Trajectory, config: ReviewConfig) -> str:
    """``family|ok-or-fail|tools|length band``, the stratum a trajectory is sampled in."""
    tools = "+".join(sorted(trace.tools_used(traj))) or "no_tools"
    outcome = "ok" if trace.is_success(traj) else "fail"
    return f"{traj.family}|{outcome}|{tools}|{trace.length_band(traj, config.length_edges)}"


def is_disagreement(traj: Trajectory) -> bool:
    """The agent's answer claims success while the verifier says the task failed."""
    return traj.reward is not None and not traj.reward.success and trace.claims_success(traj.final_answer)


def judge_uncertain(traj: Trajectory, config: ReviewConfig) -> bool:
    if traj.judge is None:
        return False
    lo, hi = config.uncertainty_band
    return lo <= traj.judge.success_prob <= hi


def anomalies(traj: Trajectory, stats: BatchStats, config: ReviewConfig) -> list[str]:
    """Anomaly reasons (``anomaly:<rule>``) that apply to ``traj``."""
    out = []
    if trace.repeated_calls(traj) >= config.repeated_calls_min:
        out.append("anomaly:repeated_calls")
    if trace.max_consecutive_errors(traj) >= config.consecutive_errors_min:
        out.append("anomaly:consecutive_tool_errors")
    if traj.num_turns > stats.p_steps:
        out.append("anomaly:steps_above_p99")
    if trace.total_tokens(traj) > stats.p_tokens:
        out.append("anomaly:tokens_above_p99")
    return out


def risk_factors(traj: Trajectory, stats: BatchStats, config: ReviewConfig) -> dict[str, float]:
    """The risk factors that apply, with their multiplicative weights."""
    w = config.weights
    out: dict[str, float] = {}
    if not trace.is_success(traj):
        out["failure"] = w.failure
    if trace.length_band(traj, config.length_edges) == "long":
        out["long"] = w.long
    if trace.tool_errors(traj) > 0:
        out["tool_error"] = w.tool_error
    if trace.total_tokens(traj) > stats.high_tokens:
        out["high_tokens"] = w.high_tokens
    p = traj.judge.success_prob if traj.judge is not None else None
    if p is not None and max(p, 1 - p) < config.judge_confidence_threshold:
        out["low_judge_confidence"] = w.low_judge_confidence
    if trace.has_violation(traj):
        out["violation"] = w.violation
    return out


def summarize(traj: Trajectory, answer_chars: int = 200) -> ReviewSummary:
    answer = traj.final_answer
    if answer is not None and len(answer) > answer_chars:
        answer = answer[: answer_chars - 3] + "..."
    return ReviewSummary(
        final_answer=answer,
        tools=[c.name or "?" for c in traj.tool_calls],
        reward=traj.reward.total if traj.reward is not None else None,
        success=trace.is_success(traj),
        violations=list(traj.reward.violations) if traj.reward is not None else [],
        finish_reason=traj.finish_reason,
        num_turns=traj.num_turns,
        tokens=trace.total_tokens(traj),
        judge_success_prob=traj.judge.success_prob if traj.judge is not None else None,
    )


@dataclass
class _Assessed:
    traj: Trajectory
    bucket: str
    weight: float
    factors: list[str]
    flags: list[str]  # disagreement, uncertainty and anomaly reasons
    reasons: list[str] = field(default_factory=list)  # why it was chosen (filled during selection)


def _assess(traj: Trajectory, stats: BatchStats, config: ReviewConfig) -> _Assessed:
    factors = risk_factors(traj, stats, config)
    flags = [DISAGREEMENT] if is_disagreement(traj) else []
    if judge_uncertain(traj, config):
        flags.append(f"judge_uncertain(p={traj.judge.success_prob:.2f})")  # type: ignore[union-attr]
    flags += anomalies(traj, stats, config)
    return _Assessed(traj, bucket_key(traj, config), math.prod(factors.values()), sorted(factors), flags)


def _weighted_order(items: Sequence[_Assessed], rng: random.Random) -> list[_Assessed]:
    """Weighted random order without replacement (Efraimidis-Spirakis keys log(u) / w)."""
    keyed = [(math.log(1.0 - rng.random()) / a.weight, i) for i, a in enumerate(items)]
    return [items[i] for _, i in sorted(keyed, key=lambda k: (-k[0], k[1]))]


# ------------------------------------------------------------------- the queue ----
def build_review_queue(trajectories: Iterable[Trajectory], config: ReviewConfig | None = None) -> list[ReviewEntry]:
    """Choose trajectories for human review; the same trajectories and seed give the same queue.

    Input order does not matter (trajectories are processed by id); ids must be unique.
    """
    config = config or ReviewConfig()
    trajs = sorted(trajectories, key=lambda t: t.id)
    dup = sorted(i for i, k in Counter(t.id for t in trajs).items() if k > 1)
    if dup:
        raise ValueError(f"duplicate trajectory ids: {dup[:5]}")
    stats = BatchStats.of(trajs, config)
    items = [_assess(t, stats, config) for t in trajs]
    rng = random.Random(config.seed)
    chosen: dict[str, _Assessed] = {}

    def take(a: _Assessed, reason: str | None = None) -> None:
        if a.traj.id not in chosen:
            a.reasons = list(a.flags)
            chosen[a.traj.id] = a
        if reason is not None and reason not in a.reasons:
            a.reasons.append(reason)

    # 1. mandatory
    for a in items:
        if DISAGREEMENT in a.flags or (config.flags_mandatory and a.flags):
            take(a)

    # 2. bucket minimums
    buckets: dict[str, list[_Assessed]] = defaultdict(list)
    for a in items:
        buckets[a.bucket].append(a)
    for name in sorted(buckets):
        members = buckets[name]
        need = min(config.per_bucket_min, len(members)) - sum(a.traj.id in chosen for a in members)
        if need <= 0:
            continue
        for a in _weighted_order([a for a in members if a.traj.id not in chosen], rng)[:need]:
            take(a, f"bucket_minimum:{name}")

    # 3. flagged (uncertain, anomalous), highest risk first
    flagged = sorted((a for a in items if a.flags and a.traj.id not in chosen), key=lambda a: (-a.weight, a.traj.id))
    for a in flagged[: max(0, config.budget - len(chosen))]:
        take(a)

    # 4. risk-weighted fill
    rest = [a for a in items if a.traj.id not in chosen]
    for a in _weighted_order(rest, rng)[: max(0, config.budget - len(chosen))]:
        take(a, f"risk_sample(weight={a.weight:g})")

    return [
        ReviewEntry(
            trajectory_id=a.traj.id,
            task_id=a.traj.task_id,
            family=a.traj.family,
            bucket=a.bucket,
            reasons=a.reasons,
            risk_score=a.weight,
            risk_factors=a.factors,
            summary=summarize(a.traj),
        )
        for a in chosen.values()
    ]


def reason_kind(reason: str) -> str:
    """A reason without its parameters: ``bucket_minimum:<bucket>`` -> ``bucket_minimum``,
    ``risk_sample(weight=3)`` -> ``risk_sample``; anomaly reasons keep their rule name."""
    if reason.startswith("anomaly:"):
        return reason
    return reason.split("(")[0].split(":")[0]


def write_review_queue(path: str | Path, entries: Iterable[ReviewEntry]) -> int:
    return write_models_jsonl(path, entries)


def read_review_queue(path: str | Path) -> list[ReviewEntry]:
    return list(read_models_jsonl(path, ReviewEntry))


__all__ = [
    "DISAGREEMENT",
    "BatchStats",
    "ReviewConfig",
    "ReviewEntry",
    "ReviewSummary",
    "RiskWeights",
    "anomalies",
    "bucket_key",
    "build_review_queue",
    "is_disagreement",
    "judge_uncertain",
    "quantile",
    "read_review_queue",
    "reason_kind",
    "risk_factors",
    "summarize",
    "write_review_queue",
]
