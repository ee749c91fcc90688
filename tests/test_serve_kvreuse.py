"""KV reuse across requests in the continuous batcher (issue 55): a finished row keeps its slot, and a
later request whose prompt continues its context (an agent's next turn: the last prompt and reply,
then new messages) is fed only the rest. A request's turns -- ids, texts, finish reasons, log-probs --
are those a fresh prefill gives; retained rows never outlive the weights they were computed with."""

from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mentorrl.rollout.decoders import SlotDecoder
from mentorrl.serve import PolicyGenerator
from mentorrl.serve.generation import ContinuousBatcher, GenRequest, Sample, ids_code, shared_ids
from tests.test_serve_decoder import assert_same, prompts, varied  # noqa: F401  (the fixture)

TIMEOUT_S = 60
Make = Callable[[PolicyGenerator], GenRequest]


def fresh(gen: PolicyGenerator, make: Make) -> list[Sample]:
    """The request served with no retained rows: its whole prompt prefilled."""
    return ContinuousBatcher(gen, window_s=0, retain_rows=0).enqueue(make(gen)).result(TIMEOUT_S)


def turn(p: list[int], n: int = 1, seed: int = 3, budget: int = 12, **kw) -> Make:
    return lambda g: g.request(p, n, 1.0, 1.0, budget, seed=seed, **kw)


def run_to_budget(p: list[int], seed: int = 3, budget: int = 12) -> Make:
    """A turn that runs to its budget (the stop tokens banned)."""
    return lambda g: g.request(p, 1, 1.0, 1.0, budget, seed=seed, banned=tuple(g.stop_ids))


def user_tokens(tokenizer) -> list[int]:
    return list(tokenizer.encode("\n<|im_start|>user\nAnd then what?<|im_end|>\n<|im_start|>assistant\n"))


def test_truncate_cuts_a_slot_back_to_a_prefix(varied):  # noqa: F811
    g = torch.Generator().manual_seed(0)
    a, c = (torch.randint(0, 200, (k,), generator=g).tolist() for k in (9, 4))
    dec = SlotDecoder(varied)
    dec.reset(2)
    dec.forward([a, a[:5] + c])
    dec.truncate(0, 5)
    assert dec.ctx[0] == a[:5]
    got = dec.forward([c, [7]])  # row 0's slot past 5 is stale: overwritten and never read
    with pytest.raises(ValueError):
        dec.truncate(1, 100)
    dec.close()
    ref = SlotDecoder(varied)
    ref.reset(2)
    want = ref.forward([a[:5] + c, a[:5] + c + [7]])
    ref.close()
    assert torch.allclose(got, want, atol=1e-5, rtol=0)


def _common_prefix(a: list[int], b: list[int]) -> int:
    """The reference: how many first ids ``a`` and ``b`` share, compared one by one."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_common_prefix():
    assert _common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert _common_prefix([1, 2, 3, 4], [1, 2]) == 2
    assert _common_prefix([1, 2, 3, 4, 5], [1, 2, 3, 9, 5]) == 3
    assert _common_prefix([5], [1]) == 0
    assert _common_prefix([], [1]) == 0


def _ids(max_id: int):
    return st.lists(st.integers(0, max_id), max_size=40)


@settings(max_examples=300, deadline=None)
@given(_ids(3), _ids(3), st.sampled_from([3, 2**32 - 1]), st.booleans())
def test_shared_ids_is_the_common_prefix(a, b, top, share):
    """The codes' first difference is the lists' (zeros after a shorter list, id 0 and the top id included)."""
    if share:  # a long shared head, then whatever follows
        b = a[: len(a) // 2] + b
    a, b = [min(x * top, top) for x in a], [min(x * top, top) for x in b]
    want = _common_prefix(a, b)
    assert shared_ids(ids_code(a), len(a), ids_code(b), len(b)) == want
    assert shared_ids(ids_code(b), len(b), ids_code(a), len(a)) == want


def test_an_id_out_of_range_shares_nothing():
    assert ids_code([1, 2**32]) is None and ids_code([-1]) is None
    assert shared_ids(None, 2, ids_code([1, 2]), 2) == 0


def test_the_next_turn_continues_the_retained_row(tokenizer, varied):  # noqa: F811
    ps = prompts(tokenizer)
    gen = PolicyGenerator(tokenizer, varied, decoder="slots")
    b = ContinuousBatcher(gen, window_s=0)
    p, last_ctx = ps[0], []
    for k in range(3):  # three turns of one episode, each prompt the last prompt + reply + a user message
        make = turn(p, n=2 if k == 1 else 1, seed=k, budget=10, top_logprobs=2)
        before = dict(b.stats)
        got = b.submit(make(gen))
        assert_same([got], [fresh(gen, make)])
        assert_same([got], [gen.run([make(gen)])[0]])
        reused = b.stats["reused_tokens"] - before["reused_tokens"]
        prefilled = b.stats["prefill_tokens"] - before["prefill_tokens"]
        assert reused == (0 if k == 0 else len(last_ctx))
        assert prefilled == len(p) * (2 if k == 1 else 1) - reused
        last_ctx = p + got[0].token_ids[:-1]  # what the row's slot holds: its last sampled id was never fed
        p = p + got[0].token_ids + user_tokens(tokenizer)
    assert b.stats["reused_rows"] == 2


def test_concurrent_episodes_each_continue_their_own_row(tokenizer, varied):  # noqa: F811
    ps = prompts(tokenizer)
    gen = PolicyGenerator(tokenizer, varied, decoder="slots")
    b = ContinuousBatcher(gen, window_s=0)
    firsts = [turn(p, seed=i, budget=8) for i, p in enumerate(ps)]
    reqs = [m(gen) for m in firsts]
    for r in reqs:
        b._queue.put(r)
    replies = [r.future.result(TIMEOUT_S) for r in reqs]
    assert len(b._kept) == len(ps)
    seconds = [
        turn(p + r[0].token_ids + user_tokens(tokenizer), seed=10 + i, budget=8, top_logprobs=1)
        for i, (p, r) in enumerate(zip(ps, replies))
    ]
    reqs = [m(gen) for m in reversed(seconds)]  # another order than the first turns'
    for r in reqs:
        b._queue.put(r)
    got = [r.future.result(TIMEOUT_S) for r in reversed(reqs)]
    assert_same(got, [fresh(gen, m) for m in seconds])
    assert b.stats["reused_rows"] == len(ps)
    assert b.stats["reused_tokens"] == sum(len(p) + len(r[0].token_ids) - 1 for p, r in zip(ps, replies))


def test_a_prompt_that_shares_part_of_the_context_cuts_the_row_back(tokenizer, varied):  # noqa: F811
    ps = prompts(tokenizer)
    gen = PolicyGenerator(tokenizer, varied, decoder="slots")
    b = ContinuousBatcher(gen, window_s=0)
    reply = b.submit(run_to_budget(ps[0], budget=12)(gen))[0].token_ids
    assert len(reply) == 12
    tail = [t for t in user_tokens(tokenizer) if t != reply[9]]
    make = turn(ps[0] + reply[:9] + tail, n=3, seed=5, budget=10, top_logprobs=2)  # the reply re-rendered otherwise
    got = b.submit(make(gen))
    assert_same([got], [fresh(gen, make)])
    assert b.stats["reused_tokens"] == len(ps[0]) + 9 and b.stats["reused_rows"] == 1
    # a prompt equal to a retained row's context: all of it but its last token is reused (its logits are needed)
    b2 = ContinuousBatcher(gen, window_s=0)
    b2.submit(run_to_budget(ps[1], budget=6)(gen))
    ctx = list(b2._dec.ctx[b2._kept[0].slot])
    same = turn(ctx, seed=2, budget=6, top_logprobs=1)
    assert_same([b2.submit(same(gen))], [fresh(gen, same)])
    assert b2.stats["reused_tokens"] == len(ctx) - 1


def test_a_prompt_sharing_little_of_a_row_leaves_it_for_its_own_episode(tokenizer, varied):  # noqa: F811
    ps = prompts(tokenizer)
    gen = PolicyGenerator(tokenizer, varied, decoder="slots")
    b = ContinuousBatcher(gen, window_s=0)
    b.submit(run_to_budget(ps[0], budget=40)(gen))
    other = turn(ps[0][:5] + user_tokens(tokenizer), seed=1, budget=6)
    assert_same([b.submit(other(gen))], [fresh(gen, other)])
    assert b.stats["reused_rows"] == 0 and len(b._kept) == 2


def test_retained_rows_are_dropped_when_the_weights_change(tokenizer, varied):  # noqa: F811
    ps = prompts(tokenizer)
    m = copy.deepcopy(varied)
    gen = PolicyGenerator(tokenizer, m, decoder="slots")
    b = ContinuousBatcher(gen, window_s=0)
    reply = b.submit(turn(ps[0], seed=1, budget=10)(gen))[0].token_ids
    make = turn(ps[0] + reply + user_tokens(tokenizer), n=2, seed=4, budget=10, top_logprobs=1)
    old = fresh(gen, make)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # an optimizer step's kind of write: in place
        for layer in m.model.layers:
            for p in (layer.self_attn.k_proj.weight, layer.mlp.up_proj.weight):
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    got = b.submit(make(gen))
    reference = PolicyGenerator(tokenizer, m, decoder="hf_generate")
    assert_same([got], [reference.run([make(reference)])[0]])
    assert [s.token_ids for s in got] != [s.token_ids for s in old]
    assert b.stats["reused_tokens"] == 0


def test_a_row_in_flight_during_a_weight_change_is_not_retained(tokenizer, varied):  # noqa: F811
    ps = prompts(tokenizer)
    m = copy.deepcopy(varied)
    gen = PolicyGenerator(tokenizer, m, decoder="slots")
    b = ContinuousBatcher(gen, window_s=0)

    def hook(n: int) -> None:
        if n == 2:
            with torch.no_grad():
                m.model.layers[0].mlp.down_proj.weight.mul_(1.1)

    b.after_pass = hook
    b.submit(run_to_budget(ps[0], budget=6)(gen))
    assert b._kept == [] and b._dec is None  # nothing retained: the empty loop closed its decoder


def test_retain_rows_caps_the_retained_rows_and_zero_turns_reuse_off(tokenizer, varied):  # noqa: F811
    ps = prompts(tokenizer)
    gen = PolicyGenerator(tokenizer, varied, decoder="slots")
    replies = {}
    b = ContinuousBatcher(gen, window_s=0, retain_rows=1)
    for i in (0, 1):
        replies[i] = b.submit(turn(ps[i], seed=i, budget=8)(gen))[0].token_ids
    assert len(b._kept) == 1  # the least recently retained row went
    for i in (1, 0):  # the first episode's row is gone
        b.submit(turn(ps[i] + replies[i] + user_tokens(tokenizer), seed=7, budget=4)(gen))
    assert b.stats["reused_rows"] == 1 and b.stats["reused_tokens"] == len(ps[1]) + len(replies[1]) - 1
    off = ContinuousBatcher(gen, window_s=0, retain_rows=0)
    reply = off.submit(turn(ps[0], seed=0, budget=8)(gen))[0].token_ids
    assert off._dec is None and off._kept == []
    off.submit(turn(ps[0] + reply + user_tokens(tokenizer), seed=7, budget=4)(gen))
    assert off.stats["reused_tokens"] == 0 and off.stats["prefill_tokens"] > 0
    with pytest.raises(ValueError):
        ContinuousBatcher(gen, retain_rows=-1)


def test_live_rows_evict_retained_rows_past_max_batch(tokenizer, varied):  # noqa: F811
    ps = prompts(tokenizer)
    gen = PolicyGenerator(tokenizer, varied, decoder="slots")
    b = ContinuousBatcher(gen, max_batch=2, window_s=0)
    b.submit(turn(ps[0], seed=0, budget=5)(gen))
    b.submit(turn(ps[1], seed=1, budget=5)(gen))
    assert len(b._kept) == 2
    rows: list[int] = []
    b.after_pass = lambda n: rows.append(len(b._rows))
    make = turn(ps[2], n=2, seed=2, budget=6, top_logprobs=1)
    assert_same([b.submit(make(gen))], [fresh(gen, make)])
    assert max(rows) <= 2 and len(b._kept) == 2  # both retained rows evicted, the new ones retained


def test_rows_not_fed_take_no_part_in_a_decode_step(varied):  # noqa: F811
    """A decode step over most rows (no gathering) attends up to the last fed row and the longest fed
    context: a retained row's longer context, after them or between them, changes nothing."""
    g = torch.Generator().manual_seed(1)
    ctxs = [torch.randint(0, 200, (k,), generator=g).tolist() for k in (5, 30, 6, 7, 40)]
    dec = SlotDecoder(varied)
    dec.reset(5)
    dec.forward(ctxs)
    before = dec.stats["attended"]
    got = dec.forward([[3], [], [4], [5], []])  # 3 of 5 rows: more than GATHER_SHARE, attention over slots
    assert dec.stats["attended"] - before == sum(len(ctxs[i]) + 1 for i in (0, 2, 3))
    dec.close()
    for row, (i, tok) in enumerate(((0, 3), (2, 4), (3, 5))):
        want = varied(input_ids=torch.tensor([ctxs[i] + [tok]])).logits[0, -1]
        assert torch.allclose(got[row], want, atol=1e-4, rtol=0)


def test_the_app_reuses_an_episode_s_kv_across_its_chat_requests(tokenizer, varied):  # noqa: F811
    """Through the endpoint: the second request of a conversation (the first's messages, its reply as an
    assistant message, a new user message) continues the first's row, and answers as without reuse."""
    from fastapi.testclient import TestClient

    from mentorrl.serve import create_app

    apps = [create_app(tokenizer, varied, "tiny", batch_window_ms=0, retain_rows=r) for r in (None, 0)]
    assert [a.state.served.batcher.retain_rows for a in apps] == [32, 0]
    answers = []
    for app in apps:
        c = TestClient(app)
        body = {"messages": [{"role": "user", "content": "Where is my order?"}], "max_tokens": 8, "seed": 1}
        body["logprobs"] = True
        reply = c.post("/v1/chat/completions", json=body).json()
        first, usage = reply["choices"][0]["message"], reply["usage"]
        body["messages"] += [{"role": "assistant", "content": first["content"]}, {"role": "user", "content": "And?"}]
        answers.append(c.post("/v1/chat/completions", json=body).json()["choices"])
    (a,), (b,) = answers
    assert (a["message"], a["finish_reason"]) == (b["message"], b["finish_reason"])
    la, lb = a["logprobs"]["content"], b["logprobs"]["content"]
    assert [x["token"] for x in la] == [y["token"] for y in lb]
    assert all(abs(x["logprob"] - y["logprob"]) <= 1e-5 for x, y in zip(la, lb))
    stats = [a.state.served.batcher.stats for a in apps]
    assert stats[1]["reused_tokens"] == 0 and stats[0]["reused_rows"] == 1
    # the whole first turn is reused: its prompt and reply as the template renders them again (the
    # reply's stop token, sampled but never fed, is fed with the new messages)
    assert stats[0]["reused_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] - 1
    assert stats[0]["prefill_tokens"] == stats[1]["prefill_tokens"] - stats[0]["reused_tokens"]


def test_a_change_of_the_embeddings_alone_drops_the_retained_rows(tokenizer, varied):  # noqa: F811
    ps = prompts(tokenizer)
    m = copy.deepcopy(varied)
    gen = PolicyGenerator(tokenizer, m, decoder="slots")
    b = ContinuousBatcher(gen, window_s=0)
    reply = b.submit(turn(ps[1], seed=2, budget=6)(gen))[0].token_ids
    with torch.no_grad():
        m.model.embed_tokens.weight.mul_(1.5)
    make = turn(ps[1] + reply + user_tokens(tokenizer), seed=4, budget=6, top_logprobs=1)
    assert_same([b.submit(make(gen))], [fresh(gen, make)])
    assert b.stats["reused_tokens"] == 0


def test_the_external_stage_reports_the_share_of_prompt_tokens_reused():
    from mentorrl.train.recipes.external import time_breakdown

    stats = {"busy_s": 1.0, "calls": 4, "row_passes": 8, "reused_tokens": 30, "prefill_tokens": 10}
    assert time_breakdown([], 0.0, stats, None)["gen_prompt_reused_share"] == 0.75
    assert "gen_prompt_reused_share" not in time_breakdown([], 0.0, {"busy_s": 1.0, "calls": 1, "rows": 2}, None)
