"""Facts about one trajectory's tool trace, shared by metrics, review sampling and failure attribution.

All functions are pure and read only the recorded :class:`~mentorrl.trajectory.Trajectory`.
"""

from __future__ import annotations

import json
import re

from mentorrl.trajectory import ToolCall, Trajectory

# error kinds that mean the policy wrote an invalid call (as opposed to a valid call the tool refused)
INVALID_CALL_KINDS = frozenset({"malformed", "unknown_tool", "bad_arguments"})

_REFUSAL_RE = re.compile(
    r"\b(sorry|can(?:no|')t|could(?: not|n't)|unable|not found|no (?:order|customer|account|product)|"
    r"does(?: not|n't) exist|not on your account|belongs? to|only have|won't|will not|"
    r"no such|not your|not cancell?able|insufficient|exceeds)\b",
    re.IGNORECASE,
)
_DONE_RE = re.compile(
    r"\b(done|completed?|is now|has been|have been|now cancell?ed|cancell?ed|refunded|placed|updated|"
    r"emailed|sent|changed|processed|successfully)\b",
    re.IGNORECASE,
)


def call_key(call: ToolCall) -> str:
    """Identity of a call: tool name and canonical arguments (raw text when unparsed)."""
    if call.name is None or call.arguments is None:
        return f"raw:{call.raw.strip()}"
    return f"{call.name}:{json.dumps(call.arguments, sort_keys=True)}"


def repeated_calls(traj: Trajectory) -> int:
    """How many calls repeat an earlier identical call (same tool and arguments)."""
    seen: set[str] = set()
    n = 0
    for c in traj.tool_calls:
        k = call_key(c)
        n += k in seen
        seen.add(k)
    return n


def max_identical_run(traj: Trajectory) -> int:
    """Longest run of back-to-back identical calls (1 when no call repeats its predecessor)."""
    best = run = 0
    prev = None
    for c in traj.tool_calls:
        k = call_key(c)
        run = run + 1 if k == prev else 1
        best, prev = max(best, run), k
    return best


def max_consecutive_errors(traj: Trajectory) -> int:
    best = run = 0
    for c in traj.tool_calls:
        run = 0 if c.ok else run + 1
        best = max(best, run)
    return best


def invalid_calls(traj: Trajectory) -> int:
    return sum(c.error_kind in INVALID_CALL_KINDS for c in traj.tool_calls)


def tool_errors(traj: Trajectory) -> int:
    return sum(not c.ok for c in traj.tool_calls)


def is_loop(traj: Trajectory, min_repeats: int = 2) -> bool:
    """A loop: at least ``min_repeats`` calls repeat an earlier identical call."""
    return repeated_calls(traj) >= min_repeats


def recovered_after_error(traj: Trajectory) -> bool | None:
    """None when no tool call failed; else whether a later call succeeded and the task was done."""
    first_err = next((i for i, c in enumerate(traj.tool_calls) if not c.ok), None)
    if first_err is None:
        return None
    later_ok = any(c.ok for c in traj.tool_calls[first_err + 1 :])
    return bool(later_ok and is_success(traj))


def is_success(traj: Trajectory) -> bool:
    return bool(traj.reward is not None and traj.reward.success)


def has_violation(traj: Trajectory) -> bool:
    return bool(traj.reward is not None and traj.reward.violations)


def answer_text(answer: str | None) -> str | None:
    """A final answer as words: a typed answer (the JSON of an answer-tool call,
    ``{"name": ..., "arguments": {"outcome": "refunded", "order_id": "O-5", ...}}``) flattened to
    "refunded order id O-5 ..."; any other answer as it is."""
    if not answer or not answer.lstrip().startswith("{"):
        return answer
    try:
        call = json.loads(answer)
    except (ValueError, RecursionError):
        return answer
    args = call.get("arguments", call.get("parameters")) if isinstance(call, dict) else None
    if not isinstance(args, dict):
        return answer
    words = [str(v).replace("_", " ") if k == "outcome" else f"{str(k).replace('_', ' ')} {v}" for k, v in args.items()]
    return " ".join(words)


def claims_success(text: str | None) -> bool:
    """Does a final answer tell the user that the request was carried out or answered?

    A refusal or an apology is not a claim; any other non-empty answer is (an information
    answer claims its fact). Environments with richer answers can register their own rule.
    """
    text = answer_text(text)
    if not text or not text.strip():
        return False
    return not _REFUSAL_RE.search(text)


def claims_action(text: str | None) -> bool:
    """Does a final answer say that something was *changed* (cancelled, refunded, sent ...)?"""
    return bool(text) and claims_success(text) and bool(_DONE_RE.search(answer_text(text) or ""))


def total_tokens(traj: Trajectory) -> int:
    return len(traj.token_ids)


def latency_s(traj: Trajectory) -> float:
    return float(traj.timings.get("total_s", 0.0))


def length_band(traj: Trajectory, edges: tuple[int, ...] = (2, 4)) -> str:
    """short / medium / long by number of turns."""
    if traj.num_turns <= edges[0]:
        return "short"
    return "medium" if traj.num_turns <= edges[1] else "long"


def tools_used(traj: Trajectory) -> tuple[str, ...]:
    return tuple(dict.fromkeys(c.name or "?" for c in traj.tool_calls))
