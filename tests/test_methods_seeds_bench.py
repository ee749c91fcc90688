"""bench/methods_seeds.py reads finished runs back: tokens to reach GRPO's final success, equal-trajectory
comparisons on the same check tasks, and the per-seed differences."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "methods_seeds.py"


def _bench():
    sys.path.insert(0, str(BENCH.parent))
    spec = importlib.util.spec_from_file_location("methods_seeds", BENCH)
    b = importlib.util.module_from_spec(spec)
    sys.modules["methods_seeds"] = b  # a dataclass resolves its annotations through its module
    spec.loader.exec_module(b)
    return b


def _eval(run: Path, label: str, success: float, per_task: list[bool] | None = None) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / f"eval_{label}.json").write_text(
        json.dumps(
            {"success": success, "success_ci95": [success - 0.04, success + 0.04], "violation_rate": 0.1, "n": 500}
        )
    )
    if per_task is not None:
        (run / f"eval_{label}.jsonl").write_text(
            "".join(json.dumps({"task_id": f"t{i}", "reward": {"success": s}}) + "\n" for i, s in enumerate(per_task))
        )


def _metrics(run: Path, stage: str, rows: list[dict]) -> None:
    (run / "metrics.jsonl").write_text("".join(json.dumps({"stage": stage, **r}) + "\n" for r in rows))


def test_tokens_to_target_and_equal_trajectories(tmp_path, capsys):
    b = _bench()
    for s in (0, 1, 2):
        # SFT: 100 check tasks, 30 + s successes among them (the rest of the 500 do not count)
        _eval(tmp_path / f"s{s}", "sft", 0.3, [i < 30 + s for i in range(100)] + [True] * 400)
        g = tmp_path / f"grpo-s{s}"
        _eval(g, "grpo", 0.5)
        # GRPO: 1000 tokens and 128 rollouts a step; checks at steps 2 and 4: 0.40 then 0.50 -> target 0.45
        _metrics(
            g,
            "grpo",
            [
                {
                    "step": i,
                    "rollout_tokens": 1000,
                    "rollouts": 128,
                    **({"heldout_success": {2: 0.4, 4: 0.5}[i]} if i in (2, 4) else {}),
                }
                for i in range(1, 5)
            ],
        )
        o = tmp_path / "out" / f"opd-s{s}"
        _eval(o, "opd", 0.55 + s / 100)
        # OPD: 100 tokens a step; checks 0.5 (two-check mean with the start ~0.4) then 0.6 (mean 0.55 >= 0.45)
        _metrics(
            o,
            "opd",
            [
                {"step": 1, "rollout_tokens": 100, "heldout_success": 0.5},
                {"step": 2, "rollout_tokens": 100, "heldout_success": 0.6},
            ],
        )
        sao = tmp_path / "out" / f"sao-s{s}"
        _eval(sao, "sao", 0.45, [i < 60 for i in range(100)] + [False] * 400)
        _metrics(sao, "sao", [{"step": i, "rollouts": 64} for i in range(1, 5)])  # 256 trajectories: GRPO step 2
    b.main(
        [
            "--sft",
            str(tmp_path / "s{seed}" / "sft" / "final"),
            "--grpo-run",
            str(tmp_path / "grpo-s{seed}"),
            "--methods",
            "opd",
            "sao",
            "--teacher",
            "T",
            "--check-tasks",
            "100",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    res = json.loads((tmp_path / "out" / "methods_opd_sao_s012.json").read_text())
    t0 = res["opd"]["seeds"][0]["tokens"]
    assert t0["target"] == pytest.approx(0.45)
    assert t0["grpo_to_target"] == 4000 and t0["to_target"] == 200 and t0["fraction_of_grpo"] == pytest.approx(0.05)
    assert [p[2] for p in t0["curve"]] == [pytest.approx(0.30), 0.5, 0.6]
    assert res["opd"]["minus_sft"]["mean"] == pytest.approx(26.0)
    e = res["sao"]["seeds"][1]["equal_trajectories"]
    assert (e["trajectories"], e["grpo_step"], e["grpo_trajectories"], e["grpo"], e["method"]) == (
        256,
        2,
        256,
        0.4,
        0.6,
    )
    assert res["sao"]["equal_trajectories_minus_grpo"]["mean"] == pytest.approx(20.0)
    # 256 trajectories sit exactly on GRPO's step-2 check; the first at or above it is that same check
    assert e["grpo_at_or_above"] == {"step": 2, "trajectories": 256, "success": 0.4}
    assert res["sao"]["minus_grpo_at_or_above"]["mean"] == pytest.approx(20.0)
    out = capsys.readouterr().out
    assert "opd minus GRPO (final evaluations) over 3 seeds" in out


def test_a_method_that_never_reaches_the_target_is_reported_not_crashed(tmp_path, capsys):
    b = _bench()
    _eval(tmp_path / "s0", "sft", 0.3, [False] * 10)
    g = tmp_path / "grpo-s0"
    _eval(g, "grpo", 0.5)
    _metrics(
        g,
        "grpo",
        [
            {"step": 1, "rollout_tokens": 10, "heldout_success": 0.5},
            {"step": 2, "rollout_tokens": 10, "heldout_success": 0.5},
        ],
    )
    o = tmp_path / "out" / "opd-s0"
    _eval(o, "opd", 0.2)
    _metrics(o, "opd", [{"step": 1, "rollout_tokens": 5, "heldout_success": 0.1}])
    b.main(
        [
            "--sft",
            str(tmp_path / "s{seed}" / "sft" / "final"),
            "--grpo-run",
            str(tmp_path / "grpo-s{seed}"),
            "--methods",
            "opd",
            "--seeds",
            "0",
            "--teacher",
            "T",
            "--check-tasks",
            "10",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert "not within 5" in capsys.readouterr().out
    res = json.loads((tmp_path / "out" / "methods_opd_s0.json").read_text())
    assert res["opd"]["seeds"][0]["tokens"]["to_target"] is None


def test_a_distilling_method_without_its_teacher_is_refused(tmp_path):
    b = _bench()
    _eval(tmp_path / "s0", "sft", 0.3, [False] * 10)
    _eval(tmp_path / "grpo-s0", "grpo", 0.5)
    _metrics(tmp_path / "grpo-s0", "grpo", [{"step": 1, "rollout_tokens": 10, "heldout_success": 0.5}])
    with pytest.raises(SystemExit, match="cross-teacher"):
        b.main(
            [
                "--sft",
                str(tmp_path / "s{seed}" / "sft" / "final"),
                "--grpo-run",
                str(tmp_path / "grpo-s{seed}"),
                "--methods",
                "opd_cross",
                "--seeds",
                "0",
                "--out",
                str(tmp_path / "out"),
            ]
        )


def test_blackbox_methods_serve_the_given_teacher_and_their_overrides_validate(tmp_path, monkeypatch):
    """Every black-box recipe runs its config's blackbox stage with that recipe and the --bb-teacher
    checkpoint served over HTTP; the overrides load as a valid run config; without a teacher it refuses."""
    from mentorrl.cli_common import load_run_config

    b = _bench()
    seen = {}
    monkeypatch.setattr(
        b, "train_run", lambda config, overrides, *a, **k: seen.setdefault(Path(config).name, overrides)
    )
    teachers = {"teacher": None, "cross": None, "bb": str(tmp_path / "T")}
    for recipe in b.BB_RECIPES:
        seen.clear()
        b.run_method(tmp_path / "out", f"bb_{recipe}", 0, tmp_path / "sft", teachers, [], 100)
        ((config, overrides),) = seen.items()
        assert f"blackbox.recipe={recipe}" in overrides and "recipe=[blackbox]" in overrides
        cfg = load_run_config(str(b.CONFIGS / config), overrides, str(tmp_path / "run"), "demo.yaml")
        assert cfg.blackbox.recipe == recipe and str(cfg.blackbox.teacher.serve.path) == str(tmp_path / "T")
    with pytest.raises(SystemExit, match="bb-teacher"):
        b.run_method(tmp_path / "out2", "bb_score", 0, tmp_path / "sft", {**teachers, "bb": None}, [], 100)


def test_a_method_between_grpo_checks_is_also_compared_with_the_next_check(tmp_path):
    """192 trajectories fall before GRPO's first check (256): at-or-below is GRPO's start, and the
    comparison that gives GRPO at least as many trajectories is its step-2 check."""
    b = _bench()
    _eval(tmp_path / "s0", "sft", 0.3, [i < 30 for i in range(100)] + [True] * 400)
    g = tmp_path / "grpo-s0"
    _eval(g, "grpo", 0.5)
    _metrics(
        g,
        "grpo",
        [
            {"step": i, "rollouts": 128, **({"heldout_success": {2: 0.4, 4: 0.5}[i]} if i in (2, 4) else {})}
            for i in range(1, 5)
        ],
    )
    sao = tmp_path / "out" / "sao-s0"
    _eval(sao, "sao", 0.45, [i < 55 for i in range(100)] + [False] * 400)
    _metrics(sao, "sao", [{"step": i, "rollouts": 64} for i in range(1, 4)])
    b.main(
        [
            "--sft",
            str(tmp_path / "s{seed}" / "sft" / "final"),
            "--grpo-run",
            str(tmp_path / "grpo-s{seed}"),
            "--methods",
            "sao",
            "--seeds",
            "0",
            "--check-tasks",
            "100",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    e = json.loads((tmp_path / "out" / "methods_sao_s0.json").read_text())["sao"]["seeds"][0]["equal_trajectories"]
    assert (e["trajectories"], e["grpo_step"], e["grpo"]) == (192, 0, pytest.approx(0.30))
    assert e["grpo_at_or_above"] == {"step": 2, "trajectories": 256, "success": 0.4}
    assert e["method"] == pytest.approx(0.55)


def test_specialist_arms_list_the_two_specialists_and_their_routing(tmp_path, monkeypatch):
    """The MOPD-from-specialists arms: opd.yaml with exactly spec_a and spec_b as teachers (one for the
    single-teacher arms); the oracle routes each family to its own specialist, the competence arm measures
    the routes, the mix arm weights as mopd.yaml does; the overrides load; a missing specialist is refused."""
    import yaml

    from mentorrl.cli_common import load_run_config
    from mentorrl.envs.orders.tasks import FAMILIES

    b = _bench()
    seen = {}
    monkeypatch.setattr(
        b, "train_run", lambda config, overrides, *a, **k: seen.setdefault(Path(config).name, overrides)
    )
    teachers = {"spec_a": str(tmp_path / "A"), "spec_b": str(tmp_path / "B")}
    spec = b.spec_split(["refund", "order_status"])
    assert spec["spec_b"] == [f for f in FAMILIES if f not in ("refund", "order_status")]
    cfgs = {}
    for name in ("opd_spec_a", "opd_spec_b", "mopd_oracle", "mopd_competence", "mopd_mix"):
        seen.clear()
        b.run_method(tmp_path / "out", name, 0, tmp_path / "sft", teachers, [], 100, spec)
        ((config, overrides),) = seen.items()
        assert config == "opd.yaml" and "recipe=[opd]" in overrides
        cfgs[name] = load_run_config(str(b.CONFIGS / config), overrides, str(tmp_path / "run"), "demo.yaml").opd
    listed = {n: [(t.name, t.path) for t in o.teachers] for n, o in cfgs.items()}
    both = [("spec_a", teachers["spec_a"]), ("spec_b", teachers["spec_b"])]
    assert listed == {
        "opd_spec_a": both[:1],
        "opd_spec_b": both[1:],
        "mopd_oracle": both,
        "mopd_competence": both,
        "mopd_mix": both,
    }
    oracle = cfgs["mopd_oracle"].mopd
    assert oracle.routes == {f: {"spec_a" if f in ("refund", "order_status") else "spec_b": 1.0} for f in FAMILIES}
    assert oracle.competence is None and oracle.confidence_temperature is None and not oracle.success_history
    comp = cfgs["mopd_competence"].mopd
    assert comp.routes == {} and (comp.competence.tasks_per_family, comp.competence.mode) == (8, "soft")
    shipped = yaml.safe_load((b.CONFIGS / "mopd.yaml").read_text())["opd"]["mopd"]
    mix = cfgs["mopd_mix"].mopd
    assert mix.routes == {} and mix.competence is None
    assert (mix.confidence_temperature, mix.success_history) == (
        shipped["confidence_temperature"],
        shipped["success_history"],
    )
    assert all(o.terms == cfgs["opd_spec_a"].terms for o in cfgs.values())  # only the routing differs
    seen.clear()
    b.run_method(tmp_path / "out2", "mopd_oracle", 0, tmp_path / "sft", teachers, [], 100)  # the default split
    routes = load_run_config(str(b.CONFIGS / "opd.yaml"), seen["opd.yaml"], str(tmp_path / "r"), "demo.yaml")
    assert routes.opd.mopd.routes["cancel_order"] == {"spec_a": 1.0} and routes.opd.mopd.routes["refund"] == {
        "spec_b": 1.0
    }
    with pytest.raises(SystemExit, match="--spec-b"):
        b.run_method(tmp_path / "out3", "mopd_mix", 0, tmp_path / "sft", {**teachers, "spec_b": None}, [], 100)
    with pytest.raises(SystemExit, match="some but not all"):
        b.spec_split(["refund", "refunds"])


def test_specialist_arms_report_the_specialists_alone_and_the_gap_to_the_oracle(tmp_path, monkeypatch, capsys):
    b = _bench()
    _eval(tmp_path / "s0", "sft", 0.3, [False] * 10)
    _eval(tmp_path / "grpo-s0", "grpo", 0.5)
    _metrics(tmp_path / "grpo-s0", "grpo", [{"step": 1, "rollout_tokens": 10, "heldout_success": 0.5}])
    for key, success in (("a", 0.4), ("b", 0.45)):
        _eval(tmp_path / f"spec-{key}", "sft", success, [False] * 10)
    for name, success in (("mopd_oracle", 0.6), ("mopd_mix", 0.55)):
        o = tmp_path / "out" / f"{name}-s0"
        _eval(o, "opd", success)
        _metrics(o, "opd", [{"step": 1, "rollout_tokens": 5, "heldout_success": success}])
    argv = ["--sft", str(tmp_path / "s{seed}" / "sft" / "final"), "--grpo-run", str(tmp_path / "grpo-s{seed}")]
    argv += ["--seeds", "0", "--check-tasks", "10", "--out", str(tmp_path / "out")]
    argv += [
        "--spec-a",
        str(tmp_path / "spec-a" / "sft" / "final"),
        "--spec-b",
        str(tmp_path / "spec-b" / "sft" / "final"),
    ]
    b.main(argv + ["--methods", "mopd_oracle", "mopd_mix"])
    res = json.loads((tmp_path / "out" / "methods_mopd_oracle_mopd_mix_s0.json").read_text())
    assert res["specialists"]["spec_a"]["alone"]["success"] == 0.4
    assert res["specialists"]["spec_b"]["families"] == ["update_address", "refund", "place_order", "email_receipt"]
    assert res["minus_oracle"]["mopd_mix"]["mean"] == pytest.approx(-5.0)
    assert "spec_b (update_address, refund, place_order, email_receipt) alone: 45.0%" in capsys.readouterr().out


# ---- the incremental results file (bench/_arms.py, --results) ------------------------------------------------


def _arms():
    _bench()  # puts bench/ on sys.path
    import _arms

    return _arms


def _references(tmp_path: Path, seeds=(0, 1)) -> None:
    for s in seeds:
        _eval(tmp_path / f"s{s}", "sft", 0.3, [i % 3 == 0 for i in range(30)])
        g = tmp_path / f"grpo-s{s}"
        _eval(g, "grpo", 0.5, [i % 2 == 0 for i in range(30)])
        _metrics(g, "grpo", [{"step": i, "rollouts": 64, "heldout_success": 0.4} for i in (1, 2)])


def _fake_training(b, monkeypatch, fail_on: str | None = None) -> list[str]:
    """train_run's stand-in: writes the run's evaluation (SAO better than GRPO on every fourth task) and records
    the run directory; ``fail_on``: a run directory name that dies instead (a killed bench)."""
    ran: list[str] = []

    def fake(config, overrides, label, log=None):
        run = Path(next(o.split("=", 1)[1] for o in overrides if o.startswith("run_dir=")))
        if run.name == fail_on:
            raise SystemExit(f"{label} killed")
        ran.append(run.name)
        _eval(run, "sao", 0.6, [i % 2 == 0 or i % 4 == 1 for i in range(30)])
        _metrics(run, "sao", [{"step": 1, "rollouts": 64}])

    monkeypatch.setattr(b, "train_run", fake)
    return ran


def _argv(tmp_path: Path, results: Path) -> list[str]:
    return [
        "--sft",
        str(tmp_path / "s{seed}" / "sft" / "final"),
        "--grpo-run",
        str(tmp_path / "grpo-s{seed}"),
        "--methods",
        "sao",
        "--seeds",
        "0",
        "1",
        "--check-tasks",
        "30",
        "--out",
        str(tmp_path / "out"),
        "--results",
        str(results),
    ]


def test_each_finished_arm_is_appended_at_once_and_a_rerun_skips_it(tmp_path, monkeypatch, capsys):
    b = _bench()
    _references(tmp_path)
    results = tmp_path / "committed" / "arms.jsonl"
    _fake_training(b, monkeypatch, fail_on="sao-s1")
    with pytest.raises(SystemExit, match="killed"):  # the bench dies in its second arm
        b.main(_argv(tmp_path, results))
    assert "2 arms to run" in capsys.readouterr().out  # the plan, with its estimate, before any arm
    lines = [json.loads(x) for x in results.read_text().splitlines()]
    assert [(r["arm"], r["seed"]) for r in lines] == [("sft", 0), ("grpo", 0), ("sao", 0), ("sft", 1), ("grpo", 1)]

    ran = _fake_training(b, monkeypatch)
    b.main(_argv(tmp_path, results))
    assert ran == ["sao-s1"]  # only what was missing
    out = capsys.readouterr().out
    assert "1 arms to run (1 already in" in out
    ran.clear()
    b.main(_argv(tmp_path, results))
    assert ran == [] and "0 arms to run" in capsys.readouterr().out

    # paired with its baseline on the same tasks: +25% of tasks (every fourth: i % 4 == 1) better than GRPO
    lines = [json.loads(x) for x in results.read_text().splitlines()]
    sao0 = next(r for r in lines if r["arm"] == "sao" and r["seed"] == 0)
    assert sao0["baseline"] == "grpo" and sao0["command"].startswith("python bench/methods_seeds.py")
    store = _arms().ArmStore.open(results)
    p = store.paired("sao", "grpo", 0)
    assert p["n"] == 30 and p["diff"] == pytest.approx(100 * 8 / 30) and p["ci95"][0] > 0

    # a changed setting is a different arm: planned again, and never read back from the old runs' directories
    with pytest.raises(SystemExit, match="other settings"):
        b.main([*_argv(tmp_path, results), "--set", "sao.steps=3"])
    assert "2 arms to run (0 already in" in capsys.readouterr().out
    ran.clear()
    b.main(
        [
            *_argv(tmp_path, results)[:-4],
            "--out",
            str(tmp_path / "out2"),
            "--results",
            str(results),
            "--set",
            "sao.steps=3",
        ]
    )
    assert ran == ["sao-s0", "sao-s1"]


def test_the_table_is_printed_from_the_results_file_alone(tmp_path, monkeypatch, capsys):
    import shutil

    b = _bench()
    _references(tmp_path)
    results = tmp_path / "arms.jsonl"
    _fake_training(b, monkeypatch)
    b.main(_argv(tmp_path, results))
    capsys.readouterr()
    for d in [*tmp_path.glob("s*"), *tmp_path.glob("grpo-s*"), tmp_path / "out"]:
        shutil.rmtree(d)
    sys.path.insert(0, str(BENCH.parent))
    import methods_table

    methods_table.main([str(results)])
    out = capsys.readouterr().out
    row = next(x for x in out.splitlines() if x.startswith("| `sao`"))
    assert "| grpo | 0, 1 |" in row and "+26.7 [" in row and "python bench/methods_seeds.py" in row
    assert any(x.startswith("| `grpo` | sft |") for x in out.splitlines())


def test_a_corrupt_results_line_is_refused_with_its_line_number(tmp_path):
    a = _arms()
    p = tmp_path / "arms.jsonl"
    p.write_text(
        json.dumps({"arm": "x", "seed": 0, "fingerprint": "f", "success": 0.5, "ci95": [0, 1], "violations": 0, "n": 2})
        + "\n{not json\n"
    )
    with pytest.raises(SystemExit, match="arms.jsonl:2"):
        a.ArmStore.open(p)
    p.write_text('{"arm": "x"}\n')
    with pytest.raises(SystemExit, match="arms.jsonl:1"):
        a.ArmStore.open(p)


@pytest.mark.parametrize("seed", range(3))
def test_paired_bits_is_the_mean_task_difference_with_an_interval_around_it(seed):
    import random

    a = _arms()
    rng = random.Random(seed)
    base = "".join(rng.choice("01") for _ in range(200))
    arm = "".join(rng.choice("01") for _ in range(200))
    p = a.paired_bits(base, arm)
    assert p["diff"] == pytest.approx(100 * (arm.count("1") - base.count("1")) / 200)
    assert p["ci95"][0] <= p["diff"] <= p["ci95"][1]
    assert a.paired_bits(arm, base)["diff"] == pytest.approx(-p["diff"])
    assert a.paired_bits(base, base) == {"n": 200, "diff": 0.0, "ci95": [0.0, 0.0]}
    with pytest.raises(ValueError):
        a.paired_bits(base, arm[:-1])


def test_the_references_are_built_once_into_a_cache_and_the_bench_command_names_them(tmp_path, monkeypatch, capsys):
    """bench/methods_refs.py: a plan with its estimate, each reference one `mentorrl train` run in the cache (a
    finished one never rebuilt, a stopped one resumed), and the methods_seeds command with every path filled in."""
    _bench()
    import methods_refs

    monkeypatch.setenv("MENTORRL_CACHE", str(tmp_path / "cache"))
    calls: list[list[str]] = []

    def fake_run(cmd, env=None):
        calls.append(cmd)
        run = Path(cmd[cmd.index("--run-dir") + 1])
        run.mkdir(parents=True, exist_ok=True)
        if "seed-1" not in str(run) or "--resume" in cmd:  # seed 1 is stopped part-way the first time
            (run / "report.json").write_text("{}")
            return subprocess.CompletedProcess(cmd, 0)
        return subprocess.CompletedProcess(cmd, 1)

    cache = methods_refs.main(["--seeds", "0", "1", "--dry-run"], run=fake_run)
    assert calls == [] and "0 of 4 built; about 40 minutes" in capsys.readouterr().out
    assert str(cache).startswith(str(tmp_path / "cache" / "methods-refs"))
    with pytest.raises(SystemExit, match="seed-1"):
        methods_refs.main(["--seeds", "0", "1"], run=fake_run)
    assert [Path(c[c.index("--run-dir") + 1]).name for c in calls] == ["seed-0", "seed-1"]
    calls.clear()
    methods_refs.main(["--seeds", "0", "1"], run=fake_run)
    assert [Path(c[c.index("--run-dir") + 1]).name for c in calls] == ["seed-1", "spec-a", "spec-b"]
    assert "--resume" in calls[0] and "seed=1" in calls[0]
    spec_a = calls[1][calls[1].index("--set") + 1]
    assert spec_a.startswith("sft.families=[order_status")
    calls.clear()
    out = capsys.readouterr().out
    methods_refs.main(["--seeds", "0", "1"], run=fake_run)
    assert calls == []  # all built: nothing again
    cmd = capsys.readouterr().out.strip().splitlines()[-1]
    assert f"--sft '{cache}/seed-{{seed}}/sft/final'" in cmd and f"opd.teachers_dir={cache}/teachers" in cmd
    assert "--results bench/results/methods_arms.jsonl" in cmd and "built in" in out


def test_jobs_trains_arms_side_by_side_and_appends_each_as_it_finishes(tmp_path, monkeypatch, capsys):
    """``--jobs 2``: two arms train at once; each is appended when it finishes (a killed one lets the other be
    recorded, then the bench fails); a rerun trains only what is missing."""
    import threading
    import time as _time

    b = _bench()
    _references(tmp_path)
    results = tmp_path / "arms.jsonl"
    inflight, peak, lock = [0], [0], threading.Lock()
    ran: list[str] = []

    def fake(config, overrides, label, log=None):
        run = Path(next(o.split("=", 1)[1] for o in overrides if o.startswith("run_dir=")))
        with lock:
            inflight[0] += 1
            peak[0] = max(peak[0], inflight[0])
        _time.sleep(0.3)  # both arms are in flight together
        with lock:
            inflight[0] -= 1
        if run.name == "sao-s0":
            raise SystemExit(f"{label} killed")
        ran.append(run.name)
        _eval(run, "sao", 0.6, [i % 2 == 0 or i % 4 == 1 for i in range(30)])
        _metrics(run, "sao", [{"step": 1, "rollouts": 64}])

    monkeypatch.setattr(b, "train_run", fake)
    with pytest.raises(SystemExit, match="killed"):
        b.main([*_argv(tmp_path, results), "--jobs", "2"])
    assert peak[0] == 2 and ran == ["sao-s1"]
    assert "2 at once" in capsys.readouterr().out
    lines = [json.loads(x) for x in results.read_text().splitlines()]
    sao = [r for r in lines if r["arm"] == "sao"]
    assert [(r["seed"], r["jobs"]) for r in sao] == [(1, 2)] and sao[0]["seconds"] >= 0.3

    monkeypatch.setattr(b, "train_run", lambda *a, **k: (ran.append("again"), fake(*a, **k)))
    with pytest.raises(SystemExit, match="killed"):  # seed 0 is still the one that dies: nothing else reruns
        b.main([*_argv(tmp_path, results), "--jobs", "2"])
    assert ran.count("again") == 1
    with pytest.raises(SystemExit, match="at least 1"):
        b.main([*_argv(tmp_path, results), "--jobs", "0"])
