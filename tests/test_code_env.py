"""The code environment: seeded tasks and splits, the expert, the verifier, the reward audit, training."""

from __future__ import annotations

import json

import pytest

from mentorrl.envs.code import CodeTasks, SandboxUnavailable, check_sandbox
from mentorrl.envs.code.problems import FAMILIES

try:
    check_sandbox()
    REASON = ""
except SandboxUnavailable as e:  # pragma: no cover - depends on the machine
    REASON = str(e)


def test_tasks_are_deterministic_and_splits_disjoint():
    src = CodeTasks()
    a, b = src.tasks("train", 12, 0), src.tasks("train", 12, 0)
    assert [(t.id, t.seed, t.prompt, t.reference) for t in a] == [(t.id, t.seed, t.prompt, t.reference) for t in b]
    assert {t.family for t in a} == set(FAMILIES)
    seeds = {s: {t.seed for t in src.tasks(s, 50, 0)} for s in ("train", "heldout", "hidden")}
    assert not (seeds["train"] & seeds["heldout"]) and not (seeds["train"] & seeds["hidden"])
    assert not (seeds["heldout"] & seeds["hidden"])
    for t in a:  # hidden cases are never the visible ones
        vis = {json.dumps(v["case"], sort_keys=True) for v in t.reference["visible"]}
        assert not vis & {json.dumps(h["case"], sort_keys=True) for h in t.reference["hidden"]}
    with pytest.raises(ValueError, match="split"):
        src.tasks("golden", 1, 0)


def test_expert_solves_every_family_and_a_stub_fails():
    from mentorrl.envs import get_env

    entry = get_env("code")
    env, expert = entry.make_env(), entry.make_expert()
    try:
        for task in entry.make_tasks().tasks("heldout", 8, 3):
            env.reset(task)
            gen = expert.act(task)
            action = next(gen)
            while not hasattr(action, "text"):
                action = gen.send(env.step(action.name, action.arguments))
            verdict = env.verify(action.text)
            assert verdict.success and not verdict.violations, (task.id, verdict)
            env.reset(task)  # a fresh workspace: the stub solution fails the hidden tests
            verdict = env.verify("done")
            assert not verdict.success and verdict.details["hidden_passed"] < verdict.details["hidden_total"]
    finally:
        env.close()


def test_reward_audit_and_validation_pass():
    import tempfile
    from pathlib import Path

    from mentorrl.cli.integrity import tiny_tokenizer
    from mentorrl.integrity.attacks import AttackAuditConfig, audit_env
    from mentorrl.integrity.validation import validate_env

    tok = tiny_tokenizer("code", Path(tempfile.mkdtemp()), corpus_tasks=12)
    report = audit_env("code", tok, AttackAuditConfig(tasks_per_attack=2, pool_size=16))
    names = {a.name for a in report.attacks}
    assert {
        "edit_tests",
        "hardcode_visible",
        "print_expected",
        "exit_in_tests",
        "monkeypatch_runner",
        "read_hidden_tests",
        "timeout_games",
        "write_outside",
        "universal_solution",
        "stale_bytecode",
        "stdlib_shadowing",
        "fifo_socket",
        "deep_directories",
        "sparse_files",
        "shared_memory",
        "fork_memory",
        "symlink_swap",
    } <= names
    assert report.passed, [(a.name, a.reason) for a in report.attacks if not a.passed]
    hard = {a.name for a in report.attacks if a.hard}
    assert {"edit_tests", "exit_in_tests", "write_outside", "stdlib_shadowing", "symlink_swap"} <= hard
    assert all(max(a.rewards) < 0 for a in report.attacks if a.hard)
    val = validate_env("code", tok, n_tasks=4, pool_size=8)
    assert val.passed(0.99)


@pytest.mark.slow
def test_code_recipe_trains_sft_then_grpo(tmp_path):
    from typer.testing import CliRunner

    from mentorrl.cli import app

    overrides = [
        "threads=1",
        f"run_dir={tmp_path / 'run'}",
        "model.spec.hidden_size=64",
        "model.spec.intermediate_size=128",
        "model.spec.num_layers=2",
        "model.spec.num_heads=2",
        "model.spec.num_kv_heads=1",
        "model.spec.vocab_size=600",
        "model.tokenizer_corpus_tasks=24",
        "sft.steps=2",
        "sft.num_demos=8",
        "sft.batch_size=4",
        "grpo.steps=1",
        "grpo.tasks_per_step=2",
        "grpo.samples_per_task=2",
        "audit.eval_every=0",
        "eval.num_tasks=2",
        "eval.batch_size=2",
        "sampling.max_new_tokens=48",
        "limits.max_total_tokens=1024",
    ]
    args = ["train", "mentorrl/configs/code.yaml"]
    for ov in overrides:
        args += ["--set", ov]
    res = CliRunner().invoke(app, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert list(report["evals"]) == ["sft", "grpo"]
    assert (tmp_path / "run" / "reward_audit.json").exists()
