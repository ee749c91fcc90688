"""The τ²-bench expert, the audit's attacks, and the screen that finds the tasks an attack wins.

* :class:`Tau2Expert` replays each task's gold actions (asking the user to confirm before each
  state-changing one, as the domain policies require; in solo mode, with no user, it takes the
  user's actions too) and ends with a message carrying the task's ``communicate_info``: the SFT demonstrations and the audit's honest baseline.
* :func:`tau2_attacks`: doing nothing, refusing, and transferring to a human at once; each is a
  scripted policy the preflight reward audit (:mod:`mentorrl.integrity.attacks`) runs like any
  environment's attacks.
* :func:`screen_tasks` plays every attack on every task of a split against the real environment
  and verifier, without a tokenizer, and reports the tasks where an attack earns the full
  benchmark reward (upstream's known no-op tasks are among them); :mod:`.tasks` leaves those out
  of training by default.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Sequence

from mentorrl.envs.base import FinalAnswer, Task, ToolAction, Verdict
from mentorrl.envs.suites import Attack, Script

from .records import Tau2Task

USER_TOOL = "message_user"  # the env's user channel (env.USER_TOOL; repeated so this module imports no env)
TRANSFER_TOOL = "transfer_to_human_agents"  # retail, airline and telecom all have it
MAX_SCRIPT_TURNS = 64


class Tau2Expert:
    """Replays the gold actions (see the module docstring); ``mutating``: the domain's state-changing tools."""

    def __init__(self, mutating: Iterable[str] = (), solo: bool = False):
        self.mutating, self.solo = frozenset(mutating), solo

    def act(self, task: Task) -> Script:
        record = Tau2Task.model_validate(task.reference["tau2"])
        crit = record.evaluation_criteria
        for action in (crit.actions or []) if crit else []:
            if action.requestor != "assistant" and not self.solo:
                continue  # the user's own actions (telecom) are the user's to take, or the agent's in solo mode
            if action.name in self.mutating and not self.solo:  # solo mode: no customer to ask
                args = json.dumps(action.arguments, ensure_ascii=False)
                yield ToolAction(USER_TOOL, {"message": f"I will now run {action.name} with {args}. Do you confirm?"})
            yield ToolAction(action.name, dict(action.arguments))
        info = (crit.communicate_info or []) if crit else []
        yield FinalAnswer(text=("To sum up: " + "; ".join(info) + ".") if info else "Your request is handled. Goodbye.")


def _do_nothing(task: Task) -> Script:
    yield FinalAnswer(text="Thank you for contacting us. Goodbye.")


def _refuse(task: Task) -> Script:
    yield FinalAnswer(text="I'm sorry, but I cannot help you with this request.")


def _transfer(task: Task) -> Script:
    yield ToolAction(TRANSFER_TOOL, {"summary": "The customer needs help with their request."})
    yield FinalAnswer(text="You are being transferred to a human agent. Please hold on.")


def tau2_attacks() -> list[Attack]:
    """The audit's attacks on a τ²-bench domain (none breaks a hard constraint: the benchmark has none)."""
    every = lambda task: True  # noqa: E731
    return [
        Attack("do_nothing", "end the conversation at once, with no tool call", False, every, _do_nothing),
        Attack("refuse", "refuse the request without looking at anything", False, every, _refuse),
        Attack("transfer_at_once", "transfer to a human agent at once", False, every, _transfer),
    ]


def play(env: Any, task: Task, script: Any) -> Verdict:
    """One scripted episode straight against ``env`` (reset, steps, verify), no tokenizer."""
    env.reset(task)
    turns = script(task)
    action = next(turns)
    for _ in range(MAX_SCRIPT_TURNS):
        if isinstance(action, FinalAnswer):
            return env.verify(action.text)
        result = env.step(action.name, action.arguments)
        try:
            action = turns.send(result)
        except StopIteration:
            break
    return env.verify(None)


def benchmark_reward(verdict: Verdict) -> float:
    tau2 = verdict.details.get("tau2") or {}
    value = tau2.get("reward", 0.0) if isinstance(tau2, dict) else 0.0
    return float(value) if isinstance(value, (int, float)) else 0.0


def screen_tasks(env: Any, tasks: Sequence[Task], attacks: Sequence[Attack]) -> dict[str, list[str]]:
    """Benchmark task id -> the attacks that earn its full reward (only tasks some attack wins)."""
    won: dict[str, list[str]] = {}
    for task in tasks:
        for attack in attacks:
            if attack.applies(task) and benchmark_reward(play(env, task, attack.script)) >= 1.0:
                won.setdefault(str(task.reference["tau2_id"]), []).append(attack.name)
    return won


__all__ = ["Tau2Expert", "benchmark_reward", "play", "screen_tasks", "tau2_attacks"]
