"""The rollout decoders (mentorrl/rollout/decoders.py): every fed row's logits are the model's own
logits for that row's whole context, whatever the rows around it do; the engine samples the same
trajectories through either decoder."""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import engine_run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mentorrl.rollout.decoders as decoders_mod
from mentorrl.rollout.decoders import (
    DynamicCacheDecoder,
    SlotDecoder,
    make_decoder,
    slot_decoder_checks,
    slot_support,
)


def _llama_gqa():
    """A Llama with grouped-query attention (4 query heads over 2 kv heads), biases and llama3 rope
    scaling: the layout differences a user's real checkpoint brings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        attention_bias=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def models(model):
    return {"qwen2": model.eval(), "llama-gqa": _llama_gqa()}


def _reference(model, ctx: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ctx]), use_cache=False).logits[0, -1].float()


# An operation schedule: ('feed', {row: chunk length}) / ('add', n) / ('drop', keep mask) / ('drop_fed',) / ('reset',)
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("feed"), st.lists(st.sampled_from([0, 1, 1, 1, 2, 5, 13, 40]), min_size=1, max_size=8)),
        st.tuples(st.just("add"), st.integers(1, 3)),
        st.tuples(st.just("drop"), st.lists(st.booleans(), min_size=1, max_size=8)),
        st.tuples(st.just("drop_fed")),  # every row with context finishes; rows never fed stay
        st.tuples(st.just("reset")),
        st.tuples(st.just("twins"), st.integers(2, 4)),
        st.tuples(st.just("echo"), st.integers(0, 96)),  # every row fed one token: twins stay twins
    ),
    min_size=1,
    max_size=14,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_ops, which=st.sampled_from(["qwen2", "llama-gqa"]), seed=st.integers(0, 10_000))
@pytest.mark.parametrize("kind,gather_share", [("slots", 0.5), ("slots", 0.0), ("slots", 1.0), ("hf", None)])
def test_each_decoder_gives_each_row_its_own_context_logits(models, kind, gather_share, ops, which, seed, monkeypatch):
    """Random schedules of admissions, decode steps, multi-token chunks (prompts, observations),
    fresh rows sharing a prompt, drops and resets: each fed row's logits equal the model's forward
    over that row's whole context, alone. Long chunks push the left-padded cache past its
    compaction width, and drops can leave it holding only rows never fed. The slot decoder's decode
    attention runs over every slot (share 0), over copies of the decode rows' slots (share 1), or
    picks by the share of rows decoding (the default)."""
    if gather_share is not None:
        monkeypatch.setattr(decoders_mod, "GATHER_SHARE", gather_share)
    model = models[which]
    vocab = model.config.vocab_size
    rng = random.Random(seed)
    dec = make_decoder(model, kind)
    ctx: list[list[int]] = []
    dec.reset(0)
    for op in ops:
        if op[0] == "add":
            dec.add_rows(op[1])
            ctx += [[] for _ in range(op[1])]
        elif op[0] == "reset":
            dec.reset(len(ctx))
            ctx = [[] for _ in ctx]
        elif op[0] in ("drop", "drop_fed"):
            keep = [i for i in range(len(ctx)) if (op[1][i % len(op[1])] if op[0] == "drop" else not ctx[i])]
            order = dec.drop(keep)
            assert sorted(order) == keep
            ctx = [ctx[o] for o in order]
        else:
            if op[0] == "twins":  # fresh rows with one prompt (a GRPO group), beside a decode step
                start = len(ctx)
                dec.add_rows(op[1])
                ctx += [[] for _ in range(op[1])]
                prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 9))]
                chunks = [[rng.randrange(vocab)] if c else [] for c in ctx[:start]] + [list(prompt)] * op[1]
            elif op[0] == "echo":
                chunks = [[op[1]] for _ in ctx]
            else:
                lens = op[1]
                chunks = [[rng.randrange(vocab) for _ in range(lens[i % len(lens)])] for i in range(len(ctx))]
            if not ctx or not any(chunks):
                continue
            logits = dec.forward(chunks)
            fed = [i for i, c in enumerate(chunks) if c]
            assert logits.shape == (len(fed), vocab)
            for j, i in enumerate(fed):
                ctx[i] = ctx[i] + chunks[i]
                want = _reference(model, ctx[i])
                assert torch.allclose(logits[j].float(), want, atol=1e-4, rtol=0), (which, i, ctx[i])
    if kind == "slots":
        assert dec.lens == [len(c) for c in ctx]


def test_left_padded_cache_left_with_only_unfed_rows_starts_afresh(models):
    """Regression (CI at fb5346a): a weight sync resets the cache while a row waits on its tool; the
    other row decodes past the compaction width and finishes. The waiting row's mask is all zeros,
    and compaction sliced ``[:, -0:]`` (every column) and raised."""
    model = models["qwen2"]
    dec = DynamicCacheDecoder(model)
    dec.reset(2)
    with torch.no_grad():
        dec.forward([list(range(70)), []])
        dec.drop([1])
        got = dec.forward([[5, 6]])
    assert torch.allclose(got[0].float(), _reference(model, [5, 6]), atol=1e-4, rtol=0)


def test_prefill_shared_then_rows_diverge(models):
    for model in models.values():
        dec = SlotDecoder(model)
        dec.reset(3)
        prefix = [3, 9, 4, 1, 7, 7, 2, 8]
        assert dec.prefill_shared(prefix)
        chunks = [[5], [6, 2, 9], [11]]
        logits = dec.forward(chunks)
        for j in range(3):
            assert torch.allclose(logits[j].float(), _reference(model, prefix + chunks[j]), atol=1e-4, rtol=0)
        assert not dec.prefill_shared(prefix)  # only into empty contexts


def test_rows_with_one_prompt_are_computed_once(models):
    model = models["qwen2"]
    dec = SlotDecoder(model)
    dec.reset(4)
    prompt = [4, 8, 15, 16, 23, 42]
    logits = dec.forward([prompt, [9, 9], prompt, prompt])
    assert dec.stats["shared_rows"] == 2
    assert torch.equal(logits[0], logits[2]) and torch.equal(logits[0], logits[3])
    # the copied cache entries are the leader's: the next step agrees with the model per row
    nxt = dec.forward([[1], [2], [3], [4]])
    for j, ctx in enumerate([prompt + [1], [9, 9, 2], prompt + [3], prompt + [4]]):
        assert torch.allclose(nxt[j].float(), _reference(model, ctx), atol=1e-4, rtol=0)


def test_auto_falls_back_to_the_models_forward_where_slots_do_not_fit():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=32, n_layer=1, n_head=2, n_positions=64)).eval()
    assert "gpt2" in slot_support(gpt2)
    assert isinstance(make_decoder(gpt2, "auto"), DynamicCacheDecoder)
    with pytest.raises(ValueError, match="slot decoder cannot run"):
        make_decoder(gpt2, "slots")
    with pytest.raises(ValueError, match="unknown decoder"):
        make_decoder(gpt2, "fast")


def test_a_model_whose_slot_logits_disagree_falls_back(monkeypatch):
    """The self-check compares against the model's own forward, so a layout the decoder gets
    wrong (here: a layer whose forward was changed) falls back instead of sampling garbage."""
    model = _llama_gqa()
    mlp = model.model.layers[0].mlp
    # the model's forward runs the layer's own forward; the slot decoder calls the modules inside it
    layer = model.model.layers[0]
    original = layer.forward
    monkeypatch.setattr(layer, "forward", lambda *a, **k: original(*a, **k) * 1.5)
    why = slot_decoder_checks(model)
    assert why is not None and "differ" in why
    assert isinstance(make_decoder(model, "auto"), DynamicCacheDecoder)
    assert mlp is model.model.layers[0].mlp


def test_engine_samples_the_same_trajectories_through_either_decoder(
    tool_happy_model, make_contract, orders_entry, orders_tasks
):
    contract = make_contract()
    tasks = [t for t in orders_tasks[20:26] for _ in range(3)]  # groups share a prompt

    slots_eng, a = engine_run(tool_happy_model, contract, orders_entry, tasks, seed=11, decoder="slots")
    hf_eng, b = engine_run(tool_happy_model, contract, orders_entry, tasks, seed=11, decoder="hf")
    assert slots_eng.last_stats["shared_rows"] >= 12 and "compactions" in hf_eng.last_stats
    assert sum(len(t.tool_calls) for t in a) >= 10  # multi-turn: observations were fed mid-context
    assert [t.token_ids for t in a] == [t.token_ids for t in b]
    for x, y in zip(a, b):
        assert max((abs(p - q) for p, q in zip(x.logprobs, y.logprobs)), default=0.0) < 1e-4
    assert isinstance(make_decoder(tool_happy_model, "auto"), SlotDecoder)


def test_cache_buffers_are_reused_after_close_and_never_shared(models):
    """A closed decoder's buffers serve the next decoder on the same model; stale entries from the
    earlier rollout never reach a row's logits; two open decoders never hold the same buffers."""
    model = models["qwen2"]
    first = SlotDecoder(model)
    first.reset(3)
    first.forward([[7] * 40, [9] * 25, [3, 4, 5]])  # fills slots with values the next rollout must not see
    held = first.k[0]
    other = SlotDecoder(model)  # while `first` is open: its own buffers
    other.reset(1)
    other.forward([[1, 2]])
    assert other.k[0].data_ptr() != held.data_ptr()
    first.close()
    second = SlotDecoder(model)
    assert second.k[0] is held
    second.reset(2)
    got = second.forward([[11, 12], [13]])
    got2 = second.forward([[14], [15, 16, 17]])
    assert torch.allclose(got[0].float(), _reference(model, [11, 12]), atol=1e-4, rtol=0)
    assert torch.allclose(got2[1].float(), _reference(model, [13, 15, 16, 17]), atol=1e-4, rtol=0)
    second.close()
    other.close()


def test_non_finite_logits_raise_and_the_buffers_are_dropped():
    model = _llama_gqa()
    with torch.no_grad():
        model.lm_head.weight[5, 0] = float("nan")
    dec = SlotDecoder(model)
    dec.reset(1)
    with pytest.raises(FloatingPointError, match="not finite"):
        dec.forward([[1, 2, 3]])
    dec.close()
    assert SlotDecoder(model).k == []  # nothing was pooled


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(1, 6),
    width=st.integers(1, 300),
    scale=st.sampled_from([1.0, 1e3, 3e4]),
    bad=st.lists(
        st.tuples(st.integers(0, 10**6), st.sampled_from([float("nan"), float("inf"), float("-inf")])), max_size=3
    ),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_the_finite_check_agrees_with_isfinite_on_logits(rows, width, scale, bad, dtype, seed):
    """The decoder's one-sum check says "not finite" exactly where isfinite(x).all() does, for logits of
    any sign and size a model gives (up to 3e4: fp16's range), with NaNs and infinities planted anywhere."""
    x = (torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)
    for at, v in bad:
        x.view(-1)[at % x.numel()] = v
    assert decoders_mod.all_finite(x) == bool(torch.isfinite(x).all())


def test_a_sequence_length_dependent_rope_runs_per_pass():
    """Dynamic NTK rope rescales with the sequence length, so no position table is cached."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    cfg = LlamaConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    )
    model = LlamaForCausalLM(cfg).eval()
    dec = SlotDecoder(model)
    assert not dec.static_rope
    dec.reset(2)
    a, b = list(range(1, 12)), [5, 6]
    out = dec.forward([a, b])
    assert torch.allclose(out[0].float(), _reference(model, a), atol=1e-4, rtol=0)
    assert torch.allclose(out[1].float(), _reference(model, b), atol=1e-4, rtol=0)


def test_the_cache_grows_to_the_contract_limit_not_past_it(models):
    model = _llama_gqa()  # its own buffers (no pooled ones from other tests)
    dec = SlotDecoder(model, max_len=100)
    dec.reset(1)
    dec.forward([[3] * 70])
    assert dec.k[0].shape[2] == 100  # doubling from 64 would give 128
    dec.forward([[4] * 40])  # a row past the limit still fits
    assert dec.k[0].shape[2] == 110
    assert torch.allclose(
        dec.forward([[5]])[0].float(), _reference(model, [3] * 70 + [4] * 40 + [5]), atol=1e-4, rtol=0
    )


def test_the_run_config_picks_the_decoder(model, make_contract):
    from mentorrl.config import RolloutConfig
    from mentorrl.rollout import BackendChoice

    for kind in ("slots", "hf", "auto"):
        assert BackendChoice(RolloutConfig(decoder=kind)).for_model(model, make_contract()).decoder == kind
    with pytest.raises(ValueError):
        RolloutConfig(decoder="fast")


def test_pooled_buffers_longer_than_the_limit_still_take_more_rows():
    """A pooled cache from a run with a longer contract, reused under a shorter limit by a decoder
    that needs more rows: the rows grow, the capacity never shrinks below what is held."""
    model = _llama_gqa()
    first = SlotDecoder(model, max_len=300)
    first.reset(1)
    first.forward([[2] * 200])
    first.close()
    second = SlotDecoder(model, max_len=100)
    second.reset(3)
    out = second.forward([[3] * 5, [4] * 7, [5]])
    assert second.k[0].shape[0] == 3 and second.k[0].shape[2] >= 256
    assert torch.allclose(out[1].float(), _reference(model, [4] * 7), atol=1e-4, rtol=0)


def test_rows_whose_running_hashes_collide_are_not_merged(models):
    """The duplicate check groups rows by a running hash, then compares contexts token by token: rows
    forced onto one hash with different contexts are each computed on their own."""
    model = models["qwen2"]
    dec = SlotDecoder(model)
    dec.reset(2)
    dec.forward([[3, 1, 4], [2, 7, 1]])
    dec.keys = [123, 123]  # a collision: same hash, different contexts
    out = dec.forward([[5], [5]])
    assert dec.stats["shared_rows"] == 0
    assert torch.allclose(out[0].float(), _reference(model, [3, 1, 4, 5]), atol=1e-4, rtol=0)
    assert torch.allclose(out[1].float(), _reference(model, [2, 7, 1, 5]), atol=1e-4, rtol=0)
