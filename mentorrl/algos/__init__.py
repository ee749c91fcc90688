"""Pure tensor functions for RL/SFT objectives (no model loading, no I/O)."""

from .advantages import (
    ADVANTAGE_ESTIMATORS,
    adaptive_gae_lambda,
    broadcast_sequence_advantages,
    gae_advantages,
    get_advantage_estimator,
    group_reward_stats,
    grpo_advantages,
    outcome_token_rewards,
    register_advantage,
    sanitize_group_rewards,
)
from .logprobs import entropy_from_logits, gather_token_logprobs, masked_mean, masked_sum
from .losses import (
    AGG_MODES,
    KL_KINDS,
    POLICY_LOSSES,
    aggregate_loss,
    clipped_policy_loss,
    clipped_value_loss,
    get_policy_loss,
    grpo_loss,
    kl_penalty,
    masked_importance_policy_loss,
    register_policy_loss,
    sft_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS", "broadcast_sequence_advantages", "get_advantage_estimator",
    "group_reward_stats", "grpo_advantages", "register_advantage", "sanitize_group_rewards",
    "outcome_token_rewards", "gae_advantages", "adaptive_gae_lambda",
    "entropy_from_logits", "gather_token_logprobs", "masked_mean", "masked_sum",
    "AGG_MODES", "KL_KINDS", "POLICY_LOSSES", "aggregate_loss", "clipped_policy_loss",
    "get_policy_loss", "grpo_loss", "kl_penalty", "register_policy_loss", "sft_loss",
    "masked_importance_policy_loss", "clipped_value_loss",
]
