"""Rejection-sampling fine-tuning (RFT) as a cold start for agent RL.

Each iteration: the current policy samples ``N`` trajectories per task, the verifier keeps
the successful ones, a difficulty filter keeps tasks whose estimated success lies in a band
(default 5-50%: the model "sometimes" solves them; tasks it always solves teach little and
tasks it never solves give nothing), and at most ``K`` distinct successes per task (ranked by
reward, distinct tool-call sequences first, so the data keeps more than one way of working)
are added to the RFT set. The policy is then fine-tuned on the set with the SFT loss.

Iteration stops when the positive-task rate (share of tasks with at least one success)
stops rising -- the notes' criterion for RFT progress -- or after ``max_iterations``.
"""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Sequence

from mentorrl.core.trace import call_key
from mentorrl.eval.agent import TaskOutcome, task_results
from mentorrl.trajectory import Trajectory

task_outcomes = task_results  # per-task n, successes and first success, shared with agent evaluation


def rft_round_stats(outcomes: dict[str, TaskOutcome]) -> dict[str, float]:
    """positive-task rate, trajectory success rate, and mean samples to the first success.

    ``samples_to_success`` (1-based, over tasks with a success) is left out when nothing succeeded.
    """
    n_tasks = len(outcomes)
    n_traj = sum(o.n for o in outcomes.values())
    firsts = [o.first_success for o in outcomes.values() if o.first_success is not None]
    out = {
        "positive_task_rate": sum(o.successes > 0 for o in outcomes.values()) / n_tasks if n_tasks else 0.0,
        "trajectory_success_rate": sum(o.successes for o in outcomes.values()) / n_traj if n_traj else 0.0,
    }
    if firsts:
        out["samples_to_success"] = sum(firsts) / len(firsts)
    return out


def in_band(rate: float, band: tuple[float, float]) -> bool:
    return band[0] <= rate <= band[1]


def select_rft_data(
    trajs: Sequence[Trajectory], top_k: int, band: tuple[float, float], seed: int = 0
) -> tuple[list[Trajectory], dict[str, float]]:
    """Verifier filter + difficulty band + top-K distinct successes per task.

    Returns the selected trajectories and counts (``tasks_in_band``, ``tasks_too_easy``,
    ``tasks_unsolved``, ``selected``).
    """
    outcomes = task_outcomes(trajs)
    by_task: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        if t.reward is not None and t.reward.success:
            by_task[t.task_id].append(t)
    rng = random.Random(seed)
    chosen: list[Trajectory] = []
    counts = {"tasks_in_band": 0, "tasks_too_easy": 0, "tasks_unsolved": 0}
    for tid, o in outcomes.items():
        if o.successes == 0:
            counts["tasks_unsolved"] += 1
            continue
        if not in_band(o.rate, band):
            counts["tasks_too_easy" if o.rate > band[1] else "tasks_unsolved"] += 1
            continue
        counts["tasks_in_band"] += 1
        wins = list(by_task[tid])
        rng.shuffle(wins)  # ties in reward are broken at random, not by sampling order
        wins.sort(key=lambda t: -t.reward.total)
        seen: set[tuple[str, ...]] = set()
        distinct, rest = [], []
        for t in wins:
            key = tuple(call_key(c) for c in t.tool_calls)
            (rest if key in seen else distinct).append(t)
            seen.add(key)
        chosen.extend((distinct + rest)[:top_k])
    counts["selected"] = len(chosen)
    return chosen, {k: float(v) for k, v in counts.items()}


def rising(history: Sequence[float], min_gain: float) -> bool:
    """Is the last value above the best earlier one by more than ``min_gain``? (True with < 2 values.)"""
    if len(history) < 2:
        return True
    return history[-1] > max(history[:-1]) + min_gain
