"""Recipes of stages end to end: SFT -> RFT -> GRPO with the reward audit and the run report."""

from __future__ import annotations

import json

import pytest
from test_resume import TINY_OVERRIDES
from typer.testing import CliRunner

from mentorrl.cli import app
from mentorrl.train.rundir import MetricsLog

RECIPE = [
    "recipe=[sft, rft, grpo]",
    "rft.max_iterations=3",
    "rft.num_tasks=4",
    "rft.samples_per_task=2",
    "rft.sft_steps=2",
    "rft.batch_size=4",
    "rft.band=[0.0, 1.0]",
    "grpo.steps=2",
    "audit.eval_every=1",
    "audit.eval_tasks=4",
    "eval.batch_size=4",
    "grpo.hard_pool={boost: 4.0}",
    "eval.final_splits=[hidden, novel_wording]",
]


def _run(tmp_path, *flags: str):
    args = ["demo", "--run-dir", str(tmp_path / "run"), *flags]
    for ov in TINY_OVERRIDES + RECIPE:
        args += ["--set", ov]
    return CliRunner().invoke(app, args, catch_exceptions=False)


@pytest.mark.slow
def test_sft_rft_grpo_recipe_writes_report_and_resumes(tmp_path):
    res = _run(tmp_path)
    assert res.exit_code == 0, res.output
    run = tmp_path / "run"
    report = json.loads((run / "report.json").read_text())
    assert list(report["evals"]) == ["sft", "rft", "grpo"]
    rounds = report["rft_rounds"]
    assert 1 <= len(rounds) <= 3 and all("positive_task_rate" in r for r in rounds)
    assert report["stages"]["rft"]["rollouts"] == len(rounds) * 4 * 2
    assert report["stages"]["grpo"]["rollouts"] == 2 * 2 * 2
    assert len(report["audit"]["gap_checks"]) == 2  # one held-out check per GRPO step
    assert {"flagged_high_reward_failures", "rewards_clipped", "end_to_end"} <= set(report["audit"])
    assert (run / "report.md").read_text().startswith("# Run report")
    # the final checkpoint on the hidden set and the novel-wording stress set, beside the headline
    assert list(report["other_splits"]) == ["hidden", "novel_wording"]
    assert all(report["other_splits"][s]["n"] == 4 for s in ("hidden", "novel_wording"))
    assert json.loads((run / "eval_grpo_hidden.json").read_text())["split"] == "hidden"
    assert "## Final checkpoint on other splits" in (run / "report.md").read_text()
    grpo = MetricsLog(run / "metrics.jsonl").read("grpo")
    assert all(
        {
            "reward_clipped",
            "reward_flagged",
            "heldout_success",
            "gap_warning",
            "rollouts",
            "hard_pool_size",
            "hard_tasks_in_batch",
        }
        <= set(r)
        for r in grpo
    )
    assert grpo[0]["hard_tasks_in_batch"] == 0  # nothing has failed before the first step
    rates = [r["positive_task_rate"] for r in rounds]
    if len(rounds) < 3:  # stopped early: only because the positive-task rate stopped rising
        assert rates[-1] <= max(rates[:-1])
    assert all({"logprob_abs_gap", "train_rollout_kl", "policy_lag_mean", "policy_lag_max"} <= set(r) for r in grpo)
    # the learner recomputes what the rollout recorded (on updates the current weights sampled; later
    # minibatches of a step also see the policy's own change)
    assert grpo[0]["mismatch_logprob_gap"] < 1e-3

    checked = CliRunner().invoke(app, ["check", str(run)])
    assert checked.exit_code == 0 and "all" in checked.output, checked.output
    before = (run / "metrics.jsonl").read_text()
    again = _run(tmp_path, "--resume")  # every stage is complete: nothing is redone or logged twice
    assert again.exit_code == 0, again.output
    assert (run / "metrics.jsonl").read_text() == before


def test_hard_pool_settings_are_checked(tmp_path):
    from mentorrl.config import GRPOConfig
    from mentorrl.flywheel.hard_pool import HardPoolConfig, HardTaskPool
    from mentorrl.train.recipes.grpo import load_hard_pool as _hard_pool

    assert _hard_pool(GRPOConfig()) is None
    with pytest.raises(ValueError, match="hard_pool is null"):  # refused when the config is built, before any stage
        GRPOConfig(hard_pool_state=str(tmp_path / "x.json"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _hard_pool(GRPOConfig(hard_pool=HardPoolConfig(), hard_pool_state=str(tmp_path / "x.json")))
    saved = HardTaskPool(HardPoolConfig(boost=1.0))
    saved.entries = HardTaskPool.from_state_dict(
        {
            "version": 1,
            "config": HardPoolConfig().model_dump(),
            "updates": 3,
            "entries": {"task-7": {"score": 2.0, "failures": 2, "attempts": 2, "last_update": 3}},
        }
    ).entries
    (tmp_path / "pool.json").write_text(json.dumps(saved.state_dict()))
    pool = _hard_pool(GRPOConfig(hard_pool=HardPoolConfig(boost=9.0), hard_pool_state=str(tmp_path / "pool.json")))
    assert "task-7" in pool and pool.config.boost == 9.0  # the saved failures, the run's settings


@pytest.mark.slow
def test_training_refuses_a_reward_that_pays_for_hacks(tmp_path):
    """Without the redundancy and verbosity terms, tool spam and a padded answer tie honest work:
    the preflight reward audit stops the run before any training step."""
    res = _run(tmp_path, "--set", "reward.redundant_penalty=0", "--set", "reward.verbosity=0")
    assert res.exit_code == 1
    assert "reward audit failed" in res.output and "tool_spam" in res.output and "padded_answer" in res.output
    assert not (tmp_path / "run" / "sft").exists() and (tmp_path / "run" / "reward_audit.json").exists()


@pytest.mark.slow
def test_check_flags_a_tampered_batch(tmp_path):
    """`mentorrl check` fails a batch whose non-policy tokens were made trainable or whose contract differs."""
    from mentorrl.trajectory import read_jsonl, write_jsonl

    res = _run(tmp_path)
    assert res.exit_code == 0, res.output
    run = tmp_path / "run"
    sample = sorted((run / "samples").glob("grpo-step-*.jsonl"))[0]
    trajs = list(read_jsonl(sample))
    t = trajs[0]  # make a prompt (or tool-observation) token trainable
    seg = next(s for s in reversed(t.segments) if s.role != "policy")
    t.loss_mask[seg.start] = 1
    trajs[-1].contract_fingerprint = "0" * 16
    write_jsonl(sample, trajs)
    checked = CliRunner().invoke(app, ["check", str(run)])
    assert checked.exit_code == 1
    assert "observation_mask" in checked.output and "contract" in checked.output
    missing = CliRunner().invoke(app, ["check", str(tmp_path)])
    assert missing.exit_code == 2 and "not a run directory" in missing.output


def test_final_splits_never_include_training_splits():
    from mentorrl.config import ConfigError, load_config

    assert load_config(None, ["eval.final_splits=[hidden, novel_wording]"]).eval.final_splits == [
        "hidden",
        "novel_wording",
    ]
    with pytest.raises(ConfigError, match="final_splits"):
        load_config(None, ["eval.final_splits=[train]"])
