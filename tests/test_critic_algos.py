"""Critic-side pure functions: outcome rewards on tokens, GAE over policy tokens, adaptive lambda,
the clipped value loss and SAO's token-level double-sided importance masking."""

from __future__ import annotations

import pytest
import torch

from mentorrl.algos import (
    adaptive_gae_lambda,
    clipped_value_loss,
    gae_advantages,
    get_policy_loss,
    masked_importance_policy_loss,
    outcome_token_rewards,
)


def reference_gae(r: list[float], v: list[float], gamma: float, lam: float) -> list[float]:
    """GAE on a plain sequence of steps, written out the textbook way."""
    adv, nxt_v, nxt_a = [0.0] * len(r), 0.0, 0.0
    for t in reversed(range(len(r))):
        delta = r[t] + gamma * nxt_v - v[t]
        nxt_a = delta + gamma * lam * nxt_a
        adv[t], nxt_v = nxt_a, v[t]
    return adv


def test_outcome_reward_lands_on_the_last_policy_token():
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]])
    out = outcome_token_rewards(torch.tensor([2.0, 5.0, -1.0]), mask)
    assert out.tolist() == [[0, 0, 0, 0, 2.0, 0], [0] * 6, [-1.0, 0, 0, 0, 0, 0]]


def test_gae_skips_observation_tokens_and_matches_the_compressed_sequence():
    # prompt(2) policy(2) observation(3) policy(2) -- the observation is not a step
    mask = torch.tensor([[0, 0, 1, 1, 0, 0, 0, 1, 1]])
    values = torch.tensor([[9.0, 9.0, 0.1, 0.2, 7.0, 7.0, 7.0, 0.4, 0.5]])  # junk on non-policy tokens
    rewards = outcome_token_rewards(torch.tensor([1.0]), mask)
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    want = reference_gae([0, 0, 0, 1.0], [0.1, 0.2, 0.4, 0.5], 0.9, 0.8)
    got = adv[0, mask[0] == 1].tolist()
    assert got == pytest.approx(want)
    assert adv[0, mask[0] == 0].abs().sum() == 0 and ret[0, mask[0] == 0].abs().sum() == 0
    assert ret[0, mask[0] == 1].tolist() == pytest.approx([a + b for a, b in zip(want, [0.1, 0.2, 0.4, 0.5])])


def test_gae_with_lambda_one_and_gamma_one_is_return_minus_value():
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1]])
    values = torch.tensor([[0.3, 0.6, 5.0, 0.2], [0.0, 0.1, 0.2, 0.3]])
    adv, ret = gae_advantages(outcome_token_rewards(torch.tensor([1.0, -1.0]), mask), values, mask, 1.0, 1.0)
    assert adv[0].tolist() == pytest.approx([0.7, 0.4, 0.0, 0.8])
    assert ret[1].tolist() == pytest.approx([-1.0] * 4)


def test_per_sequence_lambda_and_adaptive_lambda():
    assert adaptive_gae_lambda(torch.tensor([10, 100]), alpha=0.05).tolist() == pytest.approx([0.0, 0.8])
    assert adaptive_gae_lambda(torch.tensor([1000]), alpha=1.0).item() == pytest.approx(0.999)
    with pytest.raises(ValueError):
        adaptive_gae_lambda(torch.tensor([5]), alpha=0.0)
    mask = torch.ones(2, 3, dtype=torch.long)
    values = torch.tensor([[0.1, 0.2, 0.3], [0.1, 0.2, 0.3]])
    rewards = outcome_token_rewards(torch.tensor([1.0, 1.0]), mask)
    adv, _ = gae_advantages(rewards, values, mask, gamma=1.0, lam=torch.tensor([0.0, 1.0]))
    assert adv[0].tolist() == pytest.approx(reference_gae([0, 0, 1.0], [0.1, 0.2, 0.3], 1.0, 0.0))
    assert adv[1].tolist() == pytest.approx(reference_gae([0, 0, 1.0], [0.1, 0.2, 0.3], 1.0, 1.0))
    with pytest.raises(ValueError, match="same"):
        gae_advantages(rewards, values[:, :2], mask)


def test_value_loss_clipping_and_explained_variance():
    old = torch.tensor([[0.0, 0.0]])
    ret = torch.tensor([[1.0, 1.0]])
    mask = torch.ones(1, 2)
    v = torch.tensor([[0.5, -0.5]], requires_grad=True)
    loss, m = clipped_value_loss(v, old, ret, mask, clip=0.2)
    loss.backward()
    # token 0 moved 0.5 towards the target: the clipped branch (0.2 -> err 0.64) dominates err 0.25: no gradient
    # token 1 moved away: the unclipped branch dominates (err 2.25 > clipped 1.44) and gets 0.5 * 2 * (v - R) / 2
    assert v.grad[0].tolist() == pytest.approx([0.0, -0.75])
    assert loss.item() == pytest.approx(0.5 * (0.64 + 2.25) / 2)
    assert m["value_clip_frac"] == pytest.approx(0.5)
    perfect, m2 = clipped_value_loss(
        torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0, 2.0]]), mask, clip=None
    )
    assert perfect.item() == 0.0 and m2["explained_variance"] == pytest.approx(1.0)


def test_double_sided_masking_drops_out_of_range_tokens_from_the_gradient():
    behaviour = torch.zeros(1, 4)
    # ratios: 1.0 (in), 1.5 (above 1.28: out), 0.5 (below 0.8: out), 1.1 (in)
    logp = torch.log(torch.tensor([[1.0, 1.5, 0.5, 1.1]])).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1, 1]])
    adv = torch.tensor([1.0])
    loss, m = masked_importance_policy_loss(logp, behaviour, adv, mask, eps_low=0.2, eps_high=0.28)
    loss.backward()
    # d(-A r)/d logp = -A r, token-mean over all 4 policy tokens; masked tokens get exactly 0
    assert logp.grad[0].tolist() == pytest.approx([-1.0 / 4, 0.0, 0.0, -1.1 / 4])
    assert m["masked_frac"] == pytest.approx(0.5)
    assert m["ratio_max"] == pytest.approx(1.5) and m["ratio_min"] == pytest.approx(0.5)
    # unlike clipping, a negative advantage does not bring an out-of-range token back
    logp2 = logp.detach().clone().requires_grad_(True)
    loss2, _ = masked_importance_policy_loss(logp2, behaviour, torch.tensor([-1.0]), mask)
    loss2.backward()
    assert logp2.grad[0, 1].item() == 0.0 and logp2.grad[0, 2].item() == 0.0
    assert get_policy_loss("masked_is") is masked_importance_policy_loss


def test_masking_ignores_non_policy_positions():
    behaviour = torch.tensor([[float("nan"), 0.0]])
    logp = torch.tensor([[5.0, 0.0]], requires_grad=True)
    loss, m = masked_importance_policy_loss(logp, behaviour, torch.tensor([1.0]), torch.tensor([[0, 1]]))
    loss.backward()
    assert torch.isfinite(loss) and m["masked_frac"] == 0.0 and logp.grad[0, 0].item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_masked_importance_loss_runs_in_any_float_dtype(dtype):
    """Issue 16: float64 log-probs crashed on a quantile dtype mismatch in the metrics."""
    lp = torch.tensor([[-1.0, -1.1, -0.9]], dtype=dtype, requires_grad=True)
    old = torch.tensor([[-1.0, -1.0, -1.0]], dtype=dtype)
    loss, m = masked_importance_policy_loss(lp, old, torch.tensor([1.0], dtype=dtype), torch.ones(1, 3))
    loss.backward()
    assert loss.dtype == dtype and torch.isfinite(lp.grad).all()
    assert m["ratio_p50"] == pytest.approx(1.0)


def test_gae_value_lambda_decouples_the_critic_targets():
    """VAPO's decoupled GAE: the policy's advantages use ``lam``, the critic's returns ``value_lam``
    (1: Monte-Carlo returns). Without ``value_lam`` both use ``lam``, as before."""
    mask = torch.tensor([[1, 1, 0, 1]])
    values = torch.tensor([[0.1, 0.2, 9.0, 0.3]])
    rewards = outcome_token_rewards(torch.tensor([1.0]), mask)
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=0.5)
    adv2, ret2 = gae_advantages(rewards, values, mask, gamma=1.0, lam=0.5, value_lam=1.0)
    assert torch.equal(adv, adv2)  # the policy side does not move
    ref = reference_gae([0, 0, 1.0], [0.1, 0.2, 0.3], 1.0, 0.5)
    assert ret[0].tolist() == pytest.approx([ref[0] + 0.1, ref[1] + 0.2, 0.0, ref[2] + 0.3])
    assert ret2[0].tolist() == pytest.approx([1.0, 1.0, 0.0, 1.0])  # lambda 1, gamma 1: the outcome itself
    with pytest.raises(ValueError, match="value_lam"):
        gae_advantages(rewards, values, mask, value_lam=torch.ones(3))
