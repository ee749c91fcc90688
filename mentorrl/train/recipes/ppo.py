"""PPO for multi-turn agents (``recipe: [sft, ppo]``): the same rollouts, rewards, checks and
learner as GRPO, with a critic (:class:`~mentorrl.train.critic.Critic`: a value head on a copy of
the policy's decoder) and GAE over policy tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mentorrl.train.critic import Critic
from mentorrl.train.loop import Stage, StepBatch, run_on_loop
from mentorrl.train.stage_helpers import RewardGapWatch, pg_update, score_outcomes
from mentorrl.train.workspace import Workspace


class PPOStage(Stage):
    """PPO with a critic: outcome rewards, GAE advantages from the critic, clipped minibatches (the
    actor waits ``critic.warmup_steps`` steps while the critic fits)."""

    name = "ppo"

    def __init__(self, ws: Workspace, model):
        super().__init__(ws, model)
        self.critic = Critic(model, self.cfg.critic, ws.contract.pad_token_id, precision=ws.cfg.model.dtype)
        self.gap = RewardGapWatch(ws, model)

    def score(self, b: StepBatch) -> None:
        b.rewards, metrics = score_outcomes(self.ws, "ppo", b.step, b.trajs)
        b.metrics.update(metrics)

    def advantages(self, b: StepBatch) -> None:
        b.adv, _, value_metrics = self.critic.step(b.trajs, b.rewards, self.cfg.gae, seed=b.seeds("critic"))
        b.metrics.update(value_metrics)

    def update(self, b: StepBatch) -> None:
        p = self.cfg
        if b.step >= p.critic.warmup_steps:
            b.updates += pg_update(
                self.learner,
                b.trajs,
                b.adv,
                p.updates_per_step,
                b.seeds("minibatches"),
                eps_low=p.eps_low,
                eps_high=p.eps_high,
                agg=p.loss_agg,
            )
        b.metrics["actor_updated"] = float(bool(b.updates))

    def after(self, b: StepBatch) -> None:
        b.metrics.update(self.gap.observe(b.step, b.metrics["reward_mean"]))

    def state_dict(self) -> dict[str, Any]:
        return {**self.critic.state_dict(), "gap_monitor": self.gap.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.gap.load_state_dict(state.get("gap_monitor", {}))
        if state:
            self.critic.load_state_dict(state)

    def finish(self, final: Path) -> Path:
        self.critic.save(self.ws.run_dir / "ppo")
        return final


ppo_stage = run_on_loop(PPOStage)
