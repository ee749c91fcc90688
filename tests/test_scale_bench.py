"""The pure functions of the scaling benches (``bench/scale_arms.py``, ``bench/gpu_step.py``, ``bench/vs_trl.py``'s
LoRA option): no model, no training."""

from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import gpu_step, scale_arms, vs_trl  # noqa: E402
from mentorrl.config import load_config  # noqa: E402


def test_descendants_walks_the_tree_only():
    parents = {1: 0, 10: 1, 11: 10, 12: 10, 13: 12, 20: 1, 30: 99}
    assert scale_arms.descendants(10, parents) == {10, 11, 12, 13}
    assert scale_arms.descendants(13, parents) == {13}
    assert scale_arms.descendants(1, parents) == {1, 10, 11, 12, 13, 20}


def test_rss_peaks_per_process_and_sum_without_the_launcher():
    peaks = scale_arms.RssPeaks(exclude=[1])
    peaks.add({1: 100, 2: 500, 3: 400})
    peaks.add({1: 120, 2: 300, 3: 700})
    assert peaks.per_pid == {1: 120, 2: 500, 3: 700}
    assert peaks.sum_peak == 1000  # 300 + 700: the peak of the simultaneous sum, not the sum of the peaks
    assert peaks.top(2) == [700, 500]
    assert peaks.samples == 2


def test_step_figures_skip_the_warmup_and_other_stages():
    recs = [
        {"stage": "sft", "step": 1, "step_s": 99.0},
        {"stage": "grpo", "step": 1, "step_s": 50.0, "rollout_s": 20.0, "update_s": 30.0, "logprob_abs_gap": 1.0},
        {"stage": "grpo", "step": 2, "step_s": 10.0, "rollout_s": 4.0, "update_s": 6.0, "logprob_abs_gap": 2e-7},
        {"stage": "grpo", "step": 3, "step_s": 14.0, "rollout_s": 5.0, "update_s": 9.0, "logprob_abs_gap": 4e-7},
        {"stage": "grpo", "event": "final"},
    ]
    out = scale_arms.step_figures(recs, warmup=1)
    assert out["timed_steps"] == 2 and out["warmup_step_s"] == [50.0]
    assert out["step_s"] == 12.0 and out["rollout_s"] == 4.5 and out["update_s"] == 7.5
    assert out["step_s_all"] == [10.0, 14.0]
    assert out["logprob_abs_gap"] == pytest.approx(3e-7)
    with pytest.raises(ValueError):
        scale_arms.step_figures(recs[:2], warmup=1)


def test_memory_target_is_a_third_of_full():
    rows = {"full": {"peak_rss_sum_mib": 6000.0}, "lora-ckpt": {"peak_rss_sum_mib": 1900.0}}
    t = scale_arms.memory_target(rows)
    assert t["met"] and t["ratio"] == pytest.approx(1900 / 6000)
    rows["lora-ckpt"]["peak_rss_sum_mib"] = 2100.0
    assert not scale_arms.memory_target(rows)["met"]
    assert scale_arms.memory_target({"full": rows["full"]}) is None


def test_every_arm_is_a_valid_config(tmp_path):
    sets = scale_arms.train_overrides(tmp_path / "m", tmp_path / "run", 3, 1, 8, 48, 6)
    for arm, spec in scale_arms.ARMS.items():
        cfg = load_config(scale_arms.DEMO, [*sets, *spec["sets"]])
        assert cfg.grpo.steps == 3 and cfg.grpo.samples_per_task == 8 and cfg.threads == 1
        assert cfg.grpo.kl_coef == 0 and cfg.sampling.max_new_tokens == 48
        assert (cfg.model.lora is not None) == ("lora" in arm)
        assert cfg.grpo.optim.gradient_checkpointing == ("ckpt" in arm)
        assert (cfg.grpo.optim.micro_batch_tokens == 512) == arm.endswith("mbt")
        assert cfg.model.dtype == ("bfloat16" if "bf16" in arm else "float32")
        assert cfg.distributed.strategy == ("fsdp2" if arm == "fsdp2" else "ddp")
    cmd = scale_arms.arm_command("fsdp2", sets, python="py")
    assert cmd[:5] == ["py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    assert cmd[5:8] == ["-m", "mentorrl.cli", "train"]
    assert scale_arms.arm_command("full", sets, python="py")[:4] == ["py", "-m", "mentorrl.cli", "train"]


def test_vs_trl_lora_override_is_the_same_adapters():
    cfg = load_config(vs_trl.DEMO_CONFIG, [vs_trl.lora_override()])
    assert cfg.model.lora.r == vs_trl.LORA["r"] and cfg.model.lora.alpha == vs_trl.LORA["alpha"]
    assert list(cfg.model.lora.target_modules) == vs_trl.LORA["target_modules"]
    args = Namespace(target_step=1.5, target_rollout=None)
    assert vs_trl.targets_of(args) == {"rollout_tokens_per_cpu_s": 2.0, "trajectories_per_cpu_s": 1.5}


def test_gpu_step_arms_are_valid_configs(tmp_path):
    for device in ("cpu", "cuda"):
        for arm in gpu_step.ARMS:
            sets = gpu_step.arm_sets(arm, device, tmp_path / "m", tmp_path / "run", steps=2, vllm=device == "cuda")
            cfg = load_config(gpu_step.DEMO, sets)
            assert cfg.model.device == ("auto" if (device, arm) == ("cuda", "fsdp2") else device)
            if arm == "lora-bf16":
                assert cfg.model.lora is not None and cfg.model.dtype == "bfloat16"
                assert cfg.rollout.backend == ("vllm" if device == "cuda" else "hf")
            else:
                assert cfg.model.lora is None and cfg.distributed.strategy == "fsdp2"


def test_gpu_step_summary_of_metrics():
    recs = [
        {"stage": "grpo", "step": 1, "step_s": 9.0, "rollout_s": 5.0, "rollout_tokens": 100, "logprob_abs_gap": 0.1},
        {"stage": "grpo", "step": 2, "step_s": 3.0, "rollout_s": 2.0, "rollout_tokens": 400, "logprob_abs_gap": 0.01},
        {"stage": "grpo", "step": 3, "step_s": 5.0, "rollout_s": 2.0, "rollout_tokens": 200, "logprob_abs_gap": 0.03},
    ]
    recs[1]["mismatch_logprob_gap"], recs[2]["mismatch_logprob_gap"] = 1e-6, 3e-6  # lag-0 updates only
    out = gpu_step.summarise_steps(recs, warmup=1)
    assert out["mismatch_logprob_gap"] == pytest.approx(2e-6) and out["mismatch_logprob_gap_max"] == pytest.approx(3e-6)
    assert out["step_s"] == 4.0
    assert out["rollout_tokens_per_s"] == pytest.approx(600 / 4.0)
    assert out["logprob_abs_gap"] == pytest.approx(0.02)
    assert out["logprob_abs_gap_max"] == pytest.approx(0.03)


def test_frozen_copy_of_a_lora_policy_shares_the_base_only():
    """The KL reference of a LoRA policy (``frozen_copy``) holds its own adapters but the policy's frozen base."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from mentorrl.train.workspace import frozen_copy

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    policy = get_peft_model(Qwen2ForCausalLM(cfg), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        before = policy(input_ids=ids).logits
    ref = frozen_copy(policy)
    pol, cop = dict(policy.named_parameters()), dict(ref.named_parameters())
    assert pol.keys() == cop.keys()
    for name, p in pol.items():
        same = p.data_ptr() == cop[name].data_ptr()
        assert same == (not p.requires_grad), name  # frozen: shared; adapters: copied
        assert not cop[name].requires_grad
    opt = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=1.0)
    policy(input_ids=ids).logits.square().mean().backward()
    opt.step()
    with torch.no_grad():
        assert not torch.allclose(policy(input_ids=ids).logits, before)
        assert torch.equal(ref(input_ids=ids).logits, before)  # the reference stays the policy at the copy
    assert all(p.requires_grad for n, p in policy.named_parameters() if "lora_" in n)  # the policy still trains
    plain = Qwen2ForCausalLM(cfg)
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(plain.parameters(), frozen_copy(plain).parameters()))


def test_thin_timeline_keeps_each_windows_largest():
    tl = [(0.0, 2**20), (0.4, 3 * 2**20), (1.2, 2**20), (2.5, 5 * 2**20), (2.9, 4 * 2**20)]
    assert scale_arms.thin_timeline(tl, 1.0) == [(0.4, 3.0), (1.2, 1.0), (2.5, 5.0)]
