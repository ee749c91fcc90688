"""The ``external:`` section: GRPO on an agent that runs in its own harness (``stage: external``).

The stage serves the policy over an OpenAI-compatible endpoint in recording mode, launches the
user's agent command once per (task, sample) and trains on the recorded tokens with the rewards the
harness posts (docs/bring-your-agent.md). Its loss settings are GRPO's (the section extends
:class:`~mentorrl.config.rl.GRPOConfig`); the hard-task pool and expert guidance are not available
(the expert's demonstration would be in the contract's rendering, not the agent's)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from mentorrl.config.rl import GRPOConfig

MAX_ARGV = 64
MAX_ARG_CHARS = 4096


class ExternalConfig(GRPOConfig):
    defaults: ClassVar[dict[str, Any]] = {
        "steps": 10,
        "tasks_per_step": 4,
        "samples_per_task": 4,
        "updates_per_step": 1,
        "optim": {"lr": 5e-4},
    }

    agent: list[str] = Field(
        default_factory=list,
        description="the agent command as an argv list (no shell), run once per (task, sample) with "
        "OPENAI_BASE_URL, OPENAI_API_KEY, MENTORRL_EPISODE_ID, MENTORRL_TASK_ID, MENTORRL_TASK (JSON) "
        "and MENTORRL_REWARD_URL in its environment",
    )
    mode: Literal["episode", "worker"] = Field(
        "episode",
        description="episode: the agent command is started once per episode; worker: it is started once "
        "(MENTORRL_WORKER=1) and serves every episode it is sent on stdin, concurrency at a time "
        "(docs/bring-your-agent.md#worker-mode)",
    )
    reward: Literal["verifier", "agent"] = Field(
        "verifier",
        description="verifier: each recorded episode is replayed through the environment and scored by its "
        "verifier with the run's reward weights (the in-process reward; the episode ends where an "
        "in-process one would); agent: the reward the harness posts",
    )
    concurrency: int = Field(4, ge=1, le=256, description="episodes running at once (agent processes, or a worker's)")
    episode_timeout_s: float = Field(
        300.0, gt=0, le=86_400, description="an agent still running after this is killed (its episode dropped)"
    )
    reward_timeout_s: float = Field(
        10.0, ge=0, le=3600, description="after the agent exits, how long its episode's reward may take to arrive"
    )
    reward_file: str | None = Field(
        None,
        description="also read rewards from this JSONL file ({episode_id, reward, details?} per line), "
        "e.g. written by the harness instead of posting to the reward endpoint",
    )
    min_group: int = Field(2, ge=2, description="a task's group trains only with at least this many rewarded episodes")
    max_completions: int = Field(64, ge=1, le=4096, description="chat completions one episode may make")
    max_episode_tokens: int = Field(
        16_384, ge=16, le=1_048_576, description="tokens one episode may record (all its segments)"
    )
    output_chars: int = Field(
        2000, ge=0, le=100_000, description="the tail of a failed agent's stderr kept in RUN_DIR/external/"
    )

    @field_validator("agent")
    @classmethod
    def _bounded_argv(cls, v: list[str]) -> list[str]:
        if len(v) > MAX_ARGV or any(len(a) > MAX_ARG_CHARS or "\x00" in a for a in v):
            raise ValueError(f"at most {MAX_ARGV} arguments of at most {MAX_ARG_CHARS} characters, without NUL")
        return v

    @model_validator(mode="after")
    def _supported(self) -> "ExternalConfig":
        if self.hard_pool is not None or self.hard_pool_state:
            raise ValueError("external.hard_pool is not supported (the external stage draws tasks uniformly)")
        if self.dynamic_sampling is not None:
            raise ValueError("external.dynamic_sampling is not supported (the agent's episodes are not redrawn)")
        if self.guide != "none":
            raise ValueError("external.guide must be none (an expert demonstration is not in the agent's rendering)")
        if self.min_group > self.samples_per_task:
            raise ValueError("external.min_group must be at most external.samples_per_task")
        return self


__all__ = ["ExternalConfig"]
