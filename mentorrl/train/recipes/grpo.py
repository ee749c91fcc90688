"""GRPO (``recipe: [sft, grpo]``): groups of rollouts per task, group-relative advantages,
clipped policy-gradient minibatches, optionally a KL term to the policy as the stage starts and a
hard-task pool that resamples the tasks the policy keeps failing.

Under a data-parallel launch (``ws.dp``) the rollouts are split over the ranks and gathered, the
learner trains on each rank's share of every minibatch, and only rank 0 writes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mentorrl.algos.advantages import get_advantage_estimator
from mentorrl.algos.losses import get_policy_loss, unaccepted_arguments
from mentorrl.config import ConfigError
from mentorrl.envs.adapters.common import NoExpert
from mentorrl.flywheel.hard_pool import HardTaskPool
from mentorrl.train.dynamic_sampling import fill_informative
from mentorrl.train.loop import Stage, StepBatch, StepData, run_on_loop
from mentorrl.train.overlap import OverlapLoop  # noqa: F401 -- registers grpo.overlap: one_step
from mentorrl.train.stage_helpers import (
    UPDATE_HEALTH,
    RewardGapWatch,
    guide_failed_groups,
    guided_advantages,
    outcome_rewards,
    pg_update,
    reward_debugger,
)
from mentorrl.train.workspace import Workspace, frozen_copy

GRPO_METRICS = ("loss", "kl", "clip_frac", "ratio_max", *UPDATE_HEALTH)


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


def guide_expert(ws: Workspace, guide: str | None = None):
    """The scripted expert of ``grpo.guide: expert`` (``guide``: the stage's own setting, default
    ``grpo.guide``), or None; an environment without one is refused before the first step."""
    if (ws.cfg.grpo.guide if guide is None else guide) != "expert":
        return None
    expert = ws.env_entry.make_expert()
    if isinstance(expert, NoExpert):
        raise ValueError(
            f"grpo.guide: expert needs a scripted expert, and environment {ws.cfg.env.name!r} has "
            "none; set grpo.guide: none"
        )
    return expert


def expert_verified_pool(ws: Workspace, pool: list) -> list:
    """``grpo.pool: expert_verified``: the tasks of ``pool`` (in order) whose scripted expert's demonstration
    the verifier accepts within the run's limits (:meth:`~mentorrl.rollout.api.Rollout.demonstrations`);
    a :class:`ConfigError` when none is left, before the first step."""
    expert = guide_expert(ws, "expert")  # an environment without an expert is refused, named
    # rank 0 alone plays the expert (a sandbox or tau2 run per task), every rank gets the same kept set
    solved = ws.on_main(lambda: {d.task_id for d in ws.rollout.demonstrations(expert, pool)})
    kept = [t for t in pool if t.id in solved]
    ws.console.print(
        f"grpo.pool expert_verified: {len(kept)} of {len(pool)} tasks (the others' demonstrations fail "
        "or do not fit the run's limits)"
    )
    if not kept:
        raise ConfigError(
            f"grpo.pool: expert_verified left none of {len(pool)} tasks: the expert's demonstrations fail or do "
            "not fit limits.max_turns / limits.max_total_tokens; raise them or set grpo.pool: all"
        )
    return kept


def grpo_loss_kwargs(g) -> dict[str, Any]:
    """What the configured policy loss (``grpo.loss``) gets besides the log-probs, advantages and mask: the
    clip range and aggregation, and the KL coefficient when there is a KL term (the reference's log-probs come
    with it). A loss that does not take them is a :class:`ConfigError` before the first step."""
    kw: dict[str, Any] = {"eps_low": g.eps_low, "eps_high": g.eps_high, "agg": g.loss_agg}
    if g.kl_coef > 0:
        kw["kl_coef"] = g.kl_coef
    missing = unaccepted_arguments(get_policy_loss(g.loss), [*kw, *(["ref_logprobs"] if g.kl_coef > 0 else [])])
    if missing:
        raise ConfigError(
            f"grpo.loss: the policy loss {g.loss!r} does not take {', '.join(missing)}"
            + (" (grpo.kl_coef > 0 needs a loss with a KL term, e.g. grpo)" if g.kl_coef > 0 else "")
        )
    return kw


@dataclass(slots=True)
class GRPOStepData(StepData):
    """What GRPO's advantages hook hands its update: ``nll``, the per-trajectory weights of the guided
    demonstrations' SFT term (:func:`guide_nll_weights`; None without one)."""

    nll: torch.Tensor | None = None


class GRPOStage(Stage):
    """GRPO: group-relative advantages over ``samples_per_task`` rollouts per task (optionally
    resampling hard tasks, and with the scripted expert's demonstration in a group where every
    rollout failed), clipped policy-gradient minibatches of whole groups, a KL term to the policy as
    the stage starts when ``grpo.kl_coef > 0``."""

    name = "grpo"
    data_parallel = True
    update_metrics = GRPO_METRICS
    overlappable = True  # grpo.overlap: one_step rolls batch k+1 out during step k's update
    step_data = GRPOStepData

    def __init__(self, ws: Workspace, model):
        super().__init__(ws, model)
        self.loss_kwargs = grpo_loss_kwargs(self.cfg)
        self.ref_model = frozen_copy(model) if self.cfg.kl_coef > 0 else None
        self.estimator = get_advantage_estimator(self.cfg.advantage)
        self.gap = RewardGapWatch(ws, model)
        self.hard = load_hard_pool(self.cfg)
        self.expert = guide_expert(ws, self.cfg.guide)

    def pool_per_step(self) -> int | None:
        """With ``grpo.dynamic_sampling``, room for every round of a step."""
        ds = getattr(self.cfg, "dynamic_sampling", None)
        return self.cfg.tasks_per_step * (ds.max_rounds if ds is not None else 1)

    def make_pool(self) -> list:
        pool = super().make_pool()
        return expert_verified_pool(self.ws, pool) if getattr(self.cfg, "pool", "all") == "expert_verified" else pool

    def tasks(self, b: StepBatch) -> None:
        if self.hard is None:
            return super().tasks(b)
        n = min(self.cfg.tasks_per_step, len(self.pool))
        b.tasks = self.hard.sample(self.pool, n, b.seeds.rng("tasks"))
        b.metrics.update(hard_tasks_in_batch=float(sum(t.id in self.hard for t in b.tasks)))

    def rollout(self, b: StepBatch) -> None:
        """The group rollouts; with ``grpo.dynamic_sampling`` further rounds until the step holds
        ``tasks_per_step`` groups whose rewards differ (:mod:`mentorrl.train.dynamic_sampling`)."""
        self.collect(b, self.cfg.samples_per_task, shard=True)
        if self.cfg.dynamic_sampling is not None:
            fill_informative(self, b, self.cfg.dynamic_sampling.max_rounds)

    def score(self, b: StepBatch) -> None:
        """The verifier's group rewards; the hard-task pool learns the batch's failures here, in the
        learner's thread (under ``grpo.overlap`` the next batch's tasks were drawn a step earlier)."""
        super().score(b)
        if self.hard is not None:
            self.hard.update(b.trajs)

    def advantages(self, b: StepBatch) -> None:
        """Group advantages; a guided group's demonstration joins it (and is dealt with it)."""
        g, audit, n = self.cfg, self.ws.cfg.audit, len(b.trajs)
        guided = (
            guide_failed_groups(
                self.ws, self.model, b.tasks, b.trajs, self.expert, self.learner.version, self.ws.contract.pad_token_id
            )
            if self.expert is not None
            else []
        )
        demo_rewards = outcome_rewards([d for _, d in guided], audit)[0].tolist() if guided else []
        adv, demo_adv = guided_advantages(
            self.estimator,
            b.rewards,
            [(i, r) for (i, _), r in zip(guided, demo_rewards)],
            normalize_std=g.normalize_std,
        )
        b.groups = b.group_indices()
        for j, (i, _) in enumerate(guided):
            b.groups[i].append(n + j)
        b.trajs, b.adv = b.trajs + [d for _, d in guided], torch.cat([adv, demo_adv])
        b.data.nll = guide_nll_weights(n, [d for _, d in guided], g.guide_sft) if guided and g.guide_sft > 0 else None
        if self.expert is not None:
            b.metrics["guided_groups"] = float(len(guided))
        step, trajs = b.step, b.trajs
        b.metrics.update(
            self.ws.on_main(
                lambda: reward_debugger(
                    trajs, audit.flag_reward, self.ws.run_dir / "audit" / f"flagged-grpo-step-{step + 1:06d}.jsonl"
                )
            )
        )

    def update(self, b: StepBatch) -> None:
        """Zero-advantage trajectories give exactly zero policy gradient: without a KL term they are
        not forwarded, but they stay in each minibatch's loss denominator (the full-batch update)."""
        g = self.cfg
        b.updates += pg_update(
            self.learner,
            b.trajs,
            b.adv,
            g.updates_per_step,
            b.seeds("minibatches"),
            kind=g.loss,
            groups=b.groups,
            drop_zero=g.kl_coef == 0,
            ref_model=self.ref_model,
            nll_weights=b.data.nll,
            **self.loss_kwargs,
        )
        b.metrics["trained_trajectories"] = len(b.trajs) if g.kl_coef > 0 else int((b.adv.abs() > 0).sum())

    def after(self, b: StepBatch) -> None:
        if self.hard is not None:
            b.metrics["hard_pool_size"] = float(len(self.hard))
        b.metrics.update(self.gap.observe(b.step, b.metrics["reward_mean"]))
        self.write_samples(b, self.cfg.sample_trajectories)

    def state_dict(self) -> dict[str, Any]:
        return {"gap_monitor": self.gap.state_dict(), "hard_pool": self.hard.state_dict() if self.hard else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.gap.load_state_dict(state.get("gap_monitor", {}))
        if self.hard is not None and state.get("hard_pool"):
            self.hard.load_state_dict(state["hard_pool"])
            self.hard.config = self.cfg.hard_pool


run_grpo = run_on_loop(GRPOStage)
