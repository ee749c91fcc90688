"""OPD's composable advantage terms (mentorrl.algos.opd_terms) and the stage's selection of them."""

from __future__ import annotations

import pytest
import torch

from mentorrl.algos.opd_terms import (
    SEQUENCE_TERMS,
    TOKEN_TERMS,
    TermInputs,
    apply_token_terms,
    sequence_advantage,
    token_advantages,
)
from mentorrl.config import load_config
from mentorrl.opd.advantage import group_reward_weights
from mentorrl.train.recipes.opd import LOSS_TERMS, loss_term_names, sequence_term_names, token_term_names

VARIANTS = [
    [],
    ["opd.short={top_frac: 0.5}", "opd.mopd={step_weights: {}}", "opd.reward_coef=0.5"],
    ["opd.loss=topk", "opd.reward_weighted={}", "opd.distill_until=first_error"],
    ["opd.teachers=[{name: s, kind: self}]", "opd.rlsd={target: topk}", "opd.reward_coef=1.0"],
    ["opd.teachers=[{name: s, kind: self}]", "opd.rlsd={}", "opd.reward_coef=1.0"],
    ["opd.cross_tokenizer=sequence", "opd.reward_coef=1.0"],
]


@pytest.mark.parametrize("overrides", VARIANTS)
def test_every_selected_term_is_registered(overrides):
    o = load_config(None, overrides).opd
    assert set(token_term_names(o, True)) <= set(TOKEN_TERMS)
    assert set(sequence_term_names(o)) <= set(SEQUENCE_TERMS)
    assert set(loss_term_names(o, True, True)) <= set(LOSS_TERMS)


def test_the_selection_follows_the_config():
    o = load_config(None, ["opd.short={top_frac: 0.5}", "opd.distill_until=first_error", "opd.reward_weighted={}"]).opd
    assert token_term_names(o, True) == ["until_first_error", "center", "short"]
    assert sequence_term_names(o) == ["reward_weighted"]
    assert loss_term_names(o, True, False) == ["pg"]
    topk = load_config(None, ["opd.loss=topk"]).opd
    assert token_term_names(topk, True) == [] and loss_term_names(topk, True, False) == ["topk"]


def test_terms_compose_into_the_documented_advantage():
    masks = [torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0.0, 1.0, 1.0, 1.0])]
    kl = [torch.tensor([0.0, -0.5, 0.25]), None]
    rewards = torch.tensor([[1.0, 0.0]])
    x = TermInputs(masks, rewards=rewards, reward_weighted_coef=2.0, reward_weighted_temperature=0.5,
                   first_error=[torch.tensor([1.0, 1.0, 0.0]), torch.ones(4)])
    cut, m = apply_token_terms(["until_first_error"], kl, x)
    assert m == {} and cut[0].tolist() == [0.0, -0.5, 0.0] and cut[1] is None
    extra = sequence_advantage(["reward_weighted"], x, 2)
    assert torch.allclose(extra, 2.0 * group_reward_weights(rewards, 0.5).reshape(-1))
    env = torch.tensor([0.5, -0.5])
    adv = token_advantages(masks, env, 0.5, extra, cut, 3.0)
    assert torch.allclose(adv[0], (0.25 + float(extra[0])) * masks[0] + 3.0 * cut[0])
    assert torch.allclose(adv[1], (-0.25 + float(extra[1])) * masks[1])
