"""Training-time reward audit, RFT selection, the GRPO diagnosis and the run report."""

from __future__ import annotations

import json

import pytest
import torch

from mentorrl.algos.advantages import grpo_advantages, sanitize_group_rewards
from mentorrl.config import ConfigError, load_config
from mentorrl.train.audit import AuditConfig, GapMonitor, flag_high_reward_failures
from mentorrl.train.diagnose import diagnose, probe_stats
from mentorrl.train.report import build_report, end_to_end_gap, report_markdown
from mentorrl.train.rft import rft_round_stats, rising, select_rft_data, task_outcomes
from mentorrl.trajectory import RewardBreakdown, ToolCall, Trajectory


def traj(
    i: int,
    task: str,
    success: bool,
    total: float | None = None,
    calls: list[tuple[str, dict]] = (),
    finish: str = "answer",
    violations: list[str] | None = None,
) -> Trajectory:
    total = (1.2 if success else 0.0) if total is None else total
    return Trajectory(
        id=f"t{i}",
        task_id=task,
        family="refund",
        token_ids=[1, 2, 3],
        loss_mask=[0, 1, 1],
        logprobs=[0.0] * 3,
        env_name="orders",
        env_version="1.0",
        finish_reason=finish,
        tool_calls=[ToolCall(turn=k + 1, name=n, arguments=a, raw="") for k, (n, a) in enumerate(calls)],
        reward=RewardBreakdown(success=success, total=total, violations=violations or []),
    )


# ---------------------------------------------------------------- reward sanity ----
def test_sanitize_clips_out_of_range_and_nonfinite_and_counts_them():
    r = torch.tensor([[0.0, 1.25, float("nan"), 7.0], [-3.0, 0.0, 0.0, float("inf")]])
    out, counts = sanitize_group_rewards(r, -1.0, 1.5)
    assert out.tolist() == [[0.0, 1.25, -1.0, 1.5], [-1.0, 0.0, 0.0, -1.0]]
    assert counts == {"nonfinite": 2.0, "out_of_range": 2.0, "z_clipped": 0.0, "clipped": 4.0}


def test_sanitize_keeps_a_rare_success_unless_z_clipping_is_asked_for():
    r = torch.tensor([[0.0] * 15 + [1.2]])
    out, counts = sanitize_group_rewards(r, -1.0, 1.5)
    assert torch.equal(out, r) and counts["clipped"] == 0
    assert grpo_advantages(out)[0, -1] > 3  # the one success carries the signal
    out_z, counts_z = sanitize_group_rewards(r, -1.0, 1.5, z_max=2.0)
    assert counts_z["z_clipped"] == 1 and out_z[0, -1] < 1.2
    mean, std = r.mean(), r.std(unbiased=False)
    assert out_z[0, -1].item() == pytest.approx((mean + 2.0 * std).item())


def test_sanitize_rejects_bad_range():
    with pytest.raises(ValueError, match="low < high"):
        sanitize_group_rewards(torch.zeros(1, 2), 1.0, 1.0)


# ------------------------------------------------------------- reward debugger ----
def test_reward_debugger_flags_only_high_reward_failures():
    trajs = [traj(0, "a", True), traj(1, "a", False, total=0.9), traj(2, "b", False, total=0.2), traj(3, "b", False)]
    assert [t.id for t in flag_high_reward_failures(trajs, 0.5)] == ["t1"]


def test_reward_debugger_in_stage_writes_flagged_file(tmp_path):
    from mentorrl.train.stage_helpers import reward_debugger as _reward_debugger

    trajs = [traj(0, "a", False, total=0.9), traj(1, "a", True)]
    m = _reward_debugger(trajs, 0.5, tmp_path / "audit" / "flagged.jsonl")
    assert m == {"reward_flagged": 1.0, "reward_flagged_share": 0.5}
    assert [json.loads(x)["id"] for x in (tmp_path / "audit" / "flagged.jsonl").read_text().splitlines()] == ["t0"]


# ---------------------------------------------------------------- gap monitor ----
def test_gap_monitor_warns_when_reward_rises_but_heldout_success_does_not():
    mon = GapMonitor(reward_window=2, reward_rise=0.05, success_rise=0.0)
    for step, r in enumerate([0.1, 0.1, 0.2, 0.3, 0.5, 0.6], 1):
        mon.observe_reward(step, r)
        if step == 2:
            assert mon.observe_eval(step, 0.30) is None  # first check is the baseline
        if step == 4:
            assert mon.observe_eval(step, 0.40) is None  # reward up, success up: fine
    w = mon.observe_eval(6, 0.38)
    assert w is not None and w["since_step"] == 4
    assert w["reward_delta"] == pytest.approx(0.55 - 0.25) and w["success_delta"] == pytest.approx(-0.02)
    restored = GapMonitor(2, 0.05, 0.0)
    restored.load_state_dict(json.loads(json.dumps(mon.state_dict())))
    assert restored.evals == mon.evals and restored.warnings == mon.warnings


def test_gap_monitor_redone_steps_replace_records():
    mon = GapMonitor(reward_window=1)
    mon.observe_reward(1, 0.0)
    mon.observe_reward(2, 9.0)
    mon.observe_reward(2, 0.1)  # step 2 redone after a resume
    assert mon.rewards == [(1, 0.0), (2, 0.1)]


def test_end_to_end_gap_in_report():
    audit = AuditConfig(reward_window=2)
    grpo = [
        {"stage": "grpo", "step": i, "reward_mean": r, "rollouts": 8} for i, r in enumerate([0.0, 0.1, 0.5, 0.6], 1)
    ]
    gap = end_to_end_gap(grpo, before=0.30, after=0.25, audit=audit)
    assert gap["warning"] and gap["reward_delta"] == pytest.approx(0.5)
    assert not end_to_end_gap(grpo, before=0.30, after=0.45, audit=audit)["warning"]
    evals = {
        "sft": {"n": 10, "success": 0.3, "success_ci95": [0.1, 0.6]},
        "grpo": {"n": 10, "success": 0.25, "success_ci95": [0.1, 0.5]},
    }
    rep = build_report(grpo, evals, audit, pre_rl_label="sft", final_label="grpo")
    assert rep["stages"]["grpo"]["rollouts"] == 32 and rep["audit"]["end_to_end"]["warning"]
    assert "WARNING: reward rose while held-out success did not" in report_markdown(rep)


# ----------------------------------------------------------------------- RFT ----
def test_rft_round_stats_and_samples_to_success():
    trajs = [
        traj(0, "a", False),
        traj(1, "a", True),
        traj(2, "b", False),
        traj(3, "b", False),
        traj(4, "c", True),
        traj(5, "c", True),
    ]
    out = task_outcomes(trajs)
    assert (out["a"].first_success, out["c"].first_success, out["b"].first_success) == (2, 1, None)
    s = rft_round_stats(out)
    assert s["positive_task_rate"] == pytest.approx(2 / 3)
    assert s["trajectory_success_rate"] == pytest.approx(3 / 6)
    assert s["samples_to_success"] == pytest.approx(1.5)
    assert "samples_to_success" not in rft_round_stats(task_outcomes([traj(0, "a", False)]))


def test_rft_selection_band_and_distinct_top_k():
    A = [("get_order", {"order_id": "O-1"})]
    B = [("find_customer", {"email": "x"}), ("get_order", {"order_id": "O-1"})]
    trajs = (
        [traj(0, "hard", True, 1.2, A), traj(1, "hard", True, 1.1, A), traj(2, "hard", True, 1.0, B)]
        + [traj(3 + i, "hard", False) for i in range(7)]  # 3/10: in band
        + [traj(20 + i, "easy", True) for i in range(9)]
        + [traj(29, "easy", False)]  # 9/10: too easy
        + [traj(30 + i, "never", False) for i in range(10)]
    )
    kept, counts = select_rft_data(trajs, top_k=2, band=(0.05, 0.5))
    assert counts == {"tasks_in_band": 1.0, "tasks_too_easy": 1.0, "tasks_unsolved": 1.0, "selected": 2.0}
    assert [t.id for t in kept] == ["t0", "t2"]  # the best, then a different tool sequence before a repeat
    assert all(t.reward.success for t in kept)


def test_rft_stops_when_positive_rate_stops_rising():
    assert rising([0.1], 0.0)
    assert rising([0.1, 0.2], 0.0)
    assert not rising([0.1, 0.2, 0.2], 0.0)
    assert not rising([0.1, 0.3, 0.25], 0.0)
    assert not rising([0.1, 0.12], 0.05)


# ------------------------------------------------------------------ diagnose ----
def _stats(**kw):
    base = dict(
        success_rate=0.3,
        reward_zero_variance_group_share=0.3,
        tool_success=0.95,
        invalid_call_rate=0.0,
        truncation_rate=0.05,
        violation_rate=0.0,
    )
    return {**base, **kw}


@pytest.mark.parametrize(
    "kw, code",
    [
        (dict(success_rate=0.0, reward_zero_variance_group_share=1.0), "no_signal"),
        (dict(success_rate=0.1), "low_success_with_spread"),
        (dict(success_rate=0.97, reward_zero_variance_group_share=0.9), "saturated"),
        (dict(tool_success=0.5), "tool_errors"),
        (dict(timeout_rate=0.2), "tool_runtime"),
        (dict(success_rate=0.33, reward_zero_variance_group_share=0.81), "polarized"),
        (dict(invalid_call_rate=0.4), "invalid_calls"),
        (dict(truncation_rate=0.5), "truncation"),
        (dict(violation_rate=0.2), "violations"),
        ({}, "healthy"),
    ],
)
def test_diagnosis_rules(kw, code):
    codes = [f.code for f in diagnose(_stats(**kw))]
    assert code in codes
    if code != "healthy":
        assert "healthy" not in codes


def test_diagnosis_from_history_reward_hacking_and_drift():
    rising_reward = [{"reward_mean": 0.1 * i, "task_success": 0.3, "loss": 0.0} for i in range(10)]
    assert "reward_hacking" in [f.code for f in diagnose(_stats(), rising_reward)]
    honest = [{"reward_mean": 0.1 * i, "task_success": 0.1 * i, "loss": 0.0} for i in range(10)]
    assert "reward_hacking" not in [f.code for f in diagnose(_stats(), honest)]
    collapse = [{"reward_mean": r, "task_success": 0.3, "loss": 0.0} for r in [0.1] * 5 + [0.9] * 5 + [0.0] * 5]
    assert "policy_drift" in [f.code for f in diagnose(_stats(), collapse)]
    stuck = [{"reward_mean": 0.3, "task_success": 0.3, "loss": (-1) ** i * 0.5} for i in range(10)]
    assert "pipeline_bug" in [f.code for f in diagnose(_stats(), stuck)]


def test_probe_stats_layout():
    trajs = [traj(0, "a", True), traj(1, "a", False), traj(2, "b", False), traj(3, "b", False)]
    s = probe_stats(trajs, 2)
    assert s["success_rate"] == 0.25 and s["tasks_with_success"] == 0.5
    assert s["reward_zero_variance_group_share"] == 0.5
    assert s["advantage_std"] > 0
    with pytest.raises(ValueError):
        probe_stats(trajs[:3], 2)


# -------------------------------------------------------------------- config ----
def test_config_refuses_training_on_the_hidden_set():
    with pytest.raises(ConfigError, match="hidden evaluation set and is never used for training"):
        load_config(None, ["train_split=hidden"])
    with pytest.raises(ConfigError, match="recipe"):
        load_config(None, ["recipe=[sft, dpo]"])
    assert load_config(None, ["recipe=[sft, rft, grpo]"]).recipe == ["sft", "rft", "grpo"]


def test_training_stages_refuse_hidden_tasks(monkeypatch, tmp_path):
    """Even when a task source hands hidden tasks to a training stage, the stage refuses them."""
    from mentorrl.eval.sets import HiddenSetError
    from mentorrl.train.workspace import open_workspace

    ws = open_workspace(load_config(None, [f"run_dir={tmp_path}"]), show_progress=False)
    assert all(t.split == "train" for t in ws.train_tasks(4, 0))
    monkeypatch.setattr(ws, "tasks", lambda split, n, seed: ws.env_entry.make_tasks().tasks("hidden", n, seed))
    with pytest.raises(HiddenSetError, match="refusing to train on 4 hidden-set task"):
        ws.train_tasks(4, 0)


def test_bad_rft_band_and_ppo_settings_are_rejected_with_the_field_name():
    with pytest.raises(ConfigError, match=r"rft.band.*0 <= lo <= hi <= 1"):
        load_config(None, ["rft.band=[0.6, 0.2]"])
    with pytest.raises(ConfigError, match="ppo.lam"):
        load_config(None, ["ppo.lam=1.5"])
    with pytest.raises(ConfigError, match="env.latency.kind"):
        load_config(None, ["env.latency={kind: uniform}"])


def test_diagnose_rejects_bad_input(tmp_path, tiny_model_dir):
    from typer.testing import CliRunner

    from mentorrl.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["diagnose", str(tmp_path / "nope")])
    assert res.exit_code == 2
    res = runner.invoke(app, ["diagnose", str(tiny_model_dir), "--split", "nosuch", "--set", f"run_dir={tmp_path}"])
    assert res.exit_code == 2 and "nosuch" in res.output
    res = runner.invoke(app, ["diagnose", str(tiny_model_dir), "--samples", "1"])
    assert res.exit_code == 2  # a group needs at least two samples
