"""LoRA adapters through peft (``model.lora``): only the adapters train, the engine and the learner
agree on a LoRA policy's log-probs, the merged weights a vLLM engine gets are the adapted model's,
checkpoints resume exactly, stages train the same adapters one after another, and
``mentorrl export-merged`` writes a plain checkpoint."""

from __future__ import annotations

import copy
import io
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from rich.console import Console

pytest.importorskip("peft")

from mentorrl.config import ConfigError, LoraSpec, OptimConfig, load_config  # noqa: E402
from mentorrl.models.batch import collate, forward_logprobs  # noqa: E402
from mentorrl.models.lora import (  # noqa: E402
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    apply_lora,
    export_merged,
    load_adapter_weights,
    validate_target_modules,
)
from mentorrl.rollout.adapters import base_module, merged_state_dict, save_merged  # noqa: E402
from mentorrl.train.consistency import logprob_gap_metrics  # noqa: E402
from mentorrl.train.learner import Learner  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SPEC = LoraSpec(r=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])


def _adapted(model, spec=SPEC, base_path=None, seed=0):
    return apply_lora(copy.deepcopy(model), spec, base_path=base_path, seed=seed)


def _nudge(model, seed: int = 1) -> None:
    """Give every adapter a visible update (a fresh adapter's B is zero: it changes nothing)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def _learner_logprobs(model, trajs, pad_id: int, pack=False) -> tuple[torch.Tensor, torch.Tensor]:
    mb = collate(trajs, pad_id)
    with torch.no_grad():
        lp, _ = forward_logprobs(model, mb, pack=pack)
    return lp, mb


# ------------------------------------------------------------------ config and wrapping ---
def test_target_modules_are_checked_against_the_model(model):
    validate_target_modules(model, ["q_proj", "model.layers.0.mlp.up_proj"])
    with pytest.raises(ConfigError, match=r"model\.lora\.target_modules: 'qkv' matches no module.*q_proj"):
        validate_target_modules(model, ["q_proj", "qkv"])
    with pytest.raises(ConfigError, match=r"model\.lora\.target_modules: 'input_layernorm' selects .*not a Linear"):
        validate_target_modules(model, ["input_layernorm"])
    with pytest.raises(ConfigError, match="target_modules"):
        apply_lora(copy.deepcopy(model), LoraSpec(target_modules=["nope"]))
    # the tiny model ties its embeddings: an adapter on one end has no merged equivalent
    with pytest.raises(ConfigError, match=r"'embed_tokens' selects model\.embed_tokens, whose weight is tied"):
        validate_target_modules(model, ["embed_tokens"])
    with pytest.raises(ConfigError, match="lm_head, whose weight is tied"):
        validate_target_modules(model, ["lm_head"])
    cfg = load_config(None, ["model.lora.r=4"])
    assert cfg.model.lora.r == 4 and "q_proj" in cfg.model.lora.target_modules
    assert load_config(None).model.lora is None


def test_only_the_adapters_train_and_the_optimizer_holds_only_theirs(model, tokenizer, make_demos):
    pm = _adapted(model)
    base_before = {k: v.clone() for k, v in base_module(pm).state_dict().items() if "lora_" not in k}
    learner = Learner(pm, OptimConfig(lr=1e-2, micro_batch_size=2), pad_id=tokenizer.pad_token_id)
    adapters = {n: p for n, p in pm.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    group = learner.optimizer.param_groups[0]["params"]
    assert len(group) == len(adapters) and {id(p) for p in group} == {id(p) for p in adapters.values()}
    _, demos = make_demos(4)
    m = learner.sft_step(demos)
    assert m["grad_norm"] > 0
    state = learner.optimizer.state_dict()["state"]
    assert len(state) == len(adapters)  # AdamW moments for the adapters only
    sizes = sorted(s["exp_avg"].numel() for s in state.values())
    assert sizes == sorted(p.numel() for p in adapters.values())
    assert sum(sizes) < 0.2 * sum(p.numel() for p in pm.parameters())
    after = base_module(pm).state_dict()
    assert all(torch.equal(after[k], v) for k, v in base_before.items())  # the base is frozen
    assert any(float(p.detach().abs().sum()) > 0 for n, p in pm.named_parameters() if "lora_B" in n)


# ------------------------------------------------------------------ rollout == learner ---
@pytest.mark.parametrize("decoder", ["slots", "hf"])
def test_rollout_logprobs_equal_the_learners_after_an_update(model, tokenizer, make_contract, make_demos, decoder):
    from engine_helpers import engine_run

    from mentorrl.envs import get_env
    from mentorrl.rollout.decoders import slot_decoder_checks

    pm = _adapted(model)
    learner = Learner(pm, OptimConfig(lr=5e-2, micro_batch_size=4), pad_id=tokenizer.pad_token_id)
    _, demos = make_demos(4)
    learner.sft_step(demos)  # the adapters now change the model's outputs
    base = copy.deepcopy(model)
    assert not torch.allclose(
        _learner_logprobs(pm, demos[:2], tokenizer.pad_token_id)[0],
        _learner_logprobs(base, demos[:2], tokenizer.pad_token_id)[0],
    )
    if decoder == "slots":
        assert slot_decoder_checks(pm) is None  # the slot decoder runs the peft model's modules, adapters applied
    entry = get_env("orders")
    tasks = entry.make_tasks().tasks(split="train", n=3, seed=0)
    contract = make_contract(max_new_tokens=16, max_turns=2)
    _, trajs = engine_run(pm, contract, entry, tasks, seed=3, decoder=decoder)  # "slots": SlotDecoder or an error
    trajs = [t for t in trajs if sum(t.loss_mask) > 0]
    assert trajs
    for pack in (False, True):
        lp, mb = _learner_logprobs(pm, trajs, tokenizer.pad_token_id, pack=pack)
        gap = logprob_gap_metrics(mb.old_logprobs, lp, mb.loss_mask)
        assert gap["logprob_abs_gap"] < 1e-4, (pack, gap)


# ------------------------------------------------------------------ weight sync (vLLM) ---
def test_merged_weights_are_merge_and_unloads_and_a_plain_model_scores_the_same(model, tokenizer, make_demos, tmp_path):
    from transformers import AutoModelForCausalLM

    pm = _adapted(model, LoraSpec(r=4, target_modules=["q_proj", "k_proj", "o_proj", "gate_proj"]))
    _nudge(pm)
    state = merged_state_dict(pm)
    want = copy.deepcopy(pm).merge_and_unload().state_dict()
    assert set(state) == set(want)
    assert all(torch.equal(state[k], want[k]) for k in want)
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()  # still tied
    assert any(not torch.equal(state[k], v) for k, v in model.state_dict().items())  # the adapters are in them
    assert all(p.requires_grad for n, p in pm.named_parameters() if "lora_" in n)  # the peft model is untouched

    # "sync": a plain model of the base architecture takes the merged weights (what the vLLM worker loads)
    _, demos = make_demos(3)
    want_lp, mb = _learner_logprobs(pm, demos, tokenizer.pad_token_id)
    plain = AutoModelForCausalLM.from_config(model.config)
    plain.load_state_dict(state)
    got_lp, _ = _learner_logprobs(plain.eval(), demos, tokenizer.pad_token_id)
    assert logprob_gap_metrics(want_lp, got_lp, mb.loss_mask)["logprob_abs_gap"] < 1e-5
    # the engine's first copy: a plain directory of the merged model
    loaded = AutoModelForCausalLM.from_pretrained(save_merged(pm, tmp_path / "served"), dtype=torch.float32)
    got_lp, _ = _learner_logprobs(loaded.eval(), demos, tokenizer.pad_token_id)
    assert logprob_gap_metrics(want_lp, got_lp, mb.loss_mask)["logprob_abs_gap"] < 1e-5


def test_vllm_backend_serves_merged_weights(model, monkeypatch):
    """The vLLM engine's weight pushes carry the merged weights under the base model's names."""
    from mentorrl.rollout.backends import vllm as vllm_backend

    pm = _adapted(model)
    _nudge(pm)
    pushed = {}

    class Fake(vllm_backend.VLLMBackend):
        def __init__(self):  # no engine: only follow() and what it hands to _load
            self._lock, self._local, self._held, self.version = threading.RLock(), threading.local(), None, 0

        def _load(self, want):
            pushed.update(want.state())
            self._held = want.key

    Fake().follow(pm, 1)
    want = copy.deepcopy(pm).merge_and_unload().state_dict()
    assert set(pushed) == set(want) and all(torch.equal(pushed[k], want[k]) for k in want)


# ------------------------------------------------------------------ checkpoints ---
class Interrupt(Exception):
    pass


@pytest.fixture
def workspace(tmp_path, tokenizer, orders_entry):
    from mentorrl.train.workspace import Workspace

    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}"])
    ws = Workspace(
        cfg=cfg,
        run_dir=tmp_path / "run",
        env_entry=orders_entry,
        tokenizer=tokenizer,
        console=Console(file=io.StringIO(), width=200),
        show_progress=False,
    )
    ws.run_dir.mkdir(parents=True)
    return ws


def _sft_stage(ws, model, make_demos, tokenizer, steps, resume, crash_at=None, base_path=None):
    from mentorrl.train.loop import run_stage

    pm = _adapted(model, base_path=base_path)
    learner = Learner(pm, OptimConfig(lr=1e-2, micro_batch_size=2, warmup_steps=2), pad_id=tokenizer.pad_token_id)
    _, demos = make_demos(8)

    def step_fn(step: int) -> dict:
        if crash_at is not None and step == crash_at:
            raise Interrupt
        return learner.sft_step(demos[2 * (step % 4) : 2 * (step % 4) + 2])

    final = run_stage(ws, "sft", pm, learner, steps, step_fn, 2, resume)
    return pm, learner, final


def _adapter_state(pm) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in pm.named_parameters() if "lora_" in n}


def test_adapter_checkpoints_resume_exactly(workspace, model, tokenizer, make_demos, tmp_path, tiny_model_dir):
    ws = workspace
    with pytest.raises(Interrupt):
        _sft_stage(ws, model, make_demos, tokenizer, steps=4, resume=False, crash_at=3, base_path=tiny_model_dir)
    ckpt = ws.run_dir / "sft" / "checkpoints" / "step-000002"
    assert (ckpt / ADAPTER_WEIGHTS).is_file() and not (ckpt / "model.safetensors").exists()
    assert json.loads((ckpt / ADAPTER_CONFIG).read_text())["base_model_name_or_path"] == str(tiny_model_dir.resolve())
    resumed, learner, final = _sft_stage(
        ws, model, make_demos, tokenizer, steps=4, resume=True, base_path=tiny_model_dir
    )
    assert "resuming from step-000002" in ws.console.file.getvalue()

    ws2 = copy.copy(ws)
    ws2.run_dir = tmp_path / "straight"
    ws2.run_dir.mkdir()
    straight, learner2, _ = _sft_stage(
        ws2, model, make_demos, tokenizer, steps=4, resume=False, base_path=tiny_model_dir
    )
    a, b = _adapter_state(resumed), _adapter_state(straight)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    s1, s2 = learner.optimizer.state_dict()["state"], learner2.optimizer.state_dict()["state"]
    assert s1.keys() == s2.keys() and all(torch.equal(s1[i]["exp_avg_sq"], s2[i]["exp_avg_sq"]) for i in s1)
    assert (final / ADAPTER_WEIGHTS).is_file() and (final / "DONE").is_file()

    # a config changed to full fine-tuning is named, and no checkpoint is moved aside as damaged
    from mentorrl.train.loop import run_stage

    full = copy.deepcopy(model)
    with pytest.raises(ConfigError, match="model.lora is null, but .* holds a LoRA adapter"):
        run_stage(ws, "sft", full, Learner(full, OptimConfig(), pad_id=0), 4, lambda s: {}, 2, True)
    assert not [p for p in (ws.run_dir / "sft" / "checkpoints").iterdir() if p.name.startswith("corrupt")]

    # the final dir restores the same adapters into a fresh adapted model; a mismatched one is named
    fresh = _adapted(model)
    load_adapter_weights(fresh, final)
    assert all(torch.equal(v, _adapter_state(fresh)[k]) for k, v in a.items())
    with pytest.raises(ValueError, match="lora_alpha|r "):
        load_adapter_weights(_adapted(model, LoraSpec(r=2, target_modules=SPEC.target_modules)), final)


def test_a_lora_policys_critic_trains_its_adapters_and_head_only(model):
    from mentorrl.models.value import ValueModel

    critic = ValueModel.from_policy(_adapted(model))
    train = [n for n, p in critic.named_parameters() if p.requires_grad]
    assert train and all("lora_" in n or n.startswith("head.") for n in train)
    assert "head.weight" in train
    full = ValueModel.from_policy(copy.deepcopy(model))  # a full policy's critic: every weight trains
    assert all(p.requires_grad for p in full.parameters())


# ------------------------------------------------------------------ stages and export ---
def test_stages_train_the_same_adapters_and_export_merged(tiny_model_dir, model, tokenizer, make_demos, tmp_path):
    """sft -> grpo -> ppo with ``model.lora`` for two steps each: the base never changes, each stage
    moves the adapters, PPO's critic trains only its own adapters and head; ``export-merged`` writes a
    plain model that scores like the adapted one."""
    from transformers import AutoModelForCausalLM

    from mentorrl.config import RunConfig
    from mentorrl.models.lora import load_adapted
    from mentorrl.train.pipeline import run_recipe

    run = tmp_path / "run"
    cfg = RunConfig.model_validate(
        {
            "run_dir": str(run),
            "recipe": ["sft", "grpo", "ppo"],
            "threads": 1,
            "model": {
                "path": str(tiny_model_dir),
                "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
            },
            "audit": {"preflight": False},
            "eval": {"num_tasks": 0},
            "sampling": {"max_new_tokens": 12},
            "limits": {"max_turns": 2, "max_total_tokens": 1024},
            "sft": {"steps": 2, "num_demos": 8, "batch_size": 4, "optim": {"lr": 1e-2}},
            # weight decay moves every weight the optimizer holds at each update, whatever the rewards
            "grpo": {
                "steps": 2,
                "tasks_per_step": 2,
                "samples_per_task": 2,
                "kl_coef": 0.1,
                "optim": {"weight_decay": 0.5},
            },
            "ppo": {
                "steps": 2,
                "tasks_per_step": 2,
                "critic": {"warmup_steps": 0, "steps": 1, "optim": {"weight_decay": 0.5}},
                "optim": {"weight_decay": 0.5},
            },
        }
    )
    run_recipe(cfg, show_progress=False)
    finals = {s: run / s / "final" for s in cfg.recipe}
    for d in finals.values():
        assert (d / ADAPTER_WEIGHTS).is_file() and (d / "DONE").is_file() and not (d / "model.safetensors").exists()
        assert json.loads((d / ADAPTER_CONFIG).read_text())["base_model_name_or_path"] == str(tiny_model_dir.resolve())
    adapters = {s: load_adapted(d) for s, d in finals.items()}
    states = {s: _adapter_state(m) for s, m in adapters.items()}
    for a, b in (("sft", "grpo"), ("grpo", "ppo")):
        assert states[a].keys() == states[b].keys()
        assert any(not torch.equal(states[a][k], states[b][k]) for k in states[a]), f"{b} did not train the adapters"
    base = {k: v for k, v in model.state_dict().items()}
    for m in adapters.values():  # the base weights the adapters sit on are the checkpoint's
        merged_free = {
            k.replace(".base_layer.", "."): v for k, v in base_module(m).state_dict().items() if "lora_" not in k
        }
        assert all(torch.equal(merged_free[k], v) for k, v in base.items())
    from safetensors.torch import load_file

    critic = load_file(str(run / "ppo" / "critic" / "value_model.safetensors"))
    frozen = {k.replace("decoder.", "model.", 1).replace(".base_layer.", "."): v for k, v in critic.items()}
    start = {k.replace("decoder.", "base_model.model.model.", 1): k for k in critic if "lora_" in k}
    assert start and set(start) <= set(states["grpo"])  # its adapters: a copy of the policy's at PPO's start
    assert any(not torch.equal(critic[k], states["grpo"][n]) for n, k in start.items())  # ... trained since
    assert all(torch.equal(frozen[k], v) for k, v in base.items() if k in frozen)  # the critic's base stayed frozen

    # export-merged (the command line) on the run dir: its last stage, merged, loads as a plain model
    out = tmp_path / "merged"
    res = subprocess.run(
        [sys.executable, "-m", "mentorrl.cli", "export-merged", str(run), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "adapter merged" in res.stdout and str(finals["ppo"]) in res.stdout.replace("\n", "")
    plain = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert not any("lora" in k for k in plain.state_dict())
    _, demos = make_demos(3)
    want, mb = _learner_logprobs(adapters["ppo"], demos, tokenizer.pad_token_id)
    got, _ = _learner_logprobs(plain, demos, tokenizer.pad_token_id)
    assert logprob_gap_metrics(want, got, mb.loss_mask)["logprob_abs_gap"] < 1e-5
    assert (out / "tokenizer.json").is_file()
    # a final dir loads as it is too (transformers' peft integration: the base it names + the adapter)
    direct = AutoModelForCausalLM.from_pretrained(finals["ppo"], dtype=torch.float32).eval()
    got, _ = _learner_logprobs(direct, demos, tokenizer.pad_token_id)
    assert logprob_gap_metrics(want, got, mb.loss_mask)["logprob_abs_gap"] < 1e-5
    assert export_merged(finals["sft"], tmp_path / "sft_merged") == tmp_path / "sft_merged"
