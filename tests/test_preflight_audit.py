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
