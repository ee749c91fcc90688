"""The preflight reward audit every recipe runs before training (audit.preflight, on by default)."""

import json

import pytest

from mentorrl.config import load_config
from mentorrl.train.pipeline import RewardAuditFailed, preflight_reward_audit
from mentorrl.train.workspace import open_workspace


def test_preflight_audit_runs_the_suite_and_writes_its_report(tmp_path, tokenizer):
    ws = open_workspace(load_config(None, [f"run_dir={tmp_path}", "threads=1"]), show_progress=False)
    ws.bind_tokenizer(tokenizer)
    out = preflight_reward_audit(ws)
    data = json.loads((tmp_path / "reward_audit.json").read_text())
    assert out is not None and data["attacks"] and all(a["passed"] for a in data["attacks"])


def test_preflight_audit_refuses_a_reward_that_pays_a_hack(tmp_path, tokenizer):
    # without the verbosity term a padded answer scores like honest work
    ws = open_workspace(
        load_config(None, [f"run_dir={tmp_path}", "threads=1", "reward.verbosity=0"]), show_progress=False
    )
    ws.bind_tokenizer(tokenizer)
    with pytest.raises(RewardAuditFailed, match="refusing to train"):
        preflight_reward_audit(ws)


def test_the_audit_plays_at_least_the_runs_limits(tmp_path, tokenizer, monkeypatch):
    """The audit's episodes get the run's limits, each at least the audit's own default: a run with a longer
    budget (a 30-turn tau2 replay) gives the expert that room; a run with a tiny one does not cut honest work."""
    import mentorrl.integrity.attacks as attacks

    seen = []
    real = attacks.audit_env
    monkeypatch.setattr(
        attacks,
        "audit_env",
        lambda name, tok, config, **kw: seen.append(config.limits) or real(name, tok, config, **kw),
    )
    for turns, want in ((30, 30), (2, 8)):
        ws = open_workspace(
            load_config(None, [f"run_dir={tmp_path}/{turns}", "threads=1", f"limits.max_turns={turns}"]),
            show_progress=False,
        )
        ws.bind_tokenizer(tokenizer)
        preflight_reward_audit(ws)
        assert seen[-1].max_turns == want and seen[-1].max_total_tokens >= 4096


def test_an_expert_cut_short_by_the_limits_is_unfit_not_a_failure(tokenizer):
    from mentorrl.config.prompt import ContractLimits
    from mentorrl.integrity.attacks import AttackAuditConfig, audit_env

    report = audit_env(
        "orders", tokenizer, AttackAuditConfig(limits=ContractLimits(max_turns=1, max_total_tokens=4096))
    )
    d = report.to_dict()
    assert d["honest"]["unfit"] and not d["honest"]["failures"] and not report.passed  # no baseline: attacks fail


def test_an_unfit_expert_episode_is_not_an_honest_failure():
    from mentorrl.integrity.attacks import AttackResult, AuditReport

    ok = AttackResult("a", "", False, ["t1"], [0.1], 1.0, True, "below the honest minimum")
    report = AuditReport(
        "orders", [ok], {"t1": 1.2, "t2": 0.0, "t3": 0.0}, {"t1": True, "t2": False, "t3": False}, ["t2"]
    )
    assert report.honest_failures == ["t3"] and not report.passed  # t3 ended within the limits and failed
    report.honest_success["t3"] = True
    assert report.passed and report.to_dict()["honest"]["unfit"] == ["t2"]
