"""Per-step rollout metrics in metrics.jsonl (tool calls per trajectory, malformed-call rate,
finish-reason shares, turns, policy tokens, rollout vs update seconds, CPU utilisation), and the
run report's plot of them."""

from __future__ import annotations

import json

import pytest

from mentorrl.trajectory import read_jsonl

FINISH = ("answer", "max_turns", "max_tokens", "length")


def _expected(trajs) -> dict[str, float]:
    n = len(trajs)
    calls = [c for t in trajs for c in t.tool_calls]
    malformed = sum(c.error_kind == "malformed" for c in calls)
    out = {
        "tool_calls_per_traj": (len(calls) - malformed) / n,
        "malformed_call_rate": malformed / len(calls) if calls else 0.0,
        "mean_turns": sum(t.num_turns for t in trajs) / n,
        "mean_policy_tokens": sum(t.num_policy_tokens for t in trajs) / n,
        "rollout_tokens": float(sum(t.num_policy_tokens for t in trajs)),
        "rollout_tool_s": sum(t.timings.get("tool_s", 0.0) for t in trajs),
        "rollout_verify_s": sum(t.timings.get("verify_s", 0.0) for t in trajs),
    }
    out.update({f"finish_{r}": sum(t.finish_reason == r for t in trajs) / n for r in FINISH})
    return out


def test_rollout_metrics_count_calls_malformed_and_finish_reasons(make_demos):
    from mentorrl.train.stage_helpers import rollout_metrics

    _, demos = make_demos(6)
    trajs = [d.model_copy(deep=True) for d in demos]
    # one malformed call in the first trajectory, and two trajectories that did not answer
    trajs[0].tool_calls[0].error_kind, trajs[0].tool_calls[0].error = "malformed", "malformed tool call"
    trajs[1].finish_reason, trajs[2].finish_reason = "max_turns", "length"
    for t in trajs:
        t.timings = {}
    trajs[0].timings, trajs[1].timings = {"tool_s": 0.25, "verify_s": 0.5}, {"tool_s": 0.125}
    m = rollout_metrics(trajs)
    assert (m["rollout_tool_s"], m["rollout_verify_s"]) == (0.375, 0.5)  # the episodes' seconds, summed
    want = _expected(trajs)
    assert {k: m[k] for k in want} == pytest.approx(want)
    calls = sum(len(t.tool_calls) for t in trajs)
    assert m["malformed_call_rate"] == pytest.approx(1 / calls) and m["malformed_call_rate"] > 0
    assert m["finish_answer"] == pytest.approx((len(trajs) - 2) / len(trajs))
    assert sum(m[f"finish_{r}"] for r in FINISH) == pytest.approx(1.0)


def test_grpo_steps_log_rollout_metrics_and_the_report_plots_them(tiny_model_dir, tmp_path):
    from mentorrl.config import RunConfig
    from mentorrl.train.pipeline import run_recipe

    run = tmp_path / "run"
    cfg = RunConfig.model_validate(
        {
            "run_dir": str(run),
            "recipe": ["grpo"],
            "threads": 1,
            "model": {"path": str(tiny_model_dir)},
            "audit": {"preflight": False},
            "eval": {"num_tasks": 0},
            "sampling": {"max_new_tokens": 12},
            "limits": {"max_turns": 3, "max_total_tokens": 1024},
            "grpo": {
                "steps": 2,
                "tasks_per_step": 2,
                "samples_per_task": 2,
                "sample_trajectories": 4,
                "checkpoint_every": 2,
            },
        }
    )
    run_recipe(cfg, show_progress=False)
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if r["stage"] == "grpo"]
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        trajs = list(read_jsonl(run / "samples" / f"grpo-step-{r['step']:06d}.jsonl"))  # every trajectory of the step
        assert len(trajs) == 4
        want = _expected(trajs)
        assert {k: r[k] for k in want} == pytest.approx(want)
        assert 0 < r["rollout_s"] and 0 <= r["update_s"] and r["rollout_s"] + r["update_s"] <= r["step_s"]
        assert r["cpu_cores"] >= 1 and 0 < r["cpu_util"] <= 1.0 + 1e-6
        assert r["cpu_s"] == pytest.approx(r["cpu_util"] * r["cpu_cores"] * r["step_s"], rel=1e-6)
        assert 0 < r["rollout_cpu_util"] <= 1.0 + 1e-6
        assert (
            0 < r["rollout_cpu_s"] and 0 <= r["update_cpu_s"] and r["rollout_cpu_s"] + r["update_cpu_s"] <= r["cpu_s"]
        )
    report = json.loads((run / "report.json").read_text())
    plot = report["step_metrics"]["plot"]
    assert (run / plot).is_file() and (run / plot).stat().st_size > 1000
    assert report["step_metrics"]["stage"] == "grpo"
    means = report["step_metrics"]["means"]
    assert means["tool_calls_per_traj"] == pytest.approx(sum(r["tool_calls_per_traj"] for r in recs) / 2)
    md = (run / "report.md").read_text()
    assert "## Per-step rollout metrics" in md and f"![per-step rollout metrics]({plot})" in md
    assert "malformed-call rate" in md and "CPU utilisation" in md


class _Ranks:
    """The all_gather of a data-parallel group, with each rank's object given."""

    def __init__(self, objs):
        self.objs = objs

    def all_gather(self, mine):
        return [mine, *self.objs]


def test_data_parallel_cpu_time_is_the_machines_not_rank_zeros(monkeypatch):
    """Each rank times its own process: the logged CPU seconds (and so cpu_util) sum over ranks, or two
    fully busy 1-thread ranks on 2 cores would read 50% busy."""
    from mentorrl.train import stage_checkpoints as sc

    monkeypatch.setattr(sc, "cpu_cores", lambda: 2)
    m = {"rollout_s": 4.0, "rollout_cpu_s": 3.0, "update_cpu_s": 1.0, "loss": 0.5}
    other = (4.5, {"rollout_cpu_s": 3.5, "update_cpu_s": 0.75})
    out, cpu = sc.ranks_cpu(_Ranks([other]), m, 4.25)
    assert cpu == 8.75 and out["rollout_cpu_s"] == 6.5 and out["update_cpu_s"] == 1.75 and out["loss"] == 0.5
    assert out["rollout_cpu_util"] == pytest.approx(6.5 / 4.0 / 2)
    assert sc.step_timing(out, 5.0, cpu)["cpu_util"] == pytest.approx(8.75 / 5.0 / 2)
    assert sc.ranks_cpu(None, m, 4.25) == (m, 4.25)  # one process: as measured
