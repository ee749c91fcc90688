"""Reward composition: hard constraints first; soft terms only rank successes.

    total = -1                 if the verifier found a violated hard constraint
             0                 if the task was not accomplished (judged from environment state)
             1 + soft          if it was, where
    soft  = w_tool * tool + w_format * format + w_runtime * runtime      in (-0.5, 0.5)

Because |soft| < 0.5 by construction (checked when the weights are built), no amount of
formatting or tool hygiene lifts a failure to a success. Soft terms are *not* paid on
failures: when they were, a weak policy learned to answer at once without calling any tool
(no failed calls, a well-formed ending: positive soft reward, zero task success) -- the
demo's GRPO run found that hack within four steps. The breakdown still records every term.
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
    success = bool(verdict.success and not verdict.violations)
    tier = -1.0 if verdict.violations else (1.0 if success else 0.0)
    soft = weights.tool * tool + weights.format * fmt + weights.runtime * runtime if success else 0.0
    return RewardBreakdown(
        task=1.0 if success else 0.0,
        tool=tool,
        runtime=runtime,
        format=fmt,
        success=success,
        violations=list(verdict.violations),
        total=tier + soft,
        details={**verdict.details, "tool_errors": n_err, "tier": tier},
    )
