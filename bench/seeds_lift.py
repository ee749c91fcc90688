"""The demo's lift over seeds: SFT -> GRPO held-out success, mean ± sd and a 95% interval of the lift.

Each seed is one whole `mentorrl demo` run in its own process and run directory
(``OUT/seed-S``, ``--set seed=S``), exactly what a user runs; extra ``--set`` overrides go to
every seed. A finished seed is read back instead of rerun (its ``report.json``) and a seed
stopped part-way continues from its run directory (``--resume``), so the bench can be stopped
and started again. It prints one row per seed (held-out success after SFT and
after GRPO with 95% Wilson intervals, and the lift), then the mean ± sd of the lift over seeds
and a Student-t 95% interval of the mean lift, and writes everything to ``OUT/seeds_lift.json``.

    python bench/seeds_lift.py --out runs/seeds-lift                     # seeds 0 1 2, the demo recipe
    python bench/seeds_lift.py --out runs/seeds-lift --seeds 0 1 2 3 --set eval.num_tasks=500
    python bench/seeds_lift.py --out runs/smollm2 --config mentorrl/configs/smollm2.yaml --results FILE.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from mentorrl.eval.metrics import mean_interval

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _arms import task_outcomes  # noqa: E402


def lift_summary(lifts: list[float]) -> dict[str, float | None]:
    """Mean, sample sd and the Student-t 95% interval of the mean of per-seed lifts (points)."""
    if not lifts:
        raise ValueError("no seed finished")
    s = mean_interval(lifts)
    return {k: s[k] for k in ("n", "mean", "sd", "ci95")}


def paired_lift(run_dir: Path, before: str = "sft", after: str = "grpo") -> dict | None:
    """The lift on the tasks both evaluations rolled out (the same held-out tasks: ``eval.seed``): the mean
    per-task difference in points with its 95% interval (normal, paired), and the discordant counts.
    None when either evaluation's trajectories are missing."""
    a, b = run_dir / f"eval_{before}.jsonl", run_dir / f"eval_{after}.jsonl"
    if not (a.exists() and b.exists()):
        return None
    x, y = task_outcomes(a), task_outcomes(b)
    common = sorted(set(x) & set(y))
    if not common:
        return None
    diffs = [y[t] - x[t] for t in common]
    s = mean_interval(diffs)
    lo, hi = s["ci95"] if s["ci95"] is not None else (None, None)
    return {
        "n": len(common),
        "lift_points": 100 * s["mean"],
        "ci95_points": None if lo is None else [100 * lo, 100 * hi],
        "only_after": sum(d > 0 for d in diffs),
        "only_before": sum(d < 0 for d in diffs),
    }


def run_seed(out: Path, seed: int, overrides: list[str], config: str | None = None, ranks: int = 1) -> dict:
    """One seed run whole (``ranks`` > 1: as that many torchrun ranks, ``--ranks N``) and read back."""
    run_dir = out / f"seed-{seed}"
    report = run_dir / "report.json"
    wall: dict = {}
    if not report.exists():
        what = ["demo"] if config is None else ["train", config]  # the demo, or another recipe run the same way
        cmd = [sys.executable, "-m", "mentorrl.cli", *what, "--run-dir", str(run_dir), "--set", f"seed={seed}"]
        if ranks > 1:
            cmd += ["--ranks", str(ranks)]
        if run_dir.exists():
            cmd.append("--resume")  # a seed stopped part-way continues from its last checkpoint
        for ov in overrides:
            cmd += ["--set", ov]
        env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
        t0 = time.perf_counter()
        wall = {"resumed": run_dir.exists()}  # a resumed seed's wall time covers only this sitting
        done = subprocess.run(cmd, env=env)
        wall["wall_s"] = round(time.perf_counter() - t0, 1)
        if done.returncode != 0 or not report.exists():
            raise SystemExit(f"seed {seed}: `{' '.join(cmd)}` exited {done.returncode}")
    evals = json.loads(report.read_text())["evals"]
    sft, grpo = evals["sft"], evals["grpo"]
    return {
        "seed": seed,
        "n": sft["n"],
        "sft": sft["success"],
        "sft_ci95": sft["success_ci95"],
        "grpo": grpo["success"],
        "grpo_ci95": grpo["success_ci95"],
        "lift_points": 100 * (grpo["success"] - sft["success"]),
        "paired": paired_lift(run_dir),
        **wall,
    }


def record_seed(results: Path, row: dict, overrides: list[str], report: Path | None = None) -> None:
    """Add (or replace) ``row`` in ``results`` ({"overrides": ..., "seeds": [...]}), with the seed's hidden and
    stress-set success and violations from its ``report`` when given."""
    data = json.loads(results.read_text()) if results.exists() else {"overrides": overrides, "seeds": []}
    if data.get("overrides") != overrides:
        raise SystemExit(f"{results} holds seeds run with other overrides ({data.get('overrides')}); use another file")
    row = dict(row)
    if report is not None and report.exists():
        rep = json.loads(report.read_text())
        row["evals"] = {
            k: {
                "n": v.get("n"),
                "success": v.get("success"),
                "ci95": v.get("success_ci95"),
                "violations": v.get("violation_rate"),
            }  # fmt: skip
            for k, v in {**rep.get("evals", {}), **rep.get("other_splits", {})}.items()
            if isinstance(v, dict)
        }
    data["seeds"] = sorted([r for r in data["seeds"] if r["seed"] != row["seed"]] + [row], key=lambda r: r["seed"])
    results.write_text(json.dumps(data, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/seeds-lift"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="a config override for every seed")
    ap.add_argument("--config", default=None, help="a recipe to run with `mentorrl train` instead of the demo")
    ap.add_argument(
        "--results", type=Path, default=None, help="a JSON file (committed) that each finished seed's row is added to"
    )
    args = ap.parse_args(argv)
    if len(set(args.seeds)) != len(args.seeds):
        ap.error("--seeds must be distinct")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in args.seeds:
        rows.append(run_seed(args.out, seed, args.overrides, args.config))
        if args.results is not None:  # each finished seed is on disk at once: a later sitting goes on from here
            record_seed(args.results, rows[-1], args.overrides, report=args.out / f"seed-{seed}" / "report.json")

    def pct(x: float, ci: list[float]) -> str:
        return f"{100 * x:5.1f}% [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]"

    print(f"{'seed':>4}  {'n':>4}  {'after SFT':>21}  {'after GRPO':>21}  {'lift':>7}")
    for r in rows:
        print(
            f"{r['seed']:>4}  {r['n']:>4}  {pct(r['sft'], r['sft_ci95']):>21}  {pct(r['grpo'], r['grpo_ci95']):>21}  "
            f"{r['lift_points']:+6.1f}"
        )
    s = lift_summary([r["lift_points"] for r in rows])
    if s["sd"] is None:
        print(f"lift over 1 seed: {s['mean']:+.1f} points (one seed: no spread, no interval)")
    else:
        lo, hi = s["ci95"]
        verdict = "a lift" if lo > 0 else ("a drop" if hi < 0 else "no difference (the interval holds 0)")
        print(
            f"lift over {s['n']} seeds: {s['mean']:+.1f} ± {s['sd']:.1f} points (mean ± sd); "
            f"95% interval of the mean [{lo:+.1f}, {hi:+.1f}]: {verdict}"
        )
    (args.out / "seeds_lift.json").write_text(
        json.dumps({"seeds": rows, "lift": s, "overrides": args.overrides}, indent=2)
    )


if __name__ == "__main__":
    main()
