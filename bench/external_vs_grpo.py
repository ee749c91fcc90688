"""Training an agent over HTTP (``stage: external``) against in-process GRPO, over seeds.

For each seed, two runs from the same SFT checkpoint, each in its own process with the demo recipe's
settings (``mentorrl train demo.yaml --set model.path=SFT --set recipe=[STAGE]``, threads 1, run
directory ``OUT/ARM-sSEED``):

* ``grpo``: the in-process GRPO stage (no expert guidance: the external arm cannot have it);
* ``external``: the external stage driving ``docs/examples/orders_agent.py`` (the official ``openai``
  client over the in-process recording server), with the same steps, tasks per step and samples per task
  (so the same number of trajectories, less what the external arm drops, which is reported), the same
  GRPO settings as the grpo arm (the demo's ``grpo:`` section: learning rate and warm-up, updates per
  step, KL, clipping, advantage; the ``external:`` section's own defaults differ), and the same
  reward: the environment's verifier (``external.reward: verifier``: each recorded episode replayed
  through the environment, :mod:`mentorrl.rollout.rescore`). The agent runs as one long-lived worker
  (``external.mode: worker``, ``--mode episode`` for a process per episode).

Incremental: each finished (seed, arm) is appended as one JSON line to ``OUT/results.jsonl`` (its final
evaluation and throughput); a rerun skips what is there (and reads back a finished run directory, one with
its ``eval_STAGE.json``, without rerunning it). Printed per seed and as mean ± sd with a Student-t
95% interval over seeds: held-out success of each arm (the final evaluation, with its Wilson interval
per run) and external minus GRPO (points); the trajectories trained on; rollout seconds per trajectory
of each arm and their ratio; and where the external arm's rollout time goes (the stage's ``time_*``
metrics: the model's generate calls, the server's handling, HTTP and JSON, the agent's tools, the
agent's own code and start-up). The targets (issue 55): the mean difference's 95% interval holds
values >= -5 points, and the external arm's seconds per trajectory are at most 3x GRPO's.

    python bench/external_vs_grpo.py --sft 'RUNS/s{seed}/sft/final' --seeds 0 1 2 --steps 15 --out runs/external-vs-grpo
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
SDK_AGENT = ROOT / "docs" / "examples" / "orders_agent_sdk.py"
ARMS = ("grpo", "external")
BUDGET = ("steps", "tasks_per_step", "samples_per_task")
NOT_SHARED = {"guide", "guide_sft", "hard_pool", "hard_pool_state", "sample_trajectories"}  # external: none
TARGET_POINTS, TARGET_RATIO = -5.0, 3.0


def _flat(prefix: str, want: Any, have: Any) -> list[str]:
    """``--set`` overrides that turn ``have`` into ``want`` under ``prefix`` (a mapping: one per leaf
    that differs)."""
    if isinstance(want, dict) and isinstance(have, dict):
        return [x for k, v in want.items() for x in _flat(f"{prefix}.{k}", v, have.get(k))]
    return [f"{prefix}={json.dumps(want)}"] if want != have else []


def grpo_settings(config: Path = DEMO) -> list[str]:
    """The ``external.*`` overrides that give the external arm the grpo arm's GRPO settings: every field
    the two sections share (the budget and what the external stage cannot have aside) set to the
    config's ``grpo:`` value where the ``external:`` section's differs."""
    from mentorrl.config import load_config

    cfg = load_config(config, [])
    g, e = cfg.grpo.model_dump(), cfg.external.model_dump()
    out = []
    for name in sorted(set(g) & set(e) - set(BUDGET) - NOT_SHARED):
        out += _flat(f"external.{name}", g[name], e[name])
    return out


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
    agent = agent_argv(a)
    return (
        common
        + grpo_settings()
        + [
            f"external.agent={json.dumps(agent)}",  # quoted: a number in the argv stays a string
            f"external.concurrency={a.concurrency}",
            f"external.mode={getattr(a, 'mode', 'worker')}",
            "external.reward=verifier",
            f"limits.max_turns={a.max_turns}",
            "grpo.guide=none",
        ]
    )


def agent_argv(a: Any) -> list[str]:
    """The external arm's agent command: the plain agent (``--agent plain``) or the OpenAI Agents SDK
    one (``--agent sdk``; ``--sdk-path``: a ``pip install --target`` directory put on that process's
    ``PYTHONPATH`` only, through ``env``), each a worker or a process per episode (``--mode``)."""
    if getattr(a, "agent", "plain") == "sdk":
        pre = ["env", f"PYTHONPATH={a.sdk_path}"] if getattr(a, "sdk_path", None) else []
        return [*pre, sys.executable, str(SDK_AGENT), "--no-system", "--max-turns", str(a.max_turns)]
    return [sys.executable, str(AGENT), "--no-system", "--max-turns", str(a.max_turns)]


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
        # the model's generate calls in wall time (older runs: the per-request server time)
        key = "time_generate_wall_s" if any("time_generate_wall_s" in r for r in recs) else "server_generate_s"
        gen = sum(r.get(key, 0.0) for r in recs)
        out["hop_share"] = (rollout_s - gen) / rollout_s if rollout_s else 0.0
        out["dropped"] = float(sum(r.get("episodes", 0.0) - r.get("episodes_used", 0.0) for r in recs))
        for k in sorted({k for r in recs for k in r if k.startswith(("time_", "replay_"))}):
            out[k] = float(sum(r.get(k, 0.0) for r in recs))
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


def read_results(path: Path) -> dict[tuple[int, str], dict[str, Any]]:
    """The finished (seed, arm) entries of the incremental results file (the last line of each wins)."""
    done: dict[tuple[int, str], dict[str, Any]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                d = json.loads(line)
                done[(int(d["seed"]), d["arm"])] = {"eval": d["eval"], "speed": d["speed"]}
    return done


def append_result(path: Path, seed: int, arm: str, got: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"seed": seed, "arm": arm, **got}, default=str) + "\n")


def run_seed(a: Any, seed: int, out: Path, results: Path | None = None) -> dict[str, dict[str, Any]]:
    """Both arms of ``seed``: from the results file, else a finished run directory, else trained now;
    each newly finished arm appended to ``results``."""
    sft = a.sft.format(seed=seed)
    done = read_results(results) if results is not None else {}
    runs = {}
    for arm in getattr(a, "arms", ARMS):
        if (seed, arm) in done:
            runs[arm] = done[(seed, arm)]
            continue
        run_dir = out / f"{arm}-s{seed}"
        got = read_arm(run_dir, arm)
        if got is None:
            run_dir.mkdir(parents=True, exist_ok=True)
            train_run(DEMO, arm_overrides(arm, seed, sft, out, a), f"{arm} seed {seed}", run_dir / "train.log")
            got = read_arm(run_dir, arm)
            if got is None:
                raise SystemExit(f"{arm} seed {seed}: no eval_{arm}.json in {run_dir}")
        if results is not None:
            append_result(results, seed, arm, got)
        runs[arm] = got
    g, e = out / f"grpo-s{seed}" / "eval_grpo.json", out / f"external-s{seed}" / "eval_external.json"
    if g.exists() and e.exists():
        same_tasks(g, e)
    return runs


def breakdown(speed: dict[str, Any]) -> dict[str, float]:
    """The external arm's episode seconds by where they went, as shares (%) of their sum."""
    parts = {
        "generation": speed.get("time_generate_wall_s", 0.0),
        "server": max(0.0, speed.get("time_server_s", 0.0) - speed.get("time_generate_wall_s", 0.0)),
        "http_json": speed.get("time_http_json_s", 0.0),
        "tools": speed.get("time_tools_s", 0.0),
        "agent_process": speed.get("time_agent_process_s", 0.0) + speed.get("time_worker_start_s", 0.0),
    }
    total = sum(parts.values())
    return {k: 100 * v / total for k, v in parts.items()} if total else {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="external stage vs in-process GRPO, over seeds")
    ap.add_argument("--sft", required=True, help="the SFT checkpoint; {seed} is replaced by the seed")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--tasks-per-step", type=int, default=8)
    ap.add_argument("--samples-per-task", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=32, help="episodes at once (the worker's, or processes)")
    ap.add_argument("--mode", choices=["worker", "episode"], default="worker", help="external.mode of the agent")
    ap.add_argument("--max-turns", type=int, default=6)
    ap.add_argument(
        "--agent",
        choices=["plain", "sdk"],
        default="plain",
        help="the external arm's agent: docs/examples/orders_agent.py (plain) or orders_agent_sdk.py (sdk, "
        "the OpenAI Agents SDK); either as a worker or a process per episode (--mode)",
    )
    ap.add_argument("--sdk-path", default=None, help="--agent sdk: where openai-agents is installed (--target)")
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="the arms to run")
    ap.add_argument("--eval-tasks", type=int, default=500)
    ap.add_argument("--out", type=Path, default=Path("runs/external-vs-grpo"))
    a = ap.parse_args(argv)
    results = a.out / "results.jsonl"
    if set(a.arms) != set(ARMS):  # one arm: its evaluation per seed, no comparison
        for seed in a.seeds:
            got = run_seed(a, seed, a.out, results)
            for arm, r in got.items():
                ev = r["eval"]
                print(f"seed {seed} {arm}: {100 * ev['success']:.1f}% {[round(100 * x, 1) for x in ev['ci95']]}")
        return 0
    rows = {}
    for seed in a.seeds:
        runs = run_seed(a, seed, a.out, results)
        rows[seed] = {"row": seed_row(runs), "runs": runs, "breakdown": breakdown(runs["external"]["speed"])}
        r = rows[seed]["row"]
        print(
            f"seed {seed}: GRPO {r['grpo']:.1f}%  external {r['external']:.1f}%  "
            f"(external - GRPO {r['external_minus_grpo']:+.1f} points); "
            f"rollout s/trajectory external/GRPO {r['seconds_per_trajectory_ratio']:.2f}x, "
            f"outside generation {r.get('hop_share', 0.0):.0f}% of the external rollout time; "
            + ", ".join(f"{k} {v:.0f}%" for k, v in rows[seed]["breakdown"].items())
        )
    xs = [rows[s]["row"] for s in a.seeds]
    diff = summary("external - GRPO", [x["external_minus_grpo"] for x in xs])
    ratio = summary(
        "s/trajectory external/GRPO", [x["seconds_per_trajectory_ratio"] for x in xs], "x", difference=False
    )
    lo = diff["ci95"][1] if diff["ci95"] is not None else diff["mean"]
    targets = {
        "within_5_points": lo >= TARGET_POINTS,  # the interval holds values >= -5
        "overhead_at_most_3x": ratio["mean"] <= TARGET_RATIO,
    }
    print(f"targets: {targets}")
    result = {
        "grpo": summary("GRPO held-out success", [x["grpo"] for x in xs], "%", difference=False),
        "external": summary("external held-out success", [x["external"] for x in xs], "%", difference=False),
        "external_minus_grpo": diff,
        "seconds_per_trajectory_ratio": ratio,
        "hop_share": summary("outside generation", [x.get("hop_share", 0.0) for x in xs], "%", difference=False),
        "targets": targets,
        "settings": {k: v for k, v in vars(a).items() if k != "out"} | {"external_grpo_settings": grpo_settings()},
        "seeds": {str(s): v for s, v in rows.items()},
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "external_vs_grpo.json").write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
