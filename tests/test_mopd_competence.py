"""MOPD competence routing (``opd.mopd.competence``): the pure routes from verified counts, the config
checks, and the OPD stage's plumbing on the tiny model (teachers roll out, the table is written, its
weights route the step, and a resumed stage reuses it)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mentorrl.train.recipes.opd as opd_mod
from mentorrl.config import ConfigError, load_config
from mentorrl.opd.mopd import competence_routes, routing_weights

TEACHERS = ["a", "b", "c"]


@st.composite
def _counts(draw):
    """family -> teacher -> (successes, attempts), every teacher on a family with the same attempts."""
    out = {}
    for fam in draw(st.lists(st.sampled_from(["f1", "f2", "f3", "f4"]), min_size=1, max_size=4, unique=True)):
        n = draw(st.integers(0, 20))
        out[fam] = {t: (draw(st.integers(0, n)), n) for t in TEACHERS}
    return out


@settings(max_examples=60, deadline=None)
@given(_counts())
def test_soft_routes_sum_to_one_and_rank_teachers_by_success(counts):
    routes = competence_routes(counts, "soft")
    assert set(routes) == set(counts)
    for fam, per in counts.items():
        assert sum(routes[fam].values()) == pytest.approx(1.0)
        for x in TEACHERS:
            for y in TEACHERS:
                if per[x][0] > per[y][0]:  # more successes on the same attempts: strictly more weight
                    assert routes[fam][x] > routes[fam][y]
                if per[x][0] == per[y][0]:
                    assert routes[fam][x] == pytest.approx(routes[fam][y])


@settings(max_examples=60, deadline=None)
@given(_counts())
def test_hard_routes_put_everything_on_the_best_teachers(counts):
    routes = competence_routes(counts, "hard")
    for fam, per in counts.items():
        best = max(s for s, _ in per.values())
        top = [t for t in TEACHERS if per[t][0] == best]
        assert routes[fam] == {t: pytest.approx(1 / len(top) if t in top else 0.0) for t in TEACHERS}


def test_routes_prior_unknown_and_empty_families_and_bad_counts():
    # no attempts: the prior mean for everyone, so an even split; fewer attempts, same rate: the prior pulls
    assert competence_routes({"f": {"a": (0, 0), "b": (0, 0)}}) == {"f": {"a": 0.5, "b": 0.5}}
    soft = competence_routes({"f": {"a": (3, 4), "b": (0, 4)}}, "soft")
    assert soft["f"]["a"] == pytest.approx((4 / 6) / (4 / 6 + 1 / 6))
    assert competence_routes({"f": {"a": (3, 4), "b": (0, 4)}}, "hard") == {"f": {"a": 1.0, "b": 0.0}}
    # a family with no teachers is left out, and routing_weights spreads an unrouted family evenly
    routes = competence_routes({"f": {}, "g": {"a": (1, 1), "b": (0, 1)}}, "hard")
    assert routes == {"g": {"a": 1.0, "b": 0.0}} and competence_routes({}) == {}
    assert routing_weights(["f", "g"], ["a", "b"], routes).tolist() == [[0.5, 0.5], [1.0, 0.0]]
    for bad in ({"f": {"a": (3, 2)}}, {"f": {"a": (-1, 2)}}, {"f": {"a": (0, -1)}}):
        with pytest.raises(ValueError, match="must lie in"):
            competence_routes(bad)
    with pytest.raises(ValueError, match="soft or hard"):
        competence_routes({"f": {"a": (0, 1)}}, "argmax")
    with pytest.raises(ValueError, match="prior must be positive"):
        competence_routes({"f": {"a": (0, 1)}}, prior=(0.0, 1.0))


# ----------------------------------------------------------------- config -----
TWO = "opd.teachers=[{name: a}, {name: b}]"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            [TWO, "opd.mopd={competence: {}, routes: {cancel_order: {a: 1}}}"],
            "opd.mopd.competence measures the routes: give it or opd.mopd.routes",
        ),
        (
            [
                "opd.teachers=[{name: s, kind: self}]",
                "opd.rlsd={}",
                "opd.reward_coef=1.0",
                "opd.mopd.competence={}",
            ],
            "opd.mopd.competence rolls out the teachers: it needs at least one teacher of kind hf",
        ),
        ([TWO, "opd.mopd.competence={mode: best}"], "competence.mode"),
        ([TWO, "opd.mopd.competence={tasks_per_family: 0}"], "tasks_per_family"),
    ],
)
def test_competence_config_errors_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_competence_config_defaults_off_and_loads():
    assert load_config(None, [TWO]).opd.mopd.competence is None
    c = load_config(None, [TWO, "opd.mopd={competence: {tasks_per_family: 3, mode: hard, seed: 7}, routes: {}}"])
    assert (c.opd.mopd.competence.tasks_per_family, c.opd.mopd.competence.mode, c.opd.mopd.competence.seed) == (
        3,
        "hard",
        7,
    )


# ----------------------------------------------------------- the stage -----
PER_FAMILY = 2


def _stage(tmp_path, tokenizer, model, tiny_model_dir, mode: str = "soft"):
    from mentorrl.train.workspace import open_workspace

    cfg = load_config(
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            "threads=1",
            "sampling.max_new_tokens=16",
            "limits.max_turns=2",
            "limits.max_total_tokens=512",
            "eval.batch_size=16",
            "opd.steps=1",
            "opd.tasks_per_step=2",
            "opd.samples_per_task=2",
            "opd.checkpoint_every=1",
            f"opd.teachers=[{{name: a, path: {tiny_model_dir}}}, {{name: b, path: {tiny_model_dir}}}]",
            f"opd.mopd.competence={{tasks_per_family: {PER_FAMILY}, mode: {mode}}}",
        ],
    )
    ws = open_workspace(cfg, show_progress=False)
    ws.bind_tokenizer(tokenizer)
    return opd_mod.OPDStage(ws, copy.deepcopy(model))


def _forced(monkeypatch, families_of_a: set[str]):
    """The tiny teachers rarely succeed: force the verifier's outcome, teacher a on ``families_of_a``,
    teacher b on the others (the real rollouts still run); records every call."""
    real, calls = opd_mod.teacher_rollout, []

    def rollout(ws, teacher, tasks, seed, batch_size=None):
        trajs = real(ws, teacher, tasks, seed, batch_size)
        calls.append((teacher.name, [t.id for t in tasks], seed))
        for task, x in zip(tasks, trajs):
            x.reward.success = (task.family in families_of_a) == (teacher.name == "a")
        return trajs

    monkeypatch.setattr(opd_mod, "teacher_rollout", rollout)
    return calls


def test_competence_is_measured_once_written_and_routes_the_step(monkeypatch, tmp_path, policy, tiny_model_dir):
    from mentorrl.train.loop import RLLoop

    tokenizer, model = policy
    stage = _stage(tmp_path, tokenizer, model, tiny_model_dir)
    assert stage.shared == [True, True]  # both teachers share the student's tokenizer
    families = sorted({t.family for t in stage.pool})
    assert len(families) >= 2
    calls = _forced(monkeypatch, set(families[::2]))
    RLLoop(stage).run()
    # every teacher rolled out the same tasks with the same seed, tasks_per_family of every family
    assert [c[0] for c in calls] == ["a", "b"] and calls[0][1:] == calls[1][1:]
    doc = json.loads((stage.ws.run_dir / "mopd_competence.json").read_text())
    assert doc["mode"] == "soft" and doc["tasks_per_family"] == PER_FAMILY
    table = doc["families"]
    assert sorted(table) == families
    for i, fam in enumerate(families):
        assert {t: r["attempts"] for t, r in table[fam].items()} == {"a": PER_FAMILY, "b": PER_FAMILY}
        good = "a" if i % 2 == 0 else "b"
        assert table[fam][good]["successes"] == PER_FAMILY
        assert table[fam][good]["weight"] == pytest.approx(0.75)  # Beta(1,1): 3/4 against 1/4, normalised
    assert stage.state["competence"] == table
    # the step's teacher weights are the table's (no confidence, no history: routing alone)
    rows = [json.loads(x) for x in (stage.ws.run_dir / "opd" / "signals-step-000001.jsonl").read_text().splitlines()]
    assert rows
    for r in rows:
        for t in ("a", "b"):
            assert r["teachers"][t]["weight"] == pytest.approx(table[r["family"]][t]["weight"])

    # a resumed stage restores the table from its state and never rerolls
    saved = stage.state_dict()
    again = _stage(tmp_path, tokenizer, model, tiny_model_dir)
    again.load_state_dict(copy.deepcopy(saved))
    calls.clear()
    again.tasks(RLLoop(again).new_batch(0))
    assert calls == [] and again.state["competence"] == table
    assert again.routes() == {f: {t: r["weight"] for t, r in per.items()} for f, per in table.items()}


def test_state_round_trip_keeps_the_table_and_hard_mode_routes():
    """Unit level: the table survives state_dict / load_state_dict; hard routes pick the argmax."""
    counts = {"x": {"a": (2, 2), "b": (0, 2)}, "y": {"a": (1, 2), "b": (1, 2)}}
    table = opd_mod.competence_table(counts, "hard")
    assert table["x"]["a"] == {"successes": 2, "attempts": 2, "weight": 1.0} and table["x"]["b"]["weight"] == 0.0
    assert table["y"]["a"]["weight"] == table["y"]["b"]["weight"] == 0.5
    assert "x: a 2/2 w=1.00, b 0/2 w=0.00; y:" in opd_mod.competence_summary(table)

    stage = opd_mod.OPDStage.__new__(opd_mod.OPDStage)  # the state methods only, no workspace or teachers
    stage.budget, stage.cfg = None, load_config(None, [TWO]).opd
    stage.state = {"rollout_tokens": 5, "teacher_tokens": 7, "history": {"a": (0, 0), "b": (0, 0)}, "competence": table}
    saved = torch.load(_save(stage.state_dict()), weights_only=False)  # as the checkpoint stores it
    fresh = opd_mod.OPDStage.__new__(opd_mod.OPDStage)
    fresh.budget, fresh.cfg = None, stage.cfg
    fresh.state = {"rollout_tokens": 0, "teacher_tokens": 0, "history": {"a": (0, 0), "b": (0, 0)}, "competence": None}
    fresh.load_state_dict(saved)
    assert fresh.state["competence"] == table and fresh.state["teacher_tokens"] == 7
    assert fresh.routes() == {"x": {"a": 1.0, "b": 0.0}, "y": {"a": 0.5, "b": 0.5}}
    old = dict(saved, competence=None)  # a checkpoint from before competence: measured at the next step
    fresh.state["competence"] = None
    fresh.load_state_dict(old)
    assert fresh.state["competence"] is None


def _save(obj):
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf
