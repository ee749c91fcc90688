"""Reward audit during training: the reward debugger and the reward-success gap monitor.

A training curve can rise while the agent gets worse. Two instruments watch for it:

* :func:`flag_high_reward_failures` -- the reward debugger: trajectories that the reward
  function paid well although the verifier says the task was not done. With the shipped
  tiered reward this cannot happen (failures score <= 0), so any hit means a custom or
  shaped reward is paying for something other than success.
* :class:`GapMonitor` -- compares the training reward trend with held-out success measured
  at the periodic evaluations; it warns when reward rose by more than a threshold while
  held-out success did not rise by at least another threshold (the notes' signature of
  reward hacking: reward up, real quality flat or down).

Both are pure bookkeeping; the GRPO stage logs their output in ``metrics.jsonl`` and the
run report (``report.json`` / ``report.md``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from mentorrl.config import AuditConfig  # noqa: F401 (declared with the config; imported from here by callers)
from mentorrl.trajectory import Trajectory


def flag_high_reward_failures(trajs: Sequence[Trajectory], threshold: float) -> list[Trajectory]:
    """Trajectories with ``reward.total >= threshold`` whose task the verifier says was not done."""
    return [t for t in trajs if t.reward is not None and not t.reward.success and t.reward.total >= threshold]


@dataclass
class GapMonitor:
    """Reward up, held-out success flat: the reward-success gap.

    ``observe_reward(step, r)`` records each training step's mean reward; ``observe_eval(step,
    success)`` records a held-out check and returns a warning record when, since the previous
    check, the windowed training reward rose by more than ``reward_rise`` while held-out
    success changed by no more than ``success_rise``.
    """

    reward_window: int = 5
    reward_rise: float = 0.05
    success_rise: float = 0.02
    rewards: list[tuple[int, float]] = field(default_factory=list)
    evals: list[tuple[int, float, float]] = field(default_factory=list)  # (step, success, windowed reward)
    warnings: list[dict[str, Any]] = field(default_factory=list)

    def observe_reward(self, step: int, reward_mean: float) -> None:
        self.rewards = [(s, r) for s, r in self.rewards if s < step]  # a redone step replaces its record
        self.rewards.append((step, reward_mean))

    def windowed_reward(self, upto_step: int) -> float | None:
        recent = [r for s, r in self.rewards if s <= upto_step][-self.reward_window :]
        return sum(recent) / len(recent) if recent else None

    def observe_eval(self, step: int, success: float) -> dict[str, Any] | None:
        reward = self.windowed_reward(step)
        self.evals = [e for e in self.evals if e[0] < step]
        prev = self.evals[-1] if self.evals else None
        self.evals.append((step, success, reward if reward is not None else float("nan")))
        if prev is None or reward is None or prev[2] != prev[2]:  # no baseline yet (nan check)
            return None
        d_reward, d_success = reward - prev[2], success - prev[1]
        if d_reward > self.reward_rise and d_success <= self.success_rise:
            warning = {
                "step": step,
                "since_step": prev[0],
                "reward_delta": d_reward,
                "success_delta": d_success,
                "message": (
                    f"training reward rose {d_reward:+.3f} since step {prev[0]} while held-out success "
                    f"changed {d_success:+.3f}: reward hacking or overfitting to the training tasks -- "
                    "run `mentorrl reward-audit` and review flagged trajectories"
                ),
            }
            self.warnings = [w for w in self.warnings if w["step"] < step] + [warning]
            return warning
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"rewards": self.rewards, "evals": self.evals, "warnings": self.warnings}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rewards = [tuple(x) for x in state.get("rewards", [])]
        self.evals = [tuple(x) for x in state.get("evals", [])]
        self.warnings = list(state.get("warnings", []))
