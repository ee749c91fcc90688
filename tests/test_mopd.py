"""Multi-teacher OPD weights on constructed inputs."""

from __future__ import annotations

import math

import pytest
import torch

from mentorrl.opd.mopd import (
    combine,
    confidence_weights,
    mixture_log_probs,
    routing_weights,
    step_weights,
    success_weights,
)

TEACHERS = ["math", "tools", "general"]


def test_routing_by_family():
    w = routing_weights(
        ["refund", "place_order", "unknown"],
        TEACHERS,
        {"refund": {"tools": 3.0, "general": 1.0}, "place_order": {"math": 1.0}},
    )
    assert w.tolist() == [[0.0, 0.75, 0.25], [1.0, 0.0, 0.0], [pytest.approx(1 / 3)] * 3]
    with pytest.raises(ValueError, match="unknown teachers"):
        routing_weights(["refund"], TEACHERS, {"refund": {"oracle": 1.0}})
    with pytest.raises(ValueError, match="negative"):
        routing_weights(["refund"], TEACHERS, {"refund": {"math": -1.0}})


def test_confidence_prefers_the_teacher_that_likes_the_trajectory():
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    scores = torch.tensor(
        [  # [M=2, B=2, T=3] token log-probs
            [[-9.0, -0.1, -0.3], [-9.0, -2.0, -9.0]],
            [[-9.0, -1.0, -1.2], [-9.0, -0.5, -9.0]],
        ]
    )
    w = confidence_weights(scores, mask)
    # trajectory 0: means -0.2 vs -1.1; trajectory 1: -2.0 vs -0.5 (position 0 and masked tokens ignored)
    e = lambda a, b: math.exp(a) / (math.exp(a) + math.exp(b))  # noqa: E731
    assert w[0].tolist() == pytest.approx([e(-0.2, -1.1), e(-1.1, -0.2)])
    assert w[1].tolist() == pytest.approx([e(-2.0, -0.5), e(-0.5, -2.0)])
    sharp = confidence_weights(scores, mask, temperature=0.1)
    assert sharp[0, 0] > w[0, 0] and sharp[1, 1] > w[1, 1]


def test_success_history_and_combination():
    s = success_weights({"math": (8, 10), "tools": (1, 10)}, TEACHERS)
    raw = [9 / 12, 2 / 12, 1 / 2]  # Beta(1, 1) posterior means; no history: the prior mean 0.5
    assert s.tolist() == pytest.approx([r / sum(raw) for r in raw])
    with pytest.raises(ValueError, match="successes"):
        success_weights({"math": (3, 2)}, TEACHERS)
    route = routing_weights(["refund"], TEACHERS, {"refund": {"tools": 1.0, "general": 1.0}})
    both = combine(route, s)
    assert both[0, 0] == 0 and both.sum().item() == pytest.approx(1.0)
    assert both[0, 2] / both[0, 1] == pytest.approx(raw[2] / raw[1])
    with pytest.raises(ValueError, match="weight 0"):
        combine(torch.tensor([[1.0, 0.0]]), torch.tensor([0.0, 1.0]))


def test_mixture_distribution():
    p1 = torch.tensor([0.7, 0.2, 0.1])
    p2 = torch.tensor([0.1, 0.1, 0.8])
    logits = torch.log(torch.stack([p1, p2]))[:, None, None, :]  # [M=2, B=1, T=1, V=3]
    mix = mixture_log_probs(logits, torch.tensor([[0.25, 0.75]])).exp()[0, 0]
    assert mix.tolist() == pytest.approx((0.25 * p1 + 0.75 * p2).tolist())
    only_first = mixture_log_probs(logits, torch.tensor([[1.0, 0.0]])).exp()[0, 0]
    assert only_first.tolist() == pytest.approx(p1.tolist())


def test_failure_aware_step_weights():
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0]])
    tool_err = torch.tensor([[0, 0, 1, 1], [0, 0, 0, 0]])
    low = torch.tensor([False, True])
    ent = torch.tensor([[0.0, 2.0, 0.1, 0.1], [0.0, 0.1, 0.1, 5.0]])
    w = step_weights(
        mask, tool_err, low, ent, tool_error_boost=2.0, low_reward_boost=1.5, entropy_threshold=1.0, entropy_boost=3.0
    )
    assert w.tolist() == [[0.0, 3.0, 2.0, 2.0], [0.0, 1.5, 1.5, 0.0]]  # prompt and padding stay 0
    assert step_weights(mask).tolist() == mask.double().tolist()
