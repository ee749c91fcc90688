"""Pure tensor functions for RL/SFT objectives (no model loading, no I/O)."""

from .advantages import (
    ADVANTAGE_ESTIMATORS,
    broadcast_sequence_advantages,
    get_advantage_estimator,
    group_reward_stats,
    grpo_advantages,
    register_advantage,
)
from .logprobs import entropy_from_logits, gather_token_logprobs, masked_mean, masked_sum
from .losses import (
    AGG_MODES,
    KL_KINDS,
    POLICY_LOSSES,
    aggregate_loss,
    clipped_policy_loss,
    get_policy_loss,
    grpo_loss,
    kl_penalty,
    register_policy_loss,
    sft_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS", "broadcast_sequence_advantages", "get_advantage_estimator",
    "group_reward_stats", "grpo_advantages", "register_advantage",
    "entropy_from_logits", "gather_token_logprobs", "masked_mean", "masked_sum",
    "AGG_MODES", "KL_KINDS", "POLICY_LOSSES", "aggregate_loss", "clipped_policy_loss",
    "get_policy_loss", "grpo_loss", "kl_penalty", "register_policy_loss", "sft_loss",
]
