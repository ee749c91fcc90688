"""Judges: a second opinion on a trajectory that never replaces the verifier.

A :class:`Judge` reads a task and a recorded trajectory and returns a
:class:`~mentorrl.trajectory.JudgeVerdict` with a success probability, rubric scores
(``task_success``, ``tool_correctness``, ``state_tracking``, ``efficiency``,
``final_answer``, each in [0, 1]) and a reason. Judges serve evaluation where no
programmatic verifier exists (production samples) and the judge/verifier agreement
metrics in :mod:`mentorrl.eval.agent`; they never produce training reward.

The built-in :class:`TranscriptJudge` sees only the transcript: the user's request
(``task.prompt``, when a task is known), the tool calls with what came back, and the final
answer. It does not open the environment and does not read ``task.reference``. It scores
*grounding*: every argument the agent passed should come from the request or from an
earlier tool return, every fact (id, number, e-mail) in the answer should appear in what
the agent saw, and what the answer claims (an action done, a fact, a refusal) should be
backed by the trace. Its success probability is a logistic model over those features whose
weights were fitted once on recorded orders evaluations (verifier labels) and frozen here.

The LLM judge (:mod:`mentorrl.eval.llm_judge`, registered as ``llm``, configured from
``MENTORRL_JUDGE_*`` environment variables) implements the same protocol over HTTP; it adds a
``safety`` score and returns ``None`` when it could not give a verdict.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol, Sequence, runtime_checkable

from mentorrl.core import trace
from mentorrl.envs.base import Task
from mentorrl.trajectory import JudgeVerdict, ToolCall, Trajectory

RUBRIC = ("task_success", "tool_correctness", "state_tracking", "efficiency", "final_answer")


@runtime_checkable
class Judge(Protocol):
    """Anything with a ``name`` and ``judge(task, traj) -> JudgeVerdict``.

    ``task`` is None when only the recorded trajectory is known (production samples).
    A judge must not change the trajectory or any environment state. It returns None when it
    could not give a verdict (an LLM judge whose call failed): no score is invented.
    """

    name: str

    def judge(self, task: Task | None, traj: Trajectory) -> JudgeVerdict | None: ...


# ------------------------------------------------------------ grounding helpers ------
_NUMBER_RE = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?")
# a "fact" in an answer: a token that carries a digit or an @ (ids, amounts, counts, e-mails)
_FACT_RE = re.compile(r"[\w.$@+-]*[\d@][\w.@+-]*")


def _numbers(text: str) -> set[float]:
    return {float(x) for x in _NUMBER_RE.findall(text.replace(",", ""))}


def _leaves(obj: Any) -> Iterator[Any]:
    """Scalar leaves of a JSON value (keys excluded)."""
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _leaves(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _leaves(v)
    elif obj is not None:
        yield obj


def observation_text(call: ToolCall) -> str:
    """What the agent saw back from one call: its result, or its error message."""
    if call.ok:
        return json.dumps(call.result, ensure_ascii=False) if not isinstance(call.result, str) else call.result
    return call.error or ""


@dataclass(frozen=True)
class _Context:
    """Text the agent had seen at some point, with its numbers pre-parsed."""

    text: str  # lower-cased
    numbers: frozenset[float]

    @classmethod
    def of(cls, parts: Iterable[str]) -> "_Context":
        text = "\n".join(parts)
        return cls(text.lower(), frozenset(_numbers(text)))

    def grounds_value(self, value: Any) -> bool:
        """Is an argument value present in the context (numbers compared numerically)?"""
        if isinstance(value, bool):
            return True  # flags carry no fact to ground
        if isinstance(value, (int, float)):
            return any(math.isclose(float(value), x, rel_tol=1e-9, abs_tol=1e-6) for x in self.numbers)
        s = str(value).strip().lower()
        return bool(s) and s in self.text

    def grounds_fact(self, fact: str) -> bool:
        """Is a fact token from the answer present in the context?"""
        bare = fact.strip(".,;:!?").lstrip("$").replace(",", "")
        try:
            return self.grounds_value(float(bare))
        except ValueError:
            return bare.lower() in self.text


def answer_facts(text: str | None) -> list[str]:
    """Tokens in an answer that state a checkable fact (ids, amounts, counts, e-mails)."""
    return [f.strip(".,;:!?") for f in _FACT_RE.findall(text or "") if f.strip(".,;:!?$")]


def argument_grounding(prompt: str, calls: Sequence[ToolCall]) -> float:
    """Share of calls whose every argument value appears in the request or an earlier tool return.

    An unparsed call (no name or no argument object) counts as ungrounded; 1.0 with no calls.
    """
    if not calls:
        return 1.0
    grounded = 0
    for i, call in enumerate(calls):
        if call.name is None or call.arguments is None:
            continue
        ctx = _Context.of([prompt, *(observation_text(c) for c in calls[:i])])
        grounded += all(ctx.grounds_value(v) for v in _leaves(call.arguments))
    return grounded / len(calls)


def answer_grounding(prompt: str, calls: Sequence[ToolCall], answer: str | None) -> float:
    """Share of the answer's facts found in the request, the call arguments or the tool returns (1.0 with none)."""
    facts = answer_facts(answer)
    if not facts:
        return 1.0
    ctx = _Context.of([prompt, *(observation_text(c) for c in calls), *(c.raw for c in calls)])
    return sum(ctx.grounds_fact(f) for f in facts) / len(facts)


_WORD_RE = re.compile(r"[\w@.$-]*\w")


def _words(text: str) -> set[str]:
    return {w.strip(".").lstrip("$") for w in _WORD_RE.findall(text.lower()) if len(w.strip(".")) >= 2}


def request_coverage(prompt: str, calls: Sequence[ToolCall], answer: str | None) -> float:
    """Share of the request's facts (ids, amounts, e-mails) the agent acted on or answered about:
    found in some parsed call's arguments or in the answer (1.0 when the request states none)."""
    facts = answer_facts(prompt)
    if not facts:
        return 1.0
    ctx = _Context.of([*(json.dumps(c.arguments) for c in calls if c.arguments is not None), answer or ""])
    return sum(ctx.grounds_fact(f) for f in facts) / len(facts)


def answer_echo(prompt: str, calls: Sequence[ToolCall], answer: str | None) -> float:
    """1.0 when the answer repeats something the tools returned that the request did not say
    (a status, a count, a new id, an error's subject): evidence the answer reads the returns."""
    seen = set().union(*(_words(observation_text(c)) for c in calls)) if calls else set()
    return float(bool((_words(answer or "") & seen) - _words(prompt)))


# ------------------------------------------------------------ transcript features ------
def transcript_features(prompt: str, traj: Trajectory) -> dict[str, float]:
    """Judge features of one trajectory, each in [0, 1], read from the transcript alone."""
    calls = traj.tool_calls
    answer = trace.answer_text(traj.final_answer) if traj.finish_reason == "answer" else None
    answered = bool(answer and answer.strip())
    claims = trace.claims_success(answer)
    action = trace.claims_action(answer)
    ok_calls = [c for c in calls if c.ok]
    last_ok = bool(calls) and calls[-1].ok
    # a refusal is backed when it follows a well-formed call the environment answered at all
    # ("consistent"), and strongly when that call was refused by the environment itself
    # ("refusal_supported", e.g. "no customer with email ...")
    valid_calls = [c for c in calls if c.error_kind not in trace.INVALID_CALL_KINDS]
    last_valid = valid_calls[-1] if valid_calls else None
    refusal_supported = answered and not claims and last_valid is not None and not last_valid.ok
    if not answered:
        consistent = False
    elif action:
        consistent = last_ok
    elif claims:
        consistent = bool(ok_calls)
    else:
        consistent = bool(valid_calls)
    return {
        "answered": float(answered),
        "claims": float(claims),
        "claims_action": float(action),
        "has_calls": float(bool(calls)),
        "ok_share": len(ok_calls) / len(calls) if calls else 0.0,
        "invalid_share": trace.invalid_calls(traj) / len(calls) if calls else 0.0,
        "last_ok": float(last_ok),
        "arg_grounding": argument_grounding(prompt, calls) if calls else 0.0,
        "answer_grounding": answer_grounding(prompt, calls, answer) if answered else 0.0,
        "consistent": float(consistent),
        "refusal_supported": float(refusal_supported),
        "request_coverage": request_coverage(prompt, calls, answer) if prompt else 0.0,
        "answer_echo": answer_echo(prompt, calls, answer) if answered else 0.0,
        "repeats": min(1.0, trace.repeated_calls(traj) / 2),
        "error_run": min(1.0, max(0, trace.max_consecutive_errors(traj) - 1) / 2),
    }


# Logistic weights over transcript_features. Fitted by L2-regularised (1e-3) logistic
# regression with the verifier's success as the label, on 500 recorded trajectories (the
# held-out evaluations of one demo run's SFT and GRPO checkpoints, plus 100 expert
# demonstrations on train tasks), rounded to 0.1 and frozen. On 500 other trajectories (a
# second demo run, plus expert demonstrations on hidden tasks) they reach 92% agreement with
# the verifier, Cohen's kappa 0.81, Brier score 0.064; on that run's model trajectories alone
# (few successes) 90-91% agreement, kappa 0.51-0.61. ``repeats`` never occurred in that data
# (its fitted weight is 0); its -0.5 is a prior, not a fit.
TRANSCRIPT_WEIGHTS: dict[str, float] = {
    "bias": -7.3,
    "answered": 0.1,
    "claims": 0.7,
    "claims_action": 0.3,
    "has_calls": 0.0,
    "ok_share": -1.7,  # conditional on last_ok and grounding, more successful calls mean detours
    "invalid_share": -1.4,
    "last_ok": 1.8,
    "arg_grounding": 3.3,
    "answer_grounding": 2.8,
    "consistent": 1.0,
    "refusal_supported": 0.4,
    "request_coverage": 0.6,
    "answer_echo": 0.6,
    "repeats": -0.5,
    "error_run": -0.6,
}


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def success_probability(features: Mapping[str, float], weights: Mapping[str, float] = TRANSCRIPT_WEIGHTS) -> float:
    """Logistic model: sigmoid(bias + sum of weight * feature)."""
    unknown = set(weights) - set(features) - {"bias"}
    if unknown:
        raise KeyError(f"weights name features that were not computed: {sorted(unknown)}")
    return _sigmoid(weights.get("bias", 0.0) + sum(w * features[k] for k, w in weights.items() if k != "bias"))


def rubric_scores(f: Mapping[str, float], success_prob: float) -> dict[str, float]:
    """The five rubric dimensions, each in [0, 1], from transcript features."""
    tool = (
        (1.0 - f["invalid_share"]) * (0.5 + 0.5 * f["arg_grounding"])
        if f["has_calls"]
        else (0.0 if f["claims"] else 0.5)
    )
    state = f["arg_grounding"] * (0.5 + 0.5 * f["answer_grounding"]) * (1.0 if f["consistent"] else 0.5)
    efficiency = max(0.0, 1.0 - 0.5 * f["repeats"] - 0.5 * f["error_run"]) * (1.0 if f["answered"] else 0.5)
    final = f["answered"] * f["answer_grounding"] * (1.0 if f["consistent"] else 0.5)
    scores = {
        "task_success": success_prob,
        "tool_correctness": tool,
        "state_tracking": state,
        "efficiency": efficiency,
        "final_answer": final,
    }
    return {k: min(1.0, max(0.0, v)) for k, v in scores.items()}


def _reason(f: Mapping[str, float], traj: Trajectory) -> str:
    notes: list[str] = []
    if not f["answered"]:
        notes.append(f"no final answer ({traj.finish_reason})")
    elif not f["consistent"]:
        notes.append(
            "the answer's claim is not backed by the trace" if f["claims"] else "refusal without a valid lookup"
        )
    if f["has_calls"]:
        if f["invalid_share"] > 0:
            notes.append(f"{trace.invalid_calls(traj)} invalid call(s)")
        if f["arg_grounding"] < 1:
            notes.append(f"{f['arg_grounding']:.0%} of calls use only arguments from the request or tool returns")
        if f["repeats"] > 0:
            notes.append(f"{trace.repeated_calls(traj)} repeated call(s)")
    elif f["answered"]:
        notes.append("answered without any tool call")
    if f["answered"] and f["answer_grounding"] < 1:
        notes.append(f"{f['answer_grounding']:.0%} of the answer's facts appear in the transcript")
    return "; ".join(notes) or "grounded calls and a consistent, grounded answer"


class TranscriptJudge:
    """Rubric judge over the transcript only (never environment state, never the task's reference).

    With ``task=None`` there is no request to ground arguments in, so its probabilities run
    low; for recorded trajectories, rebuild the request with
    :func:`mentorrl.eval.sets.tasks_from_trajectories` (``mentorrl eval`` does).
    """

    name = "transcript"

    def __init__(self, weights: Mapping[str, float] | None = None):
        self.weights = dict(TRANSCRIPT_WEIGHTS if weights is None else weights)

    def judge(self, task: Task | None, traj: Trajectory) -> JudgeVerdict:
        f = transcript_features(task.prompt if task is not None else "", traj)
        p = success_probability(f, self.weights)
        return JudgeVerdict(judge=self.name, success_prob=p, scores=rubric_scores(f, p), reason=_reason(f, traj))


# ------------------------------------------------------------ registry and attaching ------
def _llm_judge() -> Judge:
    """The LLM judge, configured from the environment (imported only when asked for)."""
    from mentorrl.eval.llm_judge import llm_judge_from_env

    return llm_judge_from_env()


_JUDGES: dict[str, Callable[[], Judge]] = {"transcript": TranscriptJudge, "llm": _llm_judge}


def register_judge(name: str, factory: Callable[[], Judge]) -> None:
    """Make a judge available by name (e.g. an LLM judge over HTTP)."""
    if name in _JUDGES or name == "none":
        raise ValueError(f"judge {name!r} is already registered")
    _JUDGES[name] = factory


def judge_names() -> list[str]:
    return sorted(_JUDGES)


def make_judge(name: str | None) -> Judge | None:
    """The judge registered under ``name``; None for ``None`` or ``"none"``."""
    if name is None or name == "none":
        return None
    if name not in _JUDGES:
        raise ValueError(f"unknown judge {name!r}; registered: {', '.join(judge_names())}, or none")
    return _JUDGES[name]()


def attach_judgements(
    judge: Judge, tasks: Iterable[Task] | Mapping[str, Task], trajs: Sequence[Trajectory]
) -> list[Trajectory]:
    """Set ``traj.judge`` on every trajectory (in place) and return them.

    ``tasks`` are matched by id; a trajectory whose task is not given is judged with
    ``task=None`` (the judge then sees only the recorded trajectory). Where the judge gives
    no verdict, ``traj.judge`` is None: the trajectory is left out of the agreement metrics.
    """
    by_id = dict(tasks) if isinstance(tasks, Mapping) else {t.id: t for t in tasks}
    for t in trajs:
        t.judge = judge.judge(by_id.get(t.task_id), t)
    return list(trajs)


__all__ = [
    "RUBRIC",
    "TRANSCRIPT_WEIGHTS",
    "Judge",
    "TranscriptJudge",
    "answer_facts",
    "answer_grounding",
    "argument_grounding",
    "attach_judgements",
    "judge_names",
    "make_judge",
    "register_judge",
    "rubric_scores",
    "success_probability",
    "transcript_features",
]
