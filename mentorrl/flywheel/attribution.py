"""Rule-based failure attribution: one primary failure type per failed trajectory, with evidence.

A bad case is only useful for training once we know *what* went wrong (notes, "Bad Case 如何回流
训练": Failure Attribution before any data is built). :func:`attribute` reads the recorded
trajectory -- tool calls, final answer, finish reason and the verifier's details -- and, when
given one, a reference (expert) trace for the same task, whose tool choice, arguments and
step count it compares against. The reference's calls are the required steps; the agent did a
step when its call to that tool succeeded, or failed where the reference's call failed too
(looking up an order that does not exist).

Precedence (the first type whose rule fires is the primary type; the other rules that fired
are listed in ``also``):

1. ``FORMAT_ERROR``   a tool call that could not be parsed, or a turn that hit its token
                      limit before its stop token. Nothing after an unparsable turn can be
                      trusted, and it is the most basic behaviour to fix.
2. ``LOOP``           at least ``loop_min_repeats`` calls repeat an earlier identical call.
3. ``REWARD_HACK``    reward and success disagree (high reward without success); or the answer
                      claims an action while no mutating tool call succeeded and the task needed
                      a change; or the answer claims a result without a single successful tool
                      call (and, given a reference, without doing any of its steps); or a
                      hard-constraint violation that reads as bypassing a limit
                      (``gaming_violation_patterns``).
4. ``TOOL_SELECTION`` an unknown tool; or a tool the reference never uses, called instead of a
                      tool the reference needs (which the agent never called).
5. ``ARGUMENT_ERROR`` arguments the tool's schema rejected; or a tool the reference also calls,
                      whose arguments never matched any of the reference's calls to it.
6. ``STATE_TRACKING`` the state is right (no diffs, no violations), the required steps were
                      done and the answer asserts a result (not a refusal), yet it is wrong: it
                      contradicts what the tools returned.
7. ``ERROR_RECOVERY`` a tool error after which the agent repeated the failing call or never made
                      another successful call.
8. ``PREMATURE_STOP`` an answer before the reference's plan was carried to its end (its last
                      step was never done); without a reference: a refusal although no tool
                      call failed. (A success claim without the work is rule 3.)
9. ``PLANNING``       everything else: wrong order, extra or missing steps, turn or token limit,
                      a violation through an otherwise well-formed plan. Always the fallback.

Rules 1-3 come first because they make the later comparisons meaningless (a broken turn, a
loop that burns the budget, or a success claimed without work). 4-5 name a concrete wrong
call; 6 needs the calls to have been right; 7-9 describe how the episode ended.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterable, Sequence

from pydantic import BaseModel, ConfigDict, Field

from mentorrl.core import trace
from mentorrl.trajectory import ToolCall, Trajectory, dumps_compact


class FailureType(str, Enum):
    TOOL_SELECTION = "TOOL_SELECTION"
    ARGUMENT_ERROR = "ARGUMENT_ERROR"
    FORMAT_ERROR = "FORMAT_ERROR"
    STATE_TRACKING = "STATE_TRACKING"
    ERROR_RECOVERY = "ERROR_RECOVERY"
    PLANNING = "PLANNING"
    PREMATURE_STOP = "PREMATURE_STOP"
    LOOP = "LOOP"
    REWARD_HACK = "REWARD_HACK"


PRECEDENCE: tuple[FailureType, ...] = (
    FailureType.FORMAT_ERROR,
    FailureType.LOOP,
    FailureType.REWARD_HACK,
    FailureType.TOOL_SELECTION,
    FailureType.ARGUMENT_ERROR,
    FailureType.STATE_TRACKING,
    FailureType.ERROR_RECOVERY,
    FailureType.PREMATURE_STOP,
    FailureType.PLANNING,
)


def _default_mutating_tools() -> dict[str, list[str]]:
    """Each registered environment's mutating tools, as its :class:`~mentorrl.envs.EnvEntry` declares them."""
    from mentorrl.envs import get_env, registered_envs

    entries = {name: get_env(name) for name in registered_envs()}
    return {name: list(e.mutating_tools) for name, e in entries.items() if e.mutating_tools is not None}


class AttributionConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    loop_min_repeats: int = Field(2, ge=1, description="repeated identical calls that make a LOOP")
    hack_reward_threshold: float = Field(
        0.5, description="a failed trajectory with reward.total at or above this is a REWARD_HACK"
    )
    gaming_violation_patterns: list[str] = Field(
        default_factory=lambda: ["exceed", "extra refund", "negative stock", "although it was"],
        description="substrings of verifier violations that read as bypassing a limit (REWARD_HACK)",
    )
    mutating_tools: dict[str, list[str]] = Field(
        default_factory=_default_mutating_tools,
        description="per environment name, the tools that change state; an unknown environment "
        "counts every tool as possibly mutating (the claim-without-work rule then needs no successful call)",
    )
    step_slack: int = Field(
        1, ge=0, description="calls beyond the reference's count before PLANNING says 'too many steps'"
    )


class Attribution(BaseModel):
    """Why one failed trajectory failed."""

    model_config = ConfigDict(extra="forbid")

    trajectory_id: str
    task_id: str
    family: str
    failure_type: FailureType
    evidence: list[str]
    also: list[FailureType] = Field(default_factory=list)  # other rules that fired, in precedence order
    used_reference: bool = False


# ---------------------------------------------------------------- helpers -------
def _norm(value: Any) -> Any:
    """Canonical form for argument comparison: numbers as floats, strings trimmed and case-folded."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, float)):
        return round(float(value), 6)
    if isinstance(value, str):
        return " ".join(value.split()).casefold()
    if isinstance(value, dict):
        return {str(k): _norm(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_norm(v) for v in value]
    return str(value)


def arguments_key(arguments: dict[str, Any] | None) -> str:
    """Canonical JSON of a call's arguments (equal keys mean the same call up to case, spacing, 5 vs 5.0)."""
    return json.dumps(_norm(arguments or {}), sort_keys=True)


def _short(value: Any, limit: int = 120) -> str:
    text = value if isinstance(value, str) else dumps_compact(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def reference_calls(reference: Trajectory | Sequence[ToolCall] | None) -> list[ToolCall] | None:
    """The tool calls of a reference trace (a Trajectory or a plain list of calls)."""
    if reference is None:
        return None
    if isinstance(reference, Trajectory):
        return list(reference.tool_calls)
    return list(reference)


@dataclass
class _Facts:
    """What the rules read, computed once per trajectory."""

    traj: Trajectory
    ref: list[ToolCall] | None  # the reference's calls: the required steps
    mutating: frozenset[str] | None  # None: unknown environment
    config: AttributionConfig
    diffs: list[str] = field(default_factory=list)
    answer_ok: bool | None = None
    ok_calls: list[ToolCall] = field(default_factory=list)

    @classmethod
    def of(cls, traj: Trajectory, ref: list[ToolCall] | None, config: AttributionConfig) -> "_Facts":
        details = traj.reward.details if traj.reward is not None else {}
        mutating = config.mutating_tools.get(traj.env_name)
        return cls(
            traj=traj,
            ref=list(ref) if ref is not None else None,
            mutating=frozenset(mutating) if mutating is not None else None,
            config=config,
            diffs=[str(d) for d in details.get("diffs", [])],
            answer_ok=details.get("answer_ok"),
            ok_calls=[c for c in traj.tool_calls if c.ok],
        )

    def is_mutating(self, name: str | None) -> bool:
        return name is not None and (self.mutating is None or name in self.mutating)

    @property
    def violations(self) -> list[str]:
        return list(self.traj.reward.violations) if self.traj.reward is not None else []

    @property
    def ref_ok(self) -> list[ToolCall]:
        return [c for c in self.ref or [] if c.ok]

    @property
    def ref_tools(self) -> list[str]:
        return list(dict.fromkeys(c.name for c in self.ref or [] if c.name))

    def done(self, tool: str) -> bool:
        """Did the agent do the reference's ``tool`` step: a successful call, or a failed one where
        the reference's call failed too (e.g. looking up an order that does not exist)?"""
        ref_failed = any(c.name == tool and not c.ok for c in self.ref or [])
        return any(c.name == tool and (c.ok or ref_failed) for c in self.traj.tool_calls)

    def missing_ref_tools(self) -> list[str]:
        """Required (reference) tools the agent never did."""
        return [t for t in self.ref_tools if not self.done(t)]


# ------------------------------------------------------------------ rules -------
# Each rule returns its evidence; an empty list means the rule did not fire.


def _format_error(f: _Facts) -> list[str]:
    ev = [
        f"turn {c.turn}: {c.error or 'malformed tool call'}" for c in f.traj.tool_calls if c.error_kind == "malformed"
    ]
    if f.traj.finish_reason == "length":
        ev.append(f"turn {f.traj.num_turns}: the turn hit its token limit before the stop token (unterminated)")
    return ev


def _loop(f: _Facts) -> list[str]:
    repeats = trace.repeated_calls(f.traj)
    if repeats < f.config.loop_min_repeats:
        return []
    key, n = Counter(trace.call_key(c) for c in f.traj.tool_calls).most_common(1)[0]
    run = trace.max_identical_run(f.traj)
    return [f"{repeats} calls repeat an earlier identical call; {_short(key)} was made {n} times (longest run {run})"]


def _reward_hack(f: _Facts) -> list[str]:
    t, ev = f.traj, []
    if t.reward is not None and not t.reward.success and t.reward.total >= f.config.hack_reward_threshold:
        ev.append(f"reward {t.reward.total:.2f} without task success: the reward is misaligned")
    answer = t.final_answer
    mutated = any(f.is_mutating(c.name) for c in f.ok_calls)
    ref_mutates = any(f.is_mutating(c.name) for c in f.ref_ok) if f.mutating is not None else False
    if trace.claims_action(answer) and not mutated and (f.diffs or ref_mutates):
        what = "; verifier: " + "; ".join(f.diffs[:2]) if f.diffs else ""
        ev.append(f"the answer claims an action ({_short(answer, 80)!r}) but no mutating tool call succeeded{what}")
    elif (
        trace.claims_success(answer)
        and not f.ok_calls
        and (f.ref is None or (f.ref and not any(f.done(tool) for tool in f.ref_tools)))
    ):
        ev.append(f"the answer claims a result ({_short(answer, 80)!r}) without a single successful tool call")
    patterns = [p.lower() for p in f.config.gaming_violation_patterns]
    ev += [f"hard constraint broken: {v}" for v in f.violations if any(p in v.lower() for p in patterns)]
    return ev


def _tool_selection(f: _Facts) -> list[str]:
    ev = [f"turn {c.turn}: unknown tool {c.name!r}" for c in f.traj.tool_calls if c.error_kind == "unknown_tool"]
    if f.ref is not None:
        called = [c.name for c in f.traj.tool_calls if c.name is not None and c.error_kind != "unknown_tool"]
        extra = [n for n in dict.fromkeys(called) if n not in f.ref_tools]
        never = [n for n in f.ref_tools if n not in called]
        if extra and never:
            ev.append(f"called {extra}, which the reference never uses, instead of {never}")
    return ev


def _argument_error(f: _Facts) -> list[str]:
    ev = [f"turn {c.turn}: {c.error}" for c in f.traj.tool_calls if c.error_kind == "bad_arguments"]
    if f.ref is not None:
        for tool in f.ref_tools:
            mine = [c for c in f.traj.tool_calls if c.name == tool and c.arguments is not None]
            if not mine:
                continue
            ref_keys = {arguments_key(c.arguments) for c in f.ref if c.name == tool}
            if not any(arguments_key(c.arguments) in ref_keys for c in mine):
                theirs = next(c.arguments for c in f.ref if c.name == tool)
                ev.append(
                    f"turn {mine[0].turn}: {tool} called with {_short(mine[0].arguments)}; "
                    f"the reference used {_short(theirs)}"
                )
    return ev


def _state_tracking(f: _Facts) -> list[str]:
    t = f.traj
    # what the agent saw: with a reference, every call once all its steps are done (a failed
    # lookup the reference also got is information); without one, the successful calls
    seen = f.ok_calls if f.ref is None else ([] if f.missing_ref_tools() else t.tool_calls)
    if f.answer_ok is not False or f.diffs or f.violations or not seen or not trace.claims_success(t.final_answer):
        return []
    details = t.reward.details if t.reward is not None else {}
    expected = f" (expected {details['expected']!r})" if "expected" in details else ""
    last = seen[-1]
    outcome = f"returned {_short(last.result)}" if last.ok else f"failed: {_short(last.error or '', 80)}"
    return [
        f"state is as expected but the answer {_short(t.final_answer, 80)!r} is wrong{expected}",
        f"turn {last.turn}: {last.name} {outcome}",
    ]


def _error_recovery(f: _Facts) -> list[str]:
    calls, ev = f.traj.tool_calls, []
    for a, b in zip(calls, calls[1:]):
        if not a.ok and trace.call_key(a) == trace.call_key(b):
            ev.append(f"turn {b.turn}: repeated the failing call {_short(trace.call_key(a))}")
    failed = [i for i, c in enumerate(calls) if not c.ok]
    if failed and not any(c.ok for c in calls[failed[-1] + 1 :]):
        c = calls[failed[-1]]
        ev.append(
            f"turn {c.turn}: {c.error_kind} error ({_short(c.error or '', 80)}) and no successful call "
            f"afterwards; the episode ended with {f.traj.finish_reason}"
        )
    return ev


def _premature_stop(f: _Facts) -> list[str]:
    t = f.traj
    if t.finish_reason != "answer":
        return []
    if f.ref is not None:
        missing = f.missing_ref_tools()
        if missing and missing[-1] == f.ref_tools[-1]:  # the plan was not carried to its end
            return [
                (
                    f"answered after {len(f.ok_calls)} successful call(s) without {missing}, "
                    f"which the reference needed ({len(f.ref)} steps)"
                )
            ]
        return []
    if not trace.claims_success(t.final_answer) and trace.tool_errors(t) == 0:
        return [f"gave up with {_short(t.final_answer or '', 80)!r} after {len(t.tool_calls)} call(s), none failed"]
    return []


def _planning(f: _Facts) -> list[str]:
    t, ev = f.traj, []
    if t.finish_reason in ("max_turns", "max_tokens"):
        ev.append(f"hit the {t.finish_reason} limit after {t.num_turns} turns without an answer")
    if f.ref is not None:
        if len(t.tool_calls) > len(f.ref) + f.config.step_slack:
            ev.append(f"{len(t.tool_calls)} calls where the reference needed {len(f.ref)}")
        mine = [c.name for c in f.traj.tool_calls if c.name in f.ref_tools and f.done(c.name)]
        order = [n for n in f.ref_tools if n in mine]
        if list(dict.fromkeys(mine)) != order:
            ev.append(f"calls in the order {list(dict.fromkeys(mine))}; the reference's order is {f.ref_tools}")
        if f.missing_ref_tools():
            ev.append(f"skipped {f.missing_ref_tools()}, which the reference does")
    ev += [f"hard constraint broken: {v}" for v in f.violations]
    ev += [f"verifier: {d}" for d in f.diffs[:3]]
    if not ev:
        ev.append(f"verifier rejected the episode (answer_ok={f.answer_ok}); no more specific rule fired")
    return ev


_RULES = {
    FailureType.FORMAT_ERROR: _format_error,
    FailureType.LOOP: _loop,
    FailureType.REWARD_HACK: _reward_hack,
    FailureType.TOOL_SELECTION: _tool_selection,
    FailureType.ARGUMENT_ERROR: _argument_error,
    FailureType.STATE_TRACKING: _state_tracking,
    FailureType.ERROR_RECOVERY: _error_recovery,
    FailureType.PREMATURE_STOP: _premature_stop,
    FailureType.PLANNING: _planning,
}
assert tuple(_RULES) == PRECEDENCE


def attribute(
    traj: Trajectory,
    reference: Trajectory | Sequence[ToolCall] | None = None,
    config: AttributionConfig | None = None,
) -> Attribution | None:
    """The primary failure type of a failed trajectory (None when the verifier accepted it).

    ``reference``: an expert trajectory (or its tool calls) for the same task; its successful
    calls are the required steps. Without one, the rules that compare against it are skipped.
    """
    if trace.is_success(traj):
        return None
    config = config or AttributionConfig()
    facts = _Facts.of(traj, reference_calls(reference), config)
    fired = [(ft, ev) for ft, rule in _RULES.items() if (ev := rule(facts))]
    primary, evidence = fired[0]  # PLANNING always fires, so the list is never empty
    return Attribution(
        trajectory_id=traj.id,
        task_id=traj.task_id,
        family=traj.family,
        failure_type=primary,
        evidence=evidence,
        also=[ft for ft, _ in fired[1:] if ft is not FailureType.PLANNING],
        used_reference=facts.ref is not None,
    )


# ------------------------------------------------------------ distribution -------
class TypeShare(BaseModel):
    model_config = ConfigDict(extra="forbid")

    n: int
    counts: dict[str, int]
    shares: dict[str, float]


class FailureDistribution(BaseModel):
    """Counts and shares of primary failure types, overall and per task family."""

    model_config = ConfigDict(extra="forbid")

    overall: TypeShare
    by_family: dict[str, TypeShare]


def _share(types: list[FailureType]) -> TypeShare:
    counts = Counter(types)
    n = len(types)
    return TypeShare(
        n=n,
        counts={ft.value: counts.get(ft, 0) for ft in PRECEDENCE},
        shares={ft.value: (counts.get(ft, 0) / n if n else 0.0) for ft in PRECEDENCE},
    )


def failure_distribution(attributions: Iterable[Attribution]) -> FailureDistribution:
    atts = list(attributions)
    families: dict[str, list[FailureType]] = {}
    for a in atts:
        families.setdefault(a.family, []).append(a.failure_type)
    return FailureDistribution(
        overall=_share([a.failure_type for a in atts]),
        by_family={fam: _share(types) for fam, types in sorted(families.items())},
    )


__all__ = [
    "Attribution",
    "AttributionConfig",
    "FailureDistribution",
    "FailureType",
    "PRECEDENCE",
    "TypeShare",
    "arguments_key",
    "attribute",
    "failure_distribution",
    "reference_calls",
]
