"""GRPO (``recipe: [sft, grpo]``): groups of rollouts per task, group-relative advantages,
clipped policy-gradient minibatches, optionally a KL term to the policy as the stage starts and a
hard-task pool that resamples the tasks the policy keeps failing.

Under a data-parallel launch (``ws.dp``) the rollouts are split over the ranks and gathered, the
learner trains on each rank's share of every minibatch, and only rank 0 writes."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from mentorrl.algos.advantages import get_advantage_estimator
from mentorrl.envs.adapters.common import NoExpert
from mentorrl.flywheel.hard_pool import HardTaskPool
from mentorrl.train.audit import GapMonitor
from mentorrl.train.learner import Learner
from mentorrl.train.loop import (
    collect_group,
    gap_check,
    group_rewards,
    guide_failed_groups,
    guided_advantages,
    outcome_rewards,
    pg_update,
    reduce_updates,
    reward_debugger,
    rollout_metrics,
    train_pool,
)
from mentorrl.train.registry import register_stage
from mentorrl.train.stage_runner import cpu_cores, run_stage
from mentorrl.train.workspace import Workspace, frozen_copy
from mentorrl.trajectory import write_jsonl

GRPO_METRICS = ("loss", "kl", "clip_frac", "entropy", "grad_norm", "ratio_max", "approx_kl", "logprob_abs_gap",
                "train_rollout_kl", "policy_lag_mean", "policy_lag_max")


def load_hard_pool(g) -> HardTaskPool | None:
    """The GRPO stage's hard-task pool, optionally seeded from a saved state (e.g. `mentorrl flywheel`)."""
    if g.hard_pool is None:
        if g.hard_pool_state:
            raise ValueError("grpo.hard_pool_state is set but grpo.hard_pool is null; enable the pool to use it")
        return None
    pool = HardTaskPool(g.hard_pool)
    if g.hard_pool_state:
        path = Path(g.hard_pool_state)
        if not path.exists():
            raise FileNotFoundError(f"grpo.hard_pool_state: {path} does not exist")
        pool.load_state_dict(json.loads(path.read_text()))
        pool.config = g.hard_pool  # the run's settings, the saved failures
    return pool


def guide_nll_weights(n_policy: int, demos: list, coef: float) -> torch.Tensor:
    """Per-trajectory weights of ``grpo.guide_sft``'s SFT term over ``n_policy`` rollouts followed by
    ``demos``: 0 for the rollouts, ``coef / (the demonstrations' policy tokens)`` for each
    demonstration, so the term is ``coef`` times their token-mean negative log-likelihood."""
    tokens = sum(d.num_policy_tokens for d in demos)
    w = torch.zeros(n_policy + len(demos))
    if tokens:
        w[n_policy:] = coef / tokens
    return w


def guide_expert(ws: Workspace):
    """The scripted expert of ``grpo.guide: expert``, or None; an environment without one is refused
    before the first step."""
    if ws.cfg.grpo.guide != "expert":
        return None
    expert = ws.env_entry.make_expert()
    if isinstance(expert, NoExpert):
        raise ValueError(f"grpo.guide: expert needs a scripted expert, and environment {ws.cfg.env.name!r} has "
                         "none; set grpo.guide: none")
    return expert


@register_stage("grpo", config="grpo", title="GRPO", label="GRPO", rl=True)
def run_grpo(ws: Workspace, model, resume: bool = False) -> Path:
    """GRPO, with a frozen reference policy when ``grpo.kl_coef > 0``."""
    ref = frozen_copy(model) if ws.cfg.grpo.kl_coef > 0 else None
    return grpo_stage(ws, model, ref_model=ref, resume=resume)


def grpo_stage(ws: Workspace, model, ref_model=None, resume: bool = False) -> Path:
    cfg, g, audit = ws.cfg, ws.cfg.grpo, ws.cfg.audit
    pool = train_pool(ws, g.tasks_per_step, g.steps)
    learner = Learner(model, g.optim, ws.contract.pad_token_id, ws.contract.sampling.temperature, dp=ws.dp)
    estimator = get_advantage_estimator(g.advantage)
    version = {"policy": 0}
    monitor = GapMonitor(audit.reward_window, audit.reward_rise, audit.success_rise)
    hard = load_hard_pool(g)
    expert = guide_expert(ws)

    def step_fn(step: int) -> dict[str, float]:
        rng = random.Random(cfg.seed * 1_000_003 + 17 * step + 1)
        n_tasks = min(g.tasks_per_step, len(pool))
        chosen = hard.sample(pool, n_tasks, rng) if hard is not None else rng.sample(pool, n_tasks)
        hard_in_batch = sum(t.id in hard for t in chosen) if hard is not None else 0
        grp = collect_group(ws, model, chosen, g.group_size, version["policy"], cfg.seed * 7_777 + step,
                            f"GRPO step {step + 1}", shard=True)
        metrics: dict[str, float] = {**rollout_metrics(grp.trajs), "rollouts": len(grp.trajs)}  # the policy's own
        if hard is not None:
            hard.update(grp.trajs)
        rewards, clipped, stats = group_rewards(grp.raw_rewards(), audit)
        metrics.update({**stats, **{f"reward_{k}": v for k, v in clipped.items()}})
        guided = guide_failed_groups(ws, model, grp, expert, version["policy"], ws.contract.pad_token_id) \
            if expert is not None else []
        demo_rewards = outcome_rewards([d for _, d in guided], audit)[0].tolist() if guided else []
        adv, demo_adv = guided_advantages(estimator, rewards, [(i, r) for (i, _), r in zip(guided, demo_rewards)],
                                          normalize_std=g.normalize_std)
        trajs, adv = list(grp.trajs) + [d for _, d in guided], torch.cat([adv, demo_adv])
        nll = guide_nll_weights(len(grp.trajs), [d for _, d in guided], g.guide_sft) if guided and g.guide_sft > 0 \
            else None
        if expert is not None:
            metrics["guided_groups"] = float(len(guided))
        metrics.update(ws.on_main(lambda: reward_debugger(
            trajs, audit.flag_reward, ws.run_dir / "audit" / f"flagged-grpo-step-{step + 1:06d}.jsonl")))
        # Zero-advantage trajectories give exactly zero policy gradient: without a KL term they are
        # not forwarded, but they stay in each minibatch's loss denominator (the full-batch update).
        t1, c1 = time.perf_counter(), time.process_time()
        size = len(grp.trajs) // max(len(chosen), 1)  # group i: rollouts i * size ... (as the advantages)
        groups = [list(range(i * size, (i + 1) * size)) for i in range(len(chosen))]
        for j, (i, _) in enumerate(guided):  # a guided group's demonstration is dealt with its group
            groups[i].append(len(grp.trajs) + j)
        ups = pg_update(learner, trajs, adv, g.updates_per_step, step, version, kind="grpo", groups=groups,
                        drop_zero=g.kl_coef == 0,
                        ref_model=ref_model if g.kl_coef > 0 else None, kl_coef=g.kl_coef, eps_low=g.eps_low,
                        eps_high=g.eps_high, agg=g.loss_agg, nll_weights=nll, sync=ws.rollout.sync)
        metrics.update(reduce_updates(ups, GRPO_METRICS))
        trained = len(trajs) if g.kl_coef > 0 else int((adv.abs() > 0).sum())
        metrics.update(trained_trajectories=trained, policy_version=version["policy"],
                       rollout_s=grp.rollout_s, update_s=time.perf_counter() - t1,
                       rollout_cpu_s=grp.rollout_cpu_s, update_cpu_s=time.process_time() - c1,
                       rollout_cpu_util=grp.rollout_cpu_s / max(grp.rollout_s, 1e-9) / cpu_cores())
        if hard is not None:
            metrics.update(hard_tasks_in_batch=float(hard_in_batch), hard_pool_size=float(len(hard)))
        metrics.update(_after_step(ws, model, monitor, step, metrics["reward_mean"], trajs))
        return metrics

    def extra_state() -> dict[str, Any]:
        return {**version, "gap_monitor": monitor.state_dict(), "hard_pool": hard.state_dict() if hard else None}

    def restore(state: dict[str, Any]) -> None:
        version["policy"] = state.get("policy", 0)
        monitor.load_state_dict(state.get("gap_monitor", {}))
        if hard is not None and state.get("hard_pool"):
            hard.load_state_dict(state["hard_pool"])
            hard.config = g.hard_pool

    return run_stage(ws, "grpo", model, learner, g.steps, step_fn, g.checkpoint_every, resume,
                     extra_state=extra_state, restore_extra=restore)


def _after_step(ws: Workspace, model, monitor: GapMonitor, step: int, reward_mean: float, trajs) -> dict[str, float]:
    """The gap monitor's reward (and, when due, its held-out check) and the step's sample file."""
    g, audit, out = ws.cfg.grpo, ws.cfg.audit, {}
    monitor.observe_reward(step + 1, reward_mean)
    if audit.eval_every and (step + 1) % audit.eval_every == 0:
        gap = ws.on_main(lambda: (gap_check(ws, model, monitor, step + 1), monitor.state_dict()))
        out.update(gap[0])
        monitor.load_state_dict(gap[1])  # every rank keeps the same monitor (it is checkpointed)
    if g.sample_trajectories and ws.is_main:
        samples_dir = ws.run_dir / "samples"
        samples_dir.mkdir(exist_ok=True)  # one file per step: a redone step overwrites, never duplicates
        write_jsonl(samples_dir / f"grpo-step-{step + 1:06d}.jsonl", trajs[: g.sample_trajectories])
    return out
