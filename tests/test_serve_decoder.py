"""The server's decode path on the rollouts' decoder (issue 55): for every setting the server has, it
gives the same turns as ``model.generate`` -- token ids, finish reasons, texts, recorded log-probs and
streamed events -- and it runs the weights the learner last wrote in place."""

from __future__ import annotations

import copy
import queue
from typing import Any

import pytest
import torch
from conftest import random_weights
from fastapi.testclient import TestClient

from mentorrl.chat import prompt_text
from mentorrl.contract import IM_END
from mentorrl.serve import PolicyGenerator, create_app
from mentorrl.serve.generation import DONE, Sample

CONVERSATIONS = [
    [{"role": "user", "content": "Where is order 7?"}],
    [
        {"role": "system", "content": "You are a support agent. Tools: get_order(order_id)."},
        {"role": "user", "content": "Where is order 7? It was due on Monday and has not come."},
    ],
    [{"role": "user", "content": "hi"}],
]  # three prompt lengths
LP_TOL = 1e-5


@pytest.fixture(scope="module")
def varied(model, tokenizer):
    """The tiny model with large random weights (what it writes depends on the prompt) and an LM-head
    bias towards the stop token: some turns stop after a few tokens, others run to the budget."""
    m = random_weights(model, 0.15)
    bias = torch.zeros(m.lm_head.weight.shape[0])
    bias[tokenizer.convert_tokens_to_ids(IM_END)] = 3.0
    m.lm_head.bias = torch.nn.Parameter(bias)
    return m.eval()


def prompts(tokenizer) -> list[list[int]]:
    return [list(tokenizer.encode(prompt_text(m), add_special_tokens=False)) for m in CONVERSATIONS]


def both(tokenizer, model, make_batch) -> tuple[list[list[Sample]], list[list[Sample]]]:
    """The replies of the slot decoder and of ``generate`` to the same batch (``make_batch(gen)``)."""
    out = []
    for kind in ("slots", "hf_generate"):
        gen = PolicyGenerator(tokenizer, model, decoder=kind)
        out.append(gen.run(make_batch(gen)))
    return out[0], out[1]


def assert_same(a: list[list[Sample]], b: list[list[Sample]]) -> None:
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        assert len(ra) == len(rb)
        for sa, sb in zip(ra, rb):
            assert (sa.token_ids, sa.finish_reason, sa.text) == (sb.token_ids, sb.finish_reason, sb.text)
            assert sa.logprobs is not None and sb.logprobs is not None
            assert len(sa.logprobs) == len(sb.logprobs) == len(sa.token_ids)
            for x, y in zip(sa.logprobs, sb.logprobs):
                assert x.token_id == y.token_id
                assert abs(x.logprob - y.logprob) <= LP_TOL
                assert [i for i, _ in x.top] == [i for i, _ in y.top]
                assert all(abs(p - q) <= LP_TOL for (_, p), (_, q) in zip(x.top, y.top)), (x.top, y.top)


def reasons(replies: list[list[Sample]]) -> set[str]:
    return {s.finish_reason for r in replies for s in r}


def test_auto_picks_the_slot_decoder_where_the_model_supports_it(tokenizer, model):
    assert PolicyGenerator(tokenizer, model).decoder_kind() == "slots"

    class Proxy:  # not a torch module (a test's recording proxy): generate
        def __init__(self, m: Any):
            self.m = m

        def __getattr__(self, name: str) -> Any:
            return getattr(self.m, name)

    assert PolicyGenerator(tokenizer, Proxy(model)).decoder_kind() == "hf_generate"
    assert PolicyGenerator(tokenizer, model, decoder="hf_generate").decoder_kind() == "hf_generate"
    with pytest.raises(ValueError, match="unknown decoder"):
        PolicyGenerator(tokenizer, model, decoder="beam")


def test_greedy_mixed_prompt_lengths(tokenizer, varied):
    ps = prompts(tokenizer)
    a, b = both(tokenizer, varied, lambda g: [g.request(p, 1, 0.0, 1.0, 16, top_logprobs=2) for p in ps])
    assert_same(a, b)
    assert len({r[0].text for r in a}) == 3  # the prompts lead to different turns


def test_seeded_sampling_temperature_top_p_and_n(tokenizer, varied):
    ps = prompts(tokenizer)

    def batch(g: PolicyGenerator) -> list:
        return [
            g.request(ps[0], 3, 0.8, 0.9, 20, seed=1, top_logprobs=3),
            g.request(ps[1], 2, 1.0, 1.0, 20, seed=2),
            g.request(ps[2], 2, 0.0, 1.0, 20),  # greedy: one row
            g.request(ps[2], 1, 1.3, 0.5, 20, seed=3),
        ]

    a, b = both(tokenizer, varied, batch)
    assert_same(a, b)
    assert reasons(a) == {"stop", "length"}  # rows end at different steps: finished rows are not fed
    assert len({s.text for s in a[0]}) == 3


def test_budget_hit_is_length(tokenizer, varied):
    ps = prompts(tokenizer)
    a, b = both(tokenizer, varied, lambda g: [g.request(p, 2, 1.0, 1.0, 3, seed=7) for p in ps])
    assert_same(a, b)
    assert "length" in reasons(a) and all(len(s.token_ids) <= 3 for r in a for s in r)


def test_stop_strings(tokenizer, varied):
    ps = prompts(tokenizer)
    gen = PolicyGenerator(tokenizer, varied, decoder="hf_generate")

    def batch(g: PolicyGenerator, stop: tuple[str, ...]) -> list:
        return [g.request(p, 3, 1.0, 1.0, 24, seed=5, stop=stop, top_logprobs=1) for p in ps]

    text = max((s.text for s in gen.run(batch(gen, ())[:1])[0]), key=len)
    stop = (text[len(text) // 2 : len(text) // 2 + 2],)  # a string a turn writes
    assert stop[0].strip()
    a, b = both(tokenizer, varied, lambda g: batch(g, stop))
    assert_same(a, b)
    ended = [s for r in a for s in r if s.finish_reason == "stop" and s.token_ids[-1] not in gen.stop_ids]
    assert ended  # turns the stop string ended (the text is cut before it)
    assert all(stop[0] not in s.text for r in a for s in r)


def test_banned_ids(tokenizer, varied):
    ps = prompts(tokenizer)
    gen = PolicyGenerator(tokenizer, varied, decoder="hf_generate")
    free = gen.run([gen.request(ps[0], 2, 1.0, 1.0, 12, seed=4)])[0]
    banned = tuple(sorted({t for s in free for t in s.token_ids[:3]}))
    a, b = both(
        tokenizer,
        varied,
        lambda g: (
            [g.request(p, 2, 1.0, 1.0, 12, seed=4, banned=banned) for p in ps]
            + [g.request(ps[0], 1, 0.0, 1.0, 12, banned=banned)]
        ),
    )
    assert_same(a, b)
    assert not {t for r in a for s in r for t in s.token_ids} & set(banned)


def test_streaming_events(tokenizer, varied):
    """Each step's token of each streamed row, as it is sampled; a row's events after its turn ended
    carry the pad id (their log-probs are of nothing the reader uses)."""
    ps = prompts(tokenizer)
    events, counts = {}, {}
    for kind in ("slots", "hf_generate"):
        gen = PolicyGenerator(tokenizer, varied, decoder=kind)
        q: queue.Queue = queue.Queue()
        reqs = [
            gen.request(ps[0], 3, 1.0, 0.9, 10, seed=9, top_logprobs=2, events=q),
            gen.request(ps[1], 1, 0.0, 1.0, 10),  # not streamed, in the same batch
        ]
        samples = gen.run(reqs)[0]
        q.put(DONE)
        events[kind] = list(iter(q.get, DONE))
        counts[kind] = [len(s.token_ids) for s in samples]
    a, b = events["slots"], events["hf_generate"]
    assert counts["slots"] == counts["hf_generate"] and len(set(counts["slots"])) > 1
    assert [x[:3] for x in a] == [y[:3] for y in b]  # ("token", sample index, id)
    seen = [0, 0, 0]
    for x, y in zip(a, b):
        i = x[1]
        if seen[i] < counts["slots"][i]:
            assert x[3].token_id == y[3].token_id == x[2] and abs(x[3].logprob - y[3].logprob) <= LP_TOL
            assert [t for t, _ in x[3].top] == [t for t, _ in y[3].top]
        seen[i] += 1
    assert seen == [max(counts["slots"])] * 3


def test_the_dynamic_cache_decoder_gives_the_same_turns(tokenizer, varied):
    ps = prompts(tokenizer)

    def batch(g: PolicyGenerator) -> list:
        return [g.request(ps[0], 2, 0.8, 0.9, 12, seed=1), g.request(ps[1], 1, 0.0, 1.0, 12, top_logprobs=2)]

    gen = PolicyGenerator(tokenizer, varied, decoder="hf")
    assert_same(gen.run(batch(gen)), both(tokenizer, varied, batch)[1])


def test_weights_changed_in_place_are_used_by_the_next_call(tokenizer, varied):
    m = copy.deepcopy(varied)
    gen = PolicyGenerator(tokenizer, m, decoder="slots")
    ps = prompts(tokenizer)

    def batch(g: PolicyGenerator) -> list:
        return [g.request(p, 2, 1.0, 1.0, 12, seed=6, top_logprobs=1) for p in ps]

    before = gen.run(batch(gen))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # an optimizer step's kind of write: in place, layer projections only
        for layer in m.model.layers:
            for p in (layer.self_attn.q_proj.weight, layer.mlp.down_proj.weight):
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    after = gen.run(batch(gen))
    reference = PolicyGenerator(tokenizer, m, decoder="hf_generate")
    assert_same(after, reference.run(batch(reference)))
    assert [[s.token_ids for s in r] for r in after] != [[s.token_ids for s in r] for r in before]


def test_the_app_serves_the_same_replies_on_either_path(tokenizer, varied):
    body = {"messages": CONVERSATIONS[0], "max_tokens": 12, "n": 2, "seed": 3, "logprobs": True, "top_logprobs": 2}
    replies = []
    for kind in ("auto", "hf_generate"):
        app = create_app(tokenizer, varied, "tiny", decoder=kind)
        assert app.state.served.gen.decoder_kind() == ("slots" if kind == "auto" else kind)
        r = TestClient(app).post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        replies.append(r.json()["choices"])
    for a, b in zip(*replies):
        assert (a["message"], a["finish_reason"]) == (b["message"], b["finish_reason"])
        la, lb = a["logprobs"]["content"], b["logprobs"]["content"]
        assert [e["token"] for e in la] == [e["token"] for e in lb]
        assert all(abs(x["logprob"] - y["logprob"]) <= LP_TOL for x, y in zip(la, lb))
