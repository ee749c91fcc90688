"""Remote teachers (black-box: text and tool calls, no log-probs): what an API-only teacher can say about
the student's own trajectories.

A black-box teacher is reached through :class:`~mentorrl.clients.openai_api.TeacherClient` (OpenAI chat
completions over HTTP) and gives the lower rungs of the capability ladder
(:mod:`mentorrl.opd.teacher`):

* ``sampling``: its next action at a state (:meth:`BlackBoxTeacher.act`), hence corrections;
* ``step_critique``: a score per student turn, the first wrong turn and a correct next action;
* ``scoring``: rubric dimensions for a trajectory;
* ``ranking``: scores for several candidate trajectories of one task;
* ``action_ranking``: scores for candidate tool calls at one state.

Two ways to elicit them, one class each:

* :class:`PromptedTeacher` asks for each signal in words and reads a JSON answer validated with
  pydantic (an instruction-following API model: a hosted frontier model, a served 70B). A
  malformed answer is counted by the client and the sample is skipped.
* :class:`ActingTeacher` asks only for the teacher's own next actions, ``samples`` of them at
  every state the student visited, and derives every signal from agreement: a student turn
  scores the share of teacher samples that take the same action (half credit for the right
  tool with other arguments; word overlap for final answers). It works with any policy behind
  the chat protocol, including one that cannot follow a rubric prompt (the tiny local models
  served by ``mentorrl serve``), and it is how the end-to-end tests drive every recipe.

Teachers never see token ids: the student's trajectory travels as chat messages
(:func:`mentorrl.chat.trajectory_messages`), so a teacher with another tokenizer needs no
alignment.
"""

from __future__ import annotations

import json
import re
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

from mentorrl.chat import action_key, action_of, message_text
from mentorrl.clients.openai_api import TeacherClient
from mentorrl.contract import ParsedAction
from mentorrl.envs.base import Task
from mentorrl.opd.teacher import Capability
from mentorrl.trajectory import Trajectory

BLACKBOX_CAPABILITIES = frozenset(
    {Capability.SAMPLING, Capability.RANKING, Capability.SCORING, Capability.STEP_CRITIQUE, Capability.ACTION_RANKING}
)


@dataclass
class StudentEpisode:
    """A student trajectory as the teacher sees it: the task and the chat messages (no token ids)."""

    task: Task
    traj: Trajectory
    messages: list[dict[str, Any]]

    @property
    def turn_indices(self) -> list[int]:
        """Indices in ``messages`` of the student's turns (assistant messages)."""
        return [i for i, m in enumerate(self.messages) if m["role"] == "assistant"]


@dataclass
class StepCritique:
    """Per student turn a score in [0, 1]; the first turn below the threshold; the teacher's
    action there (an assistant message), when it gave one."""

    scores: list[float]
    first_wrong: int | None
    correct_action: dict[str, Any] | None = None


@dataclass
class TrajectoryScore:
    """Rubric dimensions in [0, 1] (those the teacher gave) and its reason."""

    dims: dict[str, float]
    reason: str = ""

    def overall(self, weights: Mapping[str, float] | None = None) -> float:
        """The weighted mean over the dimensions present (equal weights when none are given)."""
        w = {k: (weights or {}).get(k, 0.0 if weights else 1.0) for k in self.dims}
        total = sum(w.values())
        if total <= 0:
            raise ValueError(f"no weight on any scored dimension ({sorted(self.dims)})")
        return sum(w[k] * v for k, v in self.dims.items()) / total


# ---------------------------------------------------------------- matching ------
_WORD = re.compile(r"[a-z0-9@.$_-]+")


def _words(text: str | None) -> set[str]:
    return set(_WORD.findall((text or "").lower()))


def action_agreement(proposal: ParsedAction, taken: ParsedAction) -> float:
    """How far a teacher's proposed action agrees with the action taken, in [0, 1]: 1 for the same
    tool call (name and arguments), 0.5 for the same tool with other arguments, the word overlap
    (Jaccard) of two final answers, 0 otherwise (malformed turns agree with nothing)."""
    if proposal.kind == "tool" and taken.kind == "tool":
        if action_key(proposal) == action_key(taken):
            return 1.0
        return 0.5 if proposal.name == taken.name else 0.0
    if proposal.kind == "answer" and taken.kind == "answer":
        a, b = _words(proposal.text), _words(taken.text)
        return 1.0 if a == b else len(a & b) / len(a | b)
    return 0.0


# --------------------------------------------------------------- teachers ------
class BlackBoxTeacher:
    """The common part: acting through the client. Subclasses elicit the other signals.

    Every method returns None when the teacher failed or answered malformed (the client counts
    it); callers skip that sample."""

    capabilities = BLACKBOX_CAPABILITIES

    def __init__(
        self,
        client: TeacherClient,
        name: str = "teacher",
        act_temperature: float = 0.0,
        max_tokens: int = 96,
        seed: int = 0,
    ):
        self.client, self.name = client, name
        self.act_temperature, self.max_tokens, self.seed = act_temperature, max_tokens, seed

    def act(
        self, messages: Sequence[Mapping[str, Any]], n: int = 1, temperature: float | None = None
    ) -> list[dict[str, Any]] | None:
        """``n`` next actions (assistant messages) of the teacher at the state ``messages``."""
        t = self.act_temperature if temperature is None else temperature
        return self.client.complete(list(messages), n=n, temperature=t, max_tokens=self.max_tokens, seed=self.seed)

    def critique(self, ep: StudentEpisode) -> StepCritique | None:
        raise NotImplementedError

    def score(self, ep: StudentEpisode) -> TrajectoryScore | None:
        raise NotImplementedError

    def rank(self, eps: Sequence[StudentEpisode]) -> list[float] | None:
        raise NotImplementedError

    def rank_actions(
        self, messages: Sequence[Mapping[str, Any]], actions: Sequence[Mapping[str, Any]]
    ) -> list[float] | None:
        raise NotImplementedError


class ActingTeacher(BlackBoxTeacher):
    """Every signal from ``samples`` of the teacher's own next actions at the student's states."""

    def __init__(
        self,
        client: TeacherClient,
        name: str = "teacher",
        samples: int = 4,
        temperature: float = 1.0,
        threshold: float = 0.5,
        act_temperature: float = 0.0,
        max_tokens: int = 96,
        seed: int = 0,
        memo_size: int = 4096,
    ):
        super().__init__(client, name, act_temperature, max_tokens, seed)
        if samples < 1:
            raise ValueError(f"samples must be >= 1, got {samples}")
        self.samples, self.temperature, self.threshold = samples, temperature, threshold
        self._memo: OrderedDict[str, list[dict[str, Any]] | None] = OrderedDict()
        self._memo_size = memo_size
        self._memo_lock = threading.Lock()  # recipes ask about several episodes at once

    def proposals(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]] | None:
        """The teacher's sampled next actions at a state (memoised: recipes ask about a state more than once)."""
        key = json.dumps(list(messages), sort_keys=True, default=str)
        with self._memo_lock:
            if key in self._memo:
                self._memo.move_to_end(key)
                return self._memo[key]
        out = self.act(messages, n=self.samples, temperature=self.temperature)
        with self._memo_lock:
            self._memo[key] = out
            if len(self._memo) > self._memo_size:
                self._memo.popitem(last=False)
        return out

    def _agreement(self, props: list[dict[str, Any]], taken: ParsedAction) -> float:
        return sum(action_agreement(action_of(p), taken) for p in props) / len(props)

    def critique(self, ep: StudentEpisode) -> StepCritique | None:
        scores: list[float] = []
        first, correct = None, None
        for i, idx in enumerate(ep.turn_indices):
            props = self.proposals(ep.messages[:idx])
            if not props:
                return None
            scores.append(self._agreement(props, action_of(ep.messages[idx])))
            if first is None and scores[-1] < self.threshold:
                first = i
                keys = Counter(action_key(action_of(p)) for p in props)
                best = keys.most_common(1)[0][0]
                correct = next(p for p in props if action_key(action_of(p)) == best)
        return StepCritique(scores, first, correct)

    def score(self, ep: StudentEpisode) -> TrajectoryScore | None:
        c = self.critique(ep)
        if c is None or not c.scores:
            return None if c is None else TrajectoryScore({"task_success": 0.0}, "no student turn")
        turns = [action_of(ep.messages[i]) for i in ep.turn_indices]
        tool = [s for s, a in zip(c.scores, turns) if a.kind == "tool"]
        answered = ep.traj.finish_reason == "answer" and turns[-1].kind == "answer"
        dims = {"task_success": min(c.scores) if answered else 0.0, "final_answer": c.scores[-1] if answered else 0.0}
        if tool:
            keys = [action_key(a) for a in turns if a.kind == "tool"]
            dims.update(tool_correctness=sum(tool) / len(tool), efficiency=len(set(keys)) / len(keys))
        weakest = min(range(len(c.scores)), key=c.scores.__getitem__)
        return TrajectoryScore(dims, f"weakest turn {weakest + 1} agrees {c.scores[weakest]:.2f} with the teacher")

    def rank(self, eps: Sequence[StudentEpisode]) -> list[float] | None:
        out = []
        for ep in eps:
            s = self.score(ep)
            if s is None:
                return None
            out.append(s.overall())
        return out

    def rank_actions(self, messages, actions) -> list[float] | None:
        props = self.proposals(messages)
        if not props:
            return None
        return [self._agreement(props, action_of(a)) for a in actions]


# ------------------------------------------------------------ prompted teacher ------
class _Scores(BaseModel):
    model_config = ConfigDict(extra="ignore")
    scores: list[float] = Field(min_length=1)
    reason: str = ""

    def valid_for(self, n: int) -> list[float] | None:
        ok = len(self.scores) == n and all(0.0 <= s <= 1.0 for s in self.scores)
        return list(self.scores) if ok else None


class _Action(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str | None = None
    arguments: dict[str, Any] = Field(default_factory=dict)
    answer: str | None = None


class _Critique(BaseModel):
    model_config = ConfigDict(extra="ignore")
    step_scores: list[float]
    first_wrong_step: int | None = None  # 1-based
    correct_action: _Action | None = None


def messages_transcript(messages: Sequence[Mapping[str, Any]]) -> str:
    """A plain-text transcript of chat messages (the system turn left out), one line per message,
    student turns numbered."""
    lines, turn = [], 0
    for m in messages:
        if m["role"] == "system":
            continue
        if m["role"] == "assistant":
            turn += 1
            a = action_of(m)
            what = (
                f"calls {a.name} {json.dumps(a.arguments, sort_keys=True)}"
                if a.kind == "tool"
                else f"answers: {a.text}"
                if a.kind == "answer"
                else f"writes a malformed call: {a.raw}"
            )
            lines.append(f"[step {turn}] agent {what}")
        else:
            lines.append(f"{m['role']}: {message_text(m)}")
    return "\n".join(lines)


_RULES = "Answer with one JSON object and nothing else."


class PromptedTeacher(BlackBoxTeacher):
    """Each signal asked for in words, the answer read as JSON (pydantic-validated)."""

    def __init__(
        self,
        client: TeacherClient,
        name: str = "teacher",
        threshold: float = 0.5,
        act_temperature: float = 0.0,
        max_tokens: int = 512,
        seed: int = 0,
    ):
        super().__init__(client, name, act_temperature, max_tokens, seed)
        self.threshold = threshold

    def _ask(self, system: str, user: str, schema):
        msgs = [{"role": "system", "content": f"{system} {_RULES}"}, {"role": "user", "content": user}]
        params = {"temperature": 0.0, "max_tokens": self.max_tokens, "seed": self.seed}
        self._last = (msgs, params)
        return self.client.structured(msgs, schema, **params)

    def score(self, ep: StudentEpisode) -> TrajectoryScore | None:
        from mentorrl.eval.llm_judge import Rubric, rubric_messages

        r = self.client.structured(
            rubric_messages(ep.task, ep.traj), Rubric, temperature=0.0, max_tokens=self.max_tokens, seed=self.seed
        )
        if r is None:
            return None
        dims = r.model_dump()
        reason = dims.pop("reason", "")
        return TrajectoryScore({k: float(v) for k, v in dims.items()}, reason)

    def rank(self, eps: Sequence[StudentEpisode]) -> list[float] | None:
        body = "\n\n".join(f"Candidate {i + 1}:\n{messages_transcript(e.messages)}" for i, e in enumerate(eps))
        out = self._ask(
            "You compare attempts of a tool-using agent at the same request.",
            f"{body}\n\nScore every candidate from 0 (wrong) to 1 (fully correct and efficient): "
            f'{{"scores": [one number per candidate, in order], "reason": "..."}}',
            _Scores,
        )
        return self._checked(out, lambda o: o.valid_for(len(eps)))

    def critique(self, ep: StudentEpisode) -> StepCritique | None:
        n = len(ep.turn_indices)
        out = self._ask(
            "You review a tool-using agent's steps.",
            f"{messages_transcript(ep.messages)}\n\nScore each of the {n} agent steps from 0 (wrong) to "
            "1 (right), name the first wrong step (1-based, null if none) and the correct action there: "
            '{"step_scores": [...], "first_wrong_step": k, "correct_action": {"name": "tool", '
            '"arguments": {...}} or {"answer": "..."}}',
            _Critique,
        )
        ok = lambda o: (
            (
                len(o.step_scores) == n
                and all(0.0 <= s <= 1.0 for s in o.step_scores)  # noqa: E731
                and (o.first_wrong_step is None or 1 <= o.first_wrong_step <= n)
            )
            or None
        )
        if self._checked(out, ok) is None:
            return None
        first = out.first_wrong_step
        if first is None:
            first = next((i + 1 for i, s in enumerate(out.step_scores) if s < self.threshold), None)
        return StepCritique(
            list(out.step_scores), None if first is None else first - 1, _as_message(out.correct_action)
        )

    def rank_actions(self, messages, actions) -> list[float] | None:
        listed = "\n".join(
            f"{i + 1}. {messages_transcript([dict(a)]).split('] agent ', 1)[-1]}" for i, a in enumerate(actions)
        )
        out = self._ask(
            "You judge a tool-using agent's possible next actions.",
            f"{messages_transcript(messages)}\n\nPossible next actions:\n{listed}\n\nScore each from 0 "
            'to 1 by how right it is as the next step: {"scores": [...], "reason": "..."}',
            _Scores,
        )
        return self._checked(out, lambda o: o.valid_for(len(actions)))

    def _checked(self, out, check):
        """``check(out)`` for a parsed answer; an answer that parsed but does not fit (a wrong count of
        scores, a score outside [0, 1], a step out of range) is counted as invalid. None passes
        through (the client counted it)."""
        if out is None:
            return None
        value = check(out)
        if value is None:
            self.client._count("invalid_structured")
            msgs, params = self._last
            self.client.forget(msgs, **params)  # not replayed from the cache next time
        return value


def _as_message(a: _Action | None) -> dict[str, Any] | None:
    from mentorrl.chat import tool_call_dict

    if a is None:
        return None
    if a.name:
        return {"role": "assistant", "content": None, "tool_calls": [tool_call_dict(a.name, a.arguments)]}
    if a.answer is not None:
        return {"role": "assistant", "content": a.answer}
    return None


__all__ = [
    "ActingTeacher",
    "BLACKBOX_CAPABILITIES",
    "BlackBoxTeacher",
    "PromptedTeacher",
    "StepCritique",
    "StudentEpisode",
    "TrajectoryScore",
    "action_agreement",
    "messages_transcript",
]
