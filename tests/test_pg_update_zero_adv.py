"""pg_update's drop_zero: not forwarding zero-advantage trajectories must leave the update equal to
the full batch's (they stay in the token-mean / seq-mean denominator). Dropping them from the
denominator too (the old ``items=keep``) scaled the step up by up to the group size when few groups
had signal: on the demo with kl_coef 0 a run collapsed (held-out 38% -> 15%) while 16 of 128
trajectories carried the whole, 8x larger, step."""

import copy

import pytest
import torch

from mentorrl.config import OptimConfig
from mentorrl.train.learner import Learner
from mentorrl.train.stage_helpers import pg_update


def _advantages(demos, kind, zero_rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "grpo":
        adv = torch.randn(len(demos), generator=g)
        adv[zero_rows] = 0.0
        return adv
    adv = [torch.randn(len(d.token_ids), generator=g) * torch.tensor(d.loss_mask, dtype=torch.float32) for d in demos]
    for i in zero_rows:
        adv[i] = torch.zeros_like(adv[i])
    return adv


def _run(model, tokenizer, demos, adv, kind, agg, k, pack=True, **how):
    m = copy.deepcopy(model)
    learner = Learner(
        m, OptimConfig(lr=1e-3, micro_batch_size=2, max_grad_norm=1e9, pack_prefixes=pack), tokenizer.pad_token_id
    )
    ups = pg_update(
        learner,
        demos,
        adv,
        k,
        seed=3,
        kind="grpo" if kind == "grpo" else "clipped",
        agg=agg,
        eps_low=1.0,
        eps_high=1e9,
        **how,
    )
    grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in m.parameters()]
    return m, grads, ups


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("kind", ["grpo", "token"])
def test_dropping_zero_advantage_rows_keeps_the_full_batch_update(make_demos, model, tokenizer, agg, kind):
    _, demos = make_demos(6)
    adv = _advantages(demos, kind, zero_rows=[0, 2, 3])
    # one minibatch: the gradient itself
    _, want, _ = _run(model, tokenizer, demos, adv, kind, agg, k=1)
    _, got, ups = _run(model, tokenizer, demos, adv, kind, agg, k=1, drop_zero=True)
    assert len(ups) == 1 and max(g.abs().max().item() for g in want) > 0
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-8)
    # the cheapest fake (drop the rows from the batch and its denominator) is a larger step
    live = [i for i in range(len(demos)) if i not in (0, 2, 3)]
    fake_adv = adv[live] if kind == "grpo" else [adv[i] for i in live]
    _, fake, _ = _run(model, tokenizer, [demos[i] for i in live], fake_adv, kind, agg, k=1)
    norm = lambda gs: sum(float(g.pow(2).sum()) for g in gs) ** 0.5  # noqa: E731
    assert norm(fake) > 1.2 * norm(want)
    # two minibatches: the same weights at the end
    m_full, _, _ = _run(model, tokenizer, demos, adv, kind, agg, k=2)
    m_drop, _, _ = _run(model, tokenizer, demos, adv, kind, agg, k=2, drop_zero=True)
    for a, b in zip(m_full.parameters(), m_drop.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)  # Adam: ~1e-3 steps


def test_a_minibatch_without_signal_is_skipped(make_demos, model, tokenizer):
    _, demos = make_demos(4)
    adv = torch.zeros(len(demos))
    m, grads, ups = _run(model, tokenizer, demos, adv, "grpo", "token-mean", k=2, drop_zero=True)
    assert ups == [] and all(float(g.abs().sum()) == 0 for g in grads)
    for a, b in zip(model.parameters(), m.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("kind", ["grpo", "token"])
def test_sorted_micro_batches_give_the_same_update(make_demos, model, tokenizer, kind, pack, monkeypatch):
    """pg_update feeds the learner each minibatch sorted (by shared prefix when it packs prefixes,
    else by length: less padding per micro-batch); the gradient is the one of the minibatch in its
    dealt order."""
    import mentorrl.train.stage_helpers as helpers

    _, demos = make_demos(7)
    assert len({len(d.token_ids) for d in demos}) > 2, "need trajectories of different lengths"
    adv = _advantages(demos, kind, zero_rows=[1])
    _, sorted_grads, _ = _run(model, tokenizer, demos, adv, kind, "token-mean", k=1, pack=pack)
    monkeypatch.setattr(helpers, "update_order", lambda learner, idx, trajs: list(idx))
    _, dealt_grads, _ = _run(model, tokenizer, demos, adv, kind, "token-mean", k=1, pack=pack)
    assert max(g.abs().max().item() for g in dealt_grads) > 0
    for a, b in zip(dealt_grads, sorted_grads):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-7)


def test_length_order_is_a_permutation_sorted_within_each_ranks_share():
    from types import SimpleNamespace

    from mentorrl.train.stage_helpers import length_order

    lengths = [50, 3, 400, 7, 7, 120, 90, 1, 64]
    trajs = [SimpleNamespace(token_ids=[0] * n) for n in lengths]
    idx = [8, 0, 3, 5, 1, 6, 2, 4]
    one = length_order(idx, trajs)
    assert sorted(one) == sorted(idx) and [lengths[i] for i in one] == sorted(lengths[i] for i in idx)
    two = length_order(idx, trajs, world_size=2)
    assert sorted(two) == sorted(idx)
    n = len(two)
    shares = [two[0 : n // 2], two[n // 2 :]]  # DataParallel.shard's contiguous shares
    for share in shares:
        assert [lengths[i] for i in share] == sorted(lengths[i] for i in share)
    # the shares are alike: neither holds all the long ones
    assert abs(sum(lengths[i] for i in shares[0]) - sum(lengths[i] for i in shares[1])) < max(lengths)


def test_update_order_groups_shared_prefixes_when_the_learner_packs():
    from types import SimpleNamespace

    from mentorrl.train.stage_helpers import update_order

    toks = [[5, 1, 2], [3, 9], [5, 1, 7, 7], [3, 9, 9, 9, 9], [5, 2]]
    trajs = [SimpleNamespace(token_ids=t) for t in toks]
    packing = SimpleNamespace(packs_prefixes=True, dp=None)
    assert [toks[i] for i in update_order(packing, [0, 1, 2, 3, 4], trajs)] == sorted(toks)
    plain = SimpleNamespace(packs_prefixes=False, dp=None)
    assert [len(toks[i]) for i in update_order(plain, [0, 1, 2, 3, 4], trajs)] == sorted(len(t) for t in toks)


def test_groups_are_dealt_whole_into_minibatches():
    """pg_update(groups=...) keeps each GRPO group (with its guided demonstration) in one minibatch;
    every trajectory is trained once per pass, and the deal depends on the seed."""
    from types import SimpleNamespace

    import mentorrl.train.stage_helpers as helpers

    seen: list[list[int]] = []

    class Recorder:
        packs_prefixes, dp, model, version = True, None, torch.nn.Linear(1, 1), 0

        def policy_step(self, batch, adv, kind, **kw):
            seen.append([t.index for t in batch])
            return {}

    trajs = [SimpleNamespace(index=i, token_ids=[i % 3, i], num_policy_tokens=1, policy_version=0) for i in range(13)]
    groups = [[0, 1, 2, 12], [3, 4, 5], [6, 7, 8], [9, 10, 11]]  # 12: group 0's demonstration
    adv = torch.ones(13)
    deals = set()
    for seed in range(6):
        seen.clear()
        helpers.pg_update(Recorder(), trajs, adv, 2, seed, kind="grpo", groups=groups, drop_zero=True)
        assert len(seen) == 2 and sorted(i for mb in seen for i in mb) == list(range(13))
        for mb in seen:
            assert all(set(g) <= set(mb) or not set(g) & set(mb) for g in groups)
        deals.add(tuple(sorted(tuple(sorted(mb)) for mb in seen)))
    assert len(deals) > 1
    with pytest.raises(ValueError, match="items or groups"):
        helpers.pg_update(Recorder(), trajs, adv, 2, 0, kind="grpo", groups=groups, items=[0, 1])
