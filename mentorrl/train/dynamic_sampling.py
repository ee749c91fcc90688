"""DAPO's dynamic sampling (``grpo.dynamic_sampling``, Yu et al. 2025): a group whose rewards are all equal has zero
advantage and gives no gradient, yet it stays in the update's denominator and costs its rollouts. Once the policy
solves most tasks (or none), most groups are like that: the step's gradient rests on a few groups, and the
optimizer's normalised step turns their noise into a full-sized move.

A step with dynamic sampling keeps only the groups whose (sanitised) rewards differ, and draws ``tasks_per_step``
fresh tasks from the stage's pool for another round while it has fewer than ``tasks_per_step`` of them, at most
``max_rounds`` rounds. It trains on the first ``tasks_per_step`` informative groups, in draw order. The step's rollout
metrics (``task_success``, ``rollouts``, ...) are over every round's rollouts, since the trained batch's own success
is biased toward one half by construction; ``dynamic_rounds`` and ``dynamic_informative_share`` (informative groups
over groups sampled) say what the filter did.

Every round's tasks and rollout seed are pure functions of (run seed, stage, step, round), so a fixed configuration
draws the same rounds in every run and on every data-parallel rank (the rewards are gathered before the choice)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mentorrl.algos.advantages import zero_variance_groups
from mentorrl.train.stage_helpers import group_rewards, rollout_cost


def informative_groups(trajs: list, group_size: int, audit) -> list[int]:
    """Indices of the groups (``group_size`` consecutive trajectories each) whose sanitised rewards are not all
    equal: the groups with a non-zero group-relative advantage."""
    if not trajs:
        return []
    raw = torch.tensor([t.reward.total for t in trajs], dtype=torch.float32).view(-1, group_size)
    rewards, _, _ = group_rewards(raw, audit)
    return [i for i, flat in enumerate(zero_variance_groups(rewards).tolist()) if not flat]


@dataclass
class Rounds:
    """What a step's rounds sampled: the informative groups kept (tasks and their trajectories, in draw order),
    and every round's rollouts for the metrics."""

    tasks: list = field(default_factory=list)
    trajs: list = field(default_factory=list)
    sampled: list = field(default_factory=list)
    groups: int = 0
    rounds: int = 0
    rollout_s: float = 0.0
    rollout_cpu_s: float = 0.0

    def add(self, tasks: list, trajs: list, group_size: int, audit, rollout_s: float, cpu_s: float) -> None:
        self.rounds += 1
        self.sampled.extend(trajs)
        self.groups += len(tasks)
        self.rollout_s += rollout_s
        self.rollout_cpu_s += cpu_s
        for i in informative_groups(trajs, group_size, audit):
            self.tasks.append(tasks[i])
            self.trajs.extend(trajs[i * group_size : (i + 1) * group_size])

    def metrics(self) -> dict[str, float]:
        return {
            **rollout_cost(self.sampled, self.rollout_s, self.rollout_cpu_s),
            "dynamic_rounds": float(self.rounds),
            "dynamic_informative_share": len(self.tasks) / max(self.groups, 1),
        }


def fill_informative(stage, b, max_rounds: int) -> None:
    """After the step's first rollout (``b.tasks`` / ``b.trajs``): keep its informative groups and roll out further
    rounds of ``len(b.tasks)`` fresh pool tasks until ``len(b.tasks)`` informative groups are held or ``max_rounds``
    rounds are spent; ``b`` then holds the first ``len(b.tasks)`` of them. A step with none keeps its first batch
    (its advantages are all zero: no update)."""
    want, g, audit = len(b.tasks), b.group_size, stage.ws.cfg.audit
    acc = Rounds()
    acc.add(b.tasks, b.trajs, g, audit, b.metrics.get("rollout_s", 0.0), b.metrics.get("rollout_cpu_s", 0.0))
    used = {t.id for t in b.tasks}
    while len(acc.tasks) < want and acc.rounds < max_rounds:
        rest = [t for t in stage.pool if t.id not in used]
        if not rest:
            break
        r = acc.rounds
        tasks = b.seeds.rng(f"tasks-round-{r}").sample(rest, min(want, len(rest)))
        used.update(t.id for t in tasks)
        grp = stage.roll(b, tasks, g, f"rollout-round-{r}", f"{stage.name} step {b.step + 1} round {r + 1}", shard=True)
        acc.add(tasks, list(grp.trajs), g, audit, grp.rollout_s, grp.rollout_cpu_s)
    if acc.tasks:
        b.tasks, b.trajs = acc.tasks[:want], acc.trajs[: want * g]
    b.metrics.update(acc.metrics())
