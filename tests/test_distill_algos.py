"""On-policy distillation objectives against closed-form values, including the direction of each KL."""

from __future__ import annotations

import math

import pytest
import torch

from mentorrl.algos.distill import (
    distill_loss,
    mix_advantages,
    restrict_top_k,
    reward_weights,
    sampled_reverse_kl_advantage,
    select_large_gap,
    token_divergence,
)


def logits_of(*probs: list[float]) -> torch.Tensor:
    """``[1, len(probs), V]`` logits whose softmax is each given distribution."""
    return torch.log(torch.tensor([probs], dtype=torch.float64))


S = [0.5, 0.5]  # student
T = [0.9, 0.1]  # teacher
KL_S_T = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)  # KL(student || teacher) = 0.5108
KL_T_S = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)  # KL(teacher || student) = 0.3681


def test_reverse_and_forward_kl_closed_form_and_direction():
    s, t = logits_of(S), logits_of(T)
    assert token_divergence(s, t, "reverse").item() == pytest.approx(KL_S_T, abs=1e-9)
    assert token_divergence(s, t, "forward").item() == pytest.approx(KL_T_S, abs=1e-9)
    assert KL_S_T != pytest.approx(KL_T_S, abs=0.1)  # the two directions really differ here
    # swapping the roles swaps the directions
    assert token_divergence(t, s, "reverse").item() == pytest.approx(KL_T_S, abs=1e-9)
    assert token_divergence(s, s, "reverse").item() == pytest.approx(0.0, abs=1e-12)


def test_reverse_kl_is_mode_seeking_forward_is_mass_covering():
    """A bimodal teacher: a student on one mode has a small reverse KL but a large forward KL."""
    teacher = logits_of([0.49, 0.49, 0.02])
    one_mode = logits_of([0.97, 0.02, 0.01])
    spread = logits_of([0.34, 0.33, 0.33])
    rev = lambda s: token_divergence(s, teacher, "reverse").item()  # noqa: E731
    fwd = lambda s: token_divergence(s, teacher, "forward").item()  # noqa: E731
    assert rev(one_mode) < rev(spread)  # reverse KL prefers sitting on one mode (0.59 vs 0.67)
    assert fwd(one_mode) > fwd(spread)  # forward KL punishes the missed mode (1.25 vs 0.32)


def test_generalised_jsd():
    s, t = logits_of(S), logits_of(T)
    m = [0.5 * a + 0.5 * b for a, b in zip(S, T)]
    js = 0.5 * sum(p * math.log(p / q) for p, q in zip(T, m)) + 0.5 * sum(p * math.log(p / q) for p, q in zip(S, m))
    assert token_divergence(s, t, "jsd", beta=0.5).item() == pytest.approx(js, abs=1e-9)
    b = 0.2
    m = [b * a + (1 - b) * c for a, c in zip(T, S)]
    want = b * sum(p * math.log(p / q) for p, q in zip(T, m)) + (1 - b) * sum(p * math.log(p / q) for p, q in zip(S, m))
    assert token_divergence(s, t, "jsd", beta=b).item() == pytest.approx(want, abs=1e-9)
    # the endpoints, where the mixture equals one side and JSD(beta) would vanish identically, are
    # the two KLs, as in TRL's GKD generalized_jsd_loss: beta 0 -> KL(teacher || student), 1 -> KL(student || teacher)
    assert token_divergence(s, t, "jsd", beta=0.0).item() == pytest.approx(KL_T_S, abs=1e-9)
    assert token_divergence(s, t, "jsd", beta=1.0).item() == pytest.approx(KL_S_T, abs=1e-9)
    assert token_divergence(s, t, "jsd").item() <= math.log(2)  # JS divergence is bounded by log 2
    with pytest.raises(ValueError, match="beta"):
        token_divergence(s, t, "jsd", beta=1.5)
    with pytest.raises(ValueError, match="unknown divergence"):
        token_divergence(s, t, "kl")


def test_temperature_and_top_k():
    s, t = logits_of(S), logits_of(T)
    # temperature 2 flattens the teacher: p_t ∝ sqrt(T)
    z = math.sqrt(0.9) + math.sqrt(0.1)
    t2 = [math.sqrt(0.9) / z, math.sqrt(0.1) / z]
    want = sum(p * math.log(p / q) for p, q in zip(S, t2))
    assert token_divergence(s, t, "reverse", temperature=2.0).item() == pytest.approx(want, abs=1e-9)
    with pytest.raises(ValueError, match="temperature"):
        token_divergence(s, t, temperature=0.0)
    # top-k over the teacher's 2 best of 3 tokens: both sides renormalised on that support
    s3, t3 = logits_of([0.2, 0.3, 0.5]), logits_of([0.6, 0.1, 0.3])
    sk, tk = [0.2 / 0.7, 0.5 / 0.7], [0.6 / 0.9, 0.3 / 0.9]  # teacher's top 2 are tokens 0 and 2
    want = sum(p * math.log(p / q) for p, q in zip(sk, tk))
    assert token_divergence(s3, t3, "reverse", top_k=2).item() == pytest.approx(want, abs=1e-9)
    full = token_divergence(s3, t3, "forward").item()
    assert token_divergence(s3, t3, "forward", top_k=3).item() == pytest.approx(full, abs=1e-9)
    a, b = restrict_top_k(torch.log(torch.tensor([0.2, 0.3, 0.5])), torch.log(torch.tensor([0.6, 0.1, 0.3])), 2)
    assert a.exp().sum().item() == pytest.approx(1.0) and b.exp().sum().item() == pytest.approx(1.0)


def test_distill_loss_counts_policy_tokens_only_and_teacher_gets_no_gradient():
    torch.manual_seed(0)
    student = torch.randn(2, 4, 5, requires_grad=True)
    teacher = torch.randn(2, 4, 5, requires_grad=True)
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1]])
    loss, m = distill_loss(student, teacher, mask, "reverse")
    div = token_divergence(student, teacher, "reverse")
    assert loss.item() == pytest.approx(div[mask != 0].mean().item(), abs=1e-6)
    loss.backward()
    assert teacher.grad is None and student.grad.abs().sum() > 0
    assert student.grad[0, 0].abs().sum() == 0 and student.grad[1, 1].abs().sum() == 0  # prompt / tool positions
    w = torch.tensor([[0.0, 2.0, 1.0, 5.0], [1.0, 1.0, 1.0, 1.0]])
    weighted, _ = distill_loss(student, teacher, mask, "reverse", weights=w)
    d = div.detach()
    assert weighted.item() == pytest.approx((2 * d[0, 1] + d[0, 2] + d[1, 2] + d[1, 3]).item() / 5, abs=1e-6)
    assert m["divergence_max"] >= m["divergence_mean"] > 0


def test_sampled_advantage_mixing_and_reward_weights():
    s_lp = torch.tensor([[-1.0, -2.0, -0.5]])
    t_lp = torch.tensor([[-0.5, -3.0, -0.1]])
    mask = torch.tensor([[0, 1, 1]])
    adv = sampled_reverse_kl_advantage(s_lp, t_lp, mask)
    assert adv.tolist() == [[0.0, -1.0, pytest.approx(0.4)]]  # teacher likes token 3 more, token 2 less
    env = torch.tensor([[0.0, 1.0, 1.0]])
    assert mix_advantages(env, adv, 0.5).tolist() == [[0.0, 0.5, pytest.approx(1.2)]]
    with pytest.raises(ValueError):
        mix_advantages(env, adv, -1.0)
    w = reward_weights(torch.tensor([1.0, 0.0, 0.0]), temperature=0.5)
    e2 = math.exp(2.0)
    assert w.tolist() == pytest.approx([e2 / (e2 + 2), 1 / (e2 + 2), 1 / (e2 + 2)])
    assert reward_weights(torch.tensor([3.0, 3.0])).tolist() == [0.5, 0.5]


def test_short_opd_selection():
    gap = torch.tensor([[9.0, 0.1, 0.7, 0.3], [5.0, 0.9, 0.2, 0.8]])
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1]])  # position 0: prompt, never selected
    assert select_large_gap(gap, mask, threshold=0.5).tolist() == [
        [False, False, True, False],
        [False, True, False, True],
    ]
    top = select_large_gap(gap, mask, top_frac=0.5)  # 3 of 6 policy tokens: 0.9, 0.8, 0.7
    assert top.tolist() == [[False, False, True, False], [False, True, False, True]]
    assert select_large_gap(gap, mask, top_frac=0.0).sum() == 0
    assert select_large_gap(gap, mask, top_frac=1.0).sum() == 6
    with pytest.raises(ValueError, match="exactly one"):
        select_large_gap(gap, mask)


def test_tail_bin_keeps_mass_outside_the_top_k_visible():
    from mentorrl.algos.distill import divergence_of, renormalise, with_tail

    teacher = torch.log(torch.tensor([0.5, 0.3, 0.2, 0.0 + 1e-30]))
    student = torch.log(torch.tensor([0.25, 0.15, 0.1, 0.5]))  # same shape on the top-2, half its mass elsewhere
    t2, s2 = teacher[:2], student[:2]
    assert torch.allclose(with_tail(t2).exp().sum(), torch.tensor(1.0))
    assert torch.allclose(with_tail(s2).exp(), torch.tensor([0.25, 0.15, 0.6]))
    assert divergence_of(renormalise(s2), renormalise(t2), "reverse") < 1e-6  # renormalising hides the difference
    # reverse KL over (top-2, rest): sum p_s log(p_s / p_t) by hand
    want = 0.25 * math.log(0.25 / 0.5) + 0.15 * math.log(0.15 / 0.3) + 0.6 * math.log(0.6 / 0.2)
    assert abs(divergence_of(with_tail(s2), with_tail(t2), "reverse").item() - want) < 1e-5


def test_jsd_endpoints_match_full_vocabulary_kl_and_train():
    """Issue 16: opd.beta 0 or 1 gave a loss identically 0 (no gradient, silently no training)."""
    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, 3, 7, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(2, 3, 7, generator=g, dtype=torch.float64)
    ps, pt = torch.softmax(s, -1), torch.softmax(t, -1)
    fwd = (pt * (pt.log() - ps.log())).sum(-1)  # KL(teacher || student) over the whole vocabulary
    rev = (ps * (ps.log() - pt.log())).sum(-1)  # KL(student || teacher)
    torch.testing.assert_close(token_divergence(s, t, "jsd", beta=0.0), fwd)
    torch.testing.assert_close(token_divergence(s, t, "jsd", beta=1.0), rev)
    for beta in (0.0, 1.0):
        loss, _ = distill_loss(s, t, torch.ones(2, 3), "jsd", beta=beta)
        (grad,) = torch.autograd.grad(loss, s)
        assert loss.item() > 0 and grad.abs().max() > 1e-3


@pytest.mark.parametrize("kind, beta", [("reverse", 0.5), ("jsd", 0.5), ("jsd", 0.0), ("jsd", 1.0), ("jsd", 0.1)])
def test_distill_loss_has_finite_gradients_with_minus_inf_student_logits(kind, beta):
    """Issue 16: a -inf student logit (a banned token) gave NaN gradients through 0 * -inf."""
    inf = math.inf
    s = torch.tensor([[[0.0, 1.0, -inf], [2.0, -inf, -inf]]], requires_grad=True)
    t = torch.tensor([[[0.0, 1.0, 2.0], [0.5, 0.0, -inf]]])
    if kind == "jsd" and beta == 0.0:  # KL(teacher || student) is truly infinite where only the student bans
        t = torch.tensor([[[0.0, 1.0, -inf], [0.5, -inf, -inf]]])
    loss, m = distill_loss(s, t, torch.ones(1, 2), kind, beta=beta)
    loss.backward()
    assert math.isfinite(loss.item()) and math.isfinite(m["divergence_max"])
    assert torch.isfinite(s.grad).all()
    assert (s.grad[torch.isinf(s.detach())] == 0).all()  # a banned token gets no gradient
    # the same value as with a very negative finite logit in place of -inf
    finite = distill_loss(s.detach().clamp(min=-1e4), t.clamp(min=-1e4), torch.ones(1, 2), kind, beta=beta)[0]
    assert loss.item() == pytest.approx(finite.item(), rel=1e-5, abs=1e-7)
