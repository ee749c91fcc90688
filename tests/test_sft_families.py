"""``sft.families`` / ``opd.teachers[].build.families``: the SFT stage draws its expert demonstrations only
from tasks of the given families (a specialist), an unknown family is a ConfigError naming the field before
the first step, and a teacher's build families are part of its cache key."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mentorrl.config import ConfigError, TeacherConfig, load_config
from mentorrl.envs.base import Task, UnknownFamilyError, draw_family_tasks
from mentorrl.envs.orders.tasks import FAMILIES, OrdersTasks

HALF = list(FAMILIES[:4])


def test_family_draw_keeps_the_sources_own_tasks_of_those_families():
    src = OrdersTasks()
    kept = draw_family_tasks(src, "train", 300, 3, HALF)
    assert len(kept) == 300 and {t.family for t in kept} == set(HALF)
    # the first 300 of those families in the plain draw, in order: the source's mix within them, ids intact
    plain = [t for t in src.tasks("train", 2000, 3) if t.family in HALF][:300]
    assert [t.id for t in kept] == [t.id for t in plain]
    assert [t.id for t in draw_family_tasks(src, "train", 300, 3, list(reversed(HALF)))] == [t.id for t in kept]
    assert {t.family for t in draw_family_tasks(src, "train", 50, 3, ["refund"])} == {"refund"}


def test_family_draw_names_a_family_the_source_never_draws():
    class Finite:  # no `families` attribute: the filter is checked against what it draws
        def tasks(self, split, n, seed):
            return [Task(id=f"t{i}", family="a", split=split, prompt="p", seed=i) for i in range(min(n, 5))]

    assert len(draw_family_tasks(Finite(), "train", 10, 0, ["a"])) == 5  # a finite source gives what it has
    with pytest.raises(UnknownFamilyError, match="family b among 5"):
        draw_family_tasks(Finite(), "train", 10, 0, ["a", "b"])


def _cfg(tmp_path: Path, *overrides: str):
    return load_config(
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            "threads=1",
            "audit.preflight=false",
            "sampling.max_new_tokens=16",
            "limits.max_total_tokens=512",
            *overrides,
        ],
    )


def test_the_sft_stage_trains_only_on_demonstrations_of_its_families(tmp_path, policy):
    from mentorrl.train.recipes.sft import SFTStage
    from mentorrl.train.workspace import open_workspace

    tokenizer, model = policy
    ws = open_workspace(_cfg(tmp_path, "recipe=[sft]", "sft.num_demos=24", "sft.families=[refund, stock_check]"))
    ws.bind_tokenizer(tokenizer)
    stage = SFTStage(ws, copy.deepcopy(model))
    assert len(stage.demos) >= 20  # the expert verifies (nearly) every one of the 24 tasks
    assert {d.family for d in stage.demos} == {"refund", "stock_check"}


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["recipe=[sft]", "sft.families=[refund, refunds]"], "sft.families: unknown task family refunds"),
        (
            ["recipe=[sft, opd]", "opd.teachers=[{name: t, build: {families: [order_status, nope]}}]"],
            "opd.teachers.0.build.families: unknown task family nope",
        ),
    ],
)
def test_an_unknown_family_is_a_config_error_naming_the_field(tmp_path, overrides, field):
    from mentorrl.train.workspace import open_workspace

    with pytest.raises(ConfigError, match=field) as e:
        open_workspace(_cfg(tmp_path, *overrides), show_progress=False)
    assert "environment 'orders' has order_status, stock_check" in str(e.value)
    open_workspace(_cfg(tmp_path, "recipe=[grpo]", "sft.families=[nope]"), show_progress=False)  # no SFT stage


def test_cli_train_refuses_an_unknown_family_before_anything(tmp_path):
    from mentorrl.cli import app

    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"run_dir: {tmp_path / 'run'}\nrecipe: [sft]\nsft: {{families: [refund, nope]}}\n")
    res = CliRunner().invoke(app, ["train", str(cfg)])
    assert res.exit_code == 2 and "sft.families" in res.output and "nope" in res.output
    assert not (tmp_path / "run" / "base_model").exists()


def test_a_teachers_build_families_are_part_of_its_cache_key():
    from mentorrl.train.teachers import TEACHER_RECIPE_FIELDS, teacher_build_config, teacher_dir

    cfg = load_config(None, [])

    def key(**build):
        return teacher_dir(cfg, TeacherConfig(name="spec", build=build)).name

    every, half, other = key(), key(families=HALF), key(families=list(FAMILIES[4:]))
    assert len({every, half, other}) == 3
    assert key(families=list(reversed(HALF))) == half  # the same set of families: the same teacher
    assert teacher_build_config(cfg, TeacherConfig(build={"families": HALF})).sft.families == sorted(HALF)
    # every family: no families entry in the key, so teachers built before the filter existed stay cached
    sub = teacher_build_config(cfg, TeacherConfig(name="spec")).model_dump(
        mode="json", include=set(TEACHER_RECIPE_FIELDS)
    )
    assert sub["sft"].pop("families") is None
    assert every == "spec-" + hashlib.sha256(json.dumps(sub, sort_keys=True).encode()).hexdigest()[:10]


def test_the_specialist_recipe_is_a_teacher_build_as_a_plain_run():
    from mentorrl.config import TeacherBuildConfig

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "mentorrl" / "configs" / "specialist.yaml", ["sft.families=[refund]"])
    b = TeacherBuildConfig()
    assert cfg.recipe == ["sft"] and cfg.sft.families == ["refund"]
    assert (cfg.sft.steps, cfg.sft.num_demos, cfg.sft.batch_size, cfg.sft.optim.lr) == (
        b.sft_steps,
        b.num_demos,
        b.batch_size,
        b.lr,
    )


def test_a_resumed_complete_sft_stage_builds_no_demonstrations(tmp_path, monkeypatch):
    """Each later stage process of ``stage_processes: true`` resumes the run: a complete SFT stage must not build
    its demonstrations again (the code environment's 800 sandboxed solutions took four minutes a process)."""
    from test_resume import TINY_OVERRIDES

    from mentorrl.cli import app
    from mentorrl.train.recipes import sft

    args = ["demo", "--run-dir", str(tmp_path / "run"), "--no-eval"]
    for ov in [*TINY_OVERRIDES, "recipe=[sft]", "audit.preflight=false"]:
        args += ["--set", ov]
    assert CliRunner().invoke(app, args, catch_exceptions=False).exit_code == 0

    def built(*a, **k):
        raise AssertionError("a complete SFT stage built its demonstrations")

    monkeypatch.setattr(sft, "sft_demonstrations", built)
    res = CliRunner().invoke(app, [*args, "--resume"], catch_exceptions=False)
    assert res.exit_code == 0 and "already complete" in res.output
