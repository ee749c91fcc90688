"""A Gymnasium-style environment (``reset(seed=, options=) -> (obs, info)``, ``step(action) ->
(obs, reward, terminated, truncated, info)``) with text observations and text actions.

The policy plays it through one tool (``act`` by default) whose ``action`` argument is the text
action, or one of ``action_names`` for a discrete action space (the index is what ``step`` gets).
Each call's observation is ``{"observation", "reward", "done"}``; once the episode has ended the
observation says so and further actions are refused (``policy`` error), and the policy ends the
episode with a final answer as in every mentorrl environment. Non-text observations are shown as
JSON when they are JSON data, else as ``str``.

Verdict (:meth:`GymTextEnv.verify`): success when the episode *terminated* (not truncated, not
still running) with a summed reward of at least ``success_reward``, or whatever ``success(total,
info)`` says when given; a step whose ``info`` has a ``"violation"`` entry records it as a hard
violation (reward -1). ``reset`` seeds the environment with the task's seed (``task.reference
["options"]``, when present, goes to ``options=``). An exception in ``reset`` or ``step`` is an
``error: ...`` observation (``step``) or a failed verdict (``reset``), never a crashed rollout.
"""

from __future__ import annotations

import json
import random
from typing import Any, Callable, Sequence

from mentorrl.envs.base import Task, Tool, ToolError, ToolRegistry, ToolResult, Verdict

from .common import SEED_BASE, NoExpert

MAX_ACTION_CHARS = 2_000


def _show(obs: Any) -> Any:
    if isinstance(obs, str):
        return obs
    try:
        json.dumps(obs, allow_nan=False)
        return obs
    except (TypeError, ValueError):
        tolist = getattr(obs, "tolist", None)  # numpy arrays
        return tolist() if callable(tolist) else str(obs)


class GymTextEnv:
    """A mentorrl environment around one Gymnasium-style environment (made by ``make_gym()``)."""

    version = "1.0"

    def __init__(
        self,
        make_gym: Callable[[], Any],
        name: str = "gym",
        system_prompt: str = "You act in an environment. Call the act tool with one action at a time; "
        "when the episode is over, reply with a short final answer.",
        action_names: Sequence[str] | None = None,
        tool_name: str = "act",
        action_description: str = "take one action; returns the new observation",
        success_reward: float = 1.0,
        success: Callable[[float, dict], bool] | None = None,
        tool_timeout_s: float = 5.0,
        **_: Any,
    ):
        self.name, self.system_prompt = name, system_prompt
        self.gym = make_gym()
        self.action_names = list(action_names) if action_names is not None else None
        self.success_reward, self.success = success_reward, success
        action: dict[str, Any] = (
            {"type": "string", "enum": self.action_names}
            if self.action_names is not None
            else {"type": "string", "minLength": 1, "maxLength": MAX_ACTION_CHARS}
        )
        action["description"] = "the action" if self.action_names is None else "one of the named actions"
        self.registry = ToolRegistry(
            [
                Tool(
                    tool_name,
                    action_description,
                    {
                        "type": "object",
                        "properties": {"action": action},
                        "required": ["action"],
                        "additionalProperties": False,
                    },
                    self._act,
                )
            ],
            timeout_s=tool_timeout_s,
        )
        self._clear()

    def _clear(self) -> None:
        self.total, self.steps, self.done = 0.0, 0, False
        self.terminated = self.truncated = False
        self.info: dict[str, Any] = {}
        self.violations: list[str] = []
        self.reset_error: str | None = None

    def reset(self, task: Task) -> str:
        self._clear()
        options = task.reference.get("options")
        try:
            obs, info = self.gym.reset(seed=task.seed, options=options)
        except Exception as e:  # noqa: BLE001 - the episode fails; the rollout goes on
            self.reset_error = f"reset failed: {type(e).__name__}: {e}"[:500]
            self.done = True
            return f"{task.prompt}\n\n(the environment could not start: {self.reset_error})"
        self.info = dict(info or {})
        obs = _show(obs)
        shown = obs if isinstance(obs, str) else json.dumps(obs)
        return f"{task.prompt}\n\nObservation: {shown}" if task.prompt else shown

    def _act(self, action: str) -> dict[str, Any]:
        if self.done:
            raise ToolError("the episode is over: no more actions; reply with your final answer", kind="policy")
        a: Any = self.action_names.index(action) if self.action_names is not None else action
        obs, reward, terminated, truncated, info = self.gym.step(a)
        self.steps += 1
        self.total += float(reward)
        self.info = dict(info or {})
        if self.info.get("violation"):
            self.violations.append(str(self.info["violation"])[:200])
        self.terminated, self.truncated = bool(terminated), bool(truncated)
        self.done = self.terminated or self.truncated
        out = {"observation": _show(obs), "reward": float(reward), "done": self.done}
        if self.done:
            out["note"] = "the episode is over; reply with your final answer"
        return out

    def step(self, name: Any, arguments: Any) -> ToolResult:
        return self.registry.call(name, arguments)

    def verify(self, final_answer: str | None) -> Verdict:
        details: dict[str, Any] = {
            "env_reward": self.total,
            "env_steps": self.steps,
            "terminated": self.terminated,
            "truncated": self.truncated,
        }
        if self.reset_error is not None:
            return Verdict(success=False, details={**details, "error": self.reset_error})
        if self.success is not None:
            try:
                ok = bool(self.success(self.total, dict(self.info)))
            except Exception as e:  # noqa: BLE001
                return Verdict(
                    success=False,
                    violations=list(self.violations),
                    details={**details, "error": f"success() failed: {type(e).__name__}: {e}"[:500]},
                )
        else:
            ok = self.terminated and self.total >= self.success_reward
        return Verdict(success=ok and not self.violations, violations=list(self.violations), details=details)

    def close(self) -> None:
        self.registry.close()
        close = getattr(self.gym, "close", None)
        if callable(close):
            try:
                close()
            except Exception:  # noqa: BLE001
                pass


class GymTasks:
    """Seeded tasks: one instruction prompt, an episode seed per task (splits on disjoint seed
    ranges: ``train``, ``heldout``, ``hidden``); ``options(rng)``, when given, draws the
    ``reset(options=...)`` of each task."""

    def __init__(self, name: str, prompt: str, options: Callable[[random.Random], dict] | None = None):
        self.name, self.prompt, self.options = name, prompt, options

    def tasks(self, split: str = "train", n: int = 64, seed: int = 0) -> list[Task]:
        if split not in SEED_BASE:
            raise ValueError(f"split must be one of {', '.join(SEED_BASE)}, not {split!r}")
        rng = random.Random(f"{self.name}/{split}/{seed}")
        out = []
        for i in range(n):
            ep_seed = SEED_BASE[split] + rng.getrandbits(32)
            ref = {"options": self.options(rng)} if self.options is not None else {}
            out.append(
                Task(
                    id=f"{self.name}-{split}-{seed}-{i:05d}",
                    family=self.name,
                    split=split,
                    prompt=self.prompt,
                    seed=ep_seed,
                    reference=ref,
                )
            )
        return out


def gym_entry(
    name: str,
    make_gym: Callable[[], Any],
    prompt: str,
    options: Callable[[random.Random], dict] | None = None,
    make_expert: Callable[[], Any] | None = None,
    **env_kw: Any,
) -> Callable[[], Any]:
    """An :class:`~mentorrl.envs.EnvEntry` factory for :func:`~.common.register_adapter`."""
    from mentorrl.envs import EnvEntry

    def entry() -> EnvEntry:
        return EnvEntry(
            lambda **k: GymTextEnv(make_gym, name=name, **{**env_kw, **k}),
            lambda: GymTasks(name, prompt, options),
            make_expert or (lambda: NoExpert(name)),
            mutating_tools=(env_kw.get("tool_name", "act"),),
        )

    return entry


__all__ = ["GymTextEnv", "GymTasks", "gym_entry"]
