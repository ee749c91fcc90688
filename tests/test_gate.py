"""Regression gate: the pure decision, and `mentorrl gate` on evaluation summaries and checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from cli_helpers import cli_output, cli_with
from typer.testing import CliRunner

from mentorrl.cli.eval import register
from mentorrl.envs.orders import OrdersTasks
from mentorrl.eval.gate import GateDecision, GateError, SetResult, gate_decision, set_results
from mentorrl.eval.sets import write_tasks_jsonl


def res(name: str, success: float, kind: str | None = None, fp: str = "f", n: int = 100) -> SetResult:
    return SetResult(name=name, kind=kind or name.split(":")[0], success=success, n=n, fingerprint=fp)


def sets(*results: SetResult) -> dict[str, SetResult]:
    return {r.name: r for r in results}


BASE = sets(res("golden", 0.60), res("regression:bugs", 0.80), res("hidden", 0.40))


# ------------------------------------------------------------ the pure decision ------
def test_accepts_small_drops_and_gains():
    new = sets(res("golden", 0.59), res("regression:bugs", 0.95), res("hidden", 0.40))
    d = gate_decision(new, BASE, tolerance=0.02)
    assert d.accepted and d.reasons == []
    assert [c.name for c in d.comparisons] == ["golden", "regression:bugs"]  # hidden is not gated
    golden = d.comparisons[0]
    assert golden.delta == pytest.approx(-0.01) and golden.passed and golden.tolerance == 0.02
    assert d.summary().startswith("ACCEPTED")


def test_rejects_drop_beyond_tolerance_with_reason():
    new = sets(res("golden", 0.50), res("regression:bugs", 0.80))
    d = gate_decision(new, BASE, tolerance=0.05)
    assert not d.accepted and len(d.reasons) == 1
    assert "golden" in d.reasons[0] and "60.0% to 50.0%" in d.reasons[0] and "tolerance 5.0%" in d.reasons[0]
    assert not d.comparisons[0].passed and d.comparisons[1].passed
    assert d.summary().startswith("REJECTED: golden")


def test_drop_exactly_at_tolerance_is_accepted():
    # 0.80 - 0.75 is 0.05000000000000004 in floating point; the gate must not reject on that noise
    base = sets(res("golden", 0.80))
    assert gate_decision(sets(res("golden", 0.75)), base, tolerance=0.05).accepted
    assert not gate_decision(sets(res("golden", 0.7499)), base, tolerance=0.05).accepted
    assert gate_decision(sets(res("golden", 0.80)), base, tolerance=0.0).accepted
    assert not gate_decision(sets(res("golden", 0.79)), base, tolerance=0.0).accepted


def test_hidden_drops_do_not_gate():
    new = sets(res("golden", 0.60), res("regression:bugs", 0.80), res("hidden", 0.0))
    assert gate_decision(new, BASE).accepted
    assert not gate_decision(new, BASE, kinds=("golden", "regression", "hidden")).accepted


def test_per_set_tolerance():
    new = sets(res("golden", 0.52), res("regression:bugs", 0.79))
    assert not gate_decision(new, BASE, tolerance=0.05).accepted  # golden fell 8 points
    d = gate_decision(new, BASE, tolerance=0.05, per_set={"golden": 0.10})
    assert d.accepted and d.comparisons[0].tolerance == 0.10
    d = gate_decision(new, BASE, tolerance=0.10, per_set={"regression:bugs": 0.0})  # regressions must not slip at all
    assert not d.accepted and d.reasons[0].startswith("regression:bugs")


def test_every_failing_set_is_reported():
    new = sets(res("golden", 0.10), res("regression:bugs", 0.10))
    d = gate_decision(new, BASE)
    assert not d.accepted and [r.split(":")[0] for r in d.reasons] == ["golden", "regression"]


def test_fails_closed_on_missing_or_incomparable_sets():
    d = gate_decision(sets(res("golden", 0.9)), BASE)
    assert not d.accepted and "regression:bugs: missing" in d.reasons[0]
    assert d.comparisons[1].new is None and d.comparisons[1].delta is None
    other_tasks = sets(res("golden", 0.9, fp="g"), res("regression:bugs", 0.9))
    d = gate_decision(other_tasks, BASE)
    assert not d.accepted and "not comparable" in d.reasons[0]
    # an unknown fingerprint (hand-made results) is not checked
    assert gate_decision(sets(res("golden", 0.6, fp=""), res("regression:bugs", 0.8)), BASE).accepted


def test_gate_errors():
    with pytest.raises(GateError, match="no golden or regression set"):
        gate_decision(sets(res("hidden", 0.5)), sets(res("hidden", 0.5)))
    with pytest.raises(GateError, match="not a gated set"):
        gate_decision(BASE, BASE, per_set={"goldn": 0.1})
    with pytest.raises(GateError, match=r"\[0, 1\]"):
        gate_decision(BASE, BASE, tolerance=-0.1)
    with pytest.raises(GateError, match=r"\[0, 1\]"):
        gate_decision(BASE, BASE, per_set={"golden": 2.0})


def summary(successes: dict[str, float], fps: dict[str, str] | None = None) -> dict:
    """The shape `mentorrl eval` writes (only what the gate reads, plus a config)."""
    return {
        "model": "m",
        "config": {"sets": [], "k": [1]},
        "sets": {
            name: {
                "kind": name.split(":")[0],
                "fingerprint": (fps or {}).get(name, "fp-" + name),
                "metrics": {"overall": {"success": s, "n": 50}},
            }
            for name, s in successes.items()
        },
    }


def test_set_results_from_summary():
    r = set_results(summary({"golden": 0.5, "regression:x": 0.25}))
    assert r["regression:x"] == SetResult("regression:x", "regression", 0.25, 50, "fp-regression:x")
    with pytest.raises(GateError, match="not an evaluation summary"):
        set_results({"golden": 1})
    broken = summary({"golden": 0.5})
    del broken["sets"]["golden"]["metrics"]
    with pytest.raises(GateError, match="golden"):
        set_results(broken)
    assert isinstance(GateDecision.model_validate_json(gate_decision(r, r).model_dump_json()), GateDecision)


# ------------------------------------------------------------ the command ------
def _cli() -> typer.Typer:
    return cli_with(register)


_output = cli_output


def _write(tmp_path: Path, name: str, data: dict) -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(data))
    return p


def test_gate_cli_on_summaries(tmp_path):
    base = _write(tmp_path, "base.json", summary({"golden": 0.60, "regression:bugs": 0.80, "hidden": 0.5}))
    good = _write(tmp_path, "good.json", summary({"golden": 0.61, "regression:bugs": 0.79, "hidden": 0.1}))
    bad = _write(tmp_path, "bad.json", summary({"golden": 0.40, "regression:bugs": 0.80, "hidden": 0.9}))
    runner = CliRunner()
    ok = runner.invoke(_cli(), ["gate", "--new-summary", str(good), "--baseline-summary", str(base)])
    assert ok.exit_code == 0, _output(ok)
    assert "ACCEPTED" in ok.output and "Regression gate" in ok.output
    rej = runner.invoke(
        _cli(), ["gate", "--new-summary", str(bad), "--baseline-summary", str(base), "--out", str(tmp_path / "g")]
    )
    assert rej.exit_code == 1, _output(rej)
    assert "REJECTED" in rej.output and "golden: success fell from 60.0% to 40.0%" in rej.output
    decision = json.loads((tmp_path / "g" / "gate.json").read_text())
    assert decision["accepted"] is False and decision["reasons"]
    loose = runner.invoke(
        _cli(), ["gate", "--new-summary", str(bad), "--baseline-summary", str(base), "--set-tolerance", "golden=0.25"]
    )
    assert loose.exit_code == 0, _output(loose)
    tight = runner.invoke(
        _cli(), ["gate", "--new-summary", str(good), "--baseline-summary", str(base), "--tolerance", "0"]
    )
    assert tight.exit_code == 1 and "regression:bugs" in tight.output


def test_gate_cli_bad_input(tmp_path):
    base = _write(tmp_path, "base.json", summary({"golden": 0.6}))
    junk = tmp_path / "junk.json"
    junk.write_text("{not json")
    runner = CliRunner()
    cases = [
        (["gate", "--baseline-summary", str(base)], "give the new side"),
        (["gate", "--new-summary", str(junk), "--baseline-summary", str(base)], "cannot read"),
        (
            ["gate", "--new-summary", str(base), "--baseline-summary", str(base), "--set-tolerance", "golden"],
            "NAME=TOLERANCE",
        ),
        (
            ["gate", "--new-summary", str(base), "--baseline-summary", str(base), "--set-tolerance", "gold=0.1"],
            "not a gated set",
        ),
        (
            [
                "gate",
                "--new-summary",
                str(base),
                "--baseline-summary",
                str(_write(tmp_path, "h.json", summary({"hidden": 0.6}))),
            ],
            "no golden or regression set",
        ),
    ]
    for args, message in cases:
        r = runner.invoke(_cli(), args)
        assert r.exit_code == 2, (args, _output(r))
        assert message in _output(r), (args, _output(r))


def test_gate_cli_evaluates_checkpoints(tiny_model_dir, tmp_path):
    """Same checkpoint on both sides: same tasks, same seeds, same success -> accepted; then the
    evaluated summary gates a checkpoint evaluated from it (a summary on one side)."""
    reg = tmp_path / "bugs.jsonl"
    write_tasks_jsonl(reg, OrdersTasks().tasks("train", 2, 11))
    tiny = ["--set", "limits.max_turns=2", "--set", "sampling.max_new_tokens=12"]
    out = tmp_path / "gate"
    r = CliRunner().invoke(
        _cli(),
        [
            "gate",
            str(tiny_model_dir),
            "--baseline",
            str(tiny_model_dir),
            "--on",
            f"regression:{reg}",
            "--num-tasks",
            "2",
            "--out",
            str(out),
            *tiny,
        ],
    )
    assert r.exit_code == 0, _output(r)
    new = json.loads((out / "new" / "eval_summary.json").read_text())
    base = json.loads((out / "baseline" / "eval_summary.json").read_text())
    assert list(new["sets"]) == ["golden", "regression:bugs"]
    for name in new["sets"]:
        assert new["sets"][name]["fingerprint"] == base["sets"][name]["fingerprint"]
    # a recorded baseline summary fixes the sets for the evaluated side
    base_path = out / "baseline" / "eval_summary.json"
    r = CliRunner().invoke(
        _cli(),
        ["gate", str(tiny_model_dir), "--baseline-summary", str(base_path), "--out", str(tmp_path / "gate2"), *tiny],
    )
    assert r.exit_code == 0, _output(r)
    again = json.loads((tmp_path / "gate2" / "new" / "eval_summary.json").read_text())
    assert {k: v["fingerprint"] for k, v in again["sets"].items()} == {
        k: v["fingerprint"] for k, v in base["sets"].items()
    }
    # a baseline evaluated on other tasks is not comparable: rejected
    fake = json.loads(base_path.read_text())
    fake["sets"]["golden"]["fingerprint"] = "0" * 16
    r = CliRunner().invoke(
        _cli(),
        ["gate", "--new-summary", str(base_path), "--baseline-summary", str(_write(tmp_path, "fake.json", fake))],
    )
    assert r.exit_code == 1 and "not comparable" in r.output
