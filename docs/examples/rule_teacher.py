"""A new teacher: a black-box teacher with no model at all, just rules over the chat messages.

A teacher declares its capabilities (rungs of the ladder in :mod:`mentorrl.opd.teacher`) and
implements the methods those rungs need. Like every black-box teacher it sees the student's
trajectory only as chat messages, never token ids. This one gives ``scoring`` and ``ranking``;
a recipe that needs more (``step_critique``, ``sampling``) is refused before its first step.

Run it: ``python docs/examples/rule_teacher.py`` ranks an expert episode against a claim-only one.
"""

from __future__ import annotations

from typing import Sequence

from mentorrl.opd.remote_teacher import StudentEpisode, TrajectoryScore
from mentorrl.opd.teacher import Capability


class RuleTeacher:
    name = "rules"
    capabilities = frozenset({Capability.SCORING, Capability.RANKING})

    def score(self, ep: StudentEpisode) -> TrajectoryScore | None:
        """Rubric dimensions in [0, 1], from the messages alone (None would mean: no verdict)."""
        tools = [m for m in ep.messages if m["role"] == "tool"]
        failed = sum(str(m["content"]).startswith("error:") for m in tools)
        last = ep.messages[-1]
        answered = last["role"] == "assistant"  # a text answer, or a typed final_answer call nothing answered
        return TrajectoryScore(
            {
                "tool_correctness": 1.0 - failed / len(tools) if tools else 0.0,  # no calls earn nothing
                "final_answer": float(answered),
                "efficiency": 1.0 / max(len(ep.turn_indices), 1),
            },
            reason=f"{len(tools)} tool calls, {failed} failed",
        )

    def rank(self, eps: Sequence[StudentEpisode]) -> list[float] | None:
        """One score per candidate of the same task: higher is better."""
        scores = [self.score(ep) for ep in eps]
        return None if any(s is None for s in scores) else [s.overall() for s in scores]


if __name__ == "__main__":
    from transformers import AutoTokenizer

    from mentorrl.chat import trajectory_messages
    from mentorrl.contract import contract_for_env
    from mentorrl.envs import get_env
    from mentorrl.models.shipped import SHIPPED_ROOT
    from mentorrl.opd.teacher import MissingCapability, require
    from mentorrl.rollout.episode import run_scripted_episode, run_text_turns

    entry = get_env("orders")
    env = entry.make_env()
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_ROOT / "orders-tiny")
    contract = contract_for_env(tokenizer, env)
    task = next(t for t in entry.make_tasks().tasks("train", 20, seed=0) if t.difficulty == "normal")
    eps = [
        StudentEpisode(task, t, trajectory_messages(t, tokenizer, contract.system_text(), task.prompt))
        for t in (
            run_scripted_episode(contract, env, task, entry.make_expert()),
            run_text_turns(contract, env, task, ["All done, nothing else needed."]),
        )
    ]
    teacher = RuleTeacher()
    require(teacher, ["ranking"], "ranking")  # passes
    print("ranking (expert, claim-only):", teacher.rank(eps))
    try:
        require(teacher, ["step_critique", "sampling"], "correction")
    except MissingCapability as e:
        print("refused:", e)
