"""Reward composition: hard constraints first; soft terms only rank successes.

    total = -1                 if the verifier found a violated hard constraint
             0                 if the task was not accomplished (judged from environment state)
             1 + soft          if it was, where
    soft  = w_tool * tool + w_format * format + w_runtime * runtime + w_verbosity * verbosity

* ``tool`` in [0, 1]: share of tool calls that succeeded, 0 with no calls (no term pays for
  doing nothing). A lookup that answered "not found" (``error_kind`` ``not_found``) is an
  informative result, not a failure: the first one per tool counts as a success and costs no
  runtime, so an honest refusal that rests on a failed lookup scores as high as any other
  honest success; it counts on neither side of the share (a junk lookup cannot pad it), and
  further not-found answers of the same tool count as failed calls (guessing ids or e-mails
  until one matches is not free);
* ``format`` in {0, 1}: the episode ended with a well-formed final answer;
* ``runtime`` in [-1, 0]: ``-(error_penalty * failed calls + redundant_penalty * redundant calls
  + truncation_penalty if the episode hit a limit)``, clipped at -1. A call is *redundant* when
  it is identical (same tool, same arguments) to an earlier call that succeeded: repeating a
  read whose answer is already in the context is tool spam. A retry of a call that failed is
  not redundant (the failure is already charged by ``error_penalty``), so an honest retry after
  a real timeout is not charged twice;
* ``verbosity`` in [-1, 0]: ``-min(1, excess / verbosity_scale_chars)`` where ``excess`` is how
  many characters the final answer has beyond ``answer_budget_chars``: padding a correct answer
  with filler to look thorough ranks below the plain answer.

Because the positive terms (tool + format) and the negative terms (runtime + verbosity) each
weigh less than 0.5 (checked when the weights are built), |soft| < 0.5, so no amount of
formatting, tool hygiene or brevity lifts a failure to a success or drops a success below a
failure. Soft terms are *not* paid on failures: when they were, a weak policy learned to answer
at once without calling any tool (no failed calls, a well-formed ending: positive soft reward,
zero task success) -- the demo's GRPO run found that hack within four steps. The breakdown
still records every term (``verbosity``, ``redundant_calls`` and ``answer_chars`` in
``details``).
"""

from __future__ import annotations

from typing import Iterable, Sequence

from mentorrl.config.reward import RewardWeights
from mentorrl.core.trace import call_key
from mentorrl.envs.base import Verdict
from mentorrl.trajectory import RewardBreakdown, ToolCall


def informative_calls(calls: Sequence[ToolCall]) -> list[bool]:
    """Per call: is it the first ``not_found`` answer of its tool (an informative lookup)?"""
    seen: set[str | None] = set()
    out = []
    for c in calls:
        first = not c.ok and c.error_kind == "not_found" and c.name not in seen
        if first:
            seen.add(c.name)
        out.append(first)
    return out


def failed_calls(calls: Sequence[ToolCall]) -> int:
    """Calls that failed, except the first ``not_found`` answer of each tool (an informative lookup)."""
    return sum(not c.ok and not info for c, info in zip(calls, informative_calls(calls)))


def tool_success_share(calls: Sequence[ToolCall]) -> float:
    """Share of calls that succeeded, informative lookups counted on neither side (so extra
    "not found" lookups cannot pad the share); 0 with no calls, 1 when every call was informative."""
    info = informative_calls(calls)
    counted = [c for c, i in zip(calls, info) if not i]
    if not counted:
        return 1.0 if calls else 0.0
    return sum(c.ok for c in counted) / len(counted)


def redundant_calls(calls: Sequence[ToolCall]) -> int:
    """How many calls repeat an earlier *successful* call with the same tool and arguments."""
    succeeded: set[str] = set()
    n = 0
    for c in calls:
        key = call_key(c)
        n += key in succeeded
        if c.ok:
            succeeded.add(key)
    return n


def verbosity_term(final_answer: str | None, budget_chars: int, scale_chars: int) -> float:
    """``-min(1, excess / scale_chars)`` for the characters of the (stripped) answer beyond the budget."""
    if not final_answer:
        return 0.0
    excess = max(0, len(final_answer.strip()) - budget_chars)
    return -min(1.0, excess / scale_chars)


def compose_reward(
    verdict: Verdict,
    tool_calls: Iterable[ToolCall],
    finish_reason: str,
    weights: RewardWeights,
    final_answer: str | None = None,
) -> RewardBreakdown:
    calls = list(tool_calls)
    n_err = failed_calls(calls)
    n_redundant = redundant_calls(calls)
    tool = tool_success_share(calls)
    fmt = 1.0 if finish_reason == "answer" else 0.0
    truncation = 0.0 if finish_reason == "answer" else weights.truncation_penalty
    runtime = -min(1.0, n_err * weights.error_penalty + n_redundant * weights.redundant_penalty + truncation)
    verbosity = verbosity_term(final_answer, weights.answer_budget_chars, weights.verbosity_scale_chars)
    success = bool(verdict.success and not verdict.violations)
    tier = -1.0 if verdict.violations else (1.0 if success else 0.0)
    soft = (
        weights.tool * tool + weights.format * fmt + weights.runtime * runtime + weights.verbosity * verbosity
        if success
        else 0.0
    )
    return RewardBreakdown(
        task=1.0 if success else 0.0,
        tool=tool,
        runtime=runtime,
        format=fmt,
        success=success,
        violations=list(verdict.violations),
        total=tier + soft,
        details={
            **verdict.details,
            "tool_errors": n_err,
            "redundant_calls": n_redundant,
            "verbosity": verbosity,
            "answer_chars": len(final_answer.strip()) if final_answer else 0,
            "tier": tier,
        },
    )
