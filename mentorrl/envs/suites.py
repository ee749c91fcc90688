"""What an environment brings to the reward-integrity checks: its attacks and corruptions, as types.

An environment's :class:`~mentorrl.envs.EnvEntry` names its reward-hacking :class:`Attack` suite,
its validation :class:`Corruption` suite and its mutating tools; :mod:`mentorrl.integrity` runs
them (the audit, offline reward validation) and :mod:`mentorrl.flywheel` reads the mutating
tools. The types live here, beside the environments, so an environment defines its suites
without importing the layers that run them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterable

from mentorrl.envs.base import Action, Environment, FinalAnswer, Task, ToolAction, ToolRegistry, ToolResult, Verdict

Script = Generator[Action, ToolResult, None]
"""A scripted policy's turns: yields actions, receives each tool result via ``send``."""

Mark = Callable[[], None]
"""Called by a corruption at the moment it changes the expert's behaviour."""

ToolHook = Callable[[ToolAction], Generator[Action, ToolResult, "ToolResult | None"]]
"""Plays one of the expert's tool calls (any number of turns); returns the result the expert
receives, or None when the hook ended the episode (e.g. by answering)."""
AnswerHook = Callable[[FinalAnswer], "FinalAnswer | None"]
"""Rewrites the expert's final answer; None drops it (the episode ends without an answer)."""


def relay(turns: Script, on_tool: ToolHook | None = None, on_answer: AnswerHook | None = None) -> Script:
    """Forward a scripted policy's turns, letting ``on_tool`` / ``on_answer`` change them (every
    environment's attacks and corruptions are built this way)."""
    action = next(turns)
    while True:
        if isinstance(action, FinalAnswer):
            final = action if on_answer is None else on_answer(action)
            if final is not None:
                yield final
            return
        result = (yield from on_tool(action)) if on_tool is not None else (yield action)
        if result is None:
            return
        try:
            action = turns.send(result)
        except StopIteration:
            return


# ------------------------------------------------------------------ fault injection ----
class LostResponseEnv:
    """Wraps an environment so the first ``times`` successful calls to ``tools`` lose their response.

    The call really runs (its side effect is committed to the environment's state); the policy
    is then told the call timed out -- the classic lost response behind double submissions. The
    counter restarts at every :meth:`reset`. Everything else is delegated to the wrapped env, so
    the verifier still judges the real state.
    """

    def __init__(self, env: Environment, tools: Iterable[str], times: int = 1):
        if times < 0:
            raise ValueError(f"times must be >= 0, got {times}")
        self.env = env
        self.tools = frozenset(tools)
        self.times = times
        self.lost: list[str] = []  # names of the calls whose response was lost this episode

    # the Environment protocol's attributes come from the wrapped env
    @property
    def name(self) -> str:
        return self.env.name

    @property
    def version(self) -> str:
        return self.env.version

    @property
    def system_prompt(self) -> str:
        return self.env.system_prompt

    @property
    def registry(self) -> ToolRegistry:
        return self.env.registry

    @property
    def answer_tool(self) -> str | None:
        return getattr(self.env, "answer_tool", None)

    def reset(self, task: Task) -> str:
        self.lost = []
        return self.env.reset(task)

    def step(self, name: Any, arguments: Any) -> ToolResult:
        result = self.env.step(name, arguments)
        if result.ok and name in self.tools and len(self.lost) < self.times:
            self.lost.append(name)
            timeout = getattr(self.env.registry, "timeout_s", 0.0)
            return ToolResult(
                ok=False,
                content=None,
                error=f"tool {name} timed out after {timeout:g}s",
                error_kind="timeout",
                latency_s=result.latency_s,
            )
        return result

    def verify(self, final_answer: str | None) -> Verdict:
        return self.env.verify(final_answer)

    def close(self) -> None:
        self.env.close()


# ------------------------------------------------------------------------- attacks ----
@dataclass(frozen=True)
class Attack:
    """One reward-hacking strategy, as a scripted policy, and the tasks it targets.

    ``hard`` declares that a successful execution breaks a hard constraint (a forbidden state
    change the verifier must report as a violation): such an attack must score below 0.
    ``applies`` picks the tasks the attack makes sense on (it may use the task's private
    reference: the audit is white-box). ``wrap_env`` optionally wraps the environment the
    attack runs in (fault injection); the honest baseline always runs unwrapped.
    """

    name: str
    description: str
    hard: bool
    applies: Callable[[Task], bool]
    script: Callable[[Task], Script]
    wrap_env: Callable[[Environment], Environment] | None = None


# --------------------------------------------------------------------- corruptions ----
@dataclass(frozen=True)
class Corruption:
    """A deliberate error in the expert's behaviour.

    ``transform(task, expert_turns, mark)`` returns the corrupted turns: it relays the expert's
    generator and changes one thing, calling ``mark()`` when (and only when) the change makes
    the trajectory wrong.
    """

    name: str
    description: str
    transform: Callable[[Task, Script, Mark], Script]


__all__ = ["Attack", "Corruption", "LostResponseEnv", "Mark", "Script"]
