"""The rollout contract's sections: sampling, prompt format and episode limits (used by
:mod:`mentorrl.contract`, which re-exports them)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(1.0, ge=0.0, description="0 means greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling (keep 1.0 for on-policy RL)")
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    max_new_tokens: int = Field(96, ge=1, description="per policy turn")


class PromptFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tool_descriptions: bool = Field(True, description="list tools with their descriptions (false: signatures only)")
    system_turn: bool = Field(
        True, description="render the system turn (role, rules, tools); false: the policy learns the tools from data"
    )
    native_tools: bool = Field(
        True,
        description="a checkpoint template that renders tools itself (hermes, llama3_json) gets the tool schemas "
        "even with system_turn false, which then drops only the system prompt (the model was trained to see "
        "its tools there); false: no tools= either, the policy learns them from data",
    )
    tool_format: str = Field(
        "auto",
        min_length=1,
        description="how conversations are rendered and tool calls written: auto (a checkpoint whose chat template "
        "renders tools in a known family keeps it: hermes for Qwen2.5/Hermes <tool_call> templates, llama3_json for "
        "Llama 3.1; otherwise mentorrl's ChatML template replaces it), mentorrl, hermes or llama3_json",
    )


class ContractLimits(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_turns: int = Field(8, ge=1, description="policy turns per trajectory")
    max_total_tokens: int = Field(
        1024,
        ge=16,
        description="an episode's tokens: the task's message, all turns and observations, plus the system turn "
        "(system prompt and tool schemas, not counted here, so adding tools does not shrink the episode); "
        "the whole is capped by the model's context (the tokenizer's model_max_length)",
    )


__all__ = ["ContractLimits", "PromptFormat", "SamplingParams"]
