"""``bench/sandbox_startup.py``'s scaling and verify-path measurements, at tiny counts (a few seconds)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import sandbox_startup as bench  # noqa: E402
from mentorrl.envs.code import sandbox as sb  # noqa: E402

try:
    sb.check_sandbox()
    REASON = ""
except sb.SandboxUnavailable as e:  # pragma: no cover - depends on the machine
    REASON = str(e)

pytestmark = pytest.mark.skipif(bool(REASON), reason=f"the code sandbox is unavailable: {REASON}")


def _bench_dirs() -> set[str]:
    return {p.name for p in sb.sandbox_root().glob("bench-*")}


def test_scaling_reports_each_worker_count_and_removes_its_workspaces():
    before = _bench_dirs()
    out = bench.scaling([1, 2], runs=2, rounds=1)  # one batch each: both threads of the pool of two run
    assert set(out) == {"1", "2"}
    for row in out.values():
        assert set(row) == {"calls_per_s", "median_ms", "min_ms", "runs", "wall_s"}
        assert row["runs"] == 2 and row["calls_per_s"] > 0 and 0 < row["min_ms"] <= row["median_ms"]
    assert _bench_dirs() <= before


def test_main_writes_workers_and_verify_and_keeps_the_default_output(tmp_path, monkeypatch):
    path = tmp_path / "out.json"
    argv = ["sandbox_startup.py", "--runs", "2", "--workers", "1", "2", "--verify", "1", "--json", str(path)]
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    out = json.loads(path.read_text())
    assert out["cpu_count"] >= 1 and len(out["loadavg"]) == 3 and len(out["loadavg_before_workers"]) == 3
    assert set(out["workers"]) == {"1", "2"} and all(r["calls_per_s"] > 0 for r in out["workers"].values())
    assert set(out["verify"]) == {"run_tests", "verify"} and all(r["runs"] == 1 for r in out["verify"].values())
    monkeypatch.setattr(sys, "argv", ["sandbox_startup.py", "--runs", "1", "--json", str(path)])
    bench.main()  # without the new options: exactly the keys it always wrote
    assert list(json.loads(path.read_text())) == ["unshare", "bwrap", "run_sandboxed", "loadavg"]
