"""``threads: auto`` (mentorrl/train/parallelism.py): processes x threads from a documented table of
(cores, device, recipe, overlap, ranks), printed at start and written to the run directory."""

from __future__ import annotations

import json

import pytest
import torch

from mentorrl.config import load_config
from mentorrl.train.parallelism import Parallelism, choose_parallelism
from mentorrl.train.workspace import auto_parallelism, open_workspace

RL = ("sft", "grpo")

# cores, device, recipe, overlap, ranks -> threads, rollout workers, learner ranks
TABLE = [
    (1, "cpu", RL, False, 1, 1, 1, 1),
    (2, "cpu", RL, False, 1, 2, 2, 1),  # today's demo: one process, both cores
    (2, "cpu", RL, True, 1, 1, 1, 1),  # overlap on 2 cores: rollout 1 + learner 1
    (2, "cpu", ("sft",), False, 1, 2, 2, 1),
    (2, "cpu", RL, False, 2, 1, 2, 2),  # torchrun 2 ranks x 1 thread
    (4, "cpu", RL, False, 1, 4, 4, 2),  # ranks advised on more cores
    (64, "cpu", RL, False, 1, 64, 64, 8),
    (64, "cpu", ("sft",), False, 1, 64, 64, 1),  # no rollouts: nothing to split over processes
    (64, "cpu", RL, True, 1, 32, 32, 1),
    (64, "cpu", RL, False, 8, 8, 64, 8),
    (16, "cuda", RL, False, 1, 4, 16, 1),
    (2, "cuda", RL, True, 1, 2, 1, 1),
    (3, "cpu", RL, True, 1, 1, 1, 1),
]


@pytest.mark.parametrize("cores,device,recipe,overlap,ranks,threads,workers,learner_ranks", TABLE)
def test_the_table(cores, device, recipe, overlap, ranks, threads, workers, learner_ranks):
    p = choose_parallelism(cores, device, recipe, overlap, ranks)
    assert (p.threads, p.rollout_workers, p.learner_ranks) == (threads, workers, learner_ranks)
    assert p.reason and str(p.threads) in p.line()
    assert p.threads * max(p.learner_ranks if ranks > 1 else 1, 1) <= max(cores, 1)  # never more threads than cores
    assert choose_parallelism(cores, device, recipe, overlap, ranks) == p  # pure


def test_auto_is_applied_printed_and_written_to_the_run_directory(tmp_path, capsys):
    before = torch.get_num_threads()
    try:
        cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", "threads=auto", "grpo.overlap=one_step"])
        ws = open_workspace(cfg, show_progress=False)
        written = json.loads((ws.run_dir / "parallelism.json").read_text())
        plan = Parallelism(**written["run"])
        assert plan.threads == torch.get_num_threads() == plan.cores  # the run's: SFT keeps every core
        assert "parallelism (threads: auto)" in capsys.readouterr().out
    finally:
        torch.set_num_threads(before)


def test_auto_sets_the_ray_rollout_workers_unless_the_config_did():
    cfg = load_config(None, ["threads=auto", "distributed.backend=ray"])
    plan = auto_parallelism(cfg)
    assert cfg.distributed.rollout_workers == plan.rollout_workers
    cfg = load_config(None, ["threads=auto", "distributed.backend=ray", "distributed.rollout_workers=5"])
    auto_parallelism(cfg)
    assert cfg.distributed.rollout_workers == 5
    assert auto_parallelism(load_config(None, ["threads=2"])) is None


# ---- --ranks: a command run as data-parallel ranks on this machine -------------------------------------
DDP_STAGES = ("sft", "grpo")


@pytest.mark.parametrize(
    "cores, device, recipe, want",
    [
        (1, "cpu", RL, 1),
        (2, "cpu", RL, 2),  # the demo's machine: 2 ranks x 1 thread
        (4, "cpu", RL, 2),
        (64, "cpu", RL, 8),
        (2, "cpu", ("sft", "opd"), 1),  # a stage without a data-parallel learner: one process
        (8, "cuda:0", RL, 1),
    ],
)
def test_auto_ranks_by_cores_device_and_recipe(cores, device, recipe, want):
    from mentorrl.train.parallelism import auto_ranks

    n, why = auto_ranks(cores, device, recipe, DDP_STAGES)
    assert n == want and why


def test_ranks_relaunch_the_same_command_under_torchrun(monkeypatch, tmp_path):
    """``--ranks 2`` validates the config first, then runs the same command (its options kept) as a torchrun
    launch of 2 ranks whose threads are shared out, and exits with the launch's status."""
    import subprocess

    from typer.testing import CliRunner

    from mentorrl.cli import app

    seen: list[list[str]] = []

    def fake_run(cmd, *a, **k):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 3)

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(subprocess, "run", fake_run)
    runner = CliRunner()
    res = runner.invoke(app, ["demo", "--ranks", "2", "--run-dir", str(tmp_path / "r"), "--set", "grpo.steps=3"])
    assert res.exit_code == 3, res.output
    (cmd,) = seen
    at = cmd.index("torch.distributed.run")
    assert cmd[at + 1 : at + 3] == ["--standalone", "--nproc-per-node=2"]
    tail = cmd[cmd.index("mentorrl.cli") + 1 :]
    assert tail == ["demo", "--run-dir", str(tmp_path / "r"), "--set", "grpo.steps=3", "--set", "threads=auto"]
    # a broken config fails before anything is launched; a bad count is refused
    bad = runner.invoke(app, ["demo", "--ranks", "2", "--set", "grpo.no_such_field=1"])
    assert bad.exit_code == 2 and len(seen) == 1
    assert runner.invoke(app, ["demo", "--ranks", "zero"]).exit_code == 2 and len(seen) == 1
    # inside a launch (torchrun set WORLD_SIZE) nothing is launched again
    monkeypatch.setenv("WORLD_SIZE", "2")
    from mentorrl.cli import _launch_ranks

    _launch_ranks(2, ["demo"])
    assert len(seen) == 1


def test_demo_runs_as_auto_ranks_by_default(tmp_path, monkeypatch):
    """`mentorrl demo` with no --ranks launches the ranks `auto` chooses (2 on 2 CPU cores: half the wall time,
    docs/scaling.md); MENTORRL_DEMO_RANKS or --ranks 1 keeps one process; `train` stays one process."""
    import subprocess

    from typer.testing import CliRunner

    import mentorrl.train.parallelism as par
    from mentorrl.cli import app

    seen: list[list[str]] = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, *a, **k: seen.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("MENTORRL_DEMO_RANKS", raising=False)
    monkeypatch.setattr(par, "cpu_cores", lambda: 2)
    runner = CliRunner()
    res = runner.invoke(app, ["demo", "--run-dir", str(tmp_path / "r")])
    assert res.exit_code == 0, res.output
    assert "ranks (--ranks auto): 2" in res.output
    assert "--nproc-per-node=2" in seen[0]
    # one core, --ranks 1 or MENTORRL_DEMO_RANKS=1: this process runs the demo, nothing is launched
    import os

    import mentorrl.cli as cli

    monkeypatch.setattr(cli, "_train", lambda cfg, resume: os.makedirs(cfg.run_dir) or {"ran": True})
    monkeypatch.setattr(par, "cpu_cores", lambda: 1)
    assert runner.invoke(app, ["demo", "--run-dir", str(tmp_path / "a")]).exit_code == 0
    monkeypatch.setattr(par, "cpu_cores", lambda: 2)
    assert runner.invoke(app, ["demo", "--ranks", "1", "--run-dir", str(tmp_path / "b")]).exit_code == 0
    monkeypatch.setenv("MENTORRL_DEMO_RANKS", "1")
    assert runner.invoke(app, ["demo", "--run-dir", str(tmp_path / "c")]).exit_code == 0
    assert len(seen) == 1
    assert all((tmp_path / d / "demo_result.json").exists() for d in "abc")


def test_cpu_clock_counts_the_cpu_of_child_processes_that_ended():
    """A step's sandboxed tool calls and verifications are child processes: their CPU belongs in the step's
    ``cpu_s``. The process clock alone (the cheap fake) misses it."""
    import subprocess
    import sys
    import time

    from mentorrl.train.parallelism import cpu_clock

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass"
    c0, p0 = cpu_clock(), time.process_time()
    subprocess.run([sys.executable, "-c", burn], check=True)
    assert cpu_clock() - c0 >= 0.4
    assert time.process_time() - p0 < 0.3  # the parent itself only waited
