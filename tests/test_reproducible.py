"""Issue 41, item 5: a fixed seed and configuration give the same numbers, bit for bit, at a fixed
worker count. Two tiny GRPO runs log the same value for every key that is not a timing (the allow-list
below names each timing key); the decisions the code takes from measured time (where a tool call runs,
:mod:`mentorrl.rollout.dispatch`) differ between the runs and change nothing."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import yaml
from test_resume import TINY_OVERRIDES, _env
from test_sao import _sao_workspace

from mentorrl.config import load_config
from mentorrl.rollout import dispatch
from mentorrl.train.recipes.grpo import run_grpo

# The keys of a step's record that measure time (wall or CPU seconds, and ratios of them). Everything
# else a step logs must be equal between two runs of one seed and configuration.
TIMING_KEYS = frozenset(
    {
        "step_s",
        "cpu_s",
        "cpu_util",
        "rollout_s",
        "rollout_cpu_s",
        "rollout_cpu_util",
        "rollout_tool_s",
        "rollout_verify_s",
        "update_s",
        "update_cpu_s",
    }
)
# cpu_cores is the machine's (the same machine: the same value), so it is compared like the rest.

GRPO = [
    "grpo.steps=3",
    "grpo.tasks_per_step=3",
    "grpo.samples_per_task=3",
    "grpo.sample_trajectories=9",
    "audit.eval_every=0",
    # tool latency injected (seeded per episode): the timing of the tool calls varies, the results must not
    "env.latency={kind: pareto, median_s: 0.002, alpha: 1.5, max_s: 0.02}",
]


def _values(rec: dict, prefix: str = "") -> dict[str, object]:
    """Every logged value by its dotted key (nested dicts such as histograms flattened)."""
    out: dict[str, object] = {}
    for k, v in rec.items():
        if isinstance(v, dict):
            out.update(_values(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _differences(a: list[dict], b: list[dict]) -> list[str]:
    assert len(a) == len(b)
    bad = []
    for x, y in zip(a, b):
        vx, vy = _values(x), _values(y)
        assert set(vx) == set(vy), (x["step"], set(vx) ^ set(vy))
        bad += [
            f"{x['stage']} step {x['step']} {k}: {vx[k]!r} != {vy[k]!r}"
            for k in vx
            if k not in TIMING_KEYS and vx[k] != vy[k]
        ]
    return bad


def _samples(run_dir) -> list[tuple]:
    """What each sampled trajectory holds, less its random id and its timings."""
    out = []
    for f in sorted((run_dir / "samples").glob("grpo-step-*.jsonl")):
        for line in f.read_text().splitlines():
            t = json.loads(line)
            out.append((t["task_id"], t["token_ids"], t["logprobs"], t["loss_mask"], t["reward"], t["policy_version"]))
    return out


def test_two_grpo_runs_log_the_same_floats_while_the_dispatch_decisions_differ(
    tmp_path, tokenizer, orders_entry, tool_happy_model, monkeypatch
):
    """The first run starts with no tool-call measurements (its first calls of each kind go to the pool),
    the second with the first's (cheap kinds run inline from its first call): every logged value but the
    timings, and every sampled trajectory, are the same.

    Every call is measured as free: what a call costs on a loaded machine must not decide whether the two
    runs dispatch differently. The dispatch rule then differs for certain: a kind's first ``MIN_SAMPLES``
    calls of the first run go to the pool (nothing is measured before a call ends), while the second run
    starts with the first's measurements and runs every call of a kind called that often inline (the
    verifier is called once per trajectory)."""
    decisions: list[list[bool]] = [[], []]
    real, record = dispatch.runs_inline, dispatch.record
    run = {"k": 0}
    monkeypatch.setattr(
        dispatch, "runs_inline", lambda kind, s: decisions[run["k"]].append(real(kind, s)) or decisions[run["k"]][-1]
    )
    monkeypatch.setattr(dispatch, "record", lambda kind, cpu_s, wall_s: record(kind, 0.0, 0.0))
    dispatch.forget()
    records, samples = [], []
    for k in range(2):
        run["k"] = k
        ws, _ = _sao_workspace(tmp_path / f"r{k}", tokenizer, orders_entry, GRPO)
        run_grpo(ws, copy.deepcopy(tool_happy_model), resume=False)
        records.append([json.loads(x) for x in (ws.run_dir / "metrics.jsonl").read_text().splitlines()])
        samples.append(_samples(ws.run_dir))
    dispatch.forget()
    assert len(decisions[0]) == len(decisions[1]) and not decisions[0][0]  # the first run's first call: the pool
    assert sum(decisions[1]) > sum(decisions[0])  # the measurements the second run starts with decided differently
    assert records[0][0]["tool_calls_per_traj"] + records[0][0]["malformed_call_rate"] > 0  # tools were called
    assert not _differences(*records)
    assert samples[0] == samples[1] and len(samples[0]) == 27


@pytest.mark.slow
def test_two_cli_runs_log_the_same_floats(tmp_path):
    """The real CLI (SFT then GRPO), twice, in two processes with different string-hash seeds: every
    value of every step's record but the timings is the same, bit for bit."""
    records = []
    for k in (1, 2):
        run_dir = tmp_path / f"run{k}"
        cfg = load_config(None, TINY_OVERRIDES + GRPO + [f"run_dir={run_dir}"])
        cfg_path = tmp_path / f"cfg{k}.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        res = subprocess.run(
            [sys.executable, "-m", "mentorrl.cli", "demo", "--config", str(cfg_path), "--no-eval"],
            cwd=tmp_path,
            env=dict(_env(), PYTHONHASHSEED=str(k)),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert res.returncode == 0, res.stdout + res.stderr
        records.append([json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()])
    assert [r["stage"] for r in records[0]] == ["sft"] * 4 + ["grpo"] * 3
    assert not _differences(*records)
    assert os.path.exists(tmp_path / "run1" / "grpo" / "final" / "DONE")
