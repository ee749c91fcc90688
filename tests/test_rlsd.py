"""RLSD selection and weighting on constructed inputs."""

from __future__ import annotations

import math

import pytest
import torch

from mentorrl.opd.rlsd import distill_weights, exploration_split


def test_only_verified_trajectories_are_distilled_and_weights_follow_reward_and_length():
    rewards = torch.tensor([1.2, 1.0, 0.0, 1.1, -1.0])
    lengths = torch.tensor([100, 100, 50, 200, 80])
    passed = torch.tensor([True, True, False, True, False])
    w = distill_weights(rewards, lengths, passed)
    assert w[2] == 0 and w[4] == 0
    assert w[passed].mean().item() == pytest.approx(1.0)
    assert w[0] / w[1] == pytest.approx(math.exp(0.2))  # reward, temperature 1
    short = distill_weights(rewards, lengths, passed, length_power=1.0)
    # trajectory 3 is twice as long as 0: it loses half its weight relative to the reward-only weights
    assert (short[3] / short[0]) / (w[3] / w[0]) == pytest.approx(0.5)
    flat = distill_weights(rewards, lengths, passed, reward_temperature=1e6)
    assert flat[passed].tolist() == pytest.approx([1.0, 1.0, 1.0], rel=1e-5)
    assert distill_weights(rewards, lengths, torch.zeros(5, dtype=torch.bool)).sum() == 0
    with pytest.raises(ValueError):
        distill_weights(rewards, lengths, passed, reward_temperature=0)
    with pytest.raises(ValueError):
        distill_weights(rewards, lengths, passed, length_power=-1)


def test_exploration_share():
    split = exploration_split(20, 0.25, seed=3)
    assert sum(split) == 5 and split == exploration_split(20, 0.25, seed=3)
    assert split != exploration_split(20, 0.25, seed=4)
    assert sum(exploration_split(7, 0.0, 0)) == 0 and sum(exploration_split(7, 1.0, 0)) == 7
    with pytest.raises(ValueError):
        exploration_split(5, 1.5, 0)
