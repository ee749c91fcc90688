"""Corrected trajectories and preference pairs for routed failures, plus task recovery.

Notes: “不要直接把 bad trajectory 当成 SFT 正样本” -- a failed trajectory only locates the
problem. The correction is a new episode: the task is re-run **from scratch in a fresh
environment** by the scripted expert or a teacher (anything with the ``ExpertPolicy``
``act(task)`` protocol), verified by the environment, and kept only when the verifier
accepts it. Nothing of the failed trajectory (tokens, id, tool results) goes into it.

* targeted SFT: the corrected trajectory joins the SFT set (once per task);
* preference: a pair (chosen = corrected, rejected = failed) that share the prompt ids.

Task recovery: trajectories carry ``task_id`` only. :func:`find_tasks` regenerates tasks from
ids of the form ``{env}-{split}-{seed}-{index:05d}`` (the orders generator draws tasks one
after another from one seeded RNG, so ``tasks(split, n, seed)`` is a prefix of any longer
list and task ``i`` is ``tasks(split, i + 1, seed)[i]``); :func:`load_tasks_jsonl` reads
tasks written by :func:`write_tasks_jsonl` instead.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Mapping, Sequence

from pydantic import BaseModel, ConfigDict

from mentorrl.contract import (
    EFFECTIVE_BUDGET_KEY,
    ContractLimits,
    PromptFormat,
    RolloutContract,
    SamplingParams,
    contract_for_env,
)
from mentorrl.envs.base import Environment, ExpertPolicy, FinalAnswer, Task, ToolAction, final_answer_text
from mentorrl.eval.sets import read_tasks_jsonl, write_tasks_jsonl
from mentorrl.flywheel.attribution import Attribution, FailureType
from mentorrl.flywheel.routing import CORRECTION_METHODS, RoutingTable, TrainingMethod
from mentorrl.rewards.compose import RewardWeights
from mentorrl.rollout.episode import run_scripted_episode
from mentorrl.trajectory import ToolCall, Trajectory, dumps_compact, read_models_jsonl, write_models_jsonl

TASK_ID_RE = re.compile(r"^(?P<prefix>.+)-(?P<split>[A-Za-z]+)-(?P<seed>\d+)-(?P<index>\d+)$")


# ------------------------------------------------------------------ task recovery ----
def parse_task_id(task_id: str) -> tuple[str, int, int] | None:
    """``(split, seed, index)`` of a generated task id, or None when it has another shape."""
    m = TASK_ID_RE.match(task_id)
    return (m["split"], int(m["seed"]), int(m["index"])) if m else None


def find_tasks(env_entry: Any, task_ids: Iterable[str], max_index: int = 100_000) -> dict[str, Task]:
    """Regenerate the tasks behind ``task_ids``; ids that cannot be regenerated are left out.

    One ``tasks(split, n, seed)`` call per (split, seed) group, with ``n`` = largest index + 1;
    a regenerated task is kept only if its id is exactly the requested one.
    """
    groups: dict[tuple[str, int], set[tuple[int, str]]] = defaultdict(set)
    for tid in sorted(set(task_ids)):  # not hash order: the same in every process
        parsed = parse_task_id(tid)
        if parsed is not None and parsed[2] < max_index:
            split, seed, index = parsed
            groups[(split, seed)].add((index, tid))
    source = env_entry.make_tasks()
    found: dict[str, Task] = {}
    for (split, seed), wanted in sorted(groups.items()):
        try:
            generated = source.tasks(split=split, n=max(i for i, _ in wanted) + 1, seed=seed)
        except ValueError:  # e.g. a split this environment does not have
            continue
        for index, tid in wanted:
            if index < len(generated) and generated[index].id == tid:
                found[tid] = generated[index]
    return found


def load_tasks_jsonl(path: str | Path) -> dict[str, Task]:
    """Tasks by id from a tasks JSONL file (:func:`mentorrl.eval.sets.read_tasks_jsonl` validates it)."""
    return {t.id: t for t in read_tasks_jsonl(path)}


# -------------------------------------------------------------- reference traces ----
def expert_reference_calls(
    make_env: Callable[[], Environment], expert: ExpertPolicy, task: Task, max_steps: int = 32
) -> list[ToolCall] | None:
    """The expert's tool calls on ``task`` in a fresh environment, without a tokenizer.

    The reference for :func:`~mentorrl.flywheel.attribution.attribute`. None when the
    verifier rejects the expert's own episode (then it is no reference).
    """
    env = make_env()
    calls: list[ToolCall] = []
    final: str | None = None
    try:
        env.reset(task)
        gen = expert.act(task)
        action = next(gen)
        for turn in range(1, max_steps + 1):
            if isinstance(action, FinalAnswer):
                final = final_answer_text(env, action)
                break
            if not isinstance(action, ToolAction):
                raise TypeError(f"expert yielded {type(action).__name__}, not a ToolAction or FinalAnswer")
            result = env.step(action.name, action.arguments)
            calls.append(
                ToolCall(
                    turn=turn,
                    name=action.name,
                    arguments=dict(action.arguments),
                    raw=dumps_compact({"name": action.name, "arguments": action.arguments}),
                    result=result.content if result.ok else None,
                    error=result.error,
                    error_kind=result.error_kind,
                    latency_s=result.latency_s,  # type: ignore[arg-type]
                )
            )
            try:
                action = gen.send(result)
            except StopIteration:
                break
        verdict = env.verify(final)
    finally:
        env.close()
    return calls if verdict.success and not verdict.violations else None


# ------------------------------------------------------------------- contracts ------
def contract_for_trajectory(tokenizer: Any, env: Environment, traj: Trajectory) -> RolloutContract | None:
    """Rebuild the contract a trajectory was made with (its sampling, limits and the prompt
    format whose fingerprint matches); None when no prompt format reproduces the fingerprint."""
    sampling = SamplingParams(**{k: traj.sampling[k] for k in SamplingParams.model_fields if k in traj.sampling})
    limits = ContractLimits(**{k: traj.sampling[k] for k in ContractLimits.model_fields if k in traj.sampling})
    # a trajectory records the configured limit under max_total_tokens and its episode's whole budget
    # under EFFECTIVE_BUDGET_KEY; one written before that key recorded the budget under max_total_tokens
    legacy = EFFECTIVE_BUDGET_KEY not in traj.sampling
    for system_turn in (True, False):
        for tool_descriptions in (True, False):
            fmt = PromptFormat(tool_descriptions=tool_descriptions, system_turn=system_turn)
            contract = contract_for_env(tokenizer, env, sampling, limits, fmt)
            if legacy and contract.fingerprint() != traj.contract_fingerprint and contract.system_tokens:
                configured = limits.max_total_tokens - contract.system_tokens  # the budget less the system turn
                if configured >= 16:
                    limited = limits.model_copy(update={"max_total_tokens": configured})
                    contract = contract_for_env(tokenizer, env, sampling, limited, fmt)
            if contract.fingerprint() == traj.contract_fingerprint:
                return contract
    return None


def prompt_ids(traj: Trajectory) -> list[int]:
    """The token ids of the trajectory's prompt (its first segment, or everything before the policy's first token)."""
    if traj.segments and traj.segments[0].role == "prompt":
        s = traj.segments[0]
        return traj.token_ids[s.start : s.end]
    first = next((i for i, m in enumerate(traj.loss_mask) if m), len(traj.token_ids))
    return traj.token_ids[:first]


# ----------------------------------------------------------------- corrections ------
class PreferencePair(BaseModel):
    """chosen = a verified correction, rejected = the failed trajectory; same prompt ids."""

    model_config = ConfigDict(extra="forbid")

    task_id: str
    failure_type: FailureType
    prompt_ids: list[int]
    chosen: Trajectory
    rejected: Trajectory


class Discarded(BaseModel):
    model_config = ConfigDict(extra="forbid")

    trajectory_id: str
    task_id: str
    reason: str


@dataclasses.dataclass
class Corrections:
    sft: list[Trajectory] = dataclasses.field(default_factory=list)
    pairs: list[PreferencePair] = dataclasses.field(default_factory=list)
    discarded: list[Discarded] = dataclasses.field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {
            "sft": len(self.sft),
            "pairs": len(self.pairs),
            "discarded": len(self.discarded),
            "discarded_reasons": dict(Counter(d.reason for d in self.discarded)),
        }


def run_correction(
    task: Task,
    contract: RolloutContract,
    make_env: Callable[[], Environment],
    expert: ExpertPolicy,
    source: Literal["expert", "teacher"] = "expert",
    weights: RewardWeights | None = None,
) -> Trajectory:
    """Play ``task`` from scratch with ``expert`` in a new environment (verified, with a fresh id)."""
    env = make_env()
    try:
        return run_scripted_episode(contract, env, task, expert, weights=weights, source=source)
    finally:
        env.close()


def _discarded(failed: Trajectory, reason: str) -> Discarded:
    return Discarded(trajectory_id=failed.id, task_id=failed.task_id, reason=reason)


def build_corrections(
    failures: Sequence[tuple[Trajectory, Attribution]],
    tasks: Mapping[str, Task],
    contract: RolloutContract,
    make_env: Callable[[], Environment],
    expert: ExpertPolicy,
    routing: RoutingTable | None = None,
    source: Literal["expert", "teacher"] = "expert",
    weights: RewardWeights | None = None,
) -> Corrections:
    """Corrected SFT trajectories and preference pairs for the failures routed to them.

    One correction per task (re-used by every failure of that task); corrections the
    verifier rejects are discarded with the reason, as are pairs whose prompts differ.
    """
    routing = routing or RoutingTable()
    out = Corrections()
    cache: dict[str, Trajectory] = {}
    in_sft: set[str] = set()
    for failed, att in failures:
        method = routing.method(att.failure_type)
        if method not in CORRECTION_METHODS:
            continue

        task = tasks.get(failed.task_id)
        if task is None:
            out.discarded.append(_discarded(failed, "task not found"))
            continue
        if task.id not in cache:
            cache[task.id] = run_correction(task, contract, make_env, expert, source, weights)
        corrected = cache[task.id]
        if corrected.reward is None or not corrected.reward.success:
            out.discarded.append(_discarded(failed, "verifier rejected the correction"))
            continue
        if method is TrainingMethod.TARGETED_SFT:
            if task.id not in in_sft:
                out.sft.append(corrected)
                in_sft.add(task.id)
            continue
        shared = prompt_ids(corrected)
        if shared != prompt_ids(failed):
            out.discarded.append(_discarded(failed, "prompt differs from the failed trajectory's (another contract)"))
            continue
        out.pairs.append(
            PreferencePair(
                task_id=task.id, failure_type=att.failure_type, prompt_ids=shared, chosen=corrected, rejected=failed
            )
        )
    return out


def write_pairs_jsonl(path: str | Path, pairs: Iterable[PreferencePair]) -> int:
    return write_models_jsonl(path, pairs)


def read_pairs_jsonl(path: str | Path) -> list[PreferencePair]:
    return list(read_models_jsonl(path, PreferencePair))


__all__ = [
    "Corrections",
    "Discarded",
    "PreferencePair",
    "build_corrections",
    "contract_for_trajectory",
    "expert_reference_calls",
    "find_tasks",
    "load_tasks_jsonl",
    "parse_task_id",
    "prompt_ids",
    "read_pairs_jsonl",
    "run_correction",
    "write_pairs_jsonl",
    "write_tasks_jsonl",
]
