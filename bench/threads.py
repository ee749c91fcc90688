"""CPU threading on this machine: torch threads, inter-op threads, OpenMP's wait policy and processes,
for SFT, rollouts and GRPO, measured through ``mentorrl train`` itself (issue 19, item 5).

Every arm is a separate process (thread settings take effect at start-up) running the demo recipe's
settings for a few steps from the shipped base, with no evaluation; the figures are the medians of
the per-step seconds the run logs to ``metrics.jsonl`` (the first step of each stage is warm-up and
not counted): ``step_s`` for SFT; ``rollout_s``, ``update_s`` and ``step_s`` for GRPO. Arms:

* ``t1``: ``threads=1``;
* ``t2``: ``threads=2`` (the demo's setting);
* ``t2-active``: ``threads=2`` with ``OMP_WAIT_POLICY=ACTIVE`` (OpenMP's busy-waiting; mentorrl sets
  PASSIVE unless the environment says otherwise);
* ``t2-interop1``: ``threads=2`` and ``torch.set_num_interop_threads(1)``;
* ``ddp2x1``: ``torchrun --nproc-per-node 2`` with ``threads=1`` per rank (the data-parallel learner;
  the step's rollouts are split over the ranks too).
* ``t1-overlap`` (GRPO only): ``threads=1`` and ``grpo.overlap=one_step``: batch k+1 rolled out in a
  thread while batch k trains (one torch thread each);
* ``t1-overlap-ray`` (GRPO only): the same with the rollout ahead in one Ray actor process
  (``distributed.backend=ray``, ``distributed.rollout_workers=1``).

The arms run in turn, ``--reps`` rounds (alternating, so a change in the machine's load hits every
arm), and the table prints the median over rounds of each arm's median, with the CPU seconds the
arm's processes used per step (from ``getrusage`` of the children).

    OMP_WAIT_POLICY=PASSIVE python bench/threads.py --reps 2 --json bench/results/threads.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "mentorrl" / "configs" / "demo.yaml"
INTEROP1 = (
    "import sys, torch; torch.set_num_interop_threads(1); from mentorrl.cli import app; sys.argv[0] = 'mentorrl'; app()"
)

ARMS: dict[str, dict] = {
    "t1": {"threads": 1},
    "t2": {"threads": 2},
    "t2-active": {"threads": 2, "env": {"OMP_WAIT_POLICY": "ACTIVE"}},
    "t2-interop1": {"threads": 2, "interop1": True},
    "ddp2x1": {"threads": 1, "ranks": 2},
    # grpo.overlap: one_step (issue 41, item 2): the rollout ahead in a thread, or in a Ray actor process
    "t1-overlap": {"threads": 1, "sets": ["grpo.overlap=one_step"], "stages": ["grpo"]},
    "t1-overlap-ray": {
        "threads": 1,
        "sets": ["grpo.overlap=one_step", "distributed.backend=ray", "distributed.rollout_workers=1"],
        "stages": ["grpo"],
    },
}
STAGES = {  # the demo's settings but fewer demonstrations and tasks per step (the step's shape is the same)
    "sft": ["recipe=[sft]", "sft.num_demos=256"],
    "grpo": ["recipe=[grpo]", "grpo.tasks_per_step=8", "grpo.samples_per_task=8"],
}
STEPS = {"sft": 4, "grpo": 2}  # timed steps per arm (after 1 warm-up step)


def command(arm: dict, stage: str, steps: int, run_dir: Path) -> list[str]:
    sets = STAGES[stage] + [
        f"{stage}.steps={steps + 1}",
        f"threads={arm['threads']}",
        f"run_dir={run_dir}",
        "eval.num_tasks=0",
        "audit.preflight=false",
        "audit.eval_every=0",
        f"{stage}.checkpoint_every={steps + 10}",
        *arm.get("sets", []),
    ]
    args = ["train", str(DEMO)] + [x for s in sets for x in ("--set", s)]
    if arm.get("ranks", 1) > 1:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={arm['ranks']}",
            "-m",
            "mentorrl.cli",
        ] + args
    if arm.get("interop1"):
        return [sys.executable, "-c", INTEROP1] + args
    return [sys.executable, "-m", "mentorrl.cli"] + args


def run_arm(name: str, stage: str, steps: int) -> dict:
    arm = ARMS[name]
    run_dir = Path(tempfile.mkdtemp(prefix=f"mentorrl-threads-{name}-{stage}-"))
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", **arm.get("env", {})}
    env.pop("OMP_NUM_THREADS", None)  # the arm's threads setting decides
    for attempt in (1, 2):  # a failed arm runs once more (its first failure is printed), then the bench stops
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        done = subprocess.run(command(arm, stage, steps, run_dir), env=env, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode == 0:
            break
        message = f"arm {name} ({stage}) failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        if attempt == 2:
            raise SystemExit(message)
        print(message + "\n(running it once more)", flush=True)
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if r.get("stage") == stage and "step" in r][1:]  # the first step is warm-up
    shutil.rmtree(run_dir, ignore_errors=True)
    out = {
        "arm": name,
        "stage": stage,
        "steps": len(recs),
        "process_wall_s": wall,
        "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
    }
    for key in ("step_s", "rollout_s", "update_s", "overlap_s", "cpu_util"):
        vals = [r[key] for r in recs if key in r]
        if vals:
            out[key] = statistics.median(vals)
    return out


def summarise(results: list[dict]) -> list[dict]:
    rows = []
    for stage in STAGES:
        for name in ARMS:
            mine = [r for r in results if r["arm"] == name and r["stage"] == stage]
            if not mine:
                continue
            row = {"stage": stage, "arm": name, "reps": len(mine)}
            for key in ("step_s", "rollout_s", "update_s", "overlap_s", "cpu_util", "cpu_s", "process_wall_s"):
                vals = [r[key] for r in mine if key in r]
                if vals:
                    row[key] = statistics.median(vals)
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=1, help="rounds over every arm (alternating)")
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"timed steps per arm and stage, after 1 warm-up step (default: {STEPS})",
    )
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of " + ", ".join(ARMS))
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    arms, stages = a.arms.split(","), a.stages.split(",")
    unknown = [x for x in arms if x not in ARMS] + [x for x in stages if x not in STAGES]
    if unknown:
        raise SystemExit(f"unknown arms or stages: {unknown}")
    print(
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; {a.reps} round(s) of "
        f"{a.steps or STEPS} timed steps"
    )
    results = []
    for rep in range(a.reps):
        for stage in stages:
            for name in arms:
                if stage not in ARMS[name].get("stages", STAGES):
                    continue
                r = run_arm(name, stage, a.steps or STEPS[stage])
                results.append(r)
                print(
                    json.dumps({"rep": rep, **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}}),
                    flush=True,
                )
    rows = summarise(results)
    print(f"\n{'stage':6} {'arm':12} {'step s':>8} {'rollout s':>10} {'update s':>9} {'CPU s (run)':>12}")
    for r in rows:
        print(
            f"{r['stage']:6} {r['arm']:12} {r.get('step_s', float('nan')):8.2f} "
            f"{r.get('rollout_s', float('nan')):10.2f} {r.get('update_s', float('nan')):9.2f} {r['cpu_s']:12.1f}"
        )
    for stage in stages:
        base = next((r for r in rows if r["stage"] == stage and r["arm"] == "t2"), None)
        if base is None:
            continue
        ratios = ", ".join(
            f"{r['arm']} {base['step_s'] / r['step_s']:.2f}x" for r in rows if r["stage"] == stage and r["arm"] != "t2"
        )
        print(f"{stage}: speed against t2 (step s of t2 / step s of the arm): {ratios}")
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {"load_average": os.getloadavg(), "reps": a.reps, "steps": a.steps, "results": results, "rows": rows},
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
