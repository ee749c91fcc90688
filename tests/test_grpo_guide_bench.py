"""bench/grpo_guide.py reads finished runs back and pairs the arms per seed (guide minus plain)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "grpo_guide.py"


def _write(path: Path, success: float, violations: float = 0.1) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "success": success,
                "success_ci95": [success - 0.04, success + 0.04],
                "violation_rate": violations,
                "n": 500,
            }
        )
    )


def test_paired_differences_over_seeds_from_finished_runs(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("grpo_guide", BENCH)
    b = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(b)
    table = {0: (0.30, 0.50, 0.55), 1: (0.50, 0.60, 0.62), 2: (0.40, 0.45, 0.52)}  # sft, plain, guide
    for s, (sft, plain, guide) in table.items():
        _write(tmp_path / f"s{s}" / "eval_sft.json", sft)
        _write(tmp_path / "out" / f"plain-s{s}" / "eval_grpo.json", plain, 0.03)
        _write(tmp_path / "out" / f"guide-s{s}" / "eval_grpo.json", guide, 0.10)
        _write(tmp_path / "out" / f"guide-s{s}" / "eval_grpo_hidden.json", guide - 0.02)
    b.main(["--sft", str(tmp_path / "s{seed}" / "sft" / "final"), "--out", str(tmp_path / "out")])
    res = json.loads((tmp_path / "out" / "grpo_guide.json").read_text())
    assert res["guide_minus_plain"]["mean"] == pytest.approx((5 + 2 + 7) / 3)
    assert res["plain_minus_sft"]["mean"] == pytest.approx((20 + 10 + 5) / 3)
    assert res["violations_guide_minus_plain"]["mean"] == pytest.approx(7.0)
    assert res["seeds"][0]["guide"]["hidden"] == pytest.approx(0.53) and res["seeds"][0]["plain"]["hidden"] is None
    out = capsys.readouterr().out
    assert "guide minus plain over 3 seeds" in out and "| 0 | 30.0% [26.0, 34.0] |" in out


def test_an_arm_evaluated_on_other_tasks_than_its_sft_start_is_refused(tmp_path):
    spec = importlib.util.spec_from_file_location("grpo_guide", BENCH)
    b = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(b)
    sft, arm = tmp_path / "s0" / "eval_sft.json", tmp_path / "out" / "guide-s0" / "eval_grpo.json"
    for path, ids in ((sft, ["t1", "t2"]), (arm, ["t1", "t3"])):
        _write(path, 0.5)
        path.with_suffix(".jsonl").write_text("".join(json.dumps({"task_id": i}) + "\n" for i in ids))
    with pytest.raises(SystemExit, match="different tasks"):
        b.main(
            [
                "--sft",
                str(tmp_path / "s{seed}" / "sft" / "final"),
                "--out",
                str(tmp_path / "out"),
                "--seeds",
                "0",
                "--arms",
                "guide",
            ]
        )
    arm.with_suffix(".jsonl").write_text("".join(json.dumps({"task_id": i}) + "\n" for i in ["t1", "t2"]))
    b.main(
        [
            "--sft",
            str(tmp_path / "s{seed}" / "sft" / "final"),
            "--out",
            str(tmp_path / "out"),
            "--seeds",
            "0",
            "--arms",
            "guide",
        ]
    )
