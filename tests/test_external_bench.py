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
    results = tmp_path / "results.jsonl"
    runs = b.run_seed(SimpleNamespace(**vars(ARGS), sft="SFT-{seed}"), 0, tmp_path, results)  # read back: nothing runs
    assert [json.loads(x)["arm"] for x in results.read_text().splitlines()] == ["grpo", "external"]
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


def test_the_arms_train_with_the_same_grpo_settings_and_reward(tmp_path):
    """The external arm's resolved section equals the grpo arm's on every shared setting (the demo sets
    the grpo section's learning rate, warm-up and updates per step; the external section's defaults
    differ), it is scored by the verifier, and its agent runs as one worker."""
    from mentorrl.config import load_config

    b = _bench()
    a = SimpleNamespace(steps=2, tasks_per_step=4, samples_per_task=4, concurrency=2, max_turns=6, eval_tasks=10)
    g = load_config(b.DEMO, b.arm_overrides("grpo", 0, str(tmp_path / "sft"), tmp_path, a)).grpo.model_dump()
    cfg = load_config(b.DEMO, b.arm_overrides("external", 0, str(tmp_path / "sft"), tmp_path, a))
    e = cfg.external.model_dump()
    shared = set(g) & set(e) - b.NOT_SHARED
    assert {k: e[k] for k in shared} == {k: g[k] for k in shared}
    assert cfg.external.reward == "verifier" and cfg.external.mode == "worker"


def test_finished_arms_are_appended_and_skipped_on_a_rerun(tmp_path, monkeypatch):
    b = _bench()
    results = tmp_path / "results.jsonl"
    b.append_result(results, 0, "grpo", {"eval": {"success": 0.4}, "speed": {}})
    b.append_result(results, 0, "external", {"eval": {"success": 0.5}, "speed": {}})
    monkeypatch.setattr(b, "train_run", lambda *a, **k: pytest.fail("a finished arm was run again"))
    runs = b.run_seed(SimpleNamespace(**vars(ARGS), sft="SFT"), 0, tmp_path, results)
    assert runs["external"]["eval"]["success"] == 0.5 and len(results.read_text().splitlines()) == 2


def test_the_breakdown_shares():
    b = _bench()
    got = b.breakdown(
        {
            "time_generate_wall_s": 2.0,
            "time_server_s": 3.0,
            "time_http_json_s": 1.0,
            "time_tools_s": 1.0,
            "time_agent_process_s": 2.5,
            "time_worker_start_s": 0.5,
        }
    )
    assert got == {"generation": 25.0, "server": 12.5, "http_json": 12.5, "tools": 12.5, "agent_process": 37.5}


def test_the_sdk_agent_runs_with_its_own_path_through_env():
    from types import SimpleNamespace

    import external_vs_grpo as B

    plain = B.agent_argv(SimpleNamespace(agent="plain", sdk_path=None, max_turns=6))
    assert plain[1].endswith("orders_agent.py") and plain[-1] == "6"
    sdk = B.agent_argv(SimpleNamespace(agent="sdk", sdk_path="/opt/sdk", max_turns=4))
    assert sdk[:2] == ["env", "PYTHONPATH=/opt/sdk"] and sdk[3].endswith("orders_agent_sdk.py") and sdk[-1] == "4"


def test_the_sdk_agent_runs_as_a_worker_by_default(tmp_path, monkeypatch):
    """``--agent sdk`` takes the default ``--mode worker`` (``external.mode=worker``) and keeps ``--mode episode``."""
    b = _bench()
    seen = []
    monkeypatch.setattr(b, "run_seed", lambda a, seed, out, results=None: seen.append(a) or {})
    for extra in ([], ["--mode", "episode"]):
        argv = ["--sft", "sft", "--seeds", "0", "--arms", "external", "--agent", "sdk", "--out", str(tmp_path)]
        assert b.main(argv + extra) == 0
    assert [a.mode for a in seen] == ["worker", "episode"]
    sets = b.arm_overrides("external", 0, "sft", tmp_path, seen[0])
    assert "external.mode=worker" in sets and any("orders_agent_sdk.py" in s for s in sets)
