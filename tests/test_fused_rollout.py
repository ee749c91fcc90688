"""The slot decoder's fused projections (mentorrl/rollout/fused.py): a LoRA policy's rollout runs
four fused groups per layer instead of seven wrapped Linears, with the logits of the model's own
modules; new weights are taken at a sync; what cannot be fused exactly runs the modules."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("peft")

from mentorrl.config import LoraSpec  # noqa: E402
from mentorrl.models.lora import apply_lora  # noqa: E402
from mentorrl.rollout.decoders import SlotDecoder, slot_decoder_checks  # noqa: E402
from mentorrl.rollout.fused import fuse_layers  # noqa: E402

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _llama(bias: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=89,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attention_bias=bias,
        mlp_bias=bias,
    )
    return LlamaForCausalLM(cfg).eval()


def _adapted(model, targets, r=4, seed=0, scale_b=0.1):
    pm = apply_lora(copy.deepcopy(model), LoraSpec(r=r, alpha=2.0 * r, target_modules=targets), seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:  # a fresh adapter's B is zero: give it an effect
                p.copy_(torch.randn(p.shape, generator=g) * scale_b)
    return pm.eval()


def _run(model, fuse: bool, chunks_seq) -> list[torch.Tensor]:
    dec = SlotDecoder(model, fuse=fuse)
    dec.reset(len(chunks_seq[0]))
    try:
        return [dec.forward(chunks).float() for chunks in chunks_seq]
    finally:
        dec.close()


CHUNKS = [
    [[3, 14, 15, 9, 26], [5, 35], [8, 9, 7, 9, 3, 2, 3]],  # three fresh prompts
    [[8], [], [4]],  # two decode rows, one paused
    [[11], [6, 2, 6, 4], [33]],  # a decode row beside an observation chunk
]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    targets=st.lists(st.sampled_from(MODULES), min_size=1, max_size=7, unique=True),
    r=st.integers(1, 8),
    bias=st.booleans(),
    seed=st.integers(0, 50),
)
def test_fused_logits_equal_the_modules_for_any_adapted_subset(targets, r, bias, seed):
    base = _llama(bias)
    pm = _adapted(base, targets, r=r, seed=seed)
    want = _run(pm, False, CHUNKS)
    dec = SlotDecoder(pm)
    assert dec.fused is not None and dec.stats["fused"] == 1.0
    dec.close()
    got = _run(pm, True, CHUNKS)
    plain = _run(base, True, CHUNKS)
    for a, b, c in zip(got, want, plain):
        assert torch.allclose(a, b, atol=1e-5, rtol=0), float((a - b).abs().max())
        assert not torch.allclose(a, c, atol=1e-3)  # the adapters are applied, not dropped


def test_fused_bf16_policy_matches_its_modules_bit_for_bit():
    """Base weights in bf16, adapters in fp32 (peft's default): the fused groups keep peft's
    arithmetic (base output in bf16, adapter path in fp32, one rounding), never a merged bf16 weight."""
    pm = _adapted(_llama(), MODULES, r=8, scale_b=0.01)
    base = pm.get_base_model()
    for n, p in base.named_parameters():
        if "lora_" not in n:
            p.data = p.data.to(torch.bfloat16)
    for a, b in zip(_run(pm, True, CHUNKS), _run(pm, False, CHUNKS)):
        assert torch.allclose(a, b, atol=1e-2, rtol=0), float((a - b).abs().max())
    assert slot_decoder_checks(pm) is None


@pytest.mark.parametrize("how", ["in_place", "load_state_dict", "new_data"])
def test_new_weights_are_taken_at_the_next_pass_whoever_changed_them(how):
    """The fused groups are a copy: any change of the policy's weights (an optimizer step in place, an SAO
    actor's load_state_dict without telling the engine, a new ``.data``) is seen at the next pass."""
    pm = _adapted(_llama(), MODULES)
    dec = SlotDecoder(pm)
    dec.reset(1)
    before = dec.forward([[1, 2, 3]]).float()
    with torch.no_grad():
        if how == "in_place":
            for n, p in pm.named_parameters():
                if "lora_A" in n:
                    p.mul_(3.0)
        elif how == "load_state_dict":
            state = {k: v * 1.5 if "q_proj.base_layer.weight" in k else v for k, v in pm.state_dict().items()}
            pm.load_state_dict(state)
        else:
            layer = pm.get_base_model().model.layers[0]
            layer.mlp.down_proj.base_layer.weight.data = layer.mlp.down_proj.base_layer.weight.data * 2.0
    dec.reset(1)
    after = dec.forward([[1, 2, 3]]).float()
    dec.close()
    assert torch.allclose(after, _run(pm, False, [[[1, 2, 3]]])[0], atol=1e-5)
    assert not torch.allclose(after, before, atol=1e-3)


def test_what_cannot_be_fused_exactly_runs_the_modules():
    from peft import LoraConfig, get_peft_model

    from mentorrl.rollout.adapters import base_module

    base = _llama()
    dora = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], use_dora=True))
    dropped = apply_lora(copy.deepcopy(base), LoraSpec(r=4, alpha=8.0, target_modules=["q_proj"], dropout=0.5), seed=0)
    dropped.train()  # adapter dropout active: not a fixed function of the weights
    for m in (dora, dropped):
        assert fuse_layers(list(base_module(m).model.layers)) is None
        assert SlotDecoder(m).fused is None
    dropped.eval()
    assert fuse_layers(list(base_module(dropped).model.layers)) is not None
    dora.eval()
    want = _run(dora, False, CHUNKS)
    for a, b in zip(_run(dora, True, CHUNKS), want):  # the modules run: DoRA's own logits
        assert torch.equal(a, b)


def test_unfused_decoder_is_still_available():
    pm = _adapted(_llama(), MODULES)
    dec = SlotDecoder(pm, fuse=False)
    assert dec.fused is None and dec.stats["fused"] == 0.0
    dec.close()


@pytest.mark.parametrize("replica", [False, True])
def test_a_bf16_policy_gets_the_slot_decoder_and_a_broken_one_still_does_not(replica, monkeypatch):
    """The once-per-model check runs in float32 (a copy, or a two-layer replica past the size limit), so
    bf16 rounding never sends a bf16 LoRA policy to the slow fallback, and a real fault is still caught."""
    import mentorrl.rollout.decoders as decoders_mod

    if replica:
        monkeypatch.setattr(decoders_mod, "_CHECK_COPY_BYTES", 0)
    pm = _adapted(_llama(), MODULES).to(torch.bfloat16)
    assert slot_decoder_checks(pm) is None
    other = _adapted(_llama(), MODULES, seed=3).to(torch.bfloat16)
    real = SlotDecoder._rotary
    # a position skipped after the fourth token (a uniform shift would not show: rotary attention is relative)
    monkeypatch.setattr(SlotDecoder, "_rotary", lambda self, h, pos: real(self, h, pos + (pos >= 4).long()))
    assert "differ" in (slot_decoder_checks(other) or "")
