"""One agent episode as a small state machine over token ids.

The batched engine, the one-at-a-time baseline and the expert-demonstration builder all
drive the same :class:`Episode`, so every trajectory is assembled by one piece of code:

    ids = ep.start()                      # prompt ids (loss mask 0)
    loop:
        ep.add_policy_turn(ids, logprobs) # policy ids (loss mask 1) -> an action
        if action is a tool call:
            result = ep.run_tool(action)  # env.step, never raises
            ids = ep.add_observation(result)  # observation ids (loss mask 0), or None when out of budget
    traj = ep.finish()                    # verify state, compose reward
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
import uuid
from typing import Any, Callable

from mentorrl.contract import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ParsedAction,
    RolloutContract,
    render_observation_content,
    render_tool_call,
    replace_surrogates,
)
from mentorrl.envs.base import Environment, FinalAnswer, Task, ToolResult, Verdict
from mentorrl.rewards.compose import RewardWeights, compose_reward
from mentorrl.trajectory import Segment, ToolCall, Trajectory

log = logging.getLogger(__name__)


class Episode:
    def __init__(
        self,
        contract: RolloutContract,
        env: Environment,
        task: Task,
        policy_version: int = 0,
        weights: RewardWeights | None = None,
        source: str = "policy",
        token_budget: int | None = None,
        seed_index: int | None = None,
    ):
        """``token_budget``: a per-episode cap on the tokens after the prompt (policy turns and
        observations), e.g. ShortOPD's adaptive rollout length; the contract's ``max_total_tokens``
        still bounds the total. None: the contract's limit only. ``seed_index``: the index its sampling
        generator is seeded with in a stream (:meth:`mentorrl.rollout.engine.RolloutEngine.run_stream`;
        None: its admission order)."""
        if token_budget is not None and token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {token_budget}")
        self.contract, self.env, self.task = contract, env, task
        self.token_budget = token_budget
        self.seed_index = seed_index
        self.max_total_tokens = contract.max_total_tokens
        self.policy_version, self.weights, self.source = policy_version, weights or RewardWeights(), source
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.segments: list[Segment] = []
        self.tool_calls: list[ToolCall] = []
        self.final_answer: str | None = None
        self.finish_reason: str | None = None
        self.num_turns = 0
        self.timings = {"tool_s": 0.0}
        self.env_errors: list[str] = []  # exceptions the environment raised in step / verify (this episode's failure)
        self._t0 = time.perf_counter()

    # ---- token bookkeeping ------------------------------------------------
    def _append(self, role: str, ids: list[int], logprobs: list[float] | None = None) -> None:
        start = len(self.ids)
        self.ids.extend(ids)
        self.mask.extend([1 if role == "policy" else 0] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        self.segments.append(Segment(role=role, start=start, end=len(self.ids)))

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def tokens_left(self) -> int:
        return self.max_total_tokens - len(self.ids)

    # ---- the protocol -------------------------------------------------------
    def start(self) -> list[int]:
        user = self.env.reset(self.task)
        ids = self.contract.prompt_ids(user)
        if len(ids) >= self.max_total_tokens:
            raise ValueError(
                f"task {self.task.id}: prompt is {len(ids)} tokens, over max_total_tokens={self.max_total_tokens}"
            )
        if self.token_budget is not None:
            self.max_total_tokens = min(self.max_total_tokens, len(ids) + self.token_budget)
        self._append("prompt", ids)
        return ids

    def add_policy_turn(self, ids: list[int], logprobs: list[float], stopped: bool) -> ParsedAction | None:
        """Record a generated turn. Returns the tool call to run, or None when the episode ended."""
        self._append("policy", ids, logprobs)
        self.num_turns += 1
        if not stopped:  # hit the per-turn or total token budget before the stop token
            self.finish_reason = "length" if self.tokens_left() > 0 else "max_tokens"
            return None
        text = self.contract.decode_turn(ids)
        action = self.contract.parse_action(text)
        if action.kind == "answer":
            self.final_answer = action.text
            self.finish_reason = "answer"
            return None
        if action.kind == "tool" and action.name == getattr(self.env, "answer_tool", None):
            # a typed final answer: the call's JSON as written is the answer (the verifier parses it
            # strictly); it ends the episode and is never run as a tool
            self.final_answer = answer_call_text(text, action.body if action.body is not None else action.raw)
            self.finish_reason = "answer"
            return None
        if self.num_turns >= self.contract.limits.max_turns:
            self.finish_reason = "max_turns"
            return None
        return action

    def run_tool(self, action: ParsedAction) -> ToolResult:
        if action.kind == "malformed":
            result = ToolResult(ok=False, content=None, error=action.error, error_kind="malformed")
        else:
            try:
                result = self.env.step(action.name, action.arguments)
            except Exception as e:  # an environment error is this episode's failed call, never the batch's
                why = self._env_error("step", e)
                result = ToolResult(ok=False, content=None, error=why, error_kind="tool_exception")
        result = _clean_result(result)  # an environment's lone surrogates never reach the record or the tokenizer
        self.timings["tool_s"] += result.latency_s
        self.tool_calls.append(
            ToolCall(
                turn=self.num_turns,
                name=action.name,
                arguments=action.arguments if isinstance(action.arguments, dict) else None,
                raw=action.raw,
                result=result.content if result.ok else None,
                error=result.error,
                error_kind=result.error_kind,
                latency_s=result.latency_s,
            )
        )
        return result

    def add_observation(self, result: ToolResult) -> list[int] | None:
        """Append the observation; returns its ids, or None if it does not fit (episode ends)."""
        ids = self.contract.observation_ids(render_observation_content(result.ok, result.content, result.error))
        if len(ids) >= self.tokens_left():
            self.finish_reason = "max_tokens"
            return None
        self._append("observation", ids)
        return ids

    def _env_error(self, where: str, e: Exception) -> str:
        why = f"environment error in {where}: {type(e).__name__}: {str(e)[:200]}"
        self.env_errors.append(why)
        log.warning("task %s: %s", self.task.id, why)
        return why

    def finish(self) -> Trajectory:
        if self.finish_reason is None:
            raise RuntimeError("finish() called on a live episode")
        t_verify = time.perf_counter()
        try:
            verdict = self.env.verify(self.final_answer)
        except Exception as e:  # an environment error fails this episode, never the batch
            why = self._env_error("verify", e)
            verdict = Verdict(success=False, details={"error": why, "env_error": True})
        self.timings["verify_s"] = time.perf_counter() - t_verify
        self.timings["total_s"] = time.perf_counter() - self._t0
        reward = compose_reward(
            verdict,
            tool_calls=self.tool_calls,
            finish_reason=self.finish_reason,
            weights=self.weights,
            final_answer=self.final_answer,
        )
        return Trajectory(
            id=f"{self.task.id}-{uuid.uuid4().hex[:10]}",
            task_id=self.task.id,
            family=self.task.family,
            split=self.task.split,
            difficulty=self.task.difficulty,
            token_ids=self.ids,
            loss_mask=self.mask,
            logprobs=self.logprobs,
            segments=self.segments,
            policy_version=self.policy_version,
            env_name=self.contract.env_name,
            env_version=self.contract.env_version,
            sampling=self.contract.trajectory_sampling(self.max_total_tokens),
            contract_fingerprint=self.contract.fingerprint(),
            tool_calls=self.tool_calls,
            final_answer=self.final_answer,
            finish_reason=self.finish_reason,
            num_turns=self.num_turns,
            reward=reward,
            timings=self.timings,
            source=self.source,
        )


_THINK = r"^\s*<think>.*?</think>"  # a reasoning block before the call
_CALL_MARKS = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE, "<|python_tag|>")


def answer_call_text(turn: str, body: str) -> str:
    """What a typed-answer turn hands the verifier: the call's JSON ``body`` when the turn is that call
    and nothing else (a leading reasoning block and the call's own tags aside); otherwise the whole turn,
    which no strict reader takes for a record -- prose around the call is a format failure, never
    text that rides along unchecked."""
    rest = re.sub(_THINK, "", turn.replace(body, "", 1), count=1, flags=re.DOTALL)
    for mark in _CALL_MARKS:
        rest = rest.replace(mark, "", 1)
    return body if not rest.strip() else turn


def close_env(env: Any) -> None:
    """``env.close()``, an error in it logged, never raised: closing one environment never skips another's."""
    try:
        env.close()
    except Exception as e:  # noqa: BLE001 - whatever the environment raises
        log.warning("closing environment %s failed: %s: %s", getattr(env, "name", env), type(e).__name__, e)


class EpisodeSource:
    """Episodes pulled from ``next_episode()`` until it returns None (then ``exhausted``) or ``stop`` is set:
    the admission side of continuous batching, shared by :meth:`RolloutEngine.run_stream` and
    :func:`mentorrl.rollout.backends.stream_episodes`."""

    def __init__(self, next_episode: Callable[[], "Episode | None"], stop: Any = None):
        self.next_episode, self.stop, self.exhausted = next_episode, stop, False

    def take(self, n: int) -> list["Episode"]:
        """Up to ``n`` more episodes (fewer once the source is dry or ``stop`` is set)."""
        out: list[Episode] = []
        while len(out) < n and not self.exhausted and not (self.stop is not None and self.stop.is_set()):
            ep = self.next_episode()
            if ep is None:
                self.exhausted = True
            else:
                out.append(ep)
        return out


def _clean(value: Any) -> Any:
    """``value`` with every string's surrogate code points replaced by U+FFFD (JSON-serialisable)."""
    if isinstance(value, str):
        return replace_surrogates(value)
    if isinstance(value, dict):
        return {_clean(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _clean_result(result: ToolResult) -> ToolResult:
    if result.ok:
        content = _clean(result.content)
        return result if content == result.content else dataclasses.replace(result, content=content)
    error = _clean(result.error)
    return result if error == result.error else dataclasses.replace(result, error=error)


def drive_script(
    expert: Any,
    task: Task,
    act: Callable[[str], ToolResult | None],
    render_call: Callable[[str, dict[str, Any]], str] = render_tool_call,
    answer_tool: str | None = None,
) -> None:
    """Feed a scripted policy's turns, as text, to ``act``.

    ``expert.act(task)`` is a generator yielding ToolAction / FinalAnswer and receiving
    ToolResults; ``act(text)`` plays one turn and returns the tool result, or None once the
    episode has ended. ``render_call`` writes a tool call as the policy does (the contract's
    :meth:`~mentorrl.contract.RolloutContract.render_tool_call`). ``answer_tool``: the environment's
    typed-answer tool; a final answer that carries a record is then that tool's call.
    """
    gen = expert.act(task)
    action = next(gen)
    while True:
        if isinstance(action, FinalAnswer):
            typed = answer_tool is not None and action.record is not None
            text = render_call(answer_tool, action.record) if typed else action.text
        else:
            text = render_call(action.name, action.arguments)
        result = act(text)
        if result is None:
            return
        try:
            action = gen.send(result)
        except StopIteration:
            return


def text_turn_player(ep: Episode) -> Callable[[str], ToolResult | None]:
    """``act(text)`` for an episode whose policy turns are given as text (loss mask 1, log-probs 0)."""

    def act(text: str) -> ToolResult | None:
        ids = ep.contract.policy_turn_ids(text)
        parsed = ep.add_policy_turn(ids, [0.0] * len(ids), stopped=True)
        if parsed is None:
            return None
        result = ep.run_tool(parsed)
        return result if ep.add_observation(result) is not None else None

    return act


def _finish_scripted(ep: Episode) -> Trajectory:
    if not ep.done:  # the script ran out of turns before answering
        ep.finish_reason = "answer" if ep.final_answer is not None else "max_turns"
    return ep.finish()


def run_scripted_episode(contract: RolloutContract, env: Environment, task: Task, expert: Any, **kw: Any) -> Trajectory:
    """An episode whose policy turns are a scripted expert's text."""
    ep = Episode(contract, env, task, **{"source": "expert", **kw})
    ep.start()
    drive_script(expert, task, text_turn_player(ep), contract.render_tool_call, getattr(env, "answer_tool", None))
    return _finish_scripted(ep)


def run_text_turns(contract: RolloutContract, env: Environment, task: Task, turns: list[str], **kw: Any) -> Trajectory:
    """Replay fixed policy-turn texts (what a model might have written): audits, tests, attacks."""
    ep = Episode(contract, env, task, **kw)
    ep.start()
    act = text_turn_player(ep)
    for text in turns:
        if act(text) is None:
            break
    return _finish_scripted(ep)
