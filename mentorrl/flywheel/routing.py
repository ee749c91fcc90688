"""Routing: which training method each failure type feeds.

The notes ("SFT + RL 效果不好：Bad Case 如何回流训练") give four destinations: a model that
cannot do it gets corrected SFT; one that can but often chooses wrong gets preference data or
RL; one that breaks down over long chains gets long-horizon trajectories + RL; and when the
calls are right but the reward still disagrees, the reward/verifier is fixed. Default table:

==================  =================  =============================================================
failure type        method             why (notes)
==================  =================  =============================================================
FORMAT_ERROR        targeted_sft       basic behaviour the model does not know (FORMAT_ERROR -> SFT)
ARGUMENT_ERROR      targeted_sft       basic behaviour (ARGUMENT_ERROR -> SFT)
TOOL_SELECTION      targeted_sft       basic behaviour (UNKNOWN_TOOL -> SFT); the notes send a wrong
                                       choice among known tools to preference/RL -- override the row
                                       if most of yours are of that kind
PLANNING            preference_or_rl   knows the tools, chooses the wrong path (WRONG_ACTION)
PREMATURE_STOP      preference_or_rl   could continue, chose to stop
ERROR_RECOVERY      preference_or_rl   the failing and the recovering path are both within reach
STATE_TRACKING      long_horizon_rl    long-chain decision making (STATE_TRACKING_ERROR -> AGENT_RL)
LOOP                long_horizon_rl    a long-horizon failure: the policy loses track of progress
REWARD_HACK         reward_fix         the reward or verifier has a hole; more training amplifies it
==================  =================  =============================================================

What each method produces in the flywheel (see :data:`METHOD_OUTPUTS`): targeted SFT gets
corrected trajectories (re-run from scratch by the expert or a teacher), preference/RL gets
(chosen = corrected, rejected = failed) pairs, long-horizon RL gets no offline data, and a
reward fix goes to a person with the evidence. Every failed task except the reward-fix ones
also goes to the hard-task pool for on-policy rollouts; reward-fix cases are deliberately
kept out of training data (training on a hackable reward amplifies the hack).
"""

from __future__ import annotations

from enum import Enum
from typing import Iterable

from pydantic import BaseModel, ConfigDict, Field, model_validator
from rich.table import Table

from mentorrl.flywheel.attribution import PRECEDENCE, Attribution, FailureDistribution, FailureType


class TrainingMethod(str, Enum):
    TARGETED_SFT = "targeted_sft"
    PREFERENCE_OR_RL = "preference_or_rl"
    LONG_HORIZON_RL = "long_horizon_rl"
    REWARD_FIX = "reward_fix"


METHOD_OUTPUTS: dict[TrainingMethod, str] = {
    TrainingMethod.TARGETED_SFT: "corrected SFT data + hard-task pool",
    TrainingMethod.PREFERENCE_OR_RL: "preference pairs + hard-task pool",
    TrainingMethod.LONG_HORIZON_RL: "hard-task pool (multi-rollout RL)",
    TrainingMethod.REWARD_FIX: "reward/verifier review; no training",
}

# methods whose failures get a corrected trajectory built for them
CORRECTION_METHODS = frozenset({TrainingMethod.TARGETED_SFT, TrainingMethod.PREFERENCE_OR_RL})

DEFAULT_ROUTES: dict[FailureType, TrainingMethod] = {
    FailureType.FORMAT_ERROR: TrainingMethod.TARGETED_SFT,
    FailureType.ARGUMENT_ERROR: TrainingMethod.TARGETED_SFT,
    FailureType.TOOL_SELECTION: TrainingMethod.TARGETED_SFT,
    FailureType.PLANNING: TrainingMethod.PREFERENCE_OR_RL,
    FailureType.PREMATURE_STOP: TrainingMethod.PREFERENCE_OR_RL,
    FailureType.ERROR_RECOVERY: TrainingMethod.PREFERENCE_OR_RL,
    FailureType.STATE_TRACKING: TrainingMethod.LONG_HORIZON_RL,
    FailureType.LOOP: TrainingMethod.LONG_HORIZON_RL,
    FailureType.REWARD_HACK: TrainingMethod.REWARD_FIX,
}


class RoutingTable(BaseModel):
    """Failure type -> training method; every type must be routed."""

    model_config = ConfigDict(extra="forbid")

    routes: dict[FailureType, TrainingMethod] = Field(default_factory=lambda: dict(DEFAULT_ROUTES))

    @model_validator(mode="after")
    def _complete(self) -> "RoutingTable":
        missing = [ft.value for ft in PRECEDENCE if ft not in self.routes]
        if missing:
            raise ValueError(f"routing table: no method for {', '.join(missing)}")
        return self

    @classmethod
    def with_overrides(cls, overrides: Iterable[str]) -> "RoutingTable":
        """The default table with ``TYPE=method`` overrides, e.g. ``TOOL_SELECTION=preference_or_rl``."""
        routes = dict(DEFAULT_ROUTES)
        for item in overrides:
            name, sep, method = item.partition("=")
            try:
                if not sep:
                    raise ValueError
                routes[FailureType(name.strip().upper())] = TrainingMethod(method.strip().lower())
            except ValueError:
                raise ValueError(
                    f"bad route {item!r}: expected TYPE=METHOD with TYPE in "
                    f"{', '.join(ft.value for ft in PRECEDENCE)} and METHOD in "
                    f"{', '.join(m.value for m in TrainingMethod)}"
                ) from None
        return cls(routes=routes)

    def method(self, failure_type: FailureType) -> TrainingMethod:
        return self.routes[failure_type]

    def route(self, attributions: Iterable[Attribution]) -> dict[TrainingMethod, list[Attribution]]:
        """Attributions grouped by the method their failure type is routed to (all methods present)."""
        out: dict[TrainingMethod, list[Attribution]] = {m: [] for m in TrainingMethod}
        for a in attributions:
            out[self.method(a.failure_type)].append(a)
        return out


def routing_rows(dist: FailureDistribution, table: RoutingTable) -> list[dict[str, object]]:
    """One row per failure type (in precedence order): count, share, method and what it produces."""
    rows = []
    for ft in PRECEDENCE:
        method = table.method(ft)
        rows.append(
            {
                "failure_type": ft.value,
                "count": dist.overall.counts[ft.value],
                "share": dist.overall.shares[ft.value],
                "method": method.value,
                "produces": METHOD_OUTPUTS[method],
            }
        )
    return rows


def routing_rich_table(dist: FailureDistribution, table: RoutingTable) -> Table:
    out = Table(title=f"Failure types ({dist.overall.n} failed trajectories) and routing")
    for col, justify in (
        ("failure type", "left"),
        ("count", "right"),
        ("share", "right"),
        ("method", "left"),
        ("produces", "left"),
    ):
        out.add_column(col, justify=justify)  # type: ignore[arg-type]
    for row in routing_rows(dist, table):
        out.add_row(
            str(row["failure_type"]),
            str(row["count"]),
            f"{float(row['share']):.0%}",
            str(row["method"]),
            str(row["produces"]),
        )
    return out


__all__ = [
    "CORRECTION_METHODS",
    "DEFAULT_ROUTES",
    "METHOD_OUTPUTS",
    "RoutingTable",
    "TrainingMethod",
    "routing_rich_table",
    "routing_rows",
]
