"""The ``reward:`` section: the weights :func:`mentorrl.rewards.compose.compose_reward` composes with."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class RewardWeights(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tool: float = Field(0.1, ge=0.0, description="weight of the share of tool calls that succeeded")
    format: float = Field(0.1, ge=0.0, description="weight of ending with a well-formed final answer")
    runtime: float = Field(0.2, ge=0.0, description="weight of the runtime penalty term (which is in [-1, 0])")
    verbosity: float = Field(0.1, ge=0.0, description="weight of the verbosity penalty term (which is in [-1, 0])")
    error_penalty: float = Field(0.25, ge=0.0, le=1.0, description="runtime penalty per failed or malformed tool call")
    redundant_penalty: float = Field(
        0.25,
        ge=0.0,
        le=1.0,
        description="runtime penalty per call identical (same tool and arguments) to an earlier successful call",
    )
    truncation_penalty: float = Field(0.5, ge=0.0, le=1.0, description="runtime penalty when the episode hit a limit")
    answer_budget_chars: int = Field(
        200, ge=1, description="final-answer length (characters) free of verbosity penalty"
    )
    verbosity_scale_chars: int = Field(
        400, ge=1, description="characters beyond the budget at which the verbosity penalty reaches its cap (-1)"
    )

    @model_validator(mode="after")
    def _soft_terms_stay_inside_a_tier(self) -> "RewardWeights":
        if self.tool + self.format >= 0.5 or self.runtime + self.verbosity >= 0.5:
            raise ValueError(
                "reward weights: tool + format and runtime + verbosity must each be < 0.5 so soft terms never "
                f"cross a tier (got tool+format={self.tool + self.format:g}, "
                f"runtime+verbosity={self.runtime + self.verbosity:g})"
            )
        return self


__all__ = ["RewardWeights"]
