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


def test_the_audit_plays_the_runs_limits_and_a_cut_expert_is_no_verdict(tmp_path, tokenizer):
    """The audit's episodes run under the run's limits (not defaults of its own). An honest expert the
    limits cut short is counted apart (unfit): it says nothing about the reward, so it is not an honest
    failure, and it is no baseline either (an attack left without one still fails)."""
    ws = open_workspace(
        load_config(None, [f"run_dir={tmp_path}", "threads=1", "limits.max_turns=1"]), show_progress=False
    )
    ws.bind_tokenizer(tokenizer)
    with pytest.raises(RewardAuditFailed) as err:
        preflight_reward_audit(ws)
    data = json.loads((tmp_path / "reward_audit.json").read_text())
    assert data["honest"]["unfit"] and not data["honest"]["failures"]
    assert "honest expert failed" not in str(err.value) and "no baseline" in str(err.value)


def test_an_unfit_expert_episode_is_not_an_honest_failure():
    from mentorrl.integrity.attacks import AttackResult, AuditReport

    ok = AttackResult("a", "", False, ["t1"], [0.1], 1.0, True, "below the honest minimum")
    report = AuditReport(
        "orders", [ok], {"t1": 1.2, "t2": 0.0, "t3": 0.0}, {"t1": True, "t2": False, "t3": False}, ["t2"]
    )
    assert report.honest_failures == ["t3"] and not report.passed  # t3 ended within the limits and failed
    report.honest_success["t3"] = True
    assert report.passed and report.to_dict()["honest"]["unfit"] == ["t2"]
