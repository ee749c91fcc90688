"""DPO, IPO and ORPO against hand-computed values, masking to policy tokens, and the shared prefix."""

from __future__ import annotations

import math

import pytest
import torch

from mentorrl.algos.preference import after_shared_prefix, dpo_loss, ipo_loss, orpo_loss, sequence_logprobs


def t(*x):
    return torch.tensor(x, dtype=torch.float64, requires_grad=True)


def test_dpo_sigmoid_matches_the_hand_computed_value_and_pushes_chosen_up():
    pc, pr, rc, rr = t(-1.0), t(-2.0), t(-1.5), t(-1.5)
    loss, m = dpo_loss(pc, pr, rc, rr, beta=0.5)
    # z = 0.5 * ((-1 + 1.5) - (-2 + 1.5)) = 0.5; -log sigmoid(0.5) = log(1 + e^-0.5)
    assert loss.item() == pytest.approx(0.4740769841801067, abs=1e-12)
    assert m["chosen_reward"] == pytest.approx(0.25) and m["rejected_reward"] == pytest.approx(-0.25)
    assert m["reward_accuracy"] == 1.0 and m["reward_margin"] == pytest.approx(0.5)
    loss.backward()
    assert pc.grad.item() < 0 < pr.grad.item()  # descending raises the chosen log-prob, lowers the rejected
    assert pc.grad.item() == pytest.approx(-0.5 * (1 - 1 / (1 + math.exp(-0.5))))
    smooth, _ = dpo_loss(pc, pr, rc, rr, beta=0.5, label_smoothing=0.1)
    assert smooth.item() == pytest.approx(0.9 * math.log1p(math.exp(-0.5)) + 0.1 * math.log1p(math.exp(0.5)))


def test_dpo_averages_over_pairs_and_rejects_bad_parameters():
    loss, _ = dpo_loss(t(0.0, -1.0), t(0.0, 0.0), t(0.0, 0.0), t(0.0, 0.0), beta=1.0)
    assert loss.item() == pytest.approx((math.log(2) + math.log1p(math.e)) / 2)
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(t(0.0), t(0.0), t(0.0), t(0.0), beta=0.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(t(0.0), t(0.0), t(0.0), t(0.0), label_smoothing=0.5)


def test_ipo_regresses_the_margin_to_one_over_two_tau():
    pc, pr, rc, rr = t(-1.0), t(-2.0), t(-1.5), t(-1.5)  # margin (0.5) - (-0.5) = 1
    assert ipo_loss(pc, pr, rc, rr, tau=0.5)[0].item() == pytest.approx(0.0)  # target 1
    loss, _ = ipo_loss(pc, pr, rc, rr, tau=0.25)  # target 2: (1 - 2)^2
    assert loss.item() == pytest.approx(1.0)
    loss.backward()
    assert pc.grad.item() == pytest.approx(-2.0)  # d/dpc (m - 2)^2 = 2 (m - 2)


def test_orpo_is_nll_plus_lambda_times_the_log_odds_ratio_loss():
    chosen, cmask = t(-0.5, -1.5, -9.0), torch.tensor([1, 1, 0])  # the masked -9 is an observation token
    rejected, rmask = t(-2.0, -7.0), torch.tensor([1, 0])
    loss, m = orpo_loss(chosen, cmask, rejected, rmask, lam=0.1)
    p_c, p_r = math.exp(-1.0), math.exp(-2.0)
    ratio = math.log(p_c / (1 - p_c)) - math.log(p_r / (1 - p_r))
    want_odds = math.log1p(math.exp(-ratio))
    assert m["log_odds_ratio"] == pytest.approx(ratio)
    assert m["nll"] == pytest.approx(1.0) and m["odds_ratio_loss"] == pytest.approx(want_odds)
    assert loss.item() == pytest.approx(1.0 + 0.1 * want_odds)
    assert loss.item() == pytest.approx(1.0238183, abs=1e-6)  # 1 + 0.1 * log(1 + e^-1.3132617)
    loss.backward()
    assert chosen.grad[2].item() == 0.0 and rejected.grad[1].item() == 0.0  # masked tokens get no gradient
    assert rejected.grad[0].item() > 0  # descending lowers the rejected side


def test_sequence_logprobs_count_only_policy_tokens():
    lp = torch.tensor([[-1.0, -2.0, -100.0, -3.0]])
    mask = torch.tensor([[1, 1, 0, 1]])
    assert sequence_logprobs(lp, mask).item() == -6.0
    assert sequence_logprobs(lp, mask, average=True).item() == -2.0
    with pytest.raises(ValueError, match="no policy token"):
        sequence_logprobs(lp, torch.zeros_like(mask))


def test_after_shared_prefix_keeps_the_tokens_where_the_pair_differs():
    chosen, rejected = [1, 2, 3, 4, 5], [1, 2, 3, 9, 9, 9]
    cm, rm = after_shared_prefix(chosen, rejected, [0, 1, 1, 1, 1], [0, 1, 1, 1, 0, 1])
    assert cm == [0, 0, 0, 1, 1] and rm == [0, 0, 0, 1, 0, 1]
    with pytest.raises(ValueError, match="same token sequence"):
        after_shared_prefix([1, 2], [1, 2], [1, 1], [1, 1])


def test_sequence_logprobs_ignore_minus_inf_at_padded_positions():
    """Issue 16: -inf at a padded position times mask 0 gave NaN; the gradient there is 0."""
    lp = torch.tensor([[-1.0, -2.0, -math.inf], [-0.5, float("nan"), -math.inf]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    s = sequence_logprobs(lp, mask)
    assert s.tolist() == [-3.0, -0.5]
    assert sequence_logprobs(lp, mask, average=True).tolist() == [-1.5, -0.5]
    loss, _ = orpo_loss(lp, mask, lp.flip(0), mask.flip(0))
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(lp.grad).all()
    assert (lp.grad[mask == 0] == 0).all()


def test_orpo_update_compares_each_side_over_its_whole_completion():
    """Issue 16: the chosen side was averaged over its full mask but the rejected side only after the
    shared prefix. As in the ORPO paper and TRL, both sides are the mean log-prob of their own policy tokens."""
    from types import SimpleNamespace

    from mentorrl.config import BlackBoxConfig
    from mentorrl.train.recipes.blackbox import preference_update

    def traj(ids, mask):
        return SimpleNamespace(token_ids=ids, loss_mask=mask)

    # a shared prompt, a shared first policy turn, then the pair differs in its last turn
    chosen = traj([1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 0, 1])
    rejected = traj([1, 2, 3, 4, 5, 7, 8], [0, 0, 1, 1, 0, 1, 1])
    pairs = [(chosen, rejected, [0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 1, 1])]  # as preference_pairs builds them
    seen = {}

    class Recorder:
        def sequence_step(self, trajs, masks, objective, average=False):
            seen.update(trajs=trajs, masks=[m.tolist() for m in masks], average=average)
            return dict(objective(torch.tensor([-0.2, -0.9]))[1])

    o = BlackBoxConfig(recipe="ranking", preference={"loss": "orpo"})
    m = preference_update(Recorder(), None, pairs, o)
    assert seen["trajs"] == [chosen, rejected] and seen["average"] is True
    assert seen["masks"] == [chosen.loss_mask, rejected.loss_mask]  # the same token set on both sides
    one = torch.ones(1, 1)
    want, _ = orpo_loss(torch.tensor([[-0.2]]), one, torch.tensor([[-0.9]]), one, lam=o.preference.lam)
    assert m["loss"] == pytest.approx(want.item())
