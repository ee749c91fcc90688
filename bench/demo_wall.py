"""The demo's wall time and cores busy, today's settings against the whole-machine ones (issue 41), per seed.

Each (arm, seed) is one ``mentorrl demo --run-dir OUT/ARM-sSEED --set seed=SEED [ARM's --set ...]`` in its own
process; the bench measures its wall time and the CPU seconds of its whole process tree (``os.wait4``'s
rusage: user + system of the demo and every child it waited for), and reads the run's figures back: SFT and
GRPO held-out success (with their Wilson intervals), the hidden set's, and the GRPO stage's mean ``cpu_util``
(the share of the machine's cores busy, as each step logs it).

Arms:

* ``today``: the demo as it ships (since the demo defaults to ``--ranks auto``: 2 data-parallel ranks of one
  thread each on 2 cores; rows before that tag measured one process, ``threads: 2``);
* ``one``: one process (``--ranks 1``, ``threads: 2``, no overlap): the demo as it shipped before;
* ``whole``: ``threads: auto`` and ``grpo.overlap: one_step`` (rollout of batch k+1 beside the update of k);
* ``ranks``: two data-parallel ranks of one thread each (``torchrun --standalone --nproc-per-node 2``,
  ``threads: 1``): each rank rolls out and trains on half of every step's tasks.

Incremental: each finished (arm, seed, tag) is appended as one JSON line to ``--results`` at once, and a rerun
skips what is there. ``--tag`` names the code state measured (rows from an earlier commit keep theirs; the
first rows have none), and each row records its commit. Run it on an otherwise idle machine: wall time is what
it measures.

    OMP_WAIT_POLICY=PASSIVE python bench/demo_wall.py --seeds 0 --out runs/demo-wall \\
        --results bench/results/demo_wall.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ARMS: dict[str, list[str]] = {
    "today": [],
    "whole": ["threads=auto", "grpo.overlap=one_step"],
    "ranks": ["threads=1"],
    "one": [],
}
CLI: dict[str, list[str]] = {"one": ["--ranks", "1"]}  # an arm's own demo options
LAUNCH: dict[str, list[str]] = {  # how an arm starts the demo (default: one process)
    "ranks": ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
}


def done_keys(results: Path) -> set[tuple[str, int, str]]:
    """The (arm, seed, tag) triples already in ``results`` (a JSON-lines file; a torn last line is ignored)."""
    keys: set[tuple[str, int, str]] = set()
    if not results.exists():
        return keys
    for line in results.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "arm" in row and "seed" in row:
            keys.add((row["arm"], int(row["seed"]), str(row.get("tag", ""))))
    return keys


def run_figures(run_dir: Path) -> dict:
    """A finished demo's held-out figures and the GRPO stage's mean cores busy."""
    out: dict = {}
    evals = (
        ("eval_sft.json", "sft"),
        ("eval_grpo.json", "grpo"),
        ("eval_grpo_hidden.json", "hidden"),
        ("eval_grpo_novel_wording.json", "novel_wording"),
    )
    for name, key in evals:
        p = run_dir / name
        if p.exists():
            ev = json.loads(p.read_text())
            out[key] = {"success": ev["success"], "ci95": ev["success_ci95"], "n": ev["n"]}
            if "violation_rate" in ev:
                out[key]["violations"] = ev["violation_rate"]
    utils = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if row.get("stage") == "grpo" and "cpu_util" in row:
                utils.append(float(row["cpu_util"]))
    out["grpo_cores_busy"] = sum(utils) / len(utils) if utils else None
    return out


def commit() -> str | None:
    """This checkout's commit, if it is a git checkout."""
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or None if done.returncode == 0 else None


def run_arm(arm: str, seed: int, out: Path, extra: list[str], tag: str = "") -> dict:
    """One demo in its own process: wall time, CPU seconds of its process tree, its figures."""
    run_dir = out / (f"{arm}-s{seed}" + (f"-{tag}" if tag else ""))
    cmd = [
        sys.executable,
        *LAUNCH.get(arm, []),
        "-m",
        "mentorrl.cli",
        "demo",
        "--run-dir",
        str(run_dir),
        *CLI.get(arm, []),
    ]
    cmd += ["--set", f"seed={seed}"]
    for ov in ARMS[arm] + extra:
        cmd += ["--set", ov]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    out.mkdir(parents=True, exist_ok=True)
    log = run_dir.with_name(run_dir.name + ".log")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    rc = os.waitstatus_to_exitcode(status)
    if rc != 0:
        sys.exit(f"{arm} seed {seed}: the demo exited {rc} (log: {log})")
    cpu = usage.ru_utime + usage.ru_stime
    cores = os.cpu_count() or 1
    return {
        "arm": arm,
        "seed": seed,
        "tag": tag,
        "commit": commit(),
        "sets": ARMS[arm] + extra,
        "wall_s": wall,
        "cpu_s": cpu,
        "cores_busy": cpu / wall / cores,
        "cores": cores,
        "run_dir": str(run_dir),
        **run_figures(run_dir),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--arms", nargs="+", choices=sorted(ARMS), default=list(ARMS))
    ap.add_argument("--out", type=Path, default=Path("runs/demo-wall"))
    ap.add_argument("--results", type=Path, default=Path("bench/results/demo_wall.jsonl"))
    ap.add_argument("--set", dest="extra", action="append", default=[], help="added to every arm")
    ap.add_argument("--tag", default="", help="names the code state measured (e.g. malloc-auto); part of a row's key")
    a = ap.parse_args(argv)
    if a.tag and not a.tag.replace("-", "").replace("_", "").isalnum():
        ap.error("--tag: letters, digits, - and _ only (it names the run directory)")
    done = done_keys(a.results)
    todo = [(arm, s) for s in a.seeds for arm in a.arms if (arm, s, a.tag) not in done]
    print(
        f"{len(todo)} demo run(s) to go, ~6 minutes each on 2 idle cores as 2 ranks, ~13 as one process: {todo}",
        flush=True,
    )
    for arm, seed in todo:
        row = run_arm(arm, seed, a.out, a.extra, a.tag)
        a.results.parent.mkdir(parents=True, exist_ok=True)
        with open(a.results, "a") as f:
            f.write(json.dumps(row) + "\n")
        figs = {k: round(row[k]["success"] * 100, 1) for k in ("sft", "grpo", "hidden") if k in row}
        print(
            f"{arm} seed {seed}: {row['wall_s']:.0f} s wall, {row['cpu_s']:.0f} CPU-s, "
            f"cores busy {row['cores_busy']:.0%} (GRPO {row['grpo_cores_busy'] or 0:.0%}); {figs}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
