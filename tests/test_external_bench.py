"""bench/external_vs_grpo.py: the arms' overrides give both the same data budget, finished runs are read
back (success, throughput, the HTTP hop's share) and compared per seed."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "external_vs_grpo.py"


def _bench():
    sys.path.insert(0, str(BENCH.parent))
    spec = importlib.util.spec_from_file_location("external_vs_grpo", BENCH)
    b = importlib.util.module_from_spec(spec)
    sys.modules["external_vs_grpo"] = b
    spec.loader.exec_module(b)
    return b


ARGS = SimpleNamespace(steps=5, tasks_per_step=4, samples_per_task=3, concurrency=2, max_turns=6, eval_tasks=100)


def _run(run: Path, stage: str, success: float, rows: list[dict]) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / f"eval_{stage}.json").write_text(
        json.dumps(
            {"success": success, "success_ci95": [success - 0.05, success + 0.05], "violation_rate": 0, "n": 100}
        )
    )
    (run / "metrics.jsonl").write_text("".join(json.dumps({"stage": stage, **r}) + "\n" for r in rows))


def test_both_arms_get_the_same_budget_and_evaluation(tmp_path):
    b = _bench()
    g = b.arm_overrides("grpo", 1, "SFT", tmp_path, ARGS)
    e = b.arm_overrides("external", 1, "SFT", tmp_path, ARGS)
    for key in ("steps=5", "tasks_per_step=4", "samples_per_task=3"):
        assert f"grpo.{key}" in g and f"external.{key}" in e
    shared = {x for x in g if not x.startswith(("grpo.", "recipe=", "run_dir="))}
    assert shared <= set(e)  # the seed, the SFT weights, the evaluation
    assert "recipe=[external]" in e and any(x.startswith("external.agent=[") and "orders_agent.py" in x for x in e)


def test_throughput_and_the_hop_share():
    b = _bench()
    grpo = b.throughput([{"rollouts": 12, "rollout_s": 6.0}, {"rollouts": 12, "rollout_s": 6.0}])
    assert grpo == {"trajectories": 24.0, "rollout_s": 12.0, "trajectories_per_s": 2.0, "rollout_s_per_trajectory": 0.5}
    ext = b.throughput(
        [
            {"episodes": 12, "episodes_used": 10, "rollout_s": 10.0, "server_generate_s": 4.0},
            {"episodes": 12, "episodes_used": 12, "rollout_s": 10.0, "server_generate_s": 6.0},
        ]
    )
    assert ext["trajectories"] == 22.0 and ext["dropped"] == 2.0
    assert ext["hop_share"] == pytest.approx(0.5)
    assert b.throughput([]) == {
        "trajectories": 0.0,
        "rollout_s": 0,
        "trajectories_per_s": 0.0,
        "rollout_s_per_trajectory": 0.0,
    }


def test_finished_runs_are_read_back_and_compared(tmp_path):
    b = _bench()
    _run(tmp_path / "grpo-s0", "grpo", 0.40, [{"rollouts": 10, "rollout_s": 5.0}])
    _run(
        tmp_path / "external-s0",
        "external",
        0.45,
        [{"episodes": 10, "episodes_used": 10, "rollout_s": 20.0, "server_generate_s": 5.0}],
    )
    runs = b.run_seed(SimpleNamespace(**vars(ARGS), sft="SFT-{seed}"), 0, tmp_path)  # read back: nothing runs
    row = b.seed_row(runs)
    assert row["grpo"] == pytest.approx(40.0) and row["external"] == pytest.approx(45.0)
    assert row["external_minus_grpo"] == pytest.approx(5.0)
    assert row["seconds_per_trajectory_ratio"] == pytest.approx(4.0) and row["hop_share"] == pytest.approx(75.0)
    assert b.read_arm(tmp_path / "missing", "grpo") is None


@pytest.mark.parametrize("arm", ["grpo", "external"])
def test_each_arms_overrides_validate_through_the_real_config_loader(tmp_path, arm):
    """The overrides a run gets must load (the agent's argv, numbers included, stays a list of strings)."""
    from mentorrl.config import load_config

    b = _bench()
    a = SimpleNamespace(steps=2, tasks_per_step=4, samples_per_task=4, concurrency=2, max_turns=6, eval_tasks=10)
    cfg = load_config(b.DEMO, b.arm_overrides(arm, 0, str(tmp_path / "sft"), tmp_path, a))
    if arm == "external":
        assert cfg.external.agent[-2:] == ["--max-turns", "6"]
