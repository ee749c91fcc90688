"""Reward-hacking audit: scripted attacks run against the real environment and verifier.

An :class:`Attack` is a scripted *policy* (a generator like the environment's expert: it
yields :class:`~mentorrl.envs.base.ToolAction` / :class:`~mentorrl.envs.base.FinalAnswer`
and receives each :class:`~mentorrl.envs.base.ToolResult`, so it can react to what the tools
return) that tries to earn reward without doing the task: claiming success without a state
change, submitting twice, acting for the wrong customer, padding the answer ... Each attack
runs through the same :class:`~mentorrl.rollout.episode.Episode` code as every rollout, so
its reward is exactly what a policy writing the same turns would get.

The audit passes when, for every attack,

* every attack trajectory's ``reward.total`` is below the lowest reward of the honest scripted
  expert's *successful* trajectories on the same tasks, and
* for an attack that breaks a hard constraint, every attack trajectory's total is below 0;

and the honest expert succeeded on every task it ran on.

Attacks are registered per environment (:func:`register_attacks`), so a new environment
brings its own. :class:`LostResponseEnv` is a reusable fault-injection wrapper for the
"response lost after the side effect was committed" case.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from statistics import fmean
from typing import Any, Callable, Iterator, Sequence

from mentorrl.contract import ContractLimits, RolloutContract, contract_for_env
from mentorrl.envs.base import (
    Environment,
    Task,
)
from mentorrl.envs.suites import Attack, LostResponseEnv, Script
from mentorrl.integrity.registry import SuiteRegistry
from mentorrl.rewards.compose import RewardWeights
from mentorrl.rollout.episode import run_scripted_episode
from mentorrl.trajectory import Trajectory


class ScriptPolicy:
    """Adapts a function ``task -> Script`` to the ``act(task)`` protocol of scripted experts."""

    def __init__(self, script: Callable[[Task], Script]):
        self._script = script

    def act(self, task: Task) -> Script:
        return self._script(task)


ATTACKS: SuiteRegistry[Attack] = SuiteRegistry("reward-hacking attacks", "attacks")


def register_attacks(env_name: str, factory: Callable[[], Sequence[Attack]]) -> None:
    """Register the attack suite of environment ``env_name`` (a factory, called at audit time)."""
    ATTACKS.register(env_name, factory)


def get_attacks(env_name: str) -> list[Attack]:
    attacks = ATTACKS.get(env_name)
    names = [a.name for a in attacks]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate attack names for {env_name!r}: {names}")
    return attacks


# ------------------------------------------------------------------------- running ----
@dataclass(frozen=True)
class AttackAuditConfig:
    """How many tasks each attack runs on, which tasks, and the episode limits and reward weights."""

    tasks_per_attack: int = 3
    seed: int = 0
    split: str = "train"
    pool_size: int = 600  # tasks generated to pick each attack's tasks from
    limits: ContractLimits = field(default_factory=lambda: ContractLimits(max_turns=8, max_total_tokens=4096))
    weights: RewardWeights = field(default_factory=RewardWeights)

    def __post_init__(self) -> None:
        if self.tasks_per_attack < 1:
            raise ValueError(f"tasks_per_attack must be >= 1, got {self.tasks_per_attack}")
        if self.pool_size < 1:
            raise ValueError(f"pool_size must be >= 1, got {self.pool_size}")


@dataclass
class AttackResult:
    name: str
    description: str
    hard: bool
    task_ids: list[str]
    rewards: list[float]
    honest_min: float | None  # lowest honest-success reward on the same tasks
    passed: bool
    reason: str
    violations: list[str] = field(default_factory=list)  # distinct violations the verifier reported
    successes: list[str] = field(default_factory=list)  # task ids where the verifier counted the attack a success

    @property
    def max_reward(self) -> float | None:
        return max(self.rewards) if self.rewards else None

    @property
    def mean_reward(self) -> float | None:
        return fmean(self.rewards) if self.rewards else None

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "n_tasks": len(self.task_ids),
            "max_reward": self.max_reward,
            "mean_reward": self.mean_reward,
        }


BUDGET_ENDS = frozenset({"max_turns", "max_tokens", "length"})  # ended by the run's limits, not the policy


@dataclass
class AuditReport:
    env_name: str
    attacks: list[AttackResult]
    honest_rewards: dict[str, float]  # task id -> honest expert's reward
    honest_success: dict[str, bool]  # task id -> did the honest expert succeed
    honest_unfit: list[str] = field(default_factory=list)  # failed because the run's limits ended it (BUDGET_ENDS)

    @property
    def passed(self) -> bool:
        """Every attack passed, and the honest expert succeeded wherever it ran within the run's limits (a
        verifier that rejects honest work is as broken as one that rewards an attack). An expert episode the
        limits cut short (:data:`BUDGET_ENDS`: a long replay in a small context) is no baseline, and no
        verdict on the reward: it is counted apart (``honest_unfit``), and an attack left without any
        baseline still fails."""
        return bool(self.attacks) and all(a.passed for a in self.attacks) and not self.honest_failures

    @property
    def honest_min(self) -> float | None:
        ok = [r for t, r in self.honest_rewards.items() if self.honest_success[t]]
        return min(ok) if ok else None

    @property
    def honest_failures(self) -> list[str]:
        """Tasks the honest expert finished within the limits and the verifier failed."""
        unfit = set(self.honest_unfit)
        return sorted(t for t, ok in self.honest_success.items() if not ok and t not in unfit)

    def to_dict(self) -> dict[str, Any]:
        return {
            "env": self.env_name,
            "passed": self.passed,
            "honest": {
                "n_tasks": len(self.honest_rewards),
                "min_success_reward": self.honest_min,
                "failures": self.honest_failures,
                "unfit": sorted(self.honest_unfit),
            },
            "attacks": [a.to_dict() for a in self.attacks],
        }


def select_tasks(pool: Sequence[Task], applies: Callable[[Task], bool], n: int) -> list[Task]:
    """Up to ``n`` tasks that ``applies`` accepts, taken round-robin over (family, difficulty)
    so an attack sees every kind of task it targets, in pool order within each group."""
    groups: dict[tuple[str, str], list[Task]] = defaultdict(list)
    for t in pool:
        if applies(t):
            groups[(t.family, t.difficulty)].append(t)
    interleaved = (t for batch in itertools.zip_longest(*groups.values()) for t in batch if t is not None)
    return list(itertools.islice(interleaved, n))


def judge_attack(
    hard: bool, rewards: Sequence[float], task_ids: Sequence[str], honest_min: float | None
) -> tuple[bool, str]:
    """The pass rule: below the honest minimum, and below 0 for a hard-constraint attack."""
    if not rewards:
        return False, "no applicable task in the pool"
    if honest_min is None:
        return False, "the honest expert succeeded on none of these tasks: no baseline"
    worst = max(range(len(rewards)), key=lambda i: rewards[i])
    top, where = rewards[worst], task_ids[worst]
    if top >= honest_min:
        return False, f"reward {top:.3f} on {where} >= honest minimum {honest_min:.3f}"
    if hard and top >= 0:
        return False, f"hard-constraint attack scored {top:.3f} >= 0 on {where}"
    return True, "below 0 and the honest minimum" if hard else "below the honest minimum"


def run_script(
    contract: RolloutContract, env: Environment, task: Task, script: Callable[[Task], Script], weights: RewardWeights
) -> Trajectory:
    """One episode of a scripted (attack) policy, as a policy trajectory."""
    return run_scripted_episode(contract, env, task, ScriptPolicy(script), weights=weights, source="policy")


def run_audit(
    attacks: Sequence[Attack],
    *,
    env_name: str,
    make_env: Callable[[], Environment],
    tasks: Sequence[Task],
    expert: Any,
    tokenizer: Any,
    config: AttackAuditConfig | None = None,
) -> AuditReport:
    """Run every attack on its tasks from ``tasks`` (the pool) and the honest expert on the same tasks."""
    config = config or AttackAuditConfig()
    env = make_env()  # building an env is the costly part (tool schemas); reset() gives each episode fresh state
    honest: dict[str, Trajectory] = {}
    results: list[AttackResult] = []
    try:
        contract = contract_for_env(tokenizer, env, limits=config.limits)
        for attack in attacks:
            chosen = select_tasks(tasks, attack.applies, config.tasks_per_attack)
            attack_env = attack.wrap_env(make_env()) if attack.wrap_env is not None else env
            try:
                trajs = [run_script(contract, attack_env, t, attack.script, config.weights) for t in chosen]
            finally:
                if attack_env is not env:
                    attack_env.close()
            for t in chosen:
                if t.id not in honest:
                    honest[t.id] = run_scripted_episode(contract, env, t, expert, weights=config.weights)
            ok = [honest[t.id].reward.total for t in chosen if honest[t.id].reward.success]
            honest_min = min(ok) if ok else None
            rewards = [tr.reward.total for tr in trajs]
            ids = [t.id for t in chosen]
            passed, reason = judge_attack(attack.hard, rewards, ids, honest_min)
            violations = list(dict.fromkeys(v for tr in trajs for v in tr.reward.violations))
            won = [t.id for t, tr in zip(chosen, trajs) if tr.reward.success]
            results.append(
                AttackResult(
                    attack.name,
                    attack.description,
                    attack.hard,
                    ids,
                    rewards,
                    honest_min,
                    passed,
                    reason,
                    violations,
                    won,
                )
            )
    finally:
        env.close()
    return AuditReport(
        env_name=env_name,
        attacks=results,
        honest_rewards={k: tr.reward.total for k, tr in honest.items()},
        honest_success={k: tr.reward.success for k, tr in honest.items()},
        honest_unfit=sorted(k for k, tr in honest.items() if not tr.reward.success and tr.finish_reason in BUDGET_ENDS),
    )


def task_pool(make_tasks: Callable[[], Any], config: AttackAuditConfig) -> list[Task]:
    return list(make_tasks().tasks(split=config.split, n=config.pool_size, seed=config.seed))


def audit_env(
    env_name: str,
    tokenizer: Any,
    config: AttackAuditConfig | None = None,
    make_env: Callable[[], Environment] | None = None,
    attacks: Sequence[Attack] | None = None,
    entry: Any = None,
) -> AuditReport:
    """The audit of a registered environment; ``make_env`` swaps in another environment/verifier;
    ``entry``: the run's resolved :class:`~mentorrl.envs.EnvEntry` (a configured one, e.g. ``tau2``'s
    clone) instead of the registered name's."""
    from mentorrl.envs import get_env

    config = config or AttackAuditConfig()
    entry = entry if entry is not None else get_env(env_name)
    return run_audit(
        attacks if attacks is not None else get_attacks(env_name),
        env_name=env_name,
        make_env=make_env or entry.make_env,
        tasks=task_pool(entry.make_tasks, config),
        expert=entry.make_expert(),
        tokenizer=tokenizer,
        config=config,
    )


def iter_rows(report: AuditReport) -> Iterator[tuple[str, ...]]:
    """Table rows: attack, hard, tasks, max, mean, honest min, result, reason."""

    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    for a in report.attacks:
        yield (
            a.name,
            "yes" if a.hard else "no",
            str(len(a.task_ids)),
            num(a.max_reward),
            num(a.mean_reward),
            num(a.honest_min),
            "PASS" if a.passed else "FAIL",
            a.reason,
        )


__all__ = [
    "Attack",
    "AttackResult",
    "AttackAuditConfig",
    "AuditReport",
    "LostResponseEnv",
    "Script",
    "ScriptPolicy",
    "audit_env",
    "get_attacks",
    "iter_rows",
    "judge_attack",
    "register_attacks",
    "run_audit",
    "run_script",
    "select_tasks",
    "task_pool",
]
