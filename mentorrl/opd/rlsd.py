"""RLSD (self-distillation with verifiable rewards): which trajectories are distilled, and how much.

Only trajectories the verifier passed are distillation targets; among them, higher reward and
shorter length weigh more. A configurable share of each batch is *exploration*: trained by the
RL loss only, never distilled, so the frozen self-teacher does not pull every sample back to
what it already does. Loss = L_RL + lambda * L_SD (see :func:`mentorrl.algos.distill.mix_advantages`
and :meth:`mentorrl.train.learner.Learner.distill_step`).
"""

from __future__ import annotations

import random

import torch


def distill_weights(rewards: torch.Tensor, lengths: torch.Tensor, passed: torch.Tensor,
                    reward_temperature: float = 1.0, length_power: float = 0.0) -> torch.Tensor:
    """Per-trajectory distillation weights: 0 unless ``passed``; otherwise
    ``exp(R / T) * (length / mean length) ** -length_power``, scaled to mean 1 over the passed ones."""
    if not reward_temperature > 0:
        raise ValueError(f"reward_temperature must be > 0, got {reward_temperature}")
    if length_power < 0:
        raise ValueError(f"length_power must be >= 0, got {length_power}")
    passed = passed.bool()
    w = torch.zeros(rewards.shape, dtype=torch.float64)
    if not passed.any():
        return w
    r = rewards.double()[passed]
    lengths_p = lengths.double()[passed].clamp(min=1.0)
    raw = torch.exp((r - r.max()) / reward_temperature) * (lengths_p / lengths_p.mean()) ** (-length_power)
    w[passed] = raw / raw.mean()
    return w


def exploration_split(n: int, share: float, seed: int) -> list[bool]:
    """Which of ``n`` samples are exploration (RL only): ``round(share * n)`` of them, chosen by ``seed``."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"exploration share must lie in [0, 1], got {share}")
    k = round(share * n)
    chosen = set(random.Random(seed).sample(range(n), k))
    return [i in chosen for i in range(n)]


__all__ = ["distill_weights", "exploration_split"]
