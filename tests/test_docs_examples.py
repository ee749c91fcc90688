"""The worked examples of the "extending" guides (docs/examples/, included in docs/extending/*.md)
run here, so the guides cannot drift from the code. Small and fast: the shipped tiny base, no downloads."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "docs" / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # pydantic resolves the example's annotations through its module
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def shipped_tokenizer():
    from transformers import AutoTokenizer

    from mentorrl.models.shipped import SHIPPED_ROOT

    return AutoTokenizer.from_pretrained(SHIPPED_ROOT / "orders-tiny")


def test_every_example_is_included_in_a_guide():
    pages = [*(ROOT / "docs" / "extending").glob("*.md"), *(ROOT / "docs").glob("bring-your-*.md")]
    guides = "".join(p.read_text() for p in pages)
    for example in EXAMPLES.glob("*.py"):
        assert f'--8<-- "{example.name}"' in guides, f"{example.name} is not included in any guide"


def test_environment_example_rewards_the_expert_and_not_the_claim(shipped_tokenizer):
    from mentorrl.contract import contract_for_env
    from mentorrl.envs import get_env
    from mentorrl.rollout.episode import run_scripted_episode, run_text_turns

    mod = _load("notes_env")
    mod.register()
    mod.register()  # idempotent
    entry = get_env("notes")
    env = entry.make_env()
    contract = contract_for_env(shipped_tokenizer, env)
    tasks = entry.make_tasks().tasks("train", 6, seed=0)
    assert {t.family for t in tasks} == {"read", "set"}
    assert [t.id for t in entry.make_tasks().tasks("heldout", 6, seed=0)] != [t.id for t in tasks]
    for task in tasks:
        honest = run_scripted_episode(contract, env, task, entry.make_expert())
        cheat = run_text_turns(contract, env, task, ["Done, all taken care of."])
        assert honest.reward.success and honest.reward.total > 1.0, task
        assert not cheat.reward.success and cheat.reward.total <= 0.0, task
    bad = run_text_turns(
        contract, env, tasks[0], ['<tool_call>{"name": "get_note", "arguments": {"key": 3}}</tool_call>']
    )
    assert bad.tool_calls and not bad.tool_calls[0].ok  # bad arguments are an observation, not a crash
    env.close()


def test_loss_example_checks_and_trains(policy_and_trajs):
    from mentorrl.algos.losses import POLICY_LOSSES
    from mentorrl.config import OptimConfig
    from mentorrl.train.learner import Learner

    mod = _load("seq_clipped_loss")
    mod.check()
    assert POLICY_LOSSES["seq_clipped"].__name__ == "sequence_clipped_loss"
    tokenizer, model, trajs = policy_and_trajs
    model = copy.deepcopy(model)
    before = [p.detach().clone() for p in model.parameters()]
    learner = Learner(model, OptimConfig(lr=1e-3, micro_batch_size=2), tokenizer.pad_token_id)
    m = learner.policy_step(
        trajs, torch.ones(len(trajs)), loss_name="seq_clipped", agg="seq-mean-token-mean", eps_low=10.0, eps_high=10.0
    )
    assert all(torch.isfinite(torch.tensor(v)) for v in (m["pg_loss"], m["grad_norm"]))
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.fixture(scope="module")
def policy_and_trajs():
    """The shipped tiny base and three scripted expert trajectories of the orders environment."""
    from mentorrl.contract import contract_for_env
    from mentorrl.envs import get_env
    from mentorrl.models.build import load_policy
    from mentorrl.models.shipped import SHIPPED_ROOT
    from mentorrl.rollout.episode import run_scripted_episode

    tokenizer, model = load_policy(SHIPPED_ROOT / "orders-tiny")
    entry = get_env("orders")
    env = entry.make_env()
    contract = contract_for_env(tokenizer, env)
    trajs = [
        run_scripted_episode(contract, env, t, entry.make_expert()) for t in entry.make_tasks().tasks("train", 3, 0)
    ]
    env.close()
    return tokenizer, model, trajs


def test_stage_example_runs_checkpoints_and_resumes(tmp_path, policy_and_trajs):
    from mentorrl.config import ConfigError, load_config
    from mentorrl.train.registry import get_stage, resolve_runner, unregister_stage

    mod = _load("self_imitation_stage")
    try:
        # the module alone registers the stage and its section: a recipe may name and configure it
        assert resolve_runner(get_stage("self_imitation")).stage_cls is mod.SelfImitationStage
        cfg = load_config(None, ["recipe=[sft, self_imitation]", "self_imitation.steps=3"])
        assert cfg.recipe == ["sft", "self_imitation"] and cfg.self_imitation.steps == 3
        with pytest.raises(ConfigError, match="self_imitation.stpes"):
            load_config(None, ["recipe=[self_imitation]", "self_imitation.stpes=3"])
        _run_stage_example(mod, tmp_path, policy_and_trajs)
    finally:
        unregister_stage("self_imitation")
    with pytest.raises(ConfigError, match="unknown stage"):
        load_config(None, ["recipe=[sft, self_imitation]"])


def _example_ws(tmp_path, name, tokenizer, *overrides):
    from mentorrl.config import load_config
    from mentorrl.train.workspace import open_workspace

    cfg = load_config(
        None,
        [
            f"run_dir={tmp_path / name}",
            "threads=1",
            "sampling.max_new_tokens=48",
            "limits.max_turns=3",
            "recipe=[self_imitation]",
            *overrides,
        ],
    )
    ws = open_workspace(cfg, show_progress=False)
    ws.bind_tokenizer(tokenizer)
    return ws


def _run_stage_example(mod, tmp_path, policy_and_trajs):
    from mentorrl.train.registry import get_stage, resolve_runner

    tokenizer, model, expert_trajs = policy_and_trajs
    run = resolve_runner(get_stage("self_imitation"))
    ws = _example_ws(
        tmp_path,
        "run",
        tokenizer,
        "self_imitation.steps=2",
        "self_imitation.tasks_per_step=2",
        "self_imitation.checkpoint_every=1",
    )
    final = run(ws, copy.deepcopy(model))
    assert (final / "DONE").exists() and (final / "model.safetensors").exists()
    recs = [json.loads(x) for x in (ws.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["stage"], r["step"]) for r in recs] == [("self_imitation", 1), ("self_imitation", 2)]
    assert run(ws, copy.deepcopy(model), resume=True) == final  # complete: loaded

    class Imitating(mod.SelfImitationStage):  # the update path: rollouts that succeed (the expert's)
        def rollout(self, b):
            b.trajs = expert_trajs

    from mentorrl.train.loop import RLLoop

    ws3 = _example_ws(tmp_path, "run3", tokenizer, "self_imitation.steps=1")
    RLLoop(Imitating(ws3, copy.deepcopy(model))).run()
    rec = json.loads((ws3.run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert rec["task_success"] > 0 and "loss" in rec and rec["policy_version"] == 1.0


def test_teacher_example_ranks_and_declares(shipped_tokenizer):
    from mentorrl.chat import trajectory_messages
    from mentorrl.contract import contract_for_env
    from mentorrl.envs import get_env
    from mentorrl.opd.remote_teacher import StudentEpisode
    from mentorrl.opd.teacher import MissingCapability, Teacher, require
    from mentorrl.rollout.episode import run_scripted_episode, run_text_turns

    mod = _load("rule_teacher")
    teacher = mod.RuleTeacher()
    assert isinstance(teacher, Teacher)
    entry = get_env("orders")
    env = entry.make_env()
    contract = contract_for_env(shipped_tokenizer, env)
    normal = [t for t in entry.make_tasks().tasks("train", 20, seed=0) if t.difficulty == "normal"][:3]
    for task in normal:
        eps = [
            StudentEpisode(task, t, trajectory_messages(t, shipped_tokenizer, contract.system_text(), task.prompt))
            for t in (
                run_scripted_episode(contract, env, task, entry.make_expert()),
                run_text_turns(contract, env, task, ["All done, nothing else needed."]),
            )
        ]
        expert, claim = teacher.rank(eps)
        assert expert > claim, task
        assert 0.0 <= claim <= expert <= 1.0
    env.close()
    require(teacher, ["ranking", "scoring"], "ranking")
    with pytest.raises(MissingCapability, match="step_critique"):
        require(teacher, ["step_critique", "sampling"], "correction")


def test_advantage_example_checks_and_a_recipe_picks_it():
    from mentorrl.algos.advantages import ADVANTAGE_ESTIMATORS, get_advantage_estimator
    from mentorrl.config import ConfigError, load_config

    mod = _load("rank_advantage")
    try:
        mod.check()
        assert get_advantage_estimator("rank") is mod.rank_advantages
        assert load_config(None, ["grpo.advantage=rank"]).grpo.advantage == "rank"
    finally:
        ADVANTAGE_ESTIMATORS.unregister("rank")
    with pytest.raises(ConfigError, match="unknown advantage estimator 'rank'"):
        load_config(None, ["grpo.advantage=rank"])


def test_rollout_backend_example_decodes_and_traces(tmp_path, monkeypatch, policy_and_trajs):
    from mentorrl.config import ConfigError, RolloutConfig, load_config
    from mentorrl.config.names import ROLLOUT_BACKENDS
    from mentorrl.contract import contract_for_env
    from mentorrl.envs import get_env
    from mentorrl.rollout.api import Rollout
    from mentorrl.rollout.backends import BackendChoice

    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("MENTORRL_TRACE", str(trace))
    mod = _load("traced_backend")
    try:
        mod.register()  # idempotent
        assert load_config(None, ["rollout.backend=hf_traced"]).rollout.backend == "hf_traced"
        tokenizer, model, _ = policy_and_trajs
        entry = get_env("orders")
        env = entry.make_env()
        contract = contract_for_env(tokenizer, env)
        env.close()
        tasks = entry.make_tasks().tasks("train", 3, seed=0)
        choice = BackendChoice(RolloutConfig(backend="hf_traced"))
        trajs = Rollout(contract, entry.make_env, None, choice).run(model, tasks, seed=0)
        lines = [json.loads(x) for x in trace.read_text().splitlines()]
        assert len(trajs) == 3 and sum(x["episodes"] for x in lines) == 3
        assert sum(x["policy_tokens"] for x in lines) == sum(t.num_policy_tokens for t in trajs)
    finally:
        ROLLOUT_BACKENDS.unregister("hf_traced")
    with pytest.raises(ConfigError, match="unknown rollout backend 'hf_traced'"):
        load_config(None, ["rollout.backend=hf_traced"])
