"""Advantage estimators and reward statistics.

Conventions
-----------
* Rewards arrive grouped as ``[G, K]``: ``G`` prompts, ``K`` sampled responses
  per prompt. Advantages come back in the same layout; flatten with
  ``.reshape(-1)`` to get one advantage per sequence (row-major, group-major).
* Group std is the **unbiased** (Bessel-corrected, ``N-1``) sample std, as in
  ``torch.std`` and verl's ``compute_grpo_outcome_advantage``.
* Groups of size 1 and groups whose rewards are all equal get advantage 0.
* Higher advantage = better; losses minimise ``-A * ratio``.

Adding an estimator: write a pure function and decorate it with
``@register_advantage("name")``.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "register_advantage",
    "get_advantage_estimator",
    "grpo_advantages",
    "group_reward_stats",
    "broadcast_sequence_advantages",
    "sanitize_group_rewards",
]

ADVANTAGE_ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {}


def register_advantage(name: str):
    """Decorator: register an advantage estimator under ``name``."""

    def deco(fn):
        existing = ADVANTAGE_ESTIMATORS.get(name)
        if existing is not None and existing is not fn:
            raise ValueError(f"advantage estimator {name!r} already registered")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return deco


def get_advantage_estimator(name: str) -> Callable[..., torch.Tensor]:
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown advantage estimator {name!r}; valid: {sorted(ADVANTAGE_ESTIMATORS)}"
        ) from None


@register_advantage("grpo")
def grpo_advantages(
    rewards: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO outcome advantages within each group.

    ``A = (r - mean_g) / (std_g + eps)`` if ``normalize_std`` else ``r - mean_g``,
    with ``std_g`` the unbiased (``N-1``) std over the ``K`` responses of group g.

    Args:
        rewards: ``[G, K]`` scalar rewards.
    Returns:
        ``[G, K]`` fp32 advantages (no gradient flows to ``rewards`` semantics-wise,
        but the op itself is differentiable).
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [G, K], got shape {tuple(rewards.shape)}")
    r = rewards.float()
    G, K = r.shape
    if K <= 1:
        return torch.zeros_like(r)
    mean = r.mean(dim=1, keepdim=True)
    adv = r - mean
    if normalize_std:
        std = r.std(dim=1, keepdim=True, unbiased=True)
        adv = adv / (std + eps)
    return adv


def sanitize_group_rewards(
    rewards: torch.Tensor, low: float, high: float, z_max: float | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Group reward sanity before advantages: returns (clipped ``[G, K]`` rewards, counts).

    * non-finite rewards (NaN / inf from a broken reward function) become ``low``;
    * rewards outside the reward function's declared range ``[low, high]`` are clamped;
    * with ``z_max``, a reward more than ``z_max`` population std from its group mean is
      pulled back to that bound. Off by default: with tiered rewards a rare success in a
      large group *is* a many-sigma point, and clipping it would erase the one useful signal.

    The counts (``nonfinite``, ``out_of_range``, ``z_clipped``, ``clipped``) go to the step's
    metrics so a clip is never silent.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [G, K], got shape {tuple(rewards.shape)}")
    if not low < high:
        raise ValueError(f"reward range must have low < high, got [{low}, {high}]")
    r = rewards.detach().float().clone()
    nonfinite = ~torch.isfinite(r)
    r[nonfinite] = low
    out_of_range = (r < low) | (r > high)
    r = r.clamp(low, high)
    z_clipped = torch.zeros_like(out_of_range)
    if z_max is not None and r.shape[1] > 1:
        mean = r.mean(dim=1, keepdim=True)
        std = r.std(dim=1, keepdim=True, unbiased=False)
        lo, hi = mean - z_max * std, mean + z_max * std
        z_clipped = ((r < lo) | (r > hi)) & (std > 1e-8)
        r = torch.where(z_clipped, torch.minimum(torch.maximum(r, lo), hi), r)
    counts = {
        "nonfinite": float(nonfinite.sum()),
        "out_of_range": float((out_of_range & ~nonfinite).sum()),
        "z_clipped": float(z_clipped.sum()),
    }
    counts["clipped"] = counts["nonfinite"] + counts["out_of_range"] + counts["z_clipped"]
    return r, counts


def group_reward_stats(rewards: torch.Tensor) -> dict[str, float]:
    """Summary statistics of grouped rewards ``[G, K]`` as Python floats.

    Keys:
        mean, std, min, max: over all ``G*K`` rewards (``std`` unbiased; 0 if one reward).
        zero_reward_rate: share of rewards exactly ``== 0``.
        nonpositive_rate: share of rewards ``<= 0``.
        zero_variance_group_share: share of groups whose (population) std < 1e-8,
            i.e. groups that yield all-zero GRPO advantages. Groups of size 1 count.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [G, K], got shape {tuple(rewards.shape)}")
    r = rewards.detach().float()
    n = r.numel()
    if n == 0:
        return {
            "mean": 0.0, "std": 0.0, "min": 0.0, "max": 0.0,
            "zero_reward_rate": 0.0, "nonpositive_rate": 0.0,
            "zero_variance_group_share": 0.0,
        }
    flat = r.reshape(-1)
    group_std = r.std(dim=1, unbiased=False)
    return {
        "mean": flat.mean().item(),
        "std": flat.std(unbiased=True).item() if n > 1 else 0.0,
        "min": flat.min().item(),
        "max": flat.max().item(),
        "zero_reward_rate": (flat == 0).float().mean().item(),
        "nonpositive_rate": (flat <= 0).float().mean().item(),
        "zero_variance_group_share": (group_std < 1e-8).float().mean().item()
        if r.shape[0] > 0 else 0.0,
    }


def broadcast_sequence_advantages(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Spread per-sequence advantages ``[B]`` over tokens: ``[B, T]``.

    Each position with ``mask != 0`` gets its sequence's advantage; every other
    position gets exactly 0.
    """
    if adv.dim() != 1 or adv.shape[0] != mask.shape[0]:
        raise ValueError(
            f"adv must be [B] matching mask [B, T]; got {tuple(adv.shape)} vs {tuple(mask.shape)}"
        )
    a = adv.float().unsqueeze(-1).expand(mask.shape)
    return torch.where(mask != 0, a, torch.zeros((), dtype=a.dtype, device=a.device))
