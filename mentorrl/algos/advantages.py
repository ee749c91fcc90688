"""Advantage estimators and reward statistics.

Conventions
-----------
* Rewards arrive grouped as ``[G, K]``: ``G`` prompts, ``K`` sampled responses
  per prompt. Advantages come back in the same layout; flatten with
  ``.reshape(-1)`` to get one advantage per sequence (row-major, group-major).
* Group std is the **unbiased** (Bessel-corrected, ``N-1``) sample std, as in
  ``torch.std`` and verl's ``compute_grpo_outcome_advantage``.
* Groups of size 1 and groups whose rewards are all equal get advantage exactly 0
  (whatever the value and input dtype: no rounded mean leaks through ``std + eps``).
* Higher advantage = better; losses minimise ``-A * ratio``.

Adding an estimator: write a pure function and decorate it with
``@register_advantage("name")``.
"""

from __future__ import annotations

from typing import Callable

import torch

from mentorrl.config.names import ADVANTAGES

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "register_advantage",
    "get_advantage_estimator",
    "grpo_advantages",
    "group_reward_stats",
    "zero_variance_groups",
    "broadcast_sequence_advantages",
    "sanitize_group_rewards",
    "outcome_token_rewards",
    "gae_advantages",
    "adaptive_gae_lambda",
]

ADVANTAGE_ESTIMATORS = ADVANTAGES  # the registry a config's grpo.advantage is checked against (mentorrl.config.names)


def register_advantage(name: str, replace: bool = False):
    """Decorator: register an advantage estimator under ``name`` (a taken name is an error unless ``replace``)."""
    return ADVANTAGES.register(name, replace=replace)


def get_advantage_estimator(name: str) -> Callable[..., torch.Tensor]:
    return ADVANTAGES.get(name)


@register_advantage("grpo")
def grpo_advantages(rewards: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
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
    adv = _centred(r)
    if normalize_std:
        std = adv.std(dim=1, keepdim=True, unbiased=True)
        adv = adv / (std + eps)
    return torch.where(_constant_groups(r), torch.zeros_like(adv), adv)


def _centred(r: torch.Tensor) -> torch.Tensor:
    """``r - mean`` per group (row), computed as deviations from the row's first value so that an
    all-equal row gives exact zeros: the float32 mean of eight 1.2s is off by ~6e-8, and that error
    divided by ``std + eps`` used to become an advantage of ~0.1 for every member."""
    d = r - r[:, :1]
    return d - d.mean(dim=1, keepdim=True)


def _constant_groups(r: torch.Tensor) -> torch.Tensor:
    """``[G, 1]``: whether every reward of a group is the same value (exact comparison)."""
    return (
        (r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True))
        if r.shape[1]
        else torch.ones(r.shape[0], 1, dtype=torch.bool, device=r.device)
    )


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
        d = r - r[:, :1]  # as in _centred: an all-equal group has std exactly 0, never clipped
        mean = r[:, :1] + d.mean(dim=1, keepdim=True)
        std = _centred(r).std(dim=1, keepdim=True, unbiased=False)
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
        zero_variance_group_share: share of groups whose rewards are all equal, or whose
            population std (of deviations from the group's first reward) is < 1e-8, i.e. groups
            that yield all-zero GRPO advantages. Groups of size 1 count.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [G, K], got shape {tuple(rewards.shape)}")
    r = rewards.detach().float()
    n = r.numel()
    if n == 0:
        return {
            "mean": 0.0,
            "std": 0.0,
            "min": 0.0,
            "max": 0.0,
            "zero_reward_rate": 0.0,
            "nonpositive_rate": 0.0,
            "zero_variance_group_share": 0.0,
        }
    flat = r.reshape(-1)
    return {
        "mean": flat.mean().item(),
        "std": flat.std(unbiased=True).item() if n > 1 else 0.0,
        "min": flat.min().item(),
        "max": flat.max().item(),
        "zero_reward_rate": (flat == 0).float().mean().item(),
        "nonpositive_rate": (flat <= 0).float().mean().item(),
        "zero_variance_group_share": zero_variance_groups(r).float().mean().item() if r.shape[0] > 0 else 0.0,
    }


def zero_variance_groups(r: torch.Tensor) -> torch.Tensor:
    """``[G]``: groups that are all equal or whose population std is below 1e-8."""
    if r.shape[1] == 0:
        return torch.ones(r.shape[0], dtype=torch.bool, device=r.device)
    return _constant_groups(r).squeeze(1) | (_centred(r).square().mean(dim=1).sqrt() < 1e-8)


def broadcast_sequence_advantages(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Spread per-sequence advantages ``[B]`` over tokens: ``[B, T]``.

    Each position with ``mask != 0`` gets its sequence's advantage; every other
    position gets exactly 0.
    """
    if adv.dim() != 1 or adv.shape[0] != mask.shape[0]:
        raise ValueError(f"adv must be [B] matching mask [B, T]; got {tuple(adv.shape)} vs {tuple(mask.shape)}")
    a = adv.float().unsqueeze(-1).expand(mask.shape)
    return torch.where(mask != 0, a, torch.zeros((), dtype=a.dtype, device=a.device))


# ------------------------------------------------------------ critic-based (PPO / SAO) -----
def outcome_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's scalar reward ``[B]`` on its last policy token: ``[B, T]``.

    Rows without any policy token get no reward (all zeros).
    """
    if rewards.dim() != 1 or rewards.shape[0] != mask.shape[0]:
        raise ValueError(f"rewards must be [B] matching mask [B, T]; got {tuple(rewards.shape)} vs {tuple(mask.shape)}")
    keep = mask != 0
    T = mask.shape[1]
    pos = torch.arange(T, device=mask.device).expand_as(mask)
    last = torch.where(keep, pos, torch.full_like(pos, -1)).max(dim=1).values  # -1: no policy token
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    out[rows, last[rows]] = rewards.float()[rows]
    return out


def adaptive_gae_lambda(lengths: torch.Tensor, alpha: float) -> torch.Tensor:
    """Length-adaptive GAE lambda, ``1 - 1 / (alpha * length)`` per sequence, clamped to [0, 1].

    Longer trajectories get a lambda closer to 1 (less bias over many steps); ``lengths`` counts
    the policy tokens of each sequence. This is VAPO's length-adaptive lambda *for the policy's
    advantages* only: VAPO also decouples the critic, whose targets use their own lambda (1.0,
    Monte-Carlo returns). That half is :func:`gae_advantages`'s ``value_lam``; without it the
    returns use the same (here adaptive) lambda as the advantages, which is not VAPO's critic.
    """
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    lengths = lengths.float().clamp(min=1.0)
    return (1.0 - 1.0 / (alpha * lengths)).clamp(0.0, 1.0)


def _lambda_per_row(lam: float | torch.Tensor, B: int, device, name: str) -> torch.Tensor:
    lam_b = lam.float().to(device) if isinstance(lam, torch.Tensor) else torch.full((B,), float(lam), device=device)
    if lam_b.shape != (B,):
        raise ValueError(f"{name} must be a float or [B]; got {tuple(lam_b.shape)}")
    return lam_b


def _gae(r: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, gamma: float, lam_b: torch.Tensor) -> torch.Tensor:
    B, T = keep.shape
    adv = torch.zeros_like(v)
    next_v = torch.zeros(B, device=v.device)
    next_a = torch.zeros(B, device=v.device)
    for t in range(T - 1, -1, -1):
        m = keep[:, t]
        delta = r[:, t] + gamma * next_v - v[:, t]
        a = delta + gamma * lam_b * next_a
        adv[:, t] = torch.where(m, a, torch.zeros_like(a))
        next_v = torch.where(m, v[:, t], next_v)
        next_a = torch.where(m, a, next_a)
    return adv


def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float | torch.Tensor = 0.95,
    value_lam: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the policy tokens of multi-turn trajectories.

    Only positions with ``mask != 0`` (tokens the policy generated) are steps. Prompt and
    tool-observation tokens are skipped: the recursion carries the next policy token's value
    and advantage across them, so an observation neither gets an advantage nor breaks the
    chain between the turns before and after it. After the last policy token the episode
    ends (next value 0).

        delta_t = r_t + gamma * V_next - V_t
        A_t     = delta_t + gamma * lam * A_next          returns_t = A'_t + V_t

    where ``A'`` is the same recursion with ``value_lam`` in place of ``lam`` (decoupled GAE, as in
    VAPO, whose critic uses ``value_lam = 1``: Monte-Carlo returns), or ``A`` itself when
    ``value_lam`` is None (the default: one lambda for both, the behaviour before it existed).

    Args:
        token_rewards: ``[B, T]`` (e.g. :func:`outcome_token_rewards`).
        values: ``[B, T]`` critic values (no gradient is taken through them).
        mask: ``[B, T]`` 1 on policy tokens.
        lam: a float, or ``[B]`` per-sequence lambdas (:func:`adaptive_gae_lambda`), for the advantages.
        value_lam: None, a float or ``[B]``: the lambda of the critic's targets (``returns``).
    Returns:
        ``(advantages, returns)``, both ``[B, T]`` fp32 and exactly 0 off the mask.
    """
    if token_rewards.shape != values.shape or values.shape != mask.shape:
        raise ValueError(
            f"rewards {tuple(token_rewards.shape)}, values {tuple(values.shape)} and mask "
            f"{tuple(mask.shape)} must have the same [B, T] shape"
        )
    r, v = token_rewards.detach().float(), values.detach().float()
    keep = mask != 0
    B = mask.shape[0]
    adv = _gae(r, v, keep, gamma, _lambda_per_row(lam, B, v.device, "lam"))
    ret_adv = (
        adv if value_lam is None else _gae(r, v, keep, gamma, _lambda_per_row(value_lam, B, v.device, "value_lam"))
    )
    returns = torch.where(keep, ret_adv + v, torch.zeros_like(v))
    return adv, returns
