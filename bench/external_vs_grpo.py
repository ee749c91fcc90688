"""Training an agent over HTTP (``stage: external``) against in-process GRPO, over seeds.

For each seed, two runs from the same SFT checkpoint, each in its own process with the demo recipe's
settings (``mentorrl train demo.yaml --set model.path=SFT --set recipe=[STAGE]``, threads 1, run
directory ``OUT/ARM-sSEED``; a finished run, one with its ``eval_STAGE.json``, is read back, not rerun):

* ``grpo``: the in-process GRPO stage (no expert guidance: the external arm cannot have it);
* ``external``: the external stage driving ``docs/examples/orders_agent.py`` (the official ``openai``
  client over the in-process recording server), with the same steps, tasks per step and samples per task
  (so the same number of trajectories, less what the external arm drops, which is reported).

The arms differ in who scores: the in-process verifier's composed reward against the agent's own
reward (task success, violations, tool success). Printed per seed and as mean ± sd with a Student-t
95% interval over seeds: held-out success of each arm (the final evaluation, with its Wilson interval
per run) and external minus GRPO (points); the trajectories trained on; rollout throughput
(trajectories per rollout second); and the HTTP hop's cost: the share of the external arm's rollout
time outside the server's generation (agent start-up, HTTP, JSON, the agent's tools), and its
rollout seconds per trajectory against GRPO's.

    python bench/external_vs_grpo.py --sft 'RUNS/s{seed}/sft/final' --seeds 0 1 2 --out runs/external-vs-grpo
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _seeds import final_eval, same_tasks, summary, train_run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "mentorrl" / "configs" / "demo.yaml"
AGENT = ROOT / "docs" / "examples" / "orders_agent.py"
ARMS = ("grpo", "external")


def arm_overrides(arm: str, seed: int, sft: str, out: Path, a: Any) -> list[str]:
    """The ``--set`` overrides of one arm's run: the same data budget and evaluation for both arms."""
    common = [
        f"run_dir={out / f'{arm}-s{seed}'}",
        f"seed={seed}",
        "threads=1",
        f"model.path={sft}",
        f"recipe=[{arm}]",
        f"eval.num_tasks={a.eval_tasks}",
        "eval.final_splits=[]",
        "audit.eval_every=0",
        f"{arm}.steps={a.steps}",
        f"{arm}.tasks_per_step={a.tasks_per_step}",
        f"{arm}.samples_per_task={a.samples_per_task}",
    ]
    if arm == "grpo":
        return common + ["grpo.guide=none"]
    agent = [sys.executable, str(AGENT), "--no-system", "--max-turns", str(a.max_turns)]
    return common + [
        f"external.agent={json.dumps(agent)}",  # quoted: a number in the argv stays a string
        f"external.concurrency={a.concurrency}",
        f"limits.max_turns={a.max_turns}",
        "grpo.guide=none",
    ]


def run_metrics(run_dir: Path, stage: str) -> list[dict[str, Any]]:
    """The stage's step records of a run's ``metrics.jsonl``."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in recs if r.get("stage") == stage]


def throughput(recs: list[dict[str, Any]]) -> dict[str, float]:
    """Trajectories trained on, rollout seconds, trajectories per rollout second and, for the external
    arm (``server_generate_s`` present), the share of rollout time outside the server's generation."""
    trajs = sum(r.get("episodes_used", r.get("rollouts", 0.0)) for r in recs)
    rollout_s = sum(r.get("rollout_s", 0.0) for r in recs)
    out = {
        "trajectories": float(trajs),
        "rollout_s": rollout_s,
        "trajectories_per_s": trajs / rollout_s if rollout_s else 0.0,
        "rollout_s_per_trajectory": rollout_s / trajs if trajs else 0.0,
    }
    if any("server_generate_s" in r for r in recs):
        gen = sum(r.get("server_generate_s", 0.0) for r in recs)
        out["hop_share"] = (rollout_s - gen) / rollout_s if rollout_s else 0.0
        out["dropped"] = float(sum(r.get("episodes", 0.0) - r.get("episodes_used", 0.0) for r in recs))
    return out


def seed_row(runs: dict[str, dict[str, Any]]) -> dict[str, float]:
    """One seed's comparison: each arm's success (points) and external minus GRPO."""
    g, e = runs["grpo"], runs["external"]
    row = {
        "grpo": 100 * g["eval"]["success"],
        "external": 100 * e["eval"]["success"],
        "external_minus_grpo": 100 * (e["eval"]["success"] - g["eval"]["success"]),
        "seconds_per_trajectory_ratio": (
            e["speed"]["rollout_s_per_trajectory"] / g["speed"]["rollout_s_per_trajectory"]
            if g["speed"]["rollout_s_per_trajectory"]
            else 0.0
        ),
    }
    if "hop_share" in e["speed"]:
        row["hop_share"] = 100 * e["speed"]["hop_share"]
    return row


def read_arm(run_dir: Path, stage: str) -> dict[str, Any] | None:
    """A finished arm's final evaluation and throughput, or None when it has not finished."""
    ev = run_dir / f"eval_{stage}.json"
    if not ev.exists():
        return None
    return {"eval": final_eval(ev), "speed": throughput(run_metrics(run_dir, stage))}


def run_seed(a: Any, seed: int, out: Path) -> dict[str, dict[str, Any]]:
    sft = a.sft.format(seed=seed)
    runs = {}
    for arm in ARMS:
        run_dir = out / f"{arm}-s{seed}"
        got = read_arm(run_dir, arm)
        if got is None:
            run_dir.mkdir(parents=True, exist_ok=True)
            train_run(DEMO, arm_overrides(arm, seed, sft, out, a), f"{arm} seed {seed}", run_dir / "train.log")
            got = read_arm(run_dir, arm)
            if got is None:
                raise SystemExit(f"{arm} seed {seed}: no eval_{arm}.json in {run_dir}")
        runs[arm] = got
    same_tasks(out / f"grpo-s{seed}" / "eval_grpo.json", out / f"external-s{seed}" / "eval_external.json")
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="external stage vs in-process GRPO, over seeds")
    ap.add_argument("--sft", required=True, help="the SFT checkpoint; {seed} is replaced by the seed")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--tasks-per-step", type=int, default=8)
    ap.add_argument("--samples-per-task", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-turns", type=int, default=6)
    ap.add_argument("--eval-tasks", type=int, default=500)
    ap.add_argument("--out", type=Path, default=Path("runs/external-vs-grpo"))
    a = ap.parse_args(argv)
    rows = {}
    for seed in a.seeds:
        runs = run_seed(a, seed, a.out)
        rows[seed] = {"row": seed_row(runs), "runs": runs}
        r = rows[seed]["row"]
        print(
            f"seed {seed}: GRPO {r['grpo']:.1f}%  external {r['external']:.1f}%  "
            f"(external - GRPO {r['external_minus_grpo']:+.1f} points); "
            f"rollout s/trajectory external/GRPO {r['seconds_per_trajectory_ratio']:.2f}x, "
            f"HTTP hop {r.get('hop_share', 0.0):.0f}% of the external rollout time"
        )
    xs = [rows[s]["row"] for s in a.seeds]
    result = {
        "grpo": summary("GRPO held-out success", [x["grpo"] for x in xs], "%", difference=False),
        "external": summary("external held-out success", [x["external"] for x in xs], "%", difference=False),
        "external_minus_grpo": summary("external - GRPO", [x["external_minus_grpo"] for x in xs]),
        "hop_share": summary("HTTP hop share", [x.get("hop_share", 0.0) for x in xs], "%", difference=False),
        "seeds": {str(s): v for s, v in rows.items()},
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "external_vs_grpo.json").write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
