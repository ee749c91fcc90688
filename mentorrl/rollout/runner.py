"""Roll out a list of tasks with a model: one fresh environment per episode, batched decode.

:func:`rollout_tasks` is the rollout entry point of every stage; it decodes through the process's
generation backend (:func:`mentorrl.rollout.backends.backend_for`: the project's engine by
default, or vLLM under ``rollout.backend: vllm``), which it first brings to ``model``'s weights."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from mentorrl.contract import RolloutContract
from mentorrl.envs.base import Task
from mentorrl.rewards.compose import RewardWeights
from mentorrl.rollout.backends import GenerationBackend, backend_for
from mentorrl.rollout.episode import Episode, run_scripted_episode
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
    decode with this one as it is (default: the process's backend, synced with ``model``)."""
    if token_budgets is not None and len(token_budgets) != len(tasks):
        raise ValueError(f"token_budgets has {len(token_budgets)} entries for {len(tasks)} tasks")
    engine = backend if backend is not None else backend_for(model, contract, policy_version)
    out: list[Trajectory] = []
    for lo in range(0, len(tasks), batch_size):
        chunk = tasks[lo : lo + batch_size]
        envs = [make_env() for _ in chunk]
        try:
            budgets = token_budgets[lo : lo + batch_size] if token_budgets is not None else [None] * len(chunk)
            eps = [Episode(contract, env, t, policy_version=policy_version, weights=weights, token_budget=b)
                   for env, t, b in zip(envs, chunk, budgets)]
            out.extend(engine.run_episodes(eps, seed=seed + lo))
        finally:
            for env in envs:
                env.close()
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
