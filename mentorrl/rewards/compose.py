"""Reward composition: hard constraints first, soft terms only rank within a tier.

    tier  = -1   if the verifier found a violated hard constraint (forbidden side effect)
             0   if the task was not accomplished
            +1   if the task was accomplished (judged from environment state)
    soft  = w_tool * tool + w_format * format + w_runtime * runtime      in (-0.5, 0.5)
    total = tier + soft

Because |soft| < 0.5 by construction (checked when the weights are built), no amount of
formatting or tool hygiene lifts a failure to a success, or a violation to a failure.
"""

from __future__ import annotations

from typing import Iterable

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mentorrl.envs.base import Verdict
from mentorrl.trajectory import RewardBreakdown, ToolCall


class RewardWeights(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tool: float = Field(0.1, ge=0.0, description="weight of the share of tool calls that succeeded")
    format: float = Field(0.1, ge=0.0, description="weight of ending with a well-formed final answer")
    runtime: float = Field(0.2, ge=0.0, description="weight of the runtime penalty term (which is in [-1, 0])")
    error_penalty: float = Field(0.25, ge=0.0, le=1.0, description="runtime penalty per failed or malformed tool call")
    truncation_penalty: float = Field(0.5, ge=0.0, le=1.0, description="runtime penalty when the episode hit a limit")

    @model_validator(mode="after")
    def _soft_terms_stay_inside_a_tier(self) -> "RewardWeights":
        if self.tool + self.format >= 0.5 or self.runtime >= 0.5:
            raise ValueError(
                "reward weights: tool + format and runtime must each be < 0.5 so soft terms never "
                f"cross a tier (got tool+format={self.tool + self.format:g}, runtime={self.runtime:g})"
            )
        return self


def compose_reward(
    verdict: Verdict,
    tool_calls: Iterable[ToolCall],
    finish_reason: str,
    weights: RewardWeights,
) -> RewardBreakdown:
    calls = list(tool_calls)
    n_err = sum(not c.ok for c in calls)
    tool = (len(calls) - n_err) / len(calls) if calls else 1.0
    fmt = 1.0 if finish_reason == "answer" else 0.0
    runtime = -min(1.0, n_err * weights.error_penalty + (0.0 if finish_reason == "answer" else weights.truncation_penalty))
    tier = -1.0 if verdict.violations else (1.0 if verdict.success else 0.0)
    soft = weights.tool * tool + weights.format * fmt + weights.runtime * runtime
    return RewardBreakdown(
        task=1.0 if (verdict.success and not verdict.violations) else 0.0,
        tool=tool,
        runtime=runtime,
        format=fmt,
        success=bool(verdict.success and not verdict.violations),
        violations=list(verdict.violations),
        total=tier + soft,
        details={**verdict.details, "tool_errors": n_err, "tier": tier},
    )
