"""Every black-box recipe end to end against a real `mentorrl serve` subprocess on 127.0.0.1.

The teacher is a stronger local model (the tiny model given more SFT than the student), reached
only through the OpenAI chat-completions protocol: no log-probs, no weights. Each recipe runs two
steps from the same student checkpoint and must build a training batch and take a finite update.
"""

from __future__ import annotations

import json
import math

import pytest
from test_resume import TINY_OVERRIDES
from typer.testing import CliRunner

from mentorrl.cli import app
from mentorrl.config import BLACKBOX_RECIPES
from mentorrl.train.rundir import MetricsLog

pytestmark = pytest.mark.slow
LONGER = ["sampling.max_new_tokens=48"]  # room for a whole tool call in a turn


def _train(run_dir, overrides: list[str], resume: bool = False):
    args = ["demo", "--run-dir", str(run_dir)] + (["--resume"] if resume else [])
    for ov in TINY_OVERRIDES + overrides:
        args += ["--set", ov]
    res = CliRunner().invoke(app, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return run_dir


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(student, teacher): the teacher is the student given more SFT."""
    root = tmp_path_factory.mktemp("bb")
    sft = ["recipe=[sft]", "sft.num_demos=128", "sft.batch_size=8", "eval.num_tasks=4", "eval.batch_size=4"] + LONGER
    student = _train(root / "student", sft + ["sft.steps=120"]) / "sft" / "final"
    teacher = _train(root / "teacher", sft + ["sft.steps=200", f"model.path={student}"]) / "sft" / "final"
    return student, teacher


@pytest.fixture(scope="module")
def teacher_url(checkpoints):
    from mentorrl.serve import serve_subprocess

    with serve_subprocess(checkpoints[1]) as url:
        assert url.startswith("http://127.0.0.1:")
        yield url


RECIPE_SETTINGS = {
    "correction": ["blackbox.correction={only_failed: false, require_success: false}"],
    "ranking": ["blackbox.preference={loss: dpo, min_margin: 0.0}"],
    "score": ["blackbox.score.teacher_coef=0.5"],
    "critique": ["blackbox.critique.coef=1.0"],
    "soft_labels": ["blackbox.soft_labels.temperature=0.5"],
    "actions": ["blackbox.actions={candidates: 3, states_per_trajectory: 1}"],
}


def _run_recipe(tmp_path, checkpoints, url, recipe, extra=(), resume=False):
    student, _ = checkpoints
    return _train(
        tmp_path / recipe,
        [
            *LONGER,
            f"model.path={student}",
            "recipe=[blackbox]",
            f"blackbox.recipe={recipe}",
            "blackbox.steps=2",
            "blackbox.tasks_per_step=4",
            "blackbox.samples_per_task=4",
            "blackbox.checkpoint_every=1",
            f"blackbox.teacher.client.base_url={url}",
            "blackbox.teacher.client.api_key_env=null",
            "blackbox.teacher.samples=4",
            "blackbox.teacher.max_tokens=24",
            "eval.num_tasks=4",
            "eval.batch_size=4",
            *RECIPE_SETTINGS[recipe],
            *extra,
        ],
        resume=resume,
    )


@pytest.mark.parametrize("recipe", BLACKBOX_RECIPES)
def test_each_recipe_trains_through_the_served_teacher(tmp_path, checkpoints, teacher_url, recipe):
    run = _run_recipe(tmp_path, checkpoints, teacher_url, recipe)
    recs = MetricsLog(run / "metrics.jsonl").read("blackbox")
    assert [r["step"] for r in recs] == [1, 2]
    assert recs[-1]["teacher_requests"] > 0 and recs[-1]["teacher_failures"] == 0  # all through HTTP
    trained = [r for r in recs if r["batch_size"] > 0]
    assert trained, f"{recipe}: no step built a training batch: {recs}"
    for r in trained:
        assert math.isfinite(r["grad_norm"]) and r["skipped_update"] == 0.0
        loss = r.get("loss", r.get("pg_loss"))
        assert loss is not None and math.isfinite(loss)
    assert recs[-1]["policy_version"] >= 1
    if recipe == "ranking":
        assert all(math.isfinite(r["reward_margin"]) for r in trained)
    if recipe == "score":
        assert all(r["teacher_scored"] > 0 for r in recs)
    if recipe in ("soft_labels", "actions"):
        assert all(0.0 <= r["soft_label_kl"] for r in trained)
    report = json.loads((run / "report.json").read_text())
    assert "blackbox" in report["evals"]


def test_action_ranking_can_train_dpo_on_pairs_of_turns(tmp_path, checkpoints, teacher_url):
    """actions.loss=preference: each state's best and worst candidate turn, by the teacher's ranking, under DPO + NLL."""
    run = _run_recipe(
        tmp_path,
        checkpoints,
        teacher_url,
        "actions",
        extra=["blackbox.actions.loss=preference", "blackbox.preference={min_margin: 0.0, nll_coef: 1.0}"],
    )
    recs = MetricsLog(run / "metrics.jsonl").read("blackbox")
    trained = [r for r in recs if r["batch_size"] > 0]
    assert trained, recs
    for r in trained:
        assert math.isfinite(r["reward_margin"]) and math.isfinite(r["chosen_nll"]) and r["skipped_update"] == 0.0
        assert "soft_label_kl" not in r


def test_a_killed_blackbox_run_resumes_to_the_same_metrics(tmp_path, checkpoints, teacher_url):
    run = _run_recipe(tmp_path, checkpoints, teacher_url, "ranking")
    before = (run / "metrics.jsonl").read_text()
    _run_recipe(tmp_path, checkpoints, teacher_url, "ranking", resume=True)
    assert (run / "metrics.jsonl").read_text() == before


def test_a_teacher_that_is_down_is_counted_not_fatal(tmp_path, checkpoints):
    """No server at the URL: every request fails (counted), and the score recipe falls back to the verifier's reward."""
    run = _run_recipe(
        tmp_path,
        checkpoints,
        "http://127.0.0.1:9/v1",
        "score",
        extra=["blackbox.teacher.client.max_retries=0", "blackbox.teacher.client.timeout_s=1"],
    )
    recs = MetricsLog(run / "metrics.jsonl").read("blackbox")
    assert [r["step"] for r in recs] == [1, 2]
    assert recs[-1]["teacher_failures"] > 0 and all(r["teacher_scored"] == 0 for r in recs)
