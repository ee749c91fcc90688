"""Continuous batching in the server (issue 55): a request admitted into a running decode loop gets
the turns it gets served alone -- ids, texts, finish reasons, log-probs, streamed events -- whatever
else is in flight (other budgets, stop strings, n, banned ids); an error in a pass reaches the requests
in flight and the loop goes on; an idle loop serves the weights as they are now."""

from __future__ import annotations

import copy
import queue
import threading
from typing import Any, Callable

import pytest
import torch

from mentorrl.serve import PolicyGenerator, create_app
from mentorrl.serve.generation import DONE, Batcher, ContinuousBatcher, GenRequest, Sample
from tests.test_serve_decoder import assert_same, prompts, varied  # noqa: F401  (the fixture)

TIMEOUT_S = 60


def serve_alone(gen: PolicyGenerator, make: Callable[[PolicyGenerator], GenRequest]) -> list[Sample]:
    return ContinuousBatcher(gen, window_s=0).enqueue(make(gen)).result(TIMEOUT_S)


def serve_mid_decode(
    gen: PolicyGenerator,
    others: list[Callable[[PolicyGenerator], GenRequest]],
    make: Callable[[PolicyGenerator], GenRequest],
    at_pass: int,
    max_batch: int = 32,
) -> tuple[list[Sample], list[list[Sample]], ContinuousBatcher]:
    """``others`` start together; the probe is admitted before pass ``at_pass + 1`` (a hook after each pass)."""
    b = ContinuousBatcher(gen, max_batch=max_batch, window_s=0)
    probe: list[Any] = []
    in_flight: list[int] = []
    gate = threading.Event()

    def hook(n: int) -> None:
        if n == at_pass:
            in_flight.append(len(b._rows))  # checked below: the probe joins a running loop
            probe.append(b.enqueue(make(gen)))
            gate.set()

    b.after_pass = hook
    reqs = [m(gen) for m in others]
    for r in reqs:  # queued before the worker's first pass sees them: one admission
        b._queue.put(r)
    assert gate.wait(TIMEOUT_S) and in_flight[0] > 0
    return probe[0].result(TIMEOUT_S), [r.future.result(TIMEOUT_S) for r in reqs], b


def long_request(p: list[int], seed: int = 11) -> Callable[[PolicyGenerator], GenRequest]:
    """Two rows that run to a budget of 40 (the stop tokens banned)."""
    return lambda g: g.request(p, 2, 1.0, 1.0, 40, seed=seed, banned=tuple(g.stop_ids))


@pytest.mark.parametrize(
    "probe",
    [
        dict(n=3, temperature=0.8, top_p=0.9, max_new_tokens=20, seed=1, top_logprobs=3),
        dict(n=1, temperature=1.3, top_p=0.5, max_new_tokens=7, seed=3),
        dict(n=2, temperature=0.0, top_p=1.0, max_new_tokens=16, top_logprobs=2),  # greedy
    ],
    ids=["sampled_n3", "short_budget", "greedy"],
)
def test_a_request_admitted_mid_decode_gets_the_turns_it_gets_alone(tokenizer, varied, probe):  # noqa: F811
    ps = prompts(tokenizer)
    gen = PolicyGenerator(tokenizer, varied, decoder="slots")
    kw = dict(probe)

    def make(g: PolicyGenerator) -> GenRequest:
        return g.request(
            ps[1],
            kw["n"],
            kw["temperature"],
            kw["top_p"],
            kw["max_new_tokens"],
            **{k: v for k, v in kw.items() if k in ("seed", "top_logprobs")},
        )

    alone = serve_alone(gen, make)
    others = [  # the first ends after 3 passes: the last row (the probe's, at_pass 1) moves down into its slot
        lambda g: g.request(ps[2], 1, 0.0, 1.0, 3, banned=tuple(g.stop_ids)),
        long_request(ps[0]),
        lambda g: g.request(ps[2], 1, 0.9, 1.0, 25, seed=2, banned=(5, 6, 7)),
    ]
    for at in (1, 3):
        mixed, _, b = serve_mid_decode(gen, others, make, at)
        assert_same([mixed], [alone])
        assert b.stats["calls"] > at and b.stats["rows"] == 4 + len(alone) // (1 if kw["temperature"] else 2)
    # the per-call path (PolicyGenerator.run) gives the same turns
    assert_same([gen.run([make(gen)])[0]], [alone])


def test_different_stop_strings_banned_ids_and_budgets_share_passes(tokenizer, varied):  # noqa: F811
    ps = prompts(tokenizer)
    gen = PolicyGenerator(tokenizer, varied, decoder="slots")
    text = max((s.text for s in gen.run([gen.request(ps[0], 3, 1.0, 1.0, 24, seed=5)])[0]), key=len)
    stop = (text[len(text) // 2 : len(text) // 2 + 2],)
    banned = tuple(
        sorted({t for s in gen.run([gen.request(ps[1], 2, 1.0, 1.0, 12, seed=4)])[0] for t in s.token_ids[:3]})
    )
    makes = [
        lambda g: g.request(ps[0], 3, 1.0, 1.0, 24, seed=5, stop=stop, top_logprobs=1),
        lambda g: g.request(ps[1], 2, 1.0, 1.0, 12, seed=4, banned=banned),
        lambda g: g.request(ps[2], 1, 0.0, 1.0, 9, banned=banned),
        lambda g: g.request(ps[1], 2, 0.7, 0.8, 30, seed=8, stop=(".",)),
    ]
    alone = [serve_alone(gen, m) for m in makes]
    assert any(s.finish_reason == "stop" and stop[0] not in s.text for s in alone[0])
    # each probe admitted while the others decode, and all started together
    for k, m in enumerate(makes):
        probe, rest, _ = serve_mid_decode(gen, [x for i, x in enumerate(makes) if i != k], m, 2)
        assert_same([probe], [alone[k]])
        assert_same(rest, [a for i, a in enumerate(alone) if i != k])
    # a row cap of 3: the requests queue and join as rows free up
    probe, rest, b = serve_mid_decode(gen, makes[:3], makes[3], 1, max_batch=3)
    assert_same([probe] + rest, [alone[3]] + alone[:3])
    assert b.stats["row_passes"] <= 3 * b.stats["calls"]


def test_streaming_events_arrive_in_order_and_end(tokenizer, varied):  # noqa: F811
    ps = prompts(tokenizer)
    gen = PolicyGenerator(tokenizer, varied, decoder="slots")
    streams: list[list] = []

    def make(q: queue.Queue) -> Callable[[PolicyGenerator], GenRequest]:
        return lambda g: g.request(ps[0], 3, 1.0, 0.9, 10, seed=9, top_logprobs=2, events=q)

    q0: queue.Queue = queue.Queue()
    alone = serve_alone(gen, make(q0))
    q1: queue.Queue = queue.Queue()
    mixed, _, _ = serve_mid_decode(gen, [long_request(ps[1])], make(q1), 2)
    assert_same([mixed], [alone])
    for q in (q0, q1):
        streams.append(list(iter(lambda q=q: q.get(timeout=TIMEOUT_S), DONE)))
        assert q.empty()
    a, b = streams
    assert [x[:3] for x in a] == [y[:3] for y in b]
    counts = [len(s.token_ids) for s in alone]
    assert len(a) == 3 * max(counts)  # every row each step until the request's last row ends
    seen = [0, 0, 0]
    for x, y in zip(a, b):
        i = x[1]
        if seen[i] < counts[i]:
            assert x[2] == alone[i].token_ids[seen[i]] == x[3].token_id
            assert abs(x[3].logprob - y[3].logprob) <= 1e-5
        seen[i] += 1


def test_an_error_in_a_pass_fails_the_requests_in_flight_and_the_loop_goes_on(tokenizer, varied):  # noqa: F811
    ps = prompts(tokenizer)
    m = copy.deepcopy(varied)
    gen = PolicyGenerator(tokenizer, m, decoder="slots")
    make = long_request(ps[1], seed=3)
    alone = serve_alone(gen, make)
    w = m.model.layers[0].mlp.down_proj.weight
    saved = w.detach().clone()
    b = ContinuousBatcher(gen, window_s=0)
    q: queue.Queue = queue.Queue()
    probes: list[Any] = []

    def hook(n: int) -> None:
        if n == 2:  # an in-place write between passes: NaN weights, NaN logits in the next pass
            probes.append(b.enqueue(gen.request(ps[0], 1, 1.0, 1.0, 20, seed=1, events=q)))
            with torch.no_grad():
                w.fill_(float("nan"))

    b.after_pass = hook
    first = b.enqueue(make(gen))
    with pytest.raises(FloatingPointError):
        first.result(TIMEOUT_S)
    with pytest.raises(FloatingPointError):
        probes[0].result(TIMEOUT_S)
    assert list(iter(lambda: q.get(timeout=TIMEOUT_S), DONE)) == []  # its stream ends
    with torch.no_grad():
        w.copy_(saved)
    b.after_pass = None
    assert_same([b.enqueue(make(gen)).result(TIMEOUT_S)], [alone])


def test_an_idle_loop_serves_the_weights_changed_in_place(tokenizer, varied):  # noqa: F811
    ps = prompts(tokenizer)
    m = copy.deepcopy(varied)
    gen = PolicyGenerator(tokenizer, m, decoder="slots")
    b = ContinuousBatcher(gen, window_s=0)

    def make(g: PolicyGenerator) -> GenRequest:
        return g.request(ps[0], 2, 1.0, 1.0, 12, seed=6, top_logprobs=1)

    before = b.submit(make(gen))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # an optimizer step's kind of write: in place, layer projections only
        for layer in m.model.layers:
            for p in (layer.self_attn.q_proj.weight, layer.mlp.down_proj.weight):
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    after = b.submit(make(gen))
    reference = PolicyGenerator(tokenizer, m, decoder="hf_generate")
    assert_same([after], [reference.run([make(reference)])[0]])
    assert [s.token_ids for s in after] != [s.token_ids for s in before]


def test_the_slot_decoder_sees_a_weight_written_in_place(varied):  # noqa: F811
    """What keeps a long-lived decoder's fused copy fresh: an in-place write changes ``_layers_key``."""
    from mentorrl.rollout.decoders import SlotDecoder

    m = copy.deepcopy(varied)
    dec = SlotDecoder(m)
    key = dec._layers_key()
    with torch.no_grad():
        m.model.layers[0].self_attn.q_proj.weight.mul_(1.01)
    assert dec._layers_key() != key
    dec.close()


def test_the_app_picks_the_continuous_batcher_on_the_slot_decoder(tokenizer, varied):  # noqa: F811
    assert isinstance(create_app(tokenizer, varied, "tiny").state.served.batcher, ContinuousBatcher)
    for kw in (dict(decoder="hf_generate"), dict(continuous=False)):
        assert isinstance(create_app(tokenizer, varied, "tiny", **kw).state.served.batcher, Batcher)


def test_a_request_larger_than_the_row_cap_runs_once_the_loop_is_empty(tokenizer, varied):  # noqa: F811
    ps = prompts(tokenizer)
    gen = PolicyGenerator(tokenizer, varied, decoder="slots")

    def make(g: PolicyGenerator) -> GenRequest:
        return g.request(ps[0], 3, 1.0, 1.0, 10, seed=12, top_logprobs=1)

    alone = serve_alone(gen, make)
    probe, _, b = serve_mid_decode(gen, [long_request(ps[1])], make, 2, max_batch=2)
    assert_same([probe], [alone])
    # after the long request's 40 passes, alone: each row counts in the passes until it ends
    assert b.stats["calls"] == 40 + max(len(s.token_ids) for s in alone)
    assert b.stats["row_passes"] == 2 * 40 + sum(len(s.token_ids) for s in alone)
