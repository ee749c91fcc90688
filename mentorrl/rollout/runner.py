"""Roll out a list of tasks with a model: one fresh environment per episode, batched decode.

:func:`rollout_tasks` decodes with the generation backend it is given (default: the project's
engine over ``model``); :class:`mentorrl.rollout.api.Rollout` is how stages call it, with the
run's backend choice, environment factory and reward weights."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from mentorrl.contract import RolloutContract
from mentorrl.envs.base import Task
from mentorrl.rewards.compose import RewardWeights
from mentorrl.rollout.backends.base import GenerationBackend
from mentorrl.rollout.episode import Episode, close_env, run_scripted_episode
from mentorrl.trajectory import Trajectory


def rollout_tasks(
    model,
    contract: RolloutContract,
    make_env: Callable[[], Any],
    tasks: Sequence[Task],
    policy_version: int = 0,
    seed: int = 0,
    batch_size: int = 256,
    weights: RewardWeights | None = None,
    on_batch: Callable[[int], None] | None = None,
    token_budgets: Sequence[int | None] | None = None,
    backend: GenerationBackend | None = None,
) -> list[Trajectory]:
    """Trajectories in task order. ``batch_size`` bounds how many decode together; ``token_budgets``
    (one per task) caps each episode's tokens after the prompt (see :class:`Episode`). ``backend``:
    decode with this one as it is (default: a fresh :class:`~mentorrl.rollout.backends.hf.HFBackend`
    over ``model`` with its default decoder and tool threshold)."""
    if token_budgets is not None and len(token_budgets) != len(tasks):
        raise ValueError(f"token_budgets has {len(token_budgets)} entries for {len(tasks)} tasks")
    if backend is None:
        from mentorrl.rollout.backends.hf import HFBackend

        backend = HFBackend(model, contract)
    engine = backend
    out: list[Trajectory] = []
    for lo in range(0, len(tasks), batch_size):
        chunk = tasks[lo : lo + batch_size]
        envs = [make_env() for _ in chunk]
        try:
            budgets = token_budgets[lo : lo + batch_size] if token_budgets is not None else [None] * len(chunk)
            eps = [
                Episode(contract, env, t, policy_version=policy_version, weights=weights, token_budget=b)
                for env, t, b in zip(envs, chunk, budgets)
            ]
            out.extend(engine.run_episodes(eps, seed=seed + lo))
        finally:
            for env in envs:
                close_env(env)
        if on_batch is not None:
            on_batch(len(chunk))
    return out


def expert_demonstrations(
    contract: RolloutContract,
    make_env: Callable[[], Any],
    expert: Any,
    tasks: Sequence[Task],
    weights: RewardWeights | None = None,
) -> list[Trajectory]:
    """Run the scripted expert on each task; keep only demonstrations the verifier accepts."""
    demos = []
    env = make_env()
    try:
        for t in tasks:
            traj = run_scripted_episode(contract, env, t, expert, weights=weights)
            if traj.reward is not None and traj.reward.success:
                demos.append(traj)
    finally:
        env.close()
    return demos
