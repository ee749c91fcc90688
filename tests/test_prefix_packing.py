"""Prefix-tree packing in the learner's forward (``mentorrl.models.batch.prefix_pack``).

Rollouts of one task share their prompt and often their first turns; the packed forward runs each
distinct prefix once under a tree attention mask. It must give the padded forward's log-probs,
entropies and gradients (up to float rounding) on every batch, whatever the sharing: identical rows,
a row that is a prefix of another, rows that branch at the first token, rows of one token.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mentorrl.models import batch as B
from mentorrl.models import tree as TR
from mentorrl.models.batch import TokenBatch, forward_logprobs, forward_selected_logprobs, prefix_pack

FORMS = ("tree", "dense")  # block-sparse attention over one trie row, or a dense tree mask over packed rows


@contextmanager
def packing_form(form: str, block: int | None = None, min_block: int | None = None):
    """Run the learner's packed forward in ``form`` ("dense": as for a model the tree forward does not
    serve), with tree query blocks of ``block`` / ``min_block`` nodes and no fixed cost per block
    (so small test batches are packed)."""
    with (
        mock.patch.object(TR, "BLOCK", block or TR.BLOCK),
        mock.patch.object(TR, "MIN_BLOCK", min_block or TR.MIN_BLOCK),
        mock.patch.object(B, "BLOCK_COST", 0.0),
    ):
        if form == "dense":
            with mock.patch.object(B, "tree_support", lambda module: "dense form under test"):
                yield
        else:
            yield


VOCAB = 37


def _model(attn: str = "sdpa", model_type: str = "qwen2", **extra):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation=attn,
        **extra,
    )
    if model_type == "llama":
        return LlamaForCausalLM(LlamaConfig(**kw)).eval()
    return Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=False, **kw)).eval()


@pytest.fixture(scope="module")
def sdpa_model():
    return _model("sdpa")


def _batch(rows: list[list[int]], masks: list[list[int]]) -> TokenBatch:
    T = max(len(r) for r in rows)
    n = len(rows)
    ids = torch.zeros(n, T, dtype=torch.long)
    attn = torch.zeros(n, T, dtype=torch.long)
    loss = torch.zeros(n, T)
    for b, (r, m) in enumerate(zip(rows, masks)):
        ids[b, : len(r)] = torch.tensor(r)
        attn[b, : len(r)] = 1
        loss[b, : len(r)] = torch.tensor(m, dtype=torch.float32)
    return TokenBatch(ids, attn, loss, torch.zeros(n, T))


@st.composite
def grouped_rows(draw):
    """Rows in groups that share a prompt and then follow each other for a while (as a GRPO group's
    rollouts do), with policy-token masks; some rows repeat, some are prefixes of others."""
    rows: list[list[int]] = []
    for _ in range(draw(st.integers(1, 3))):
        prompt = draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=12))
        trunk = draw(st.lists(st.integers(1, VOCAB - 1), min_size=0, max_size=10))
        for _ in range(draw(st.integers(1, 4))):
            cut = draw(st.integers(0, len(trunk)))
            tail = draw(st.lists(st.integers(1, VOCAB - 1), min_size=0, max_size=10))
            rows.append(prompt + trunk[:cut] + tail)
    if draw(st.booleans()):
        rows.append(list(rows[0]))  # an identical row
    if draw(st.booleans()) and len(rows[0]) > 1:
        rows.append(rows[0][: draw(st.integers(1, len(rows[0]) - 1))])  # a strict prefix of another row
    order = draw(st.permutations(range(len(rows))))
    rows = [rows[i] for i in order]
    masks = [[0] + [draw(st.integers(0, 1)) for _ in r[1:]] for r in rows]
    for m in masks:  # at least one scored token in the batch when any row can have one
        if len(m) > 1:
            m[-1] = 1
            break
    return rows, masks


def _branching() -> tuple[list[list[int]], list[list[int]]]:
    """A group sharing a 10-token prompt that branches after it and again later, beside one long
    unrelated row (which sets the packed-row length): the group packs into one row."""
    prompt = list(range(3, 13))
    rows = [
        prompt + [6, 7, 8],
        prompt + [9, 10],
        prompt + [6, 7, 11, 12],
        prompt + [13],
        [(7 * i) % (VOCAB - 1) + 1 for i in range(30)],
    ]
    masks = [[0] * 10 + [1] * (len(r) - 10) for r in rows[:4]] + [[0] * 5 + [1] * 25]
    return rows, masks


def _would_pack(model, b: TokenBatch) -> bool:
    """Does the learner's forward of ``model`` pack ``b`` (its form and cost rule)?"""
    decoder = model.get_decoder()
    form = B._packable(decoder)
    return (
        form is not None
        and prefix_pack(b.input_ids, b.attention_mask, attn_weight=B.attention_weight(decoder), tree=form == "tree")
        is not None
    )


def _used_packing(model, b: TokenBatch) -> bool:
    """Did the last packed forward of ``model`` on ``b`` really pack (and pass its first-use check)?"""
    decoder = model.get_decoder()
    return _would_pack(model, b) and B._PACK_VERIFIED.get(decoder, {}).get(B._packable(decoder)) is True


def _grads(model, loss):
    model.zero_grad(set_to_none=True)
    if loss.requires_grad:  # no scored token at all: nothing depends on the weights, in either forward
        loss.backward()
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def _compare(model, rows, masks, must_pack: bool = True):
    b = _batch(rows, masks)
    w = torch.linspace(-1.0, 1.5, b.input_ids.numel()).view_as(b.loss_mask)
    out = {}
    for pack in (False, True):
        lp, ent = forward_logprobs(model, b, temperature=0.7, with_entropy=True, pack=pack)
        g = _grads(model, (lp * w * b.loss_mask).sum())
        out[pack] = (lp.detach(), ent, g)
    (lp0, e0, g0), (lp1, e1, g1) = out[False], out[True]
    sel = b.loss_mask > 0
    torch.testing.assert_close(lp1[sel], lp0[sel], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(e1[sel], e0[sel], rtol=1e-5, atol=1e-5)
    assert float(lp1[~sel].abs().sum()) == 0.0
    for a, c in zip(g0, g1):
        torch.testing.assert_close(c, a, rtol=1e-4, atol=1e-5)  # sums of up to thousands of fp32 terms
    if must_pack:
        assert _used_packing(model, b), "the packed path did not run: this compared the padded forward with itself"


@pytest.mark.parametrize("form", FORMS)
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=grouped_rows(), block=st.integers(1, 24), min_share=st.floats(0.0, 1.0))
def test_packed_forward_equals_the_padded_one(sdpa_model, form, data, block, min_share):
    """Values, entropies and gradients; tree query blocks from 1 node up, cut anywhere in a segment."""
    rows, masks = data
    b = _batch(rows, masks)
    with packing_form(form, block, max(1, int(min_share * block))):
        # packing applies when it saves slots and some token is scored; then the packed path must run
        _compare(sdpa_model, rows, masks, must_pack=_would_pack(sdpa_model, b) and bool((b.loss_mask[:, 1:] > 0).any()))


@settings(max_examples=60, deadline=None)
@given(grouped_rows())
def test_pack_layout_invariants(data):
    """Each row's tokens read back from its nodes at positions 0..L-1; a node sees exactly the nodes
    of its own prefix; a pack is returned only when it costs less than the padded batch."""
    rows, masks = data
    b = _batch(rows, masks)
    w = 1.0 / 64
    p = prefix_pack(b.input_ids, b.attention_mask, attn_weight=w)
    Bn, T = b.input_ids.shape
    if p is None:
        return
    R, N = p.input_ids.shape
    assert B.pack_cost(R, N, w) < B.pack_cost(Bn, T, w) and N <= max(B.PACK_CAPS) * T
    flat_ids, flat_pos = p.input_ids.reshape(-1), p.position_ids.reshape(-1)
    for r_i, row in enumerate(rows):
        nodes = p.node[r_i, : len(row)]
        assert (p.node[r_i, len(row) :] == -1).all()
        assert flat_ids[nodes].tolist() == row
        assert flat_pos[nodes].tolist() == list(range(len(row)))
        packed_row = nodes // N
        assert (packed_row == packed_row[0]).all()
        cols = nodes % N
        for t in range(len(row)):  # node t sees nodes 0..t of this row, and nothing else
            seen = torch.nonzero(p.allowed[packed_row[0], cols[t]]).view(-1).tolist()
            assert sorted(seen) == sorted(cols[: t + 1].tolist())


@settings(max_examples=60, deadline=None)
@given(data=grouped_rows(), block=st.integers(1, 20), min_block=st.integers(1, 20))
def test_tree_plan_invariants(data, block, min_block):
    """The block-sparse form: one trie row; each row's tokens read back from its nodes at positions
    0..L-1; the query blocks cover the row in order; each node attends to exactly the nodes of its
    own prefix (its block's keys under its mask row), whatever the block sizes."""
    rows, masks = data
    b = _batch(rows, masks)
    with packing_form("tree", block, min_block):
        p = prefix_pack(b.input_ids, b.attention_mask, attn_weight=0.0, tree=True)
    if p is None:  # only when the trie saves no slot: one row, or distinct rows of one length
        distinct = {tuple(r) for r in rows}
        assert len(rows) < 2 or (
            len(distinct) == len(rows)
            and len({len(r) for r in rows}) == 1
            and all(x[:1] != y[:1] for x in distinct for y in distinct if x != y)
        )
        return
    plan = p.plan
    R, N = p.input_ids.shape
    assert R == 1 and plan.n == N and sum(plan.q_sizes) == N and max(plan.q_sizes) <= block
    assert p.allowed is None and (p.node[b.attention_mask == 0] == -1).all()
    seen_by: dict[int, list[int]] = {}
    q0 = k0 = 0
    for q, k, m in zip(plan.q_sizes, plan.k_sizes, plan.masks):
        keys = plan.keys[k0 : k0 + k]
        assert m.shape == (q, k) and bool((keys[1:] > keys[:-1]).all())  # keys in column order, no repeats
        for j in range(q):
            seen_by[q0 + j] = keys[m[j]].tolist()
        q0, k0 = q0 + q, k0 + k
    for r_i, row in enumerate(rows):
        nodes = p.node[r_i, : len(row)]
        assert p.input_ids[0, nodes].tolist() == row and p.position_ids[0, nodes].tolist() == list(range(len(row)))
        for t in range(len(row)):
            assert sorted(seen_by[int(nodes[t])]) == sorted(nodes[: t + 1].tolist())


def test_a_group_with_a_shared_prompt_packs_into_fewer_slots():
    """A group's prompt runs once, then each distinct continuation after it; with attention costly
    (a small model) packed rows stay as long as the longest input row, with it cheap they grow to
    hold whole groups."""
    prompt = list(range(1, 21))
    rows = [prompt + [21, 22, 23], prompt + [21, 22, 24, 25], prompt + [30], prompt + [21, 22, 23], list(range(40, 72))]
    b = _batch(rows, [[0] * 20 + [1] * (len(r) - 20) for r in rows])
    assert prefix_pack(b.input_ids, b.attention_mask, attn_weight=0.0).input_ids.shape == (1, 32 + 26)
    p = prefix_pack(b.input_ids, b.attention_mask, attn_weight=1.0)
    assert p is not None and p.input_ids.shape == (2, 32)
    group_row = int(p.node[0, 0]) // 32
    assert int((p.node[:4] // 32 == group_row).sum()) == sum(len(r) for r in rows[:4])  # one packed row
    assert int(p.node[:4].max()) % 32 == 20 + 3 + 2 + 1 - 1  # the prompt once, then each distinct continuation


def test_a_batch_without_anything_to_share_is_not_packed():
    rows = [[1, 2, 3, 4], [5, 6, 7, 8]]
    b = _batch(rows, [[0, 1, 1, 1]] * 2)
    assert prefix_pack(b.input_ids, b.attention_mask) is None  # two full rows: nothing saved
    assert prefix_pack(b.input_ids, b.attention_mask, attn_weight=0.0) is None  # one row of 8: the same slots
    assert prefix_pack(b.input_ids[:1], b.attention_mask[:1]) is None
    empty = torch.zeros_like(b.attention_mask)
    assert prefix_pack(b.input_ids, empty) is None and prefix_pack(b.input_ids, empty, tree=True) is None


@pytest.mark.parametrize("form", FORMS)
def test_short_rows_share_a_packed_row_without_a_common_prefix(sdpa_model, form):
    """Packing is also padding-free batching: unrelated short rows fill one packed row and do not see each other."""
    rows = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10], [11, 12, 13], [14, 15]]
    masks = [[0] + [1] * (len(r) - 1) for r in rows]
    b = _batch(rows, masks)
    p = prefix_pack(b.input_ids, b.attention_mask)
    assert p is not None and p.input_ids.shape[0] < len(rows)
    with packing_form(form, block=3, min_block=1):
        _compare(sdpa_model, rows, masks)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("attn,model_type", [("eager", "qwen2"), ("sdpa", "llama"), ("eager", "llama")])
def test_other_attention_kernels_and_architectures(attn, model_type, form):
    model = _model(attn, model_type)
    rows, masks = _branching()
    assert B.packable(model)
    with packing_form(form, block=7):
        assert B._packable(model.get_decoder()) == (
            "tree" if form == "tree" else "additive" if attn == "eager" else "bool"
        )
        _compare(model, rows, masks)


@pytest.mark.parametrize("form", FORMS)
def test_selected_logprobs_for_distillation_match(sdpa_model, form):
    rows, masks = _branching()
    b = _batch(rows, masks)
    ids = torch.randint(0, VOCAB, (*b.input_ids.shape, 4), generator=torch.Generator().manual_seed(1))
    with packing_form(form, block=5):
        a = forward_selected_logprobs(sdpa_model, b, ids, 1.3, pack=False)
        c = forward_selected_logprobs(sdpa_model, b, ids, 1.3, pack=True)
        torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-5)
        assert _used_packing(sdpa_model, b)


def test_models_a_tree_mask_cannot_serve_are_not_packed():
    sliding = _model("sdpa", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert not B.packable(sliding)
    assert not B.packable(_model("flex_attention")) if _flex_ok() else True


def _flex_ok() -> bool:
    try:
        _model("flex_attention")
        return True
    except Exception:  # noqa: BLE001 - not every torch build has flex attention on CPU
        return False


def _causal_only(pack: B.PrefixPack) -> B.PrefixPack:
    """The cheapest fake of either form: ignore the tree, attend causally over the packed row."""
    broken = copy.copy(pack)
    R, N = pack.input_ids.shape
    if pack.plan is not None:
        broken.plan = TR.plan_blocks([TR.Segment(0, N, [])], N, block=5)
    else:
        broken.allowed = torch.ones(N, N, dtype=torch.bool).tril().expand(R, N, N).clone()
    return broken


@pytest.mark.parametrize("form", FORMS)
def test_a_packed_forward_that_disagrees_falls_back_to_the_padded_one(monkeypatch, form):
    """The safety net: a model whose packed forward differs from its padded one (here a broken mask)
    is detected on first use and keeps the padded forward's numbers from then on."""
    model = _model("sdpa")
    rows, masks = _branching()
    b = _batch(rows, masks)
    with packing_form(form):
        assert _would_pack(model, b)
        want, _ = forward_logprobs(model, b, pack=False)
        real = B._packed_outputs
        monkeypatch.setattr(
            B, "_packed_outputs", lambda module, pack, attr, f: real(module, _causal_only(pack), attr, f)
        )
        got, _ = forward_logprobs(model, b, pack=True)
        torch.testing.assert_close(got, want)
        dec = model.get_decoder()
        assert B._PACK_VERIFIED[dec][B._packable(dec)] is False


@pytest.mark.parametrize("form", FORMS)
def test_the_cheapest_fake_would_be_caught(sdpa_model, form):
    """Causal attention over the packed row (no tree mask) changes the numbers of a branching batch,
    so the equality test above can tell a real tree mask from it."""
    rows, masks = _branching()
    b = _batch(rows, masks)
    want, _ = forward_logprobs(sdpa_model, b, pack=False)
    dec = sdpa_model.get_decoder()
    with packing_form(form):
        f = B._packable(dec)
        p = _causal_only(
            prefix_pack(b.input_ids, b.attention_mask, attn_weight=B.attention_weight(dec), tree=f == "tree")
        )
        out = B._packed_outputs(dec, p, "last_hidden_state", f)
    head = sdpa_model.get_output_embeddings()
    sel = b.loss_mask[:, 1:] > 0
    nodes = p.node[:, :-1][sel]
    lp = torch.log_softmax(head(out[nodes]), -1).gather(-1, b.input_ids[:, 1:][sel][:, None])[:, 0]
    assert (lp - want[:, 1:][sel]).abs().max() > 1e-3


def test_attention_weight_follows_the_model_shape(sdpa_model):
    """Linear layers cost ~2 x the layer's parameters per slot, attention ~4 x heads x head dim per key."""
    dec = sdpa_model.get_decoder()
    per_layer = (sum(p.numel() for p in dec.parameters()) - dec.get_input_embeddings().weight.numel()) / 2
    assert B.attention_weight(dec) == pytest.approx(2 * 32 / per_layer)


def test_the_learner_chooses_the_form_from_its_config():
    """``optim.tree_attention: false`` keeps prefix packing under the dense tree mask; the values agree."""
    from mentorrl.config import OptimConfig
    from mentorrl.train.learner import Learner

    model = _model("sdpa")
    dec = model.get_decoder()
    assert Learner(model, OptimConfig(), pad_id=0).pack_mode is True
    assert Learner(model, OptimConfig(tree_attention=False), pad_id=0).pack_mode == "dense"
    assert Learner(model, OptimConfig(pack_prefixes=False, tree_attention=True), pad_id=0).pack_mode is False
    rows, masks = _branching()
    b = _batch(rows, masks)
    with packing_form("tree"):
        dense, _ = forward_logprobs(model, b, pack="dense")
        assert set(B._PACK_VERIFIED[dec]) == {"bool"}
        tree, _ = forward_logprobs(model, b, pack=True)
        assert set(B._PACK_VERIFIED[dec]) == {"bool", "tree"} and all(B._PACK_VERIFIED[dec].values())
    torch.testing.assert_close(tree, dense, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="pack"):
        forward_logprobs(model, b, pack="sparse")


@pytest.mark.parametrize(
    "segments,n",
    [
        ([], 0),
        ([TR.Segment(1, 3, [0])], 3),
        ([TR.Segment(0, 2, []), TR.Segment(3, 4, [1])], 4),
        ([TR.Segment(0, 2, []), TR.Segment(2, 2, [1])], 2),
        ([TR.Segment(0, 3, [])], 4),
    ],
)
def test_a_plan_refuses_segments_that_do_not_tile_the_row(segments, n):
    with pytest.raises(ValueError, match="cover the row"):
        TR.plan_blocks(segments, n)
