"""Regression gate: a new checkpoint may not lose success on the golden and regression sets.

The gate compares per-set task success of a new checkpoint with its baseline (the
previous accepted checkpoint), evaluated on the same tasks with the same seeds. A set whose
success drops by more than its tolerance (absolute, in success-rate units) rejects the
checkpoint; so does a gated set that is missing from the new evaluation or was evaluated
on different tasks, seeds or sampling settings (the gate fails closed). Everything here
is pure; :mod:`mentorrl.cli.eval` evaluates checkpoints and calls it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

GATED_KINDS: tuple[str, ...] = ("golden", "regression")
_EPS = 1e-9  # success rates are ratios of small integers; don't reject on float noise


class GateError(ValueError):
    """The inputs cannot be gated at all (nothing to compare, malformed summary, bad tolerance)."""


class GateConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tolerance: float = Field(0.02, ge=0.0, le=1.0, description="largest allowed absolute drop in success")
    per_set: dict[str, float] = Field(default_factory=dict, description="set name -> its own tolerance")
    kinds: tuple[str, ...] = Field(GATED_KINDS, description="kinds of evaluation set the gate checks")


@dataclass(frozen=True)
class SetResult:
    """What the gate needs from one set's evaluation."""

    name: str
    kind: str
    success: float
    n: int  # trajectories
    fingerprint: str = ""  # identity of tasks + seeds + sampling; "" when unknown (not checked)


class SetComparison(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    kind: str
    baseline: float | None
    new: float | None
    delta: float | None  # new - baseline
    tolerance: float
    passed: bool
    reason: str | None = None


class GateDecision(BaseModel):
    model_config = ConfigDict(extra="forbid")

    accepted: bool
    reasons: list[str]  # why it was rejected (empty when accepted)
    comparisons: list[SetComparison]

    def summary(self) -> str:
        if self.accepted:
            parts = [f"{c.name} {c.new:.1%} ({c.delta:+.1%})" for c in self.comparisons]
            return "ACCEPTED: " + ", ".join(parts)
        return "REJECTED: " + "; ".join(self.reasons)


def _compare(name: str, base: SetResult, new: SetResult | None, tol: float) -> SetComparison:
    def out(passed: bool, reason: str | None, new_success: float | None = None) -> SetComparison:
        delta = None if new_success is None else new_success - base.success
        return SetComparison(
            name=name,
            kind=base.kind,
            baseline=base.success,
            new=new_success,
            delta=delta,
            tolerance=tol,
            passed=passed,
            reason=reason,
        )

    if new is None:
        return out(False, f"{name}: missing from the new checkpoint's evaluation")
    if base.fingerprint and new.fingerprint and base.fingerprint != new.fingerprint:
        return out(
            False,
            f"{name}: not comparable, evaluated on different tasks, seeds or sampling "
            f"(fingerprint {new.fingerprint} vs baseline {base.fingerprint})",
            new.success,
        )
    drop = base.success - new.success
    if drop > tol + _EPS:
        return out(
            False,
            f"{name}: success fell from {base.success:.1%} to {new.success:.1%} (-{drop:.1%}, tolerance {tol:.1%})",
            new.success,
        )
    return out(True, None, new.success)


def gate_decision(
    new: Mapping[str, SetResult],
    baseline: Mapping[str, SetResult],
    tolerance: float = 0.02,
    per_set: Mapping[str, float] | None = None,
    kinds: Sequence[str] = GATED_KINDS,
) -> GateDecision:
    """Accept the new checkpoint iff no gated baseline set drops by more than its tolerance.

    The gated sets are the baseline's sets of a gated kind; ``per_set`` overrides the
    tolerance by set name. Raises :class:`GateError` when there is nothing to gate or a
    tolerance is out of range or names no gated set.
    """
    per_set = dict(per_set or {})
    for name, tol in {"(default)": tolerance, **per_set}.items():
        if not 0.0 <= tol <= 1.0:
            raise GateError(f"tolerance for {name} must lie in [0, 1], not {tol}")
    gated = [name for name, r in baseline.items() if r.kind in kinds]
    if not gated:
        raise GateError(f"the baseline has no {' or '.join(kinds)} set to gate on (sets: {sorted(baseline) or 'none'})")
    stray = sorted(set(per_set) - set(gated))
    if stray:
        raise GateError(f"per-set tolerance for {stray}, which is not a gated set of the baseline ({sorted(gated)})")
    comparisons = [_compare(n, baseline[n], new.get(n), per_set.get(n, tolerance)) for n in sorted(gated)]
    reasons = [c.reason for c in comparisons if not c.passed and c.reason]
    return GateDecision(accepted=not reasons, reasons=reasons, comparisons=comparisons)


def set_results(summary: Mapping[str, Any], source: str = "summary") -> dict[str, SetResult]:
    """Per-set results from an evaluation summary written by ``mentorrl eval``."""
    sets = summary.get("sets") if isinstance(summary, Mapping) else None
    if not isinstance(sets, Mapping):
        raise GateError(f"{source}: not an evaluation summary (no 'sets' object)")
    out: dict[str, SetResult] = {}
    for name, s in sets.items():
        try:
            overall = s["metrics"]["overall"]
            out[name] = SetResult(
                name=name,
                kind=str(s["kind"]),
                success=float(overall["success"]),
                n=int(overall["n"]),
                fingerprint=str(s.get("fingerprint", "")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise GateError(f"{source}: set {name!r} lacks kind / metrics.overall.success / n ({e})") from None
    return out


__all__ = [
    "GATED_KINDS",
    "GateConfig",
    "GateDecision",
    "GateError",
    "SetComparison",
    "SetResult",
    "gate_decision",
    "set_results",
]
