"""Property tests (hypothesis) of the invariants issue 16 asks of the pure algorithms:

* a zero-variance GRPO group gets advantage exactly 0, in any dtype and for any value, while
  general groups still match the textbook formula;
* losses stay finite, with finite gradients, under -inf / NaN at masked positions, and equal the
  loss of the same batch with clean values there;
* micro-batched gradients, accumulated as the learner does (``Learner._accumulate`` with
  ``_share``), equal the full-batch gradient.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mentorrl.algos import (
    AGG_MODES,
    aggregate_loss,
    clipped_value_loss,
    get_policy_loss,
    group_reward_stats,
    grpo_advantages,
    sft_loss,
)
from mentorrl.algos.distill import distill_loss
from mentorrl.algos.preference import dpo_loss, orpo_loss, sequence_logprobs
from mentorrl.train.learner import _share

SETTINGS = settings(max_examples=150, deadline=None)
FAST = settings(max_examples=60, deadline=None)
POISON = [math.nan, math.inf, -math.inf]


# ------------------------------------------------------------------ GRPO advantages -----
@SETTINGS
@given(
    value=st.floats(-1e4, 1e4, allow_nan=False, width=32),
    k=st.integers(1, 16),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    normalize=st.booleans(),
    other=st.lists(st.floats(-3, 3, width=32), min_size=1, max_size=16),
)
def test_zero_variance_group_gets_exactly_zero_advantage(value, k, dtype, normalize, other):
    """Whatever the value and dtype, an all-equal group's advantages are exactly 0 (not ~1e-1 from
    a rounded mean divided by std + eps), also next to a group that does vary."""
    equal = torch.full((k,), value, dtype=dtype)
    varied = torch.tensor((other * k)[:k], dtype=dtype)
    rewards = torch.stack([equal, varied])
    adv = grpo_advantages(rewards, normalize_std=normalize)
    assert torch.equal(adv[0], torch.zeros(k)), (value, dtype, adv[0])
    assert torch.isfinite(adv).all()
    share = group_reward_stats(equal.view(1, -1))["zero_variance_group_share"]
    assert share == 1.0


@SETTINGS
@given(
    rows=st.lists(st.lists(st.integers(-300, 300), min_size=2, max_size=12), min_size=1, max_size=4),
    normalize=st.booleans(),
)
def test_grpo_advantages_match_the_reference_formula(rows, normalize):
    """``(r - mean) / (std_unbiased + eps)`` per group, from a float64 reference (rewards in steps of 0.01)."""
    k = min(len(r) for r in rows)
    r64 = torch.tensor([r[:k] for r in rows], dtype=torch.float64) / 100
    r64 = r64.float().double()  # the same float32 inputs on both sides
    ref = r64 - r64.mean(1, keepdim=True)
    if normalize:
        ref = ref / (r64.std(1, unbiased=True, keepdim=True) + 1e-6)
    adv = grpo_advantages(r64.float(), normalize_std=normalize)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv.double(), ref, atol=2e-5, rtol=1e-5)
    same = r64.amax(1) == r64.amin(1)
    assert torch.equal(adv[same], torch.zeros_like(adv[same]))


# --------------------------------------------------- poison at masked positions -----
@st.composite
def masked_batch(draw, max_b=4, max_t=6):
    b, t = draw(st.integers(1, max_b)), draw(st.integers(1, max_t))
    bits = draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))
    mask = torch.tensor(bits, dtype=torch.float32).view(b, t)
    seed = draw(st.integers(0, 2**16))
    poison = draw(st.sampled_from(POISON))
    return mask, torch.Generator().manual_seed(seed), poison


def _poisoned(x: torch.Tensor, mask: torch.Tensor, poison: float) -> torch.Tensor:
    keep = (mask != 0).view(mask.shape + (1,) * (x.dim() - mask.dim())).expand_as(x)
    return torch.where(keep, x, torch.full_like(x, poison))


def _check_clean_equals_poisoned(fn, clean: dict, mask: torch.Tensor, poison: float, grad_keys: tuple[str, ...]):
    """``fn(**inputs)`` is the same finite loss with clean and with poisoned masked positions; the
    gradients are finite and exactly 0 at masked positions."""
    results = []
    for p in (None, poison):
        inputs = {k: (v if p is None else _poisoned(v, mask, p)).detach().clone() for k, v in clean.items()}
        for k in grad_keys:
            inputs[k].requires_grad_(True)
        loss = fn(**inputs)
        grads = torch.autograd.grad(loss, [inputs[k] for k in grad_keys], allow_unused=True)
        results.append((loss.detach(), grads))
    (l0, g0), (l1, g1) = results
    assert torch.isfinite(l1), (l1, poison)
    torch.testing.assert_close(l1, l0, rtol=1e-6, atol=1e-7)
    for a, b in zip(g0, g1):
        if a is None:
            continue
        assert torch.isfinite(b).all(), poison
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
        keep = (mask != 0).view(mask.shape + (1,) * (b.dim() - mask.dim())).expand_as(b)
        assert (b[~keep] == 0).all()


@FAST
@given(
    batch=masked_batch(),
    agg=st.sampled_from(AGG_MODES),
    name=st.sampled_from(["clipped", "masked_is", "grpo"]),
    kl_kind=st.sampled_from(["k1", "k2", "k3"]),
)
def test_policy_losses_ignore_poison_at_masked_positions(batch, agg, name, kl_kind):
    mask, g, poison = batch
    shape = mask.shape
    clean = {
        "logprobs": -torch.rand(shape, generator=g) * 3,
        "old_logprobs": -torch.rand(shape, generator=g) * 3,
        "advantages": torch.randn(shape, generator=g),
    }
    kw = {"agg": agg}
    if name == "grpo":
        clean["ref_logprobs"] = -torch.rand(shape, generator=g) * 3
        kw.update(kl_coef=0.1, kl_kind=kl_kind)
    loss = get_policy_loss(name)

    def fn(**x):
        return loss(x.pop("logprobs"), x.pop("old_logprobs"), x.pop("advantages"), mask, **x, **kw)[0]

    _check_clean_equals_poisoned(fn, clean, mask, poison, ("logprobs",))


@FAST
@given(batch=masked_batch(), agg=st.sampled_from(AGG_MODES), clip=st.sampled_from([None, 0.2]))
def test_sft_value_and_aggregate_losses_ignore_poison_at_masked_positions(batch, agg, clip):
    mask, g, poison = batch
    shape = mask.shape
    _check_clean_equals_poisoned(
        lambda logprobs: sft_loss(logprobs, mask, agg)[0],
        {"logprobs": -torch.rand(shape, generator=g)},
        mask,
        poison,
        ("logprobs",),
    )
    _check_clean_equals_poisoned(
        lambda x: aggregate_loss(x, mask, agg), {"x": torch.randn(shape, generator=g)}, mask, poison, ("x",)
    )
    _check_clean_equals_poisoned(
        lambda values, old, ret: clipped_value_loss(values, old, ret, mask, clip=clip, agg=agg)[0],
        {
            "values": torch.randn(shape, generator=g),
            "old": torch.randn(shape, generator=g),
            "ret": torch.randn(shape, generator=g),
        },
        mask,
        poison,
        ("values",),
    )


@FAST
@given(
    batch=masked_batch(),
    kind=st.sampled_from(["reverse", "forward", "jsd"]),
    beta=st.sampled_from([0.0, 0.3, 0.5, 1.0]),
    top_k=st.sampled_from([None, 2]),
)
def test_distill_loss_ignores_poison_at_masked_positions(batch, kind, beta, top_k):
    mask, g, poison = batch
    b, t = mask.shape
    if not bool((mask != 0).any()):
        mask = mask.clone()
        mask[0, 0] = 1.0
    clean = {
        "s": torch.randn(b, t, 5, generator=g),
        "te": torch.randn(b, t, 5, generator=g),
        "w": torch.rand(b, t, generator=g),
    }
    _check_clean_equals_poisoned(
        lambda s, te, w: distill_loss(s, te, mask, kind, beta=beta, top_k=top_k, weights=w)[0],
        clean,
        mask,
        poison,
        ("s",),
    )


@FAST
@given(batch=masked_batch(), average=st.booleans())
def test_preference_losses_ignore_poison_at_masked_positions(batch, average):
    mask, g, poison = batch
    mask = mask.clone()
    mask[:, 0] = 1.0  # every sequence needs a policy token
    b, t = mask.shape
    clean = {"lp": -torch.rand(b, t, generator=g) * 2, "ref": -torch.rand(b, t, generator=g) * 2}

    def dpo(lp, ref):
        s, r = sequence_logprobs(lp, mask, average), sequence_logprobs(ref, mask, average)
        return dpo_loss(s, s.flip(0), r, r.flip(0), beta=0.5)[0] + s.sum()

    _check_clean_equals_poisoned(dpo, clean, mask, poison, ("lp",))
    _check_clean_equals_poisoned(
        lambda lp, ref: orpo_loss(lp, mask, lp.flip(0), mask.flip(0))[0], clean, mask, poison, ("lp",)
    )


# ------------------------------------------------- micro-batch == full batch -----
@st.composite
def ragged_batch(draw):
    """Trajectories of different lengths, right-padded like ``collate`` (mask 0 past the end)."""
    b = draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(1, 7), min_size=b, max_size=b))
    t = max(lengths)
    mask = torch.zeros(b, t)
    for i, n in enumerate(lengths):
        mask[i, :n] = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=torch.float32)
    mbs = draw(st.integers(1, b))
    seed = draw(st.integers(0, 2**16))
    return mask, lengths, mbs, torch.Generator().manual_seed(seed)


def _accumulated_grad(loss_of, leaves: dict, mask, lengths, mbs, agg):
    """The gradient ``Learner._accumulate`` builds: micro-batches of ``mbs`` rows, each cut to its own
    longest row (``collate`` pads per micro-batch), its loss weighted by ``_share``."""
    grads = {k: torch.zeros_like(v) for k, v in leaves.items()}
    total_tokens = float(mask.sum())
    for lo in range(0, mask.shape[0], mbs):
        sl = slice(lo, min(lo + mbs, mask.shape[0]))
        t = max(lengths[sl])
        part = {k: v[sl, :t].detach().clone().requires_grad_(True) for k, v in leaves.items()}
        mb = SimpleNamespace(loss_mask=mask[sl, :t], input_ids=torch.zeros(sl.stop - sl.start, t))
        loss = loss_of(part, mask[sl, :t], sl) * _share(mb, total_tokens, mask.shape[0], agg)
        for k, gr in zip(part, torch.autograd.grad(loss, list(part.values()), allow_unused=True)):
            if gr is not None:
                grads[k][sl, :t] += gr
    return grads


@SETTINGS
@given(
    batch=ragged_batch(),
    agg=st.sampled_from(AGG_MODES),
    name=st.sampled_from(["clipped", "masked_is", "grpo", "sft"]),
    per_token=st.booleans(),
)
def test_micro_batched_gradient_equals_the_full_batch_gradient(batch, agg, name, per_token):
    mask, lengths, mbs, g = batch
    b, t = mask.shape
    lp = -torch.rand(b, t, generator=g) * 2
    old = lp + 0.3 * torch.randn(b, t, generator=g)  # some tokens outside the clip range
    ref = -torch.rand(b, t, generator=g) * 2
    adv = torch.randn(b, t, generator=g) if per_token else torch.randn(b, generator=g)

    def loss_of(x, m, sl):
        if name == "sft":
            return sft_loss(x["lp"], m, agg)[0]
        a = adv[sl, : m.shape[1]] if per_token else adv[sl]
        kw = {"ref_logprobs": ref[sl, : m.shape[1]], "kl_coef": 0.05} if name == "grpo" else {}
        return get_policy_loss(name)(x["lp"], old[sl, : m.shape[1]], a, m, agg=agg, **kw)[0]

    full = lp.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(loss_of({"lp": full}, mask, slice(0, b)), [full])
    got = _accumulated_grad(loss_of, {"lp": lp}, mask, lengths, mbs, agg)["lp"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_learner_policy_step_gradient_is_the_same_at_any_micro_batch_size(make_demos, model, tokenizer, agg):
    """The real path: ``Learner.token_policy_step`` and ``policy_step`` on the tiny model, micro-batch
    sizes 1, 2 and 5 against the whole batch at once, on trajectories of different lengths."""
    from mentorrl.config import OptimConfig
    from mentorrl.train.learner import Learner

    _, demos = make_demos(5)
    assert len({len(d.token_ids) for d in demos}) > 1
    g = torch.Generator().manual_seed(0)
    token_adv = [torch.randn(len(d.token_ids), generator=g) * torch.tensor(d.loss_mask) for d in demos]
    seq_adv = torch.randn(len(demos), generator=g)
    kw = {"agg": agg, "eps_low": 1.0, "eps_high": 1e9}  # nothing clipped: every token carries a gradient
    for step in ("token", "seq"):
        grads = []
        for mbs in (5, 1, 2):
            m = copy.deepcopy(model)
            learner = Learner(m, OptimConfig(lr=1e-3, micro_batch_size=mbs, max_grad_norm=1e9), tokenizer.pad_token_id)
            if step == "token":
                learner.token_policy_step(demos, token_adv, "clipped", **kw)
            else:
                learner.policy_step(demos, seq_adv, "grpo", **kw)
            grads.append([p.grad.detach().clone() for p in m.parameters() if p.grad is not None])
        assert len(grads[0]) > 0 and max(x.abs().max().item() for x in grads[0]) > 0
        for other in grads[1:]:
            assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(grads[0], other)), step
