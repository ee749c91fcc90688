"""``stage_processes: true`` runs each unit of a recipe (a stage, an evaluation) in a fresh process that
resumes the run: the same run as in one process (the same trajectories, figures and weights), each unit
in a process of its own, and a child's failure is the run's."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file
from test_reproducible import _differences
from test_resume import TINY_OVERRIDES, _env

from mentorrl.config import ConfigError, load_config
from mentorrl.train.stage_processes import (
    THP_ENV,
    UnitBoundary,
    UnitGate,
    child_environ,
    recipe_units,
    unit_rendezvous,
)


def test_units_follow_the_recipe():
    cfg = load_config(None, ["recipe=[sft,rft,grpo]", "eval.num_tasks=4", "eval.final_splits=[hidden]"])
    assert recipe_units(cfg) == ["sft", "eval sft", "rft", "eval rft", "grpo", "eval grpo", "eval grpo on hidden"]
    cfg = load_config(None, ["recipe=[sft,grpo]", "eval.num_tasks=0", "eval.final_splits=[hidden]"])
    assert recipe_units(cfg) == ["sft", "grpo"]  # no evaluation: no final splits either


def test_gate_stops_at_the_end_of_its_unit():
    gate = UnitGate(2, first=False)
    gate.passed("sft")
    gate.passed("eval sft")
    with pytest.raises(UnitBoundary, match="grpo"):
        gate.passed("grpo")
    never = UnitGate()
    for u in ("a", "b", "c"):
        never.passed(u)
    assert never.first and never.count == 3


def test_child_environ_sets_only_for_the_start(monkeypatch):
    monkeypatch.delenv(THP_ENV, raising=False)
    monkeypatch.setenv("MENTORRL_KEEP_ME", "user")
    with child_environ({THP_ENV: "1", "MENTORRL_KEEP_ME": "ours"}):
        assert os.environ[THP_ENV] == "1" and os.environ["MENTORRL_KEEP_ME"] == "user"  # the user's wins
    assert THP_ENV not in os.environ and os.environ["MENTORRL_KEEP_ME"] == "user"


def test_forced_variables_are_set_for_the_start_and_restored(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with child_environ({}, force={"MASTER_PORT": "29501", "TORCHELASTIC_USE_AGENT_STORE": "False"}):
        assert os.environ["MASTER_PORT"] == "29501" and os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "False"
    assert os.environ["MASTER_PORT"] == "29500" and "TORCHELASTIC_USE_AGENT_STORE" not in os.environ


@given(st.integers(1024, 65535), st.integers(2, 64), st.integers(0, 40))
def test_each_unit_meets_at_its_own_store_and_every_rank_agrees(port, world, index):
    """The ranks derive the unit's port from the launch alone (so every rank gets the same one), each unit of a
    recipe gets another port than the launcher's and the other units', and rank 0 hosts it."""
    launch = {"WORLD_SIZE": str(world), "MASTER_PORT": str(port)}
    got = [unit_rendezvous({**launch, "RANK": str(r)}, index) for r in range(world)]
    assert all(g == got[0] for g in got)
    ports = [int(unit_rendezvous(launch, i)["MASTER_PORT"]) for i in range(index + 1)]
    assert len(set(ports)) == len(ports) and port not in ports and all(1024 <= q <= 65535 for q in ports)
    assert got[0]["TORCHELASTIC_USE_AGENT_STORE"] == "False"
    assert unit_rendezvous({"MASTER_PORT": str(port)}, index) == {}  # one process: nothing to meet


def test_config_refuses_what_cannot_work():
    with pytest.raises(ConfigError, match="huge_pages needs stage_processes"):
        load_config(None, ["huge_pages=true"])
    with pytest.raises(ConfigError, match="not with distributed.backend ray"):
        load_config(None, ["stage_processes=true", "distributed.backend=ray"])
    assert load_config(None, ["stage_processes=true", "huge_pages=true"]).huge_pages


def _train(tmp_path: Path, name: str, data: dict) -> tuple[int, str]:
    """``mentorrl train`` of the config ``data`` (written to NAME.yaml): its exit code and output."""
    cfg_path = tmp_path / f"{name}.yaml"
    cfg_path.write_text(yaml.safe_dump(data, sort_keys=False))
    res = subprocess.run(
        [sys.executable, "-m", "mentorrl.cli", "train", str(cfg_path)],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    return res.returncode, res.stdout + res.stderr


def _run(tmp_path: Path, name: str, extra: list[str]) -> tuple[Path, str]:
    run_dir = tmp_path / name
    cfg = load_config(None, TINY_OVERRIDES + ["eval.final_splits=[hidden]", f"run_dir={run_dir}"] + extra)
    code, out = _train(tmp_path, name, cfg.model_dump(mode="json"))
    assert code == 0, out
    return run_dir, out


def _records(run_dir: Path, stage: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, filter(None, lines)) if r.get("stage") == stage]


def _evaluation(run_dir: Path, name: str) -> list[dict]:
    """An evaluation's trajectories, but their timings and their random record ids."""
    rows = [json.loads(x) for x in (run_dir / name).read_text().splitlines() if x.strip()]
    return [{k: v for k, v in r.items() if k not in ("timings", "id")} for r in rows]


@pytest.mark.slow
def test_stage_processes_give_the_same_run(tmp_path):
    one, _ = _run(tmp_path, "one", [])
    many, out = _run(tmp_path, "many", ["stage_processes=true", "huge_pages=true"])
    # each unit in a process of its own, THP asked for
    pids = re.findall(r"stage process (\d)/5: ([a-z ]+) \(pid (\d+), THP_MEM_ALLOC_ENABLE=1\)", out)
    assert [u for _, u, _ in pids] == ["sft", "eval sft", "grpo", "eval grpo", "eval grpo on hidden"], out
    assert len({p for _, _, p in pids}) == 5 and str(os.getpid()) not in {p for _, _, p in pids}
    # the same run: the steps' logged values (timings aside), the evaluations, the final weights
    for stage in ("sft", "grpo"):
        a, b = _records(one, stage), _records(many, stage)
        assert [r["step"] for r in a] == [r["step"] for r in b] and a
        assert not _differences(a, b), stage
    for name in ("eval_sft.jsonl", "eval_grpo.jsonl", "eval_grpo_hidden.jsonl"):
        assert _evaluation(one, name) == _evaluation(many, name), name
    wa, wb = (load_file(str(next((d / "grpo" / "final").glob("*.safetensors")))) for d in (one, many))
    assert wa.keys() == wb.keys() and all(wa[k].equal(wb[k]) for k in wa)
    assert "held-out success after" in out and (many / "report.json").exists()


def test_a_child_failure_is_the_runs(tmp_path):
    """A child's error ends the run as it would in one process: the same exit code and message."""
    got = {}
    for flag in ("false", "true"):
        cfg = load_config(None, TINY_OVERRIDES + [f"run_dir={tmp_path / flag}", f"stage_processes={flag}"])
        data = cfg.model_dump(mode="json")
        data["model"]["path"] = str(tmp_path / "no-such-checkpoint")
        code, out = _train(tmp_path, flag, data)
        assert "no-such-checkpoint is not a Hugging Face checkpoint" in out and "Traceback" not in out, out
        got[flag] = (code, [x for x in out.splitlines() if "no-such-checkpoint" in x])
    assert got["true"] == got["false"] and got["true"][0] != 0


@pytest.mark.slow
def test_a_killed_parent_takes_its_stage_process_along_and_the_run_resumes(tmp_path):
    run_dir = tmp_path / "run"
    cfg = load_config(
        None,
        TINY_OVERRIDES
        + [
            f"run_dir={run_dir}",
            "stage_processes=true",
            "grpo.steps=400",
            "grpo.checkpoint_every=50",
            "eval.num_tasks=0",
        ],
    )
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    log = tmp_path / "out.log"
    with log.open("w") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mentorrl.cli", "train", str(cfg_path)],
            cwd=tmp_path,
            env=_env(),
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 240
        child = None
        while child is None or not (run_dir / "grpo" / "checkpoints").exists():  # GRPO steps under way
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the run did not reach its GRPO unit (rc={proc.poll()}):\n{log.read_text()}")
            m = re.search(r"stage process 2/\d+: grpo \(pid (\d+)", log.read_text())
            child = int(m.group(1)) if m else None
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 3  # its unit had ~350 steps left, more than 10 s
        while _alive(child):
            assert time.monotonic() < deadline, "the GRPO stage process outlived its killed parent"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    res = subprocess.run(
        [sys.executable, "-m", "mentorrl.cli", "train", str(cfg_path), "--resume"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert [r["step"] for r in _records(run_dir, "grpo")] == list(range(1, 401))
    assert (run_dir / "report.json").exists()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its new parent, counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
