"""Shared by the benches that compare runs over seeds (``grpo_guide.py``, ``methods_seeds.py``): one
training run in its own process, a run's final evaluation read back, and the mean ± sd / Student-t
interval line they print."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from mentorrl.eval.metrics import mean_interval


def train_run(config: Path, overrides: list[str], label: str, log: Path | None = None) -> None:
    """``mentorrl train CONFIG --set ...`` in a child process at one torch thread with passive OpenMP
    waiting (so two or three runs can share the cores); output to ``log`` when given. Exits with the
    command on failure."""
    cmd = [sys.executable, "-m", "mentorrl.cli", "train", str(config)]
    for ov in overrides:
        cmd += ["--set", ov]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}
    if log is None:
        done = subprocess.run(cmd, env=env)
    else:
        with open(log, "w") as f:
            done = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        where = f" (log: {log})" if log is not None else ""
        raise SystemExit(f"{label}: `{' '.join(cmd)}` exited {done.returncode}{where}")


def final_eval(path: Path) -> dict:
    """A run's ``eval_*.json``: success, its 95% interval, the violation rate and the task count."""
    d = json.loads(path.read_text())
    return {"success": d["success"], "ci95": d["success_ci95"], "violations": d["violation_rate"], "n": d["n"]}


def same_tasks(a: Path, b: Path) -> None:
    """Refuse to compare two evaluations (``eval_*.json``) run on different tasks, e.g. a plain and
    a stratified draw: the task ids of the ``.jsonl`` beside each, in order, must be equal. Files
    written without their ``.jsonl`` are not checked."""
    ids = []
    for p in (a, b):
        rows = p.with_suffix(".jsonl")
        if not rows.exists():
            return
        ids.append([json.loads(line)["task_id"] for line in rows.read_text().splitlines() if line.strip()])
    if ids[0] != ids[1]:
        raise SystemExit(
            f"{a} and {b} were evaluated on different tasks (another eval.seed, split, num_tasks "
            "or eval.stratify?): re-evaluate one with the other's settings before comparing them"
        )


def summary(label: str, xs: list[float], unit: str = "points", difference: bool = True, indent: str = "") -> dict:
    """Print and return the mean ± sd and Student-t 95% interval of the mean of ``xs`` (one per seed);
    ``difference``: the values are differences, printed signed with the verdict against zero."""
    s = mean_interval(xs)
    f = "+.1f" if difference else ".1f"
    if s["ci95"] is None:
        print(f"{indent}{label}: {s['mean']:{f}} {unit} (one seed: no interval)")
    else:
        lo, hi = s["ci95"]
        verdict = f": {s['verdict']}" if difference else ""
        print(
            f"{indent}{label} over {s['n']} seeds: {s['mean']:{f}} ± {s['sd']:.1f} {unit} (mean ± sd); "
            f"95% interval of the mean [{lo:{f}}, {hi:{f}}]{verdict}"
        )
    return s
