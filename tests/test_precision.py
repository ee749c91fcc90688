"""Device and precision: the config's names resolved and checked before the first step, the learner's
mixed precision (fp32 weights and optimizer state, autocast forward), a rollout in another dtype than
the learner (a synced copy), and training that stays stable under the bf16-rollout / fp32-learner gap
with the clipped and the masked importance-sampling corrections. CPU only here; the GPU paths (CUDA
devices, float16 with a gradient scaler) are what bench/gpu_check.sh runs."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from mentorrl.config import ConfigError, OptimConfig, RunConfig
from mentorrl.models.device import (
    Placement,
    autocast,
    grad_scaler,
    learner_placement,
    placement_problems,
    resolve_device,
    resolve_dtype,
    rollout_backend_args,
    rollout_placement,
    teacher_placement,
)
from mentorrl.rollout import BackendChoice, Rollout
from mentorrl.train.consistency import logprob_gap_metrics
from mentorrl.train.learner import Learner

NO_CUDA = not torch.cuda.is_available()


# ------------------------------------------------------------------ names and checks ----
def test_resolve_device_and_dtype():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device(None) == resolve_device("auto")
    assert resolve_dtype("bfloat16") is torch.bfloat16 and resolve_dtype(None) is torch.float32
    with pytest.raises(ValueError, match="expected auto, cpu"):
        resolve_device("gpu")
    with pytest.raises(ValueError, match="expected one of"):
        resolve_dtype("float8")
    if NO_CUDA:
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda:1")


def test_config_fields_and_their_defaults():
    cfg = RunConfig()
    assert (cfg.model.device, cfg.model.dtype, cfg.rollout.device, cfg.rollout.dtype) == ("auto", "float32", None, None)
    with pytest.raises(ValueError, match="model.device"):
        RunConfig.model_validate({"model": {"device": "gpu0"}})
    cfg = RunConfig.model_validate(
        {"model": {"device": "cpu", "dtype": "bfloat16"}, "opd": {"teachers": [{"name": "t", "dtype": "float32"}]}}
    )
    learner = learner_placement(cfg)
    assert learner == Placement(torch.device("cpu"), torch.bfloat16)
    assert rollout_placement(cfg) == learner  # null: as the learner
    assert teacher_placement(cfg, cfg.opd.teachers[0]) == Placement(torch.device("cpu"), torch.float32)
    section, place = rollout_backend_args(cfg)
    assert section.dtype == "bfloat16" and place == learner  # the vLLM engine is built in the learner's dtype


@pytest.mark.skipif(not NO_CUDA, reason="checks a machine without CUDA")
def test_preflight_names_a_device_this_machine_does_not_have(tmp_path):
    from mentorrl.train.pipeline import preflight_config

    for over, field in (
        ({"model": {"device": "cuda"}}, "model.device"),
        ({"rollout": {"device": "cuda:0"}}, "rollout.device"),
        ({"opd": {"teachers": [{"device": "cuda"}]}}, "opd.teachers[0].device"),
        ({"model": {"device": "cpu", "dtype": "float16"}}, "model.dtype"),
    ):
        cfg = RunConfig.model_validate({"run_dir": str(tmp_path / "run"), **over})
        with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
            preflight_config(cfg)
        assert not (tmp_path / "run").exists()  # checked before anything is written
    ok = RunConfig.model_validate({"run_dir": str(tmp_path / "ok"), "rollout": {"device": "cpu", "dtype": "float16"}})
    assert placement_problems(ok) == []  # float16 inference on the CPU is allowed


def test_grad_scaler_only_for_float16_on_a_gpu():
    cpu = torch.device("cpu")
    assert grad_scaler(cpu, torch.float16) is None and grad_scaler(cpu, torch.bfloat16) is None
    if not NO_CUDA:
        assert grad_scaler(torch.device("cuda", 0), torch.float16) is not None


# ------------------------------------------------------------------ the learner in mixed precision ----
def test_bf16_learner_keeps_fp32_weights_and_state_and_runs_its_forward_in_bf16(make_demos, model, tokenizer):
    _, demos = make_demos(4)
    seen: list[torch.dtype] = []
    grads = {}
    for prec in ("float32", "bfloat16"):
        m = copy.deepcopy(model)
        hook = m.model.layers[0].mlp.down_proj.register_forward_hook(lambda mod, i, o: seen.append(o.dtype))
        learner = Learner(m, OptimConfig(lr=1e-3, max_grad_norm=1e9), tokenizer.pad_token_id, precision=prec)
        metrics = learner.sft_step(demos)
        hook.remove()
        assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])
        assert all(p.dtype == torch.float32 for p in m.parameters())
        state = learner.optimizer.state_dict()["state"]
        assert all(v.dtype == torch.float32 for s in state.values() for k, v in s.items() if k != "step")
        grads[prec] = torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
    assert seen[0] == torch.float32 and seen[-1] == torch.bfloat16
    cos = torch.nn.functional.cosine_similarity(grads["float32"], grads["bfloat16"], dim=0)
    assert cos > 0.99  # the same update, to bf16 rounding


def test_autocast_context_is_nothing_for_float32():
    with autocast(torch.device("cpu"), torch.float32):
        assert not torch.is_autocast_enabled("cpu")
    with autocast(torch.device("cpu"), torch.bfloat16):
        assert torch.is_autocast_enabled("cpu")


# ------------------------------------------------------------------ a rollout in another dtype ----
def _rollout(contract, orders_entry, placement) -> Rollout:
    return Rollout(contract, orders_entry.make_env, None, BackendChoice(None, placement))


def test_bf16_rollout_decodes_a_synced_copy_and_leaves_the_learner_in_fp32(
    tool_happy_model, make_contract, orders_entry, orders_tasks, tokenizer
):
    model = copy.deepcopy(tool_happy_model)
    choice = BackendChoice(None, Placement(torch.device("cpu"), torch.bfloat16))
    copy1 = choice.placed(model)
    assert copy1 is not model and next(copy1.parameters()).dtype == torch.bfloat16
    assert next(model.parameters()).dtype == torch.float32
    assert choice.placed(model) is copy1  # unchanged weights: the same copy, not re-copied
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # an optimizer step changes parameters in place
    again = choice.placed(model)
    assert again is copy1
    assert torch.equal(next(again.parameters()), next(model.parameters()).to(torch.bfloat16))
    # the same placement as the model's: the model itself, no copy
    assert BackendChoice(None, Placement(torch.device("cpu"), torch.float32)).placed(model) is model
    assert BackendChoice(None, None).placed(model) is model


def _behaviour_gap(model, trajs, pad_id, temperature):
    from mentorrl.models.batch import collate, forward_logprobs

    mb = collate(trajs, pad_id)
    with torch.no_grad():
        lp, _ = forward_logprobs(model, mb, temperature)
    return logprob_gap_metrics(mb.old_logprobs, lp, mb.loss_mask)


def test_the_bf16_rollout_gap_is_measured_and_the_masked_is_correction_keeps_training_stable(
    tool_happy_model, make_contract, orders_entry, orders_tasks, tokenizer
):
    """An fp32 learner trained on a bf16 rollout's trajectories: the gap of their behaviour log-probs
    to the learner's is logged (and is zero for an fp32 rollout), and a few masked-IS updates (SAO's
    loss) stay finite with bounded ratios, reporting the masked share."""
    contract = make_contract(temperature=1.0, max_new_tokens=16, max_turns=3, max_total_tokens=1024)
    tasks = orders_tasks[:6]
    model = copy.deepcopy(tool_happy_model)
    gaps = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        trajs = _rollout(contract, orders_entry, Placement(torch.device("cpu"), dtype)).run(model, tasks, seed=3)
        assert all(t.num_policy_tokens > 0 for t in trajs)
        gaps[name] = (_behaviour_gap(model, trajs, contract.pad_token_id, 1.0), trajs)
    assert gaps["float32"][0]["logprob_abs_gap"] < 1e-3
    assert gaps["bfloat16"][0]["logprob_abs_gap"] > 10 * max(gaps["float32"][0]["logprob_abs_gap"], 1e-5)
    trajs = gaps["bfloat16"][1]
    learner = Learner(model, OptimConfig(lr=1e-4, micro_batch_size=3), contract.pad_token_id, 1.0)
    adv = [torch.randn(len(t.token_ids), generator=torch.Generator().manual_seed(i)) for i, t in enumerate(trajs)]
    adv = [a * torch.tensor(t.loss_mask) for a, t in zip(adv, trajs)]
    for _ in range(3):
        m = learner.token_policy_step(trajs, adv, "masked_is", eps_low=0.2, eps_high=0.28)
        for k in ("pg_loss", "grad_norm", "logprob_abs_gap", "train_rollout_kl", "masked_frac", "ratio_max"):
            assert math.isfinite(m[k]), (k, m)
        assert 0.0 <= m["masked_frac"] <= 1.0
        assert m["skipped_update"] == 0.0
    assert m["logprob_abs_gap"] > 0 and m["train_rollout_kl"] >= 0
    assert all(p.dtype == torch.float32 and bool(torch.isfinite(p).all()) for p in model.parameters())


def test_grpo_run_with_a_bf16_rollout_and_an_fp32_learner_logs_the_gap(tiny_model_dir, tmp_path):
    """A short GRPO run, rollout in bfloat16 (a synced copy), learner in float32: every step's losses
    are finite, the clipped ratio stays bounded, and the train/rollout gap is logged per step."""
    from mentorrl.train.pipeline import run_recipe

    run = tmp_path / "run"
    cfg = RunConfig.model_validate(
        {
            "run_dir": str(run),
            "recipe": ["grpo"],
            "threads": 1,
            "model": {"path": str(tiny_model_dir), "device": "cpu", "dtype": "float32"},
            "rollout": {"dtype": "bfloat16"},
            "audit": {"preflight": False},
            "eval": {"num_tasks": 0},
            "sampling": {"max_new_tokens": 12},
            "limits": {"max_turns": 3, "max_total_tokens": 1024},
            # a KL term: every trajectory is trained on (and its gap measured), also at zero advantage
            "grpo": {"steps": 2, "tasks_per_step": 2, "samples_per_task": 2, "checkpoint_every": 2, "kl_coef": 0.01},
        }
    )
    run_recipe(cfg, show_progress=False)
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if r["stage"] == "grpo"]
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        for k in ("loss", "grad_norm", "logprob_abs_gap", "train_rollout_kl", "clip_frac"):
            if k in r:
                assert math.isfinite(r[k]), (k, r)
        assert "logprob_abs_gap" in r and "train_rollout_kl" in r
        assert 0.0 <= r.get("clip_frac", 0.0) <= 1.0
    assert any(r["logprob_abs_gap"] > 0 for r in recs)


def test_dtype_auto_is_chosen_by_a_probe_and_reported(monkeypatch):
    """``model.dtype: auto`` takes bfloat16 on a CPU only where the measured bf16 matmul is fast enough."""
    from mentorrl.config.model import ModelConfig
    from mentorrl.models import device as dev

    assert ModelConfig(dtype="auto").dtype == "auto"
    for fast, want in ((6.0, torch.bfloat16), (0.07, torch.float32)):
        dev._choose_dtype.cache_clear()
        rates = {torch.float32: 100.0, torch.bfloat16: 100.0 * fast}
        monkeypatch.setattr(dev, "matmul_rate", lambda dtype, device, **_: rates[dtype])
        choice = dev.choose_dtype(torch.device("cpu"))
        assert choice.dtype == want and choice.bf16_speedup == pytest.approx(fast, abs=0.01)
        assert dev.resolve_dtype("auto", torch.device("cpu")) == want
        assert dev.Placement.of("cpu", "auto").dtype == want
        assert json.dumps(choice.to_dict())
    dev._choose_dtype.cache_clear()


def test_the_matmul_probe_measures_a_rate():
    from mentorrl.models.device import matmul_rate

    assert matmul_rate(torch.float32, torch.device("cpu"), n=64, min_s=0.001) > 0


def test_a_run_decides_dtype_auto_once_and_a_resume_keeps_its_choice(monkeypatch, tmp_path):
    """The probe is a timing: the run probes once, records the choice, and a resumed run (or another rank)
    computes in that dtype even when its own probe would now measure otherwise."""
    import io
    from types import SimpleNamespace

    from rich.console import Console

    from mentorrl.config import load_config
    from mentorrl.models import device as dev
    from mentorrl.train.pipeline import report_precision

    monkeypatch.setattr(dev, "_PINNED", dev.PinnedChoices())
    out = io.StringIO()
    ws = SimpleNamespace(
        cfg=load_config(None, ["model.dtype=auto", "model.device=cpu"]),
        run_dir=tmp_path,
        console=Console(file=out, width=200),
        on_main=lambda fn: fn(),
    )

    def probe_measures(fast: float) -> None:
        dev._PINNED.clear()
        dev._choose_dtype.cache_clear()
        rates = {torch.float32: 100.0, torch.bfloat16: 100.0 * fast}
        monkeypatch.setattr(dev, "matmul_rate", lambda dtype, device, **_: rates[dtype])

    probe_measures(6.0)
    report_precision(ws)
    assert json.loads((tmp_path / "precision.json").read_text())["dtype"] == "bfloat16"
    probe_measures(0.07)  # a busy machine, at the resume: the probe alone would now take float32
    report_precision(ws, resume=True)
    assert dev.resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16
    assert "bfloat16 (the run's recorded choice)" in out.getvalue()
    probe_measures(0.07)
    report_precision(ws)  # a fresh run probes again
    assert dev.resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert json.loads((tmp_path / "precision.json").read_text())["dtype"] == "float32"
    dev._choose_dtype.cache_clear()
