"""Offline reward validation: does the reward rank correct trajectories above incorrect ones?

A small labelled set is built by construction, not by the verifier under test:

* *correct*: the scripted expert's trajectories (the expert is correct by construction);
* *incorrect*: the same expert with one deliberate :class:`Corruption` of its behaviour (skip
  the mutating call but claim success, a wrong argument, a wrong reported value, a duplicate
  mutation, a hedged answer, no final answer ...). A corruption marks itself *applied* only
  where it really makes the trajectory wrong; trajectories it did not apply to are dropped.

The report gives, per class, the count and mean reward, the Mann-Whitney AUC (ties count
1/2) and two overlap measures. Corruptions are registered per environment
(:func:`register_corruptions`), like attacks.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import asdict, dataclass, field
from statistics import fmean
from typing import Any, Callable, Sequence

from mentorrl.contract import ContractLimits, contract_for_env
from mentorrl.envs.base import Environment, Task
from mentorrl.envs.suites import Corruption, Script
from mentorrl.integrity.attacks import select_tasks
from mentorrl.integrity.registry import SuiteRegistry
from mentorrl.rewards.compose import RewardWeights
from mentorrl.rollout.episode import run_scripted_episode


# ------------------------------------------------------------------------- metrics ----
def auc(positive: Sequence[float], negative: Sequence[float]) -> float:
    """Mann-Whitney AUC: P(score of a positive > score of a negative), ties counting 1/2."""
    if not positive or not negative:
        raise ValueError("AUC needs at least one positive and one negative score")
    neg = sorted(negative)
    wins = sum(bisect_left(neg, p) + 0.5 * (bisect_right(neg, p) - bisect_left(neg, p)) for p in positive)
    return wins / (len(positive) * len(neg))


def overlap_share(positive: Sequence[float], negative: Sequence[float]) -> float:
    """Share of negatives scoring at least the lowest positive (0 when the classes separate)."""
    if not positive or not negative:
        raise ValueError("overlap needs at least one positive and one negative score")
    lowest = min(positive)
    return sum(n >= lowest for n in negative) / len(negative)


def range_overlap(positive: Sequence[float], negative: Sequence[float]) -> tuple[float, float] | None:
    """The interval where the two score ranges ``[min, max]`` intersect, or None when they do not."""
    if not positive or not negative:
        raise ValueError("overlap needs at least one positive and one negative score")
    lo, hi = max(min(positive), min(negative)), min(max(positive), max(negative))
    return (lo, hi) if lo <= hi else None


# --------------------------------------------------------------------- corruptions ----
class CorruptedPolicy:
    """The expert with one corruption; ``applied`` tells whether the last episode was corrupted."""

    def __init__(self, expert: Any, corruption: Corruption):
        self.expert, self.corruption = expert, corruption
        self.applied = False

    def _mark(self) -> None:
        self.applied = True

    def act(self, task: Task) -> Script:
        self.applied = False
        return self.corruption.transform(task, self.expert.act(task), self._mark)


CORRUPTIONS: SuiteRegistry[Corruption] = SuiteRegistry("reward-validation corruptions", "corruptions")


def register_corruptions(env_name: str, factory: Callable[[], Sequence[Corruption]]) -> None:
    """Register the corruptions used to validate environment ``env_name``'s reward."""
    CORRUPTIONS.register(env_name, factory)


def get_corruptions(env_name: str) -> list[Corruption]:
    return CORRUPTIONS.get(env_name)


# -------------------------------------------------------------------------- report ----
@dataclass
class LabelledReward:
    task_id: str
    label: str  # "correct" or the corruption's name
    correct: bool
    reward: float


@dataclass
class ValidationReport:
    samples: list[LabelledReward] = field(default_factory=list)

    def scores(self, correct: bool) -> list[float]:
        return [s.reward for s in self.samples if s.correct == correct]

    @property
    def n_correct(self) -> int:
        return len(self.scores(True))

    @property
    def n_incorrect(self) -> int:
        return len(self.scores(False))

    @property
    def auc(self) -> float:
        return auc(self.scores(True), self.scores(False))

    @property
    def overlap_share(self) -> float:
        return overlap_share(self.scores(True), self.scores(False))

    @property
    def range_overlap(self) -> tuple[float, float] | None:
        return range_overlap(self.scores(True), self.scores(False))

    def by_label(self) -> dict[str, dict[str, float]]:
        """Per label (``correct`` and each corruption): n, mean and max reward."""
        out: dict[str, list[float]] = {}
        for s in self.samples:
            out.setdefault(s.label, []).append(s.reward)
        return {k: {"n": len(v), "mean": fmean(v), "max": max(v)} for k, v in out.items()}

    def passed(self, min_auc: float, max_overlap: float = 0.0) -> bool:
        """AUC at least ``min_auc`` and at most ``max_overlap`` of the incorrect trajectories at or
        above the lowest correct reward (0 by default: none may reach honest work)."""
        return self.n_correct > 0 and self.n_incorrect > 0 and self.auc >= min_auc and self.overlap_share <= max_overlap

    def to_dict(self) -> dict[str, Any]:
        correct, incorrect = self.scores(True), self.scores(False)
        both = bool(correct and incorrect)
        return {
            "n_correct": len(correct),
            "n_incorrect": len(incorrect),
            "mean_correct": fmean(correct) if correct else None,
            "mean_incorrect": fmean(incorrect) if incorrect else None,
            "auc": self.auc if both else None,
            "overlap_share": self.overlap_share if both else None,
            "range_overlap": self.range_overlap if both else None,
            "by_label": self.by_label(),
            "samples": [asdict(s) for s in self.samples],
        }


# ------------------------------------------------------------------------- running ----
def run_validation(
    corruptions: Sequence[Corruption],
    *,
    make_env: Callable[[], Environment],
    tasks: Sequence[Task],
    expert: Any,
    tokenizer: Any,
    weights: RewardWeights | None = None,
    limits: ContractLimits | None = None,
) -> ValidationReport:
    """Reward every task's expert trajectory (correct) and each applicable corruption (incorrect)."""
    weights = weights or RewardWeights()
    env = make_env()  # one env for every episode: reset() gives each its own fresh state
    report = ValidationReport()
    try:
        contract = contract_for_env(tokenizer, env, limits=limits or ContractLimits(max_turns=8, max_total_tokens=4096))
        for task in tasks:
            honest = run_scripted_episode(contract, env, task, expert, weights=weights)
            report.samples.append(LabelledReward(task.id, "correct", True, honest.reward.total))
            for corruption in corruptions:
                policy = CorruptedPolicy(expert, corruption)
                traj = run_scripted_episode(contract, env, task, policy, weights=weights, source="policy")
                if policy.applied:
                    report.samples.append(LabelledReward(task.id, corruption.name, False, traj.reward.total))
    finally:
        env.close()
    return report


def validate_env(
    env_name: str,
    tokenizer: Any,
    n_tasks: int = 40,
    seed: int = 0,
    split: str = "train",
    make_env: Callable[[], Environment] | None = None,
    weights: RewardWeights | None = None,
    pool_size: int = 600,
) -> ValidationReport:
    """Offline validation of a registered environment's reward on ``n_tasks`` mixed tasks.

    Tasks are taken round-robin over (family, difficulty) from a pool of ``pool_size``, so every
    kind of task is represented; ``make_env`` swaps in another environment/verifier.
    """
    from mentorrl.envs import get_env

    if n_tasks < 1:
        raise ValueError(f"n_tasks must be >= 1, got {n_tasks}")
    entry = get_env(env_name)
    pool = entry.make_tasks().tasks(split=split, n=max(pool_size, n_tasks), seed=seed)
    return run_validation(
        get_corruptions(env_name),
        make_env=make_env or entry.make_env,
        tasks=select_tasks(pool, lambda t: True, n_tasks),
        expert=entry.make_expert(),
        tokenizer=tokenizer,
        weights=weights,
    )


__all__ = [
    "Corruption",
    "CorruptedPolicy",
    "LabelledReward",
    "ValidationReport",
    "auc",
    "get_corruptions",
    "overlap_share",
    "range_overlap",
    "register_corruptions",
    "run_validation",
    "validate_env",
]
