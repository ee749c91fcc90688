"""The critic PPO and SAO share: a value head on a copy of the policy's decoder (or a separate
checkpoint), GAE advantages over policy tokens, and its clipped value-loss updates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mentorrl.algos.advantages import adaptive_gae_lambda, gae_advantages, outcome_token_rewards
from mentorrl.models.value import build_critic
from mentorrl.train.learner import CriticLearner, pad_token_values
from mentorrl.train.stage_helpers import minibatches, reduce_updates
from mentorrl.trajectory import Trajectory


def critic_advantages(
    trajs: list[Trajectory], rewards: torch.Tensor, values: list[torch.Tensor], p
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-trajectory GAE advantages and returns (1-D, aligned to tokens) from outcome rewards and critic values
    (PPO and SAO); ``p`` is a :class:`~mentorrl.config.GAEConfig`.

    Tool-observation and prompt tokens are skipped by the recursion; with ``normalize_advantages``
    the advantages are whitened over all policy tokens of the batch.
    """
    T = max(len(t.token_ids) for t in trajs)
    mask = pad_token_values([torch.tensor(t.loss_mask) for t in trajs], T)
    vals = pad_token_values(values, T)
    lam = adaptive_gae_lambda(mask.sum(1), p.lambda_alpha) if p.lambda_alpha else p.lam
    adv, ret = gae_advantages(
        outcome_token_rewards(rewards, mask), vals, mask, gamma=p.gamma, lam=lam, value_lam=p.value_lam
    )
    if p.normalize_advantages:
        keep = mask != 0
        if int(keep.sum()) > 1:
            a = adv[keep]
            adv = torch.where(keep, (adv - a.mean()) / (a.std(unbiased=False) + 1e-6), torch.zeros_like(adv))
    return [adv[b, : len(t.token_ids)] for b, t in enumerate(trajs)], [
        ret[b, : len(t.token_ids)] for b, t in enumerate(trajs)
    ]


class Critic:
    """A critic, its learner and the per-step update PPO and SAO share: values before the update,
    GAE advantages, then ``cfg.steps`` clipped value-loss minibatches towards the returns."""

    METRICS = ("value_loss", "value_clip_frac", "explained_variance")

    def __init__(self, policy, cfg, pad_id: int, precision: str | None = None):
        self.cfg = cfg
        self.model = build_critic(policy, cfg)
        self.learner = CriticLearner(self.model, cfg.optim, pad_id, precision=precision)

    def step(
        self, trajs: list[Trajectory], rewards: torch.Tensor, gae, seed: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, float]]:
        """``(advantages, values before the update, value metrics)``, per trajectory aligned to its tokens."""
        old_values = self.learner.values(trajs)
        adv, ret = critic_advantages(trajs, rewards, old_values, gae)
        vm = [
            self.learner.value_step(
                [trajs[i] for i in idx], [ret[i] for i in idx], [old_values[i] for i in idx], clip=self.cfg.value_clip
            )
            for idx in minibatches(list(range(len(trajs))), self.cfg.steps, seed=seed)
        ]
        return adv, old_values, reduce_updates(vm, self.METRICS)

    def state_dict(self) -> dict[str, Any]:
        return {"critic": self.model.state_dict(), "critic_learner": self.learner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "critic" in state:
            self.model.load_state_dict(state["critic"])
            self.learner.load_state_dict(state["critic_learner"])

    def save(self, stage_dir: Path) -> None:
        (stage_dir / "critic").mkdir(parents=True, exist_ok=True)
        self.model.save(stage_dir / "critic" / "value_model.safetensors")
