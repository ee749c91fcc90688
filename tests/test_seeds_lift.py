"""bench/seeds_lift.py: the statistics it prints, and one real (tiny) run of two seeds."""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path

import pytest
from test_resume import TINY_OVERRIDES

BENCH = Path(__file__).resolve().parent.parent / "bench" / "seeds_lift.py"


def _bench():
    spec = importlib.util.spec_from_file_location("seeds_lift", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_lift_summary_is_mean_sd_and_a_t_interval():
    b = _bench()
    s = b.lift_summary([2.0, 4.0, 9.0])
    assert s["mean"] == pytest.approx(5.0) and s["sd"] == pytest.approx(statistics.stdev([2.0, 4.0, 9.0]))
    half = 4.303 * s["sd"] / 3**0.5  # t(0.975, 2 dof)
    assert s["ci95"] == pytest.approx((5.0 - half, 5.0 + half))
    one = b.lift_summary([3.0])
    assert one["sd"] is None and one["ci95"] is None
    with pytest.raises(ValueError):
        b.lift_summary([])


def test_paired_lift_counts_each_task_once_on_the_tasks_both_evaluated(tmp_path):
    b = _bench()

    def write(label, results):
        lines = [json.dumps({"task_id": t, "reward": {"success": ok}}) for t, ok in results.items()]
        (tmp_path / f"eval_{label}.jsonl").write_text("\n".join(lines) + "\n")

    assert b.paired_lift(tmp_path) is None
    write("sft", {"a": False, "b": True, "c": False, "d": True, "only_sft": True})
    write("grpo", {"a": True, "b": True, "c": True, "d": False, "only_grpo": False})
    p = b.paired_lift(tmp_path)
    assert p["n"] == 4 and p["only_after"] == 2 and p["only_before"] == 1
    assert p["lift_points"] == pytest.approx(25.0)
    lo, hi = p["ci95_points"]
    assert lo < 25.0 < hi


@pytest.mark.slow
def test_two_tiny_seeds_run_and_are_read_back(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH.parent.parent))
    b = _bench()
    args = ["--out", str(tmp_path), "--seeds", "0", "1"]
    for ov in TINY_OVERRIDES:
        args += ["--set", ov]
    b.main(args)
    out = json.loads((tmp_path / "seeds_lift.json").read_text())
    assert [r["seed"] for r in out["seeds"]] == [0, 1] and out["lift"]["n"] == 2
    assert "lift over 2 seeds" in capsys.readouterr().out
    mtimes = [(tmp_path / f"seed-{s}" / "report.json").stat().st_mtime for s in (0, 1)]
    b.main(args)  # finished seeds are read back, not rerun
    assert [(tmp_path / f"seed-{s}" / "report.json").stat().st_mtime for s in (0, 1)] == mtimes
