"""GRPO step seconds on this machine: one process vs Ray with 1 and 2 rollout actors, side by side.

Each arm runs the same GRPO stage (same base model, tasks, seeds; ``grpo.kl_coef`` > 0 so every
step changes the weights and the Ray arms broadcast them every step) in this process, one after
the other, on one local Ray (``ray.init(num_cpus=2)``, started before the first arm and not timed).
The first ``--warmup`` steps of each arm (actor start-up, first weight load) are not timed; the
median of the rest is. The learner runs with ``threads`` torch threads in every arm; each actor
with one. ``--model``: a trained checkpoint instead of an untrained base (trajectories of a random
model are long and rarely call tools). ``cores busy``: the machine's busy CPU seconds (every
process, from ``/proc/stat``) over the arm's wall seconds, its start-up included. Prints a table,
the ratios, and one JSON line.

    OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 python bench/ray_scaling.py
    OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 python bench/ray_scaling.py --tasks 8 --group 4 --steps 4
    OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 python bench/ray_scaling.py --config mentorrl/configs/demo.yaml \
        --model RUNS/s0/sft/final --tasks 16 --group 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import ray

from mentorrl.config import load_config
from mentorrl.distributed.ray_workers import RayRollouts
from mentorrl.train.models_init import base_model_dir
from mentorrl.train.pipeline import run_recipe
from mentorrl.train.workspace import open_workspace

ARMS = {
    "plain": [],
    "ray-1": ["distributed.backend=ray", "distributed.rollout_workers=1"],
    "ray-2": ["distributed.backend=ray", "distributed.rollout_workers=2"],
}


def busy_cpu_s() -> float | None:
    """The machine's busy CPU seconds since boot (all cores, every process), or None off Linux."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", type=int, default=8, help="grpo.tasks_per_step")
    p.add_argument("--group", type=int, default=4, help="grpo.samples_per_task")
    p.add_argument("--steps", type=int, default=4, help="timed steps per arm")
    p.add_argument("--warmup", type=int, default=1, help="untimed first steps per arm")
    p.add_argument("--threads", type=int, default=1, help="the learner's torch threads")
    p.add_argument("--set", action="append", default=[], help="more config overrides (a.b=value)")
    p.add_argument("--model", default=None, help="a checkpoint directory to start from (default: an untrained base)")
    p.add_argument("--config", default=None, help="a recipe file to start from (default: the built-in defaults)")
    a = p.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning")
    common = [
        f"threads={a.threads}",
        "model.pretrain.steps=0",
        "recipe=[grpo]",
        f"grpo.steps={a.steps + a.warmup}",
        f"grpo.tasks_per_step={a.tasks}",
        f"grpo.samples_per_task={a.group}",
        "grpo.kl_coef=0.05",
        "grpo.checkpoint_every=1000",
        "eval.num_tasks=0",
        "audit.preflight=false",
    ] + a.set
    out: dict[str, dict] = {}
    closed: list[RayRollouts] = []  # the run's rollout actors, remembered when its workspace releases them
    real_close = RayRollouts.close

    def close(pool: RayRollouts) -> None:
        closed.append(pool)
        real_close(pool)

    RayRollouts.close = close  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as tmp:
        base = (
            Path(a.model).resolve()
            if a.model
            else base_model_dir(
                open_workspace(load_config(a.config, common + [f"run_dir={tmp}/base"]), show_progress=False)
            )
        )
        for arm, extra in ARMS.items():
            run_dir = Path(tmp) / arm
            cfg = load_config(a.config, common + [f"run_dir={run_dir}", f"model.path={base}"] + extra)
            busy0, t0 = busy_cpu_s(), time.perf_counter()
            run_recipe(cfg, show_progress=False)
            busy1, wall = busy_cpu_s(), time.perf_counter() - t0
            recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
            steps = [r for r in recs if r.get("stage") == "grpo"][a.warmup :]
            pool = closed[-1] if closed else None
            out[arm] = {
                "step_s": statistics.median(r["step_s"] for r in steps),
                "rollout_s": statistics.median(r["rollout_s"] for r in steps),
                "update_s": statistics.median(r["update_s"] for r in steps),
                "policy_version": steps[-1]["policy_version"],
                "cores_busy": None if busy0 is None or busy1 is None else (busy1 - busy0) / wall,
            }
            if pool is not None:
                out[arm].update(broadcasts=pool.weights.broadcasts, put_s=pool.weights.last_put_s)
            closed.clear()
    ray.shutdown()
    print(
        f"\nGRPO, {a.tasks} tasks x {a.group} rollouts per step, median of {a.steps} steps (after {a.warmup} warm-up)"
    )
    print(f"{'arm':8s} {'step_s':>8s} {'rollout_s':>10s} {'update_s':>9s} {'cores busy':>11s}")
    for arm, m in out.items():
        busy = "-" if m["cores_busy"] is None else f"{m['cores_busy']:.2f}"
        print(f"{arm:8s} {m['step_s']:8.2f} {m['rollout_s']:10.2f} {m['update_s']:9.2f} {busy:>11s}")
    ratios = {
        f"{x}/{y}": {k: out[x][k] / max(out[y][k], 1e-9) for k in ("step_s", "rollout_s")}
        for x, y in (("plain", "ray-1"), ("plain", "ray-2"), ("ray-1", "ray-2"))
    }
    for name, r in ratios.items():
        print(f"speed-up {name}: step {r['step_s']:.2f}x, rollout {r['rollout_s']:.2f}x")
    print(json.dumps({"args": vars(a), "arms": out, "ratios": ratios}))


if __name__ == "__main__":
    main()
