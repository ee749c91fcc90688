"""τ²-bench's reward: the product of the components a task's ``reward_basis`` lists.

* DB: the gold actions replayed on a fresh environment, and its DB hashes (agent and user) equal
  to the episode's (computed by the child, :mod:`.child`);
* ENV_ASSERTION: each assertion function, run on the episode's final environment, returns its
  ``assert_value``;
* COMMUNICATE: each ``communicate_info`` string is a case-insensitive substring of one of the
  agent's messages to the user (commas removed from the message, as upstream does);
* ACTION: each gold action matches one of the agent's calls (name, and ``compare_args`` or all
  arguments);
* NL_ASSERTION: an LLM judge (``env.judge``) says each assertion holds. Without a judge, tasks that
  carry assertions are left out of the task pool (and counted); an empty or malformed judge reply
  is a fail, never a pass. A task whose basis lists a component with nothing to check (no
  assertions, no strings) gets 1 for it, as upstream.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from pydantic import BaseModel, Field

from .records import Criteria

MAX_TRANSCRIPT_CHARS = 60_000


class Tau2Outcome(BaseModel):
    """What the benchmark says about one episode (recorded in ``Verdict.details["tau2"]``)."""

    task_id: str
    reward: float
    components: dict[str, float] = Field(default_factory=dict)
    communicate: dict[str, bool] = Field(default_factory=dict)
    env_assertions: list[bool] = Field(default_factory=list)
    nl_assertions: list[bool] = Field(default_factory=list)
    gold_errors: list[str] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)


class JudgeReply(BaseModel):
    met: list[bool]


def communicate_checks(infos: Sequence[str], messages: Sequence[str]) -> dict[str, bool]:
    lowered = [m.lower().replace(",", "") for m in messages]
    return {info: any(info.lower() in m for m in lowered) for info in infos}


def action_matched(gold: Any, calls: Sequence[tuple[str, dict[str, Any]]]) -> bool:
    for name, args in calls:
        if name != gold.name:
            continue
        keys = gold.compare_args if gold.compare_args is not None else list(args)
        if {k: args.get(k) for k in keys if k in args} == {
            k: gold.arguments.get(k) for k in keys if k in gold.arguments
        }:
            return True
    return False


JUDGE_PROMPT = (
    "You grade a customer-service conversation. For each assertion, in order, say whether the agent's "
    'behaviour in the conversation satisfies it. Answer with JSON only: {{"met": [true|false, ...]}} with '
    "exactly {n} values.\n\nAssertions:\n{assertions}\n\nConversation:\n{transcript}"
)


def judge_assertions(judge: Any, assertions: Sequence[str], transcript: Sequence[tuple[str, str]]) -> list[bool]:
    """The judge's verdict per assertion; a missing, empty or wrongly sized reply fails every one."""
    text = "\n".join(f"{role}: {content}" for role, content in transcript)[-MAX_TRANSCRIPT_CHARS:]
    listed = "\n".join(f"{i + 1}. {a}" for i, a in enumerate(assertions))
    prompt = JUDGE_PROMPT.format(n=len(assertions), assertions=listed, transcript=text)
    reply = judge.structured([{"role": "user", "content": prompt}], JudgeReply)
    if reply is None or len(reply.met) != len(assertions):
        return [False] * len(assertions)
    return list(reply.met)


def score(
    task_id: str,
    criteria: Criteria | None,
    evaluation: dict[str, Any] | None,
    messages: Sequence[str],
    calls: Sequence[tuple[str, dict[str, Any]]],
    transcript: Sequence[tuple[str, str]],
    judge: Any = None,
) -> Tau2Outcome:
    """The episode's benchmark reward. ``evaluation``: the child's ``evaluate`` reply (DB match and
    assertion results), needed when the basis lists DB or ENV_ASSERTION."""
    out = Tau2Outcome(task_id=task_id, reward=1.0)
    if criteria is None:
        out.notes.append("no evaluation criteria")
        return out
    basis = criteria.reward_basis
    if "DB" in basis or "ENV_ASSERTION" in basis:
        ev = evaluation or {}
        nothing = criteria.actions is None and criteria.env_assertions is None
        out.components["DB"] = 1.0 if nothing or ev.get("db_match") is True else 0.0
        met = ev.get("assertions")
        out.env_assertions = [m is True for m in met] if isinstance(met, list) else []
        want = len(criteria.env_assertions or [])
        out.components["ENV_ASSERTION"] = float(len(out.env_assertions) == want and all(out.env_assertions))
        out.gold_errors = [str(e)[:300] for e in (ev.get("gold_errors") or [])][:20]
    if "COMMUNICATE" in basis:
        out.communicate = communicate_checks(criteria.communicate_info or [], messages)
        out.components["COMMUNICATE"] = float(all(out.communicate.values()))
    if "ACTION" in basis:
        out.components["ACTION"] = float(all(action_matched(a, calls) for a in criteria.actions or []))
    if "NL_ASSERTION" in basis:
        if not criteria.nl_assertions:
            out.components["NL_ASSERTION"] = 1.0
        elif judge is None:
            out.components["NL_ASSERTION"] = 0.0
            out.notes.append("NL_ASSERTION needs a judge (env.judge); scored 0")
        else:
            out.nl_assertions = judge_assertions(judge, criteria.nl_assertions, transcript)
            out.components["NL_ASSERTION"] = float(all(out.nl_assertions))
    out.components = {k: v for k, v in out.components.items() if k in basis}
    for v in out.components.values():
        out.reward *= v
    return out


def gold_calls(criteria: Criteria | None) -> list[dict[str, Any]]:
    """The gold actions as the child's ``evaluate`` takes them."""
    return [json.loads(a.model_dump_json()) for a in (criteria.actions or [])] if criteria else []


__all__ = [
    "JudgeReply",
    "Tau2Outcome",
    "action_matched",
    "communicate_checks",
    "gold_calls",
    "judge_assertions",
    "score",
]
