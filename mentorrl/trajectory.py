"""The one record every stage passes: a trajectory of token ids with its provenance.

A trajectory is stored token-in/token-out: ``token_ids`` is exactly what the policy saw
and produced, ``loss_mask`` is 1 only where the policy generated the token, and
``logprobs`` holds the behaviour log-probability of each generated token (0.0 elsewhere).
The learner trains on these ids and never re-tokenises rendered text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

ErrorKind = Literal["malformed", "unknown_tool", "bad_arguments", "tool_exception", "timeout", "policy", "not_found"]


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ToolCall(_Record):
    """One tool call the policy made, with what came back."""

    turn: int
    name: str | None  # None when the call could not even be parsed
    arguments: dict[str, Any] | None
    raw: str  # the text between the tool-call tags, as generated
    result: Any = None  # parsed tool output when the call succeeded
    error: str | None = None  # message shown to the policy when it failed
    error_kind: ErrorKind | None = None
    latency_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


class Segment(_Record):
    """A contiguous span of ``token_ids`` and who wrote it."""

    role: Literal["prompt", "policy", "observation"]
    start: int
    end: int  # exclusive


class RewardBreakdown(_Record):
    """Reward terms. ``total`` is composed by :func:`mentorrl.rewards.compose.compose_reward`."""

    task: float = 0.0  # 1.0 iff the verifier says the task is done, from environment state
    tool: float = 0.0  # share of tool calls that succeeded (1.0 with no calls)
    runtime: float = 0.0  # <= 0: penalty for malformed / failed calls and truncation
    format: float = 0.0  # 1.0 when the episode ended with a well-formed final answer
    success: bool = False
    violations: list[str] = Field(default_factory=list)  # hard constraints broken
    total: float = 0.0
    details: dict[str, Any] = Field(default_factory=dict)


class JudgeVerdict(_Record):
    """What a judge (LLM or rule-based) said about a trajectory; the verifier stays authoritative."""

    judge: str  # name of the judge that produced it
    success_prob: float = Field(ge=0.0, le=1.0)  # the judge's probability that the task was done
    scores: dict[str, float] = Field(default_factory=dict)  # rubric dimensions, each in [0, 1]
    reason: str = ""


class Trajectory(_Record):
    id: str
    task_id: str
    family: str
    split: str = "train"
    difficulty: str = "normal"
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    segments: list[Segment] = Field(default_factory=list)
    policy_version: int = 0
    env_name: str
    env_version: str
    sampling: dict[str, Any] = Field(default_factory=dict)
    contract_fingerprint: str = ""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    final_answer: str | None = None
    finish_reason: Literal["answer", "max_turns", "max_tokens", "length"] = "answer"
    num_turns: int = 0
    reward: RewardBreakdown | None = None
    timings: dict[str, float] = Field(default_factory=dict)
    source: Literal["policy", "expert", "teacher"] = "policy"
    judge: JudgeVerdict | None = None

    @model_validator(mode="after")
    def _lengths_agree(self) -> "Trajectory":
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.logprobs) != n:
            raise ValueError(
                f"trajectory {self.id}: token_ids ({n}), loss_mask ({len(self.loss_mask)}) "
                f"and logprobs ({len(self.logprobs)}) must have the same length"
            )
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError(f"trajectory {self.id}: loss_mask must hold only 0 and 1")
        return self

    @property
    def num_policy_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def tool_success_rate(self) -> float:
        return sum(c.ok for c in self.tool_calls) / len(self.tool_calls) if self.tool_calls else 1.0

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, line: str) -> "Trajectory":
        return cls.model_validate_json(line)


M = TypeVar("M", bound=BaseModel)


def write_models_jsonl(path: str | Path, records: Iterable[BaseModel], append: bool = False) -> int:
    """One pydantic record per line; returns how many were written."""
    n = 0
    with open(path, "a" if append else "w", encoding="utf-8") as f:
        for r in records:
            f.write(r.model_dump_json() + "\n")
            n += 1
    return n


def read_models_jsonl(path: str | Path, cls: type[M]) -> Iterator[M]:
    """Records of ``cls``, one per non-blank line; a bad line fails with its file and line number."""
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield cls.model_validate_json(line)
                except ValueError as e:  # pydantic.ValidationError is a ValueError
                    raise ValueError(f"{path}:{i}: not a valid {cls.__name__}: {e}") from e


def write_jsonl(path: str | Path, trajectories: Iterable[Trajectory], append: bool = False) -> int:
    return write_models_jsonl(path, trajectories, append)


def read_jsonl(path: str | Path) -> Iterator[Trajectory]:
    return read_models_jsonl(path, Trajectory)


def dumps_compact(obj: Any) -> str:
    """The one JSON rendering used for tool arguments and tool results in prompts."""
    return json.dumps(obj, separators=(", ", ": "), ensure_ascii=False)
