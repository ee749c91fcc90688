"""A recorded external episode scored the way an in-process rollout is scored.

An external agent's episode is recorded token in / token out (:mod:`mentorrl.rollout.recorder`), but
its reward and its end are the agent's: it may score with its own formula, run the environment's
typed-answer tool as if it were a tool (and go on talking), ignore the run's turn and token limits.
:func:`replay_episode` replays the policy's recorded turns through a fresh environment for the task
with the same :class:`~mentorrl.rollout.episode.Episode` every in-process rollout uses: each turn is
parsed by the contract, its tool call run, its observation appended (the context budget checked), and
the episode ends where an in-process one would (the answer, the typed-answer call, ``max_turns``, a
turn over ``max_new_tokens`` or over the context budget). The verifier then scores the final state
and :func:`~mentorrl.rewards.compose.compose_reward` composes the reward with the run's weights, the
same reward the in-process GRPO arm gets.

The recorded tokens stay what the policy saw (the agent's own observations, its own prompt): the
replay only decides the reward and where the in-process episode would have ended. Turns the agent
recorded after that end are cut (``turns_cut``): an in-process rollout never samples them, so they
get no advantage. A recording that stops before the environment's episode ended (the agent gave up,
e.g. a malformed call it returned as text) ends as ``max_turns`` without an answer (``agent_stopped``).
When the replayed observations differ from the recorded ones (the agent renders its tools another
way), ``observations_differ`` counts it; the reward still comes from the environment's own replay.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from mentorrl.rollout.episode import Episode, close_env
from mentorrl.rollout.recorder import RecordedSegment
from mentorrl.trajectory import Trajectory

REPLAY_COUNTERS = ("turns_cut", "agent_stopped", "observations_differ", "segments_cut")


@dataclass
class Replayed:
    """The replay of one recorded episode: ``trajectory`` is the in-process episode the policy's turns
    make (its reward, tool calls, final answer and finish reason are the verifier's view); ``segments``
    the recorded segments cut where that episode ended; ``counts`` the :data:`REPLAY_COUNTERS`."""

    trajectory: Trajectory
    segments: list[RecordedSegment]
    counts: dict[str, int] = field(default_factory=dict)
    tools_s: float = 0.0


def _cut(seg: RecordedSegment, end: int, turns: int) -> RecordedSegment:
    return RecordedSegment(seg.token_ids[:end], seg.loss_mask[:end], seg.logprobs[:end], seg.versions[:turns], turns)


def replay_episode(
    segments: Sequence[RecordedSegment],
    task: Any,
    contract: Any,
    make_env: Callable[[], Any],
    weights: Any = None,
    policy_version: int = 0,
) -> Replayed:
    """Replay the policy's recorded turns of ``segments`` (in order) through ``make_env()`` for ``task``
    (see the module docstring)."""
    counts = dict.fromkeys(REPLAY_COUNTERS, 0)
    stops = set(contract.stop_token_ids)
    env = make_env()
    t0 = time.perf_counter()
    try:
        ep = Episode(contract, env, task, policy_version=policy_version, weights=weights)
        ep.start()
        kept: list[RecordedSegment] = []
        for seg in segments:
            if ep.done:
                counts["segments_cut"] += 1
                counts["turns_cut"] += seg.turns
                continue
            end, turns, spans = len(seg.token_ids), 0, seg.spans()
            for k, (role, a, b) in enumerate(spans):
                if role != "policy":
                    continue
                if ep.done:
                    counts["turns_cut"] += 1
                    continue
                ids, lps = seg.token_ids[a:b], seg.logprobs[a:b]
                room = ep.tokens_left()
                stopped = bool(ids) and ids[-1] in stops
                if len(ids) > room:  # an in-process turn is cut at the context budget
                    ids, lps, stopped, b = ids[:room], lps[:room], False, a + room
                if len(ids) > contract.sampling.max_new_tokens:  # ... and at max_new_tokens
                    n = contract.sampling.max_new_tokens
                    ids, lps, stopped, b = ids[:n], lps[:n], False, a + n
                turns += 1
                end = b
                action = ep.add_policy_turn(list(ids), list(lps), stopped)
                if action is None:
                    continue
                result = ep.run_tool(action)
                obs = ep.add_observation(result)
                if obs is None:
                    continue
                nxt = spans[k + 1] if k + 1 < len(spans) else None
                if nxt is not None and nxt[0] == "observation":
                    if not _starts_with(seg.token_ids[nxt[1] : nxt[2]], obs):
                        counts["observations_differ"] += 1
            if turns:
                kept.append(_cut(seg, end, turns) if end < len(seg.token_ids) or turns < seg.turns else seg)
        if not ep.done:
            counts["agent_stopped"] += 1
            ep.finish_reason = "max_turns"
        traj = ep.finish()
    finally:
        tools_s = time.perf_counter() - t0
        close_env(env)
    return Replayed(traj, kept, counts, tools_s)


def _starts_with(recorded: Sequence[int], obs: Sequence[int]) -> bool:
    """Whether the recorded observation run holds the replay's observation ids (the run may also hold
    the next assistant header, which the contract puts at the start of the next policy turn's prompt)."""
    return list(recorded[: len(obs)]) == list(obs)


__all__ = ["REPLAY_COUNTERS", "Replayed", "replay_episode"]
