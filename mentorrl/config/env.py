"""The ``env:`` section and the injected tool latency (:class:`LatencyModel`, sampled by
:mod:`mentorrl.envs.latency`)."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mentorrl.config.base import Section
from mentorrl.config.client import ClientConfig
from mentorrl.config.names import ENVIRONMENT, check_registered


class LatencyModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["lognormal", "pareto"] = Field("lognormal", description="distribution of the per-call delay")
    median_s: float = Field(0.02, gt=0, description="median delay in seconds")
    sigma: float = Field(1.0, gt=0, description="log-normal: std of log(delay); 1.0 puts P99 at ~10x the median")
    alpha: float = Field(1.5, gt=0, description="Pareto tail index; smaller is heavier (alpha <= 2: infinite variance)")
    max_s: float = Field(30.0, gt=0, description="cap on one delay")
    seed: int = Field(0, description="combined with each episode's seed")
    per_tool: dict[str, float] = Field(default_factory=dict, description="multiplier of the delay per tool name")
    repeats: Literal["independent", "same"] = Field(
        "independent",
        description="independent: each episode of a task draws its own delays (the k-th episode of a "
        "task in this process uses stream k); same: every episode of a task sees the same",
    )

    def quantile(self, q: float) -> float:
        """The delay at quantile ``q`` of the (uncapped, unscaled) distribution."""
        if self.kind == "lognormal":
            from statistics import NormalDist

            return self.median_s * math.exp(self.sigma * NormalDist().inv_cdf(q))
        scale = self.median_s / 2 ** (1 / self.alpha)  # Pareto with this median
        return scale / (1 - q) ** (1 / self.alpha)


class EnvConfig(Section):
    name: str = Field("orders", description="registered environment name")

    @field_validator("name")
    @classmethod
    def _registered(cls, v: str) -> str:
        return check_registered(ENVIRONMENT, v)  # a ValueError naming the registered environments

    id: str | None = Field(
        None,
        description="an installed environment to load by id (name: verifiers: its package or module, or a hub "
        "id owner/name); null: the registered environment `name` itself",
    )
    args: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments of the environment loaded by id (its config's fields)"
    )
    tool_timeout_s: float = Field(5.0, gt=0, description="per tool call")
    answer: Literal["typed", "free_text"] = Field(
        "typed",
        description="how the episode's final answer is read: typed (a final_answer tool call with a record, checked "
        "field by field; the default) or free_text (a heuristic sentence reader, for environments that support it; "
        "prints a warning at start: docs/integrity.md)",
    )
    latency: LatencyModel | None = Field(
        None, description="inject seeded heavy-tailed tool latency (log-normal or Pareto); null: none"
    )
    # ---- environments that read a benchmark clone (name: tau2; docs/bring-your-env.md#tau2-bench) ----
    path: str | None = Field(None, description="tau2: the user's clone of tau2-bench (its root directory)")
    domain: str | None = Field(None, description="tau2: the domain (retail, airline, telecom, or any in the clone)")
    split: str | None = Field(
        None, description="tau2: the benchmark split the train tasks come from (train, test, base; null: train)"
    )
    task_set: Literal["tasks", "small", "full"] = Field(
        "tasks",
        description="tau2: the domain's task file, by name (an allow-list, never a path): tasks (tasks.json), "
        "small (tasks_small.json), full (tasks_full.json; both telecom's); its splits are upstream's "
        "split_<file> beside it, else split_tasks.json (telecom's small set: env.split: small)",
    )
    python: str | None = Field(
        None,
        description="tau2: the interpreter that runs the domain (null: the clone's .venv/bin/python, else python3.12)",
    )
    user: Literal["scripted", "llm"] = Field(
        "scripted",
        description="tau2: who plays the customer: scripted (deterministic, from the task's scenario) or llm "
        "(user_client's model)",
    )
    user_client: ClientConfig | None = Field(None, description="tau2: the LLM user's OpenAI-compatible server")
    judge: ClientConfig | None = Field(
        None, description="tau2: the NL_ASSERTION judge's server; null: tasks with NL assertions are left out"
    )
    exclude_hackable: bool = Field(
        True, description="tau2: leave out of the task pool every task an audit attack scores full reward on"
    )
    max_user_turns: int = Field(10, ge=1, le=100, description="tau2: messages the user answers before leaving")
    solo: bool = Field(
        False,
        description="tau2: solo mode (telecom): the agent gets each task's ticket and the user's tools, and no user",
    )

    @model_validator(mode="after")
    def _clone_fields(self) -> "EnvConfig":
        if self.name != "tau2":
            for key in ("path", "domain", "split", "python", "user_client", "judge"):
                if getattr(self, key) is not None:
                    raise ValueError(f"{key}: only for name: tau2 (this environment is {self.name!r})")
            if self.solo:
                raise ValueError(f"solo: only for name: tau2 (this environment is {self.name!r})")
            if self.task_set != "tasks":
                raise ValueError(f"task_set: only for name: tau2 (this environment is {self.name!r})")
        elif self.user == "llm" and self.user_client is None:
            raise ValueError("user_client: user: llm needs the user's server (user_client: {base_url, model})")
        return self


__all__ = ["EnvConfig", "LatencyModel"]
