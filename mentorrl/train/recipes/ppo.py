"""PPO for multi-turn agents (``recipe: [sft, ppo]``): the same rollouts, rewards, checks and
learner as GRPO, with a critic (:class:`~mentorrl.train.critic.Critic`: a value head on a copy of
the policy's decoder) and GAE over policy tokens."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from mentorrl.train.audit import GapMonitor
from mentorrl.train.critic import Critic
from mentorrl.train.learner import Learner
from mentorrl.train.loop import (
    PG_METRICS,
    collect_group,
    gap_check,
    outcome_rewards,
    pg_update,
    pick_tasks,
    reduce_updates,
    reward_debugger,
    rollout_metrics,
    train_pool,
)
from mentorrl.train.registry import register_stage
from mentorrl.train.stage_runner import run_stage
from mentorrl.train.workspace import Workspace


@register_stage("ppo", config="ppo", title="PPO with a critic", label="PPO", rl=True)
def ppo_stage(ws: Workspace, model, resume: bool = False) -> Path:
    cfg, p, audit = ws.cfg, ws.cfg.ppo, ws.cfg.audit
    pool = train_pool(ws, p.tasks_per_step, p.steps)
    learner = Learner(model, p.optim, ws.contract.pad_token_id, ws.contract.sampling.temperature)
    critic = Critic(model, p.critic, ws.contract.pad_token_id)
    version = {"policy": 0}
    monitor = GapMonitor(audit.reward_window, audit.reward_rise, audit.success_rise)

    def step_fn(step: int) -> dict[str, float]:
        _, chosen = pick_tasks(pool, p.tasks_per_step, cfg.seed * 1_000_003 + 17 * step + 5)
        grp = collect_group(ws, model, chosen, p.samples_per_task, version["policy"], cfg.seed * 7_919 + step,
                            f"PPO step {step + 1}")
        trajs = grp.trajs
        rewards, clipped = outcome_rewards(trajs, audit)
        metrics: dict[str, float] = {"reward_mean": rewards.mean().item(),
                                     "reward_std": rewards.std().item() if len(trajs) > 1 else 0.0,
                                     "reward_clipped": clipped["clipped"], "rollouts": float(len(trajs))}
        metrics.update(rollout_metrics(trajs))
        metrics.update(reward_debugger(trajs, audit.flag_reward,
                                       ws.run_dir / "audit" / f"flagged-ppo-step-{step + 1:06d}.jsonl"))
        t1 = time.perf_counter()
        adv, _, value_metrics = critic.step(trajs, rewards, p.gae, seed=step * 7 + 1)
        am = []
        if step >= p.critic.warmup_steps:
            am = pg_update(learner, trajs, adv, p.updates_per_step, step * 7 + 2, version, eps_low=p.eps_low,
                           eps_high=p.eps_high, agg=p.loss_agg, sync=ws.rollout.sync)
        metrics.update(value_metrics)
        metrics.update(reduce_updates(am, PG_METRICS))
        metrics.update(actor_updated=float(bool(am)), policy_version=version["policy"], rollout_s=grp.rollout_s,
                       update_s=time.perf_counter() - t1)
        monitor.observe_reward(step + 1, metrics["reward_mean"])
        if audit.eval_every and (step + 1) % audit.eval_every == 0:
            metrics.update(gap_check(ws, model, monitor, step + 1))
        return metrics

    def extra_state() -> dict[str, Any]:
        return {**version, **critic.state_dict(), "gap_monitor": monitor.state_dict()}

    def restore(state: dict[str, Any]) -> None:
        version["policy"] = state.get("policy", 0)
        monitor.load_state_dict(state.get("gap_monitor", {}))
        critic.load_state_dict(state)

    final = run_stage(ws, "ppo", model, learner, p.steps, step_fn, p.checkpoint_every, resume,
                      extra_state=extra_state, restore_extra=restore)
    critic.save(ws.run_dir / "ppo")
    return final
