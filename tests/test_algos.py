"""Tests for mentorrl.algos: exact, hand-computed values (arithmetic in comments)."""

import math

import pytest
import torch

from mentorrl import algos
from mentorrl.algos import (
    ADVANTAGE_ESTIMATORS,
    AGG_MODES,
    POLICY_LOSSES,
    aggregate_loss,
    broadcast_sequence_advantages,
    clipped_policy_loss,
    entropy_from_logits,
    gather_token_logprobs,
    get_advantage_estimator,
    get_policy_loss,
    group_reward_stats,
    grpo_advantages,
    grpo_loss,
    kl_penalty,
    masked_mean,
    masked_sum,
    register_advantage,
    register_policy_loss,
    sft_loss,
)
from mentorrl.algos import logprobs as lp_mod

LN2 = math.log(2.0)


def t(x, **kw):
    return torch.tensor(x, dtype=torch.float32, **kw)


def close(a, b, tol=1e-5):
    a = torch.as_tensor(a, dtype=torch.float32)
    b = torch.as_tensor(b, dtype=torch.float32)
    torch.testing.assert_close(a, b, atol=tol, rtol=0)


# --------------------------------------------------------------------------- logprobs


def test_gather_token_logprobs_hand_value():
    # logits [0, ln 3] -> softmax [1/4, 3/4]; target 1 -> ln(3/4) = -0.2876821
    logits = t([[[0.0, math.log(3.0)]]])
    close(gather_token_logprobs(logits, torch.tensor([[1]])), [[-0.2876821]])
    # temperature 2 on [0, 2 ln 3] gives the same distribution
    logits2 = t([[[0.0, 2 * math.log(3.0)]]])
    close(gather_token_logprobs(logits2, torch.tensor([[1]]), temperature=2.0), [[-0.2876821]])
    close(gather_token_logprobs(logits2, torch.tensor([[0]]), temperature=2.0), [[math.log(0.25)]])


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_gather_token_logprobs_matches_log_softmax(monkeypatch, temperature):
    monkeypatch.setattr(lp_mod, "_CHUNK_ROWS", 3)  # force several chunks (10 rows)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g) * 3
    targets = torch.randint(0, 11, (2, 5), generator=g)
    x1 = logits.clone().requires_grad_(True)
    x2 = logits.clone().requires_grad_(True)
    out = gather_token_logprobs(x1, targets, temperature=temperature)
    ref = torch.log_softmax(x2 / temperature, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    assert out.dtype == torch.float32 and out.shape == (2, 5)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    w = torch.randn(2, 5, generator=g)
    (out * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, atol=1e-6, rtol=1e-6)


def test_gather_token_logprobs_bf16_returns_fp32():
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(3, 4, 7, generator=g) * 2).bfloat16()
    targets = torch.randint(0, 7, (3, 4), generator=g)
    out = gather_token_logprobs(logits, targets, temperature=0.9)
    ref = torch.log_softmax(logits.float() / 0.9, -1).gather(-1, targets[..., None]).squeeze(-1)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)


def test_entropy_from_logits():
    # p = [1/4, 3/4]: H = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.3465736 + 0.2157616 = 0.5623351
    close(entropy_from_logits(t([[[0.0, math.log(3.0)]]])), [[0.5623351]])
    # uniform over 8 -> ln 8 = 2.0794415 ; temperature does not change a uniform
    close(entropy_from_logits(torch.zeros(1, 2, 8), temperature=0.5), [[2.0794415] * 2])
    g = torch.Generator().manual_seed(2)
    z = torch.randn(2, 3, 9, generator=g)
    p = torch.softmax(z / 1.5, -1)
    close(entropy_from_logits(z, temperature=1.5), -(p * p.log()).sum(-1))
    with pytest.raises(ValueError):
        entropy_from_logits(z, temperature=0.0)


def test_masked_mean_and_sum():
    x = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1, 0, 1], [0, 0, 0]])
    # sum = 1 + 3 = 4 ; mean = 4 / 2 = 2
    close(masked_sum(x, m), 4.0)
    close(masked_mean(x, m), 2.0)
    # per row: [4, 0] and [2, 0] (empty row -> 0, not NaN)
    close(masked_sum(x, m, dim=-1), [4.0, 0.0])
    close(masked_mean(x, m, dim=-1), [2.0, 0.0])
    # junk (inf/nan) at masked positions must not leak
    y = t([[1.0, float("inf"), 3.0], [float("nan"), 0.0, 0.0]])
    close(masked_mean(y, m), 2.0)
    close(masked_mean(x, torch.zeros(2, 3)), 0.0)


# --------------------------------------------------------------------------- advantages


def test_grpo_advantages_hand_values():
    rewards = t([[1, 0, 0, 1], [2, 2, 2, 2], [3, 0, 0, 0]])
    adv = grpo_advantages(rewards)
    # row 0: mean 0.5, deviations ±0.5, unbiased var = 4*0.25/3 = 1/3, std = 0.5773503
    #        -> ±0.5/0.5773503 = ±0.8660254
    # row 1: all equal -> 0
    # row 2: mean 0.75, dev [2.25, -0.75 x3], var = (5.0625 + 3*0.5625)/3 = 2.25, std 1.5
    #        -> [1.5, -0.5, -0.5, -0.5]
    expected = t(
        [
            [0.8660254, -0.8660254, -0.8660254, 0.8660254],
            [0.0, 0.0, 0.0, 0.0],
            [1.5, -0.5, -0.5, -0.5],
        ]
    )
    close(adv, expected, tol=2e-6)  # eps=1e-6 in the denominator
    # without std normalisation: r - mean
    close(
        grpo_advantages(rewards, normalize_std=False),
        t([[0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0], [2.25, -0.75, -0.75, -0.75]]),
    )


def test_grpo_advantages_degenerate_groups_are_zero():
    close(grpo_advantages(t([[5.0], [0.0]])), t([[0.0], [0.0]]))  # K = 1
    adv = grpo_advantages(t([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]))
    assert torch.equal(adv, torch.zeros(2, 3))
    assert torch.isfinite(adv).all()


def test_group_reward_stats():
    rewards = t([[1, 0, 0, 1], [2, 2, 2, 2], [3, 0, 0, -1]])
    s = group_reward_stats(rewards)
    # flat: 1 0 0 1 2 2 2 2 3 0 0 -1 ; sum 12, n 12 -> mean 1
    # sum of squares 28 -> unbiased var = (28 - 12*1)/11 = 16/11 -> std 1.2060454
    assert s["mean"] == pytest.approx(1.0)
    assert s["std"] == pytest.approx(1.2060454, abs=1e-6)
    assert s["min"] == -1.0 and s["max"] == 3.0
    assert s["zero_reward_rate"] == pytest.approx(4 / 12)  # four exact zeros
    assert s["nonpositive_rate"] == pytest.approx(5 / 12)  # four zeros + one -1
    assert s["zero_variance_group_share"] == pytest.approx(1 / 3)  # row [2,2,2,2]
    assert all(isinstance(v, float) for v in s.values())
    # zero-variance groups get zero advantage and are counted
    r2 = t([[0, 0], [1, 1], [0, 1]])
    assert group_reward_stats(r2)["zero_variance_group_share"] == pytest.approx(2 / 3)
    assert torch.equal(grpo_advantages(r2)[:2], torch.zeros(2, 2))


def test_broadcast_sequence_advantages():
    out = broadcast_sequence_advantages(t([2.0, -1.0]), torch.tensor([[1, 1, 0], [0, 1, 1]]))
    assert torch.equal(out, t([[2.0, 2.0, 0.0], [0.0, -1.0, -1.0]]))


def test_advantage_registry():
    assert ADVANTAGE_ESTIMATORS["grpo"] is grpo_advantages
    assert get_advantage_estimator("grpo") is grpo_advantages
    with pytest.raises(ValueError, match="grpo"):
        get_advantage_estimator("nope")

    @register_advantage("_test_dummy")
    def dummy(rewards):
        return rewards * 0

    try:
        assert ADVANTAGE_ESTIMATORS["_test_dummy"] is dummy
        with pytest.raises(ValueError):
            register_advantage("_test_dummy")(lambda r: r)
    finally:
        del ADVANTAGE_ESTIMATORS["_test_dummy"]


# --------------------------------------------------------------------------- aggregation

LOSS_TOK = t([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])
RAGGED = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize(
    "mode,expected",
    [
        # masked tokens: row0 {1,2,3}, row1 {5}, row2 {} -> 11 / 4 tokens
        ("token-mean", 11 / 4),
        # per-seq means [2, 5, 0] -> 7 / 3
        ("seq-mean-token-mean", 7 / 3),
        # per-seq sums [6, 5, 0] -> 11 / 3
        ("seq-mean-token-sum", 11 / 3),
    ],
)
def test_aggregate_loss_modes(mode, expected):
    x = LOSS_TOK.clone().requires_grad_(True)
    out = aggregate_loss(x, RAGGED, mode)
    close(out, expected)
    out.backward()
    assert torch.isfinite(x.grad).all()
    assert torch.equal(x.grad[RAGGED == 0], torch.zeros(int((RAGGED == 0).sum())))


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_loss_empty_mask(mode):
    x = LOSS_TOK.clone().requires_grad_(True)
    out = aggregate_loss(x, torch.zeros(3, 4), mode)
    assert out.item() == 0.0
    out.backward()
    assert torch.equal(x.grad, torch.zeros(3, 4))


def test_aggregate_loss_unknown_mode():
    with pytest.raises(ValueError) as e:
        aggregate_loss(LOSS_TOK, RAGGED, "token-sum")
    for m in AGG_MODES:
        assert m in str(e.value)


# --------------------------------------------------------------------------- clipped loss

# One sequence, old log-probs 0 so ratio = exp(logprobs). eps_low 0.2, eps_high 0.28
# -> clip range [0.8, 1.28].
#   tok  A   ratio  -A*r    -A*clip(r)   max      clipped branch active?
#   0   +1   1.50   -1.50   -1.28        -1.28    yes (above 1+eps_high, A>0)
#   1   +1   0.50   -0.50   -0.80        -0.50    no  (A>0 below range: not clipped)
#   2   -1   1.50   +1.50   +1.28        +1.50    no  (A<0 above range: not clipped)
#   3   -1   0.50   +0.50   +0.80        +0.80    yes (below 1-eps_low, A<0)
#   4   +1   1.25   -1.25   -1.25        -1.25    no  (inside 1.28; would clip at eps 0.2)
#   5   -1   0.85   +0.85   +0.85        +0.85    no  (inside)
# sum = -1.28 - 0.5 + 1.5 + 0.8 - 1.25 + 0.85 = 0.12 -> token-mean 0.02 ; clip_frac 2/6
RATIOS = [1.5, 0.5, 1.5, 0.5, 1.25, 0.85]
ADV_TOK = t([[1, 1, -1, -1, 1, -1]])


def _clip_inputs():
    logprobs = torch.log(t([RATIOS])).requires_grad_(True)
    return logprobs, torch.zeros(1, 6), ADV_TOK.clone(), torch.ones(1, 6)


def test_clipped_policy_loss_values_and_metrics():
    logprobs, old, adv, mask = _clip_inputs()
    loss, m = clipped_policy_loss(logprobs, old, adv, mask, eps_low=0.2, eps_high=0.28)
    close(loss, 0.02)
    assert m["pg_loss"] == pytest.approx(0.02, abs=1e-6)
    assert m["clip_frac"] == pytest.approx(2 / 6)
    # ratio mean = (1.5+0.5+1.5+0.5+1.25+0.85)/6 = 6.1/6
    assert m["ratio_mean"] == pytest.approx(6.1 / 6, abs=1e-6)
    assert m["ratio_max"] == pytest.approx(1.5) and m["ratio_min"] == pytest.approx(0.5)
    # approx_kl = mean(old - new) = -mean(ln r) = 0.0857899
    assert m["approx_kl"] == pytest.approx(0.0857899, abs=1e-6)
    assert all(isinstance(v, float) for v in m.values())
    loss.backward()
    # d/dlogp of (-A*r)/6 = -A*r/6 on unclipped tokens, 0 on clipped ones
    close(logprobs.grad, t([[0.0, -0.5 / 6, 1.5 / 6, 0.0, -1.25 / 6, 0.85 / 6]]))


def test_clip_higher_is_asymmetric():
    logprobs, old, adv, mask = _clip_inputs()
    # symmetric eps 0.2: token 4 (A=+1, r=1.25 > 1.2) is now clipped -> -1.2
    # sum = -1.28->-1.2 too (tok 0 clips at 1.2): -1.2 - 0.5 + 1.5 + 0.8 - 1.2 + 0.85 = 0.25
    loss, m = clipped_policy_loss(logprobs, old, adv, mask, eps_low=0.2, eps_high=0.2)
    close(loss, 0.25 / 6)
    assert m["clip_frac"] == pytest.approx(3 / 6)
    # wide eps_low 0.6 -> range [0.4, 1.28]: tok 3 (A=-1, r=0.5) no longer clipped -> +0.5
    # sum = -1.28 - 0.5 + 1.5 + 0.5 - 1.25 + 0.85 = -0.18
    loss, m = clipped_policy_loss(logprobs, old, adv, mask, eps_low=0.6, eps_high=0.28)
    close(loss, -0.18 / 6)
    assert m["clip_frac"] == pytest.approx(1 / 6)


def test_clipped_policy_loss_sequence_advantages():
    # advantages [B] broadcast over tokens: A=+2 on all; ratios [1.5, 1.0] ; mask [1, 1]
    # tok0: max(-3.0, -2*1.28=-2.56) = -2.56 ; tok1: -2.0 -> mean -2.28
    logprobs = torch.log(t([[1.5, 1.0]]))
    loss, m = clipped_policy_loss(logprobs, torch.zeros(1, 2), t([2.0]), torch.ones(1, 2))
    close(loss, -2.28)
    assert m["clip_frac"] == pytest.approx(0.5)


# --------------------------------------------------------------------------- KL


def test_kl_penalty_exact_values():
    logp = t([[0.0, LN2, 0.0]])
    ref = t([[LN2, 0.0, 0.0]])
    # d = logp - ref = [-ln2, ln2, 0]
    close(kl_penalty(logp, ref, "k1"), [[-LN2, LN2, 0.0]])
    # k2 = 0.5 d^2 = 0.5 * 0.480453 = 0.2402265
    close(kl_penalty(logp, ref, "k2"), [[0.2402265, 0.2402265, 0.0]])
    # k3 = exp(ref-logp) - (ref-logp) - 1:
    #   tok0: e^{ln2} - ln2 - 1 = 2 - 0.6931472 - 1 = 0.3068528
    #   tok1: e^{-ln2} + ln2 - 1 = 0.5 + 0.6931472 - 1 = 0.1931472
    close(kl_penalty(logp, ref), [[0.3068528, 0.1931472, 0.0]])
    with pytest.raises(ValueError, match="k3"):
        kl_penalty(logp, ref, "k4")


def test_kl_k3_nonnegative():
    g = torch.Generator().manual_seed(3)
    a = torch.randn(64, 32, generator=g) * 4
    b = torch.randn(64, 32, generator=g) * 4
    k3 = kl_penalty(a, b, "k3")
    assert (k3 >= 0).all()
    assert torch.equal(kl_penalty(a, a, "k3"), torch.zeros_like(a))


# --------------------------------------------------------------------------- grpo loss


def test_grpo_loss_with_kl():
    logprobs, old, adv, mask = _clip_inputs()
    ref = torch.zeros(1, 6)
    # k3 per token with d = ln r: 1/r + ln r - 1
    #   r=1.5: 0.6666667+0.4054651-1 = 0.0721318 (x2)
    #   r=0.5: 2-0.6931472-1         = 0.3068528 (x2)
    #   r=1.25: 0.8+0.2231436-1      = 0.0231436
    #   r=0.85: 1.1764706-0.1625189-1 = 0.0139517
    # sum = 0.1442636 + 0.6137056 + 0.0231436 + 0.0139517 = 0.7950644 ; /6 = 0.1325107
    # loss = 0.02 + 0.1 * 0.1325107 = 0.0332511
    loss, m = grpo_loss(logprobs, old, adv, mask, ref_logprobs=ref, kl_coef=0.1)
    close(loss, 0.0332511)
    assert m["kl"] == pytest.approx(0.1325107, abs=1e-6)
    assert m["pg_loss"] == pytest.approx(0.02, abs=1e-6)
    assert m["loss"] == pytest.approx(0.0332511, abs=1e-6)
    assert m["clip_frac"] == pytest.approx(2 / 6)
    # kl reported even with kl_coef 0, but not added
    loss0, m0 = grpo_loss(logprobs, old, adv, mask, ref_logprobs=ref)
    close(loss0, 0.02)
    assert m0["kl"] == pytest.approx(0.1325107, abs=1e-6)
    with pytest.raises(ValueError):
        grpo_loss(logprobs, old, adv, mask, kl_coef=0.1)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_masked_tokens_get_zero_gradient(agg):
    # 2 sequences; mask 0 = prompt / tool observation / padding.
    mask = torch.tensor([[0, 1, 1, 0, 1], [1, 1, 0, 0, 0]])
    g = torch.Generator().manual_seed(4)
    logprobs = (-torch.rand(2, 5, generator=g) * 3).requires_grad_(True)
    old = logprobs.detach() + 0.1 * torch.randn(2, 5, generator=g)
    old[mask == 0] = float("nan")  # junk at masked positions must not leak
    ref = logprobs.detach() - 0.3
    ref[0, 0] = float("inf")
    loss, m = grpo_loss(logprobs, old, t([1.5, -0.7]), mask, ref_logprobs=ref, kl_coef=0.05, agg=agg)
    assert torch.isfinite(loss)
    assert all(math.isfinite(v) for v in m.values())
    loss.backward()
    assert torch.equal(logprobs.grad[mask == 0], torch.zeros(int((mask == 0).sum())))
    assert (logprobs.grad[mask == 1] != 0).all()


def test_policy_loss_registry():
    assert POLICY_LOSSES["grpo"] is grpo_loss
    assert POLICY_LOSSES["clipped"] is clipped_policy_loss
    assert get_policy_loss("clipped") is clipped_policy_loss
    with pytest.raises(ValueError, match="grpo"):
        get_policy_loss("nope")

    @register_policy_loss("_test_dummy")
    def dummy(logprobs, old_logprobs, advantages, mask, **kw):
        return logprobs.sum(), {}

    try:
        assert POLICY_LOSSES["_test_dummy"] is dummy
    finally:
        del POLICY_LOSSES["_test_dummy"]


# --------------------------------------------------------------------------- SFT


def test_sft_loss():
    logprobs = t([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]]).requires_grad_(True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # token-mean NLL = (1 + 2 + 4) / 3 = 7/3
    loss, m = sft_loss(logprobs, mask)
    close(loss, 7 / 3)
    assert m["loss"] == pytest.approx(7 / 3, abs=1e-6)
    assert m["nll_token_mean"] == pytest.approx(7 / 3, abs=1e-6)
    assert m["num_tokens"] == 3.0
    loss.backward()
    close(logprobs.grad, t([[-1 / 3, -1 / 3, 0.0], [-1 / 3, 0.0, 0.0]]))
    # seq-mean-token-mean: per-seq [1.5, 4] -> 2.75 ; seq-mean-token-sum: [3, 4] -> 3.5
    close(sft_loss(logprobs, mask, agg="seq-mean-token-mean")[0], 2.75)
    close(sft_loss(logprobs, mask, agg="seq-mean-token-sum")[0], 3.5)


def test_package_exports():
    for name in algos.__all__:
        assert hasattr(algos, name)


def test_grpo_all_equal_groups_get_exactly_zero_advantage():
    """Issue 16: the float32 mean of eight 1.2s is off by ~6e-8, which divided by std + 1e-6 gave +0.106."""
    for v in (1.2, 0.1, 1 / 3, -0.7, 1e6 + 0.1):
        rewards = torch.full((1, 8), v)
        assert torch.equal(grpo_advantages(rewards), torch.zeros(1, 8)), v
        assert torch.equal(grpo_advantages(rewards, normalize_std=False), torch.zeros(1, 8)), v
        # and the statistics count such a group as zero-variance (they called it noisy before)
        assert group_reward_stats(rewards)["zero_variance_group_share"] == 1.0, v


def test_entropy_is_finite_with_minus_inf_logits():
    """Issue 16: a -inf logit (a banned token) made 0 * -inf = NaN in ``sum p * z``."""
    z = t([[0.0, -math.inf, math.log(3.0)]]).requires_grad_(True)
    h = entropy_from_logits(z)
    close(h, entropy_from_logits(t([[0.0, math.log(3.0)]])))  # the banned token adds nothing: 0.5623351
    h.sum().backward()
    assert torch.isfinite(z.grad).all() and z.grad[0, 1] == 0.0


@pytest.mark.parametrize("shape", [(1, 6), (1, 8), (3, 16), (2, 8)])
def test_sanitize_never_z_clips_an_all_equal_group(shape):
    """The rounded float32 mean of identical 1.2s sat an ulp off every member (with std 1.2e-7 > 1e-8),
    so a small z_max clipped them all."""
    from mentorrl.algos import sanitize_group_rewards

    rewards = torch.full(shape, 1.2)
    out, counts = sanitize_group_rewards(rewards, 0.0, 2.0, z_max=0.1)
    assert counts["z_clipped"] == 0.0 and torch.equal(out, rewards)
