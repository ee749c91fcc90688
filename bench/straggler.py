"""The straggler effect: synchronous GRPO vs asynchronous SAO under heavy-tailed tool latency.

Both arms start from the same SFT checkpoint, run on the same ``orders`` train tasks with the
same seeded Pareto tool latency (most calls fast, a few many times the median, as with real
search / database / sandbox tools), and consume the same number of trajectories:

* ``grpo``: ``--steps`` synchronous steps of ``--tasks`` tasks x ``--group`` samples. Each step
  decodes its whole batch together, waits for its slowest trajectory, then trains.
* ``sao``: ``--steps`` learner steps of ``tasks x group`` trajectories taken from an
  asynchronous rollout worker that keeps the same number of episodes in flight
  (``sao.rollout.slots``) and admits a new one as soon as one finishes, while the learner trains.

Timed: the training stage only (rollouts, updates, checkpoints), one arm after the other in this
process. Printed: trajectories consumed, wall seconds, trajectories/s for both and their ratio,
then held-out success (evaluated without injected latency) for the start checkpoint and both arms.

    python bench/straggler.py --sft runs/demo/sft/final
    python bench/straggler.py --steps 6 --tasks 8 --group 8 --eval-tasks 200 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore")

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from mentorrl.cli_common import quiet_transformers  # noqa: E402
from mentorrl.config import load_config  # noqa: E402
from mentorrl.models.build import load_policy  # noqa: E402
from mentorrl.train.pipeline import run_recipe  # noqa: E402
from mentorrl.train.registry import run_stage_by_name  # noqa: E402
from mentorrl.train.rundir import MetricsLog  # noqa: E402
from mentorrl.train.workspace import evaluate, open_workspace  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "mentorrl" / "configs" / "demo.yaml"


def _fmt_latency(cfg) -> str:
    m = cfg.env.latency
    return (
        f"{m.kind} tool latency: median {m.median_s:g}s, alpha {m.alpha:g}, cap {m.max_s:g}s "
        f"(p90 {m.quantile(0.9):.2f}s, p99 {m.quantile(0.99):.2f}s)"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sft", type=Path, help="SFT checkpoint both arms start from (default: run the demo's SFT)")
    ap.add_argument("--out", type=Path, default=Path("runs/straggler"))
    ap.add_argument("--steps", type=int, default=8, help="steps per arm")
    ap.add_argument("--tasks", type=int, default=8, help="GRPO tasks per step")
    ap.add_argument("--group", type=int, default=8, help="GRPO samples per task (SAO batch = tasks x group)")
    ap.add_argument("--median", type=float, default=1.0, help="median tool latency, seconds")
    ap.add_argument("--alpha", type=float, default=1.2, help="Pareto tail index of the tool latency")
    ap.add_argument(
        "--cap", type=float, default=60.0, help="longest single tool delay, seconds (also the tool timeout)"
    )
    ap.add_argument("--eval-tasks", type=int, default=200)
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config override for both arms")
    ap.add_argument("--arms", default="grpo,sao", help="arms to run (the ratio needs both)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    chosen = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not chosen or set(chosen) - {"grpo", "sao"}:
        ap.error("--arms: a comma-separated subset of grpo,sao")
    quiet_transformers()
    con = Console()
    batch = args.tasks * args.group
    latency = f"env.latency={{kind: pareto, median_s: {args.median}, alpha: {args.alpha}, max_s: {args.cap}, seed: 1}}"
    common = [
        "audit.eval_every=0",
        f"eval.num_tasks={args.eval_tasks}",
        f"env.tool_timeout_s={args.cap + 1}",
        *args.overrides,
    ]

    sft = args.sft
    if sft is None:
        cfg = load_config(DEMO, [*common, f"run_dir={args.out / 'sft'}", "recipe=[sft]", "audit.preflight=false"])
        run_recipe(cfg, resume=True)
        sft = args.out / "sft" / "sft" / "final"

    arms = {
        # neither arm uses a KL reference (SAO has none): GRPO does no extra reference forward pass
        "grpo": [
            "grpo.kl_coef=0",
            f"grpo.steps={args.steps}",
            f"grpo.tasks_per_step={args.tasks}",
            f"grpo.samples_per_task={args.group}",
            f"grpo.checkpoint_every={args.steps}",
            "grpo.sample_trajectories=0",
        ],
        "sao": [
            f"sao.steps={args.steps}",
            f"sao.batch_size={batch}",
            f"sao.rollout.slots={batch}",
            f"sao.checkpoint_every={args.steps}",
            "sao.sample_trajectories=0",
        ],
    }
    results: dict[str, dict] = {}
    start = None
    for arm, extra in ((a, arms[a]) for a in chosen):
        run_dir = args.out / arm
        if run_dir.exists():
            shutil.rmtree(run_dir)
        cfg = load_config(DEMO, [*common, f"run_dir={run_dir}", f"model.path={sft}", latency, *extra])
        ws = open_workspace(cfg)
        tokenizer, model = load_policy(sft)
        ws.bind_tokenizer(tokenizer)
        con.rule(f"{arm}: {args.steps} steps x {batch} trajectories, {_fmt_latency(cfg)}")
        t0 = time.perf_counter()
        run_stage_by_name(ws, arm, model, resume=False)
        wall = time.perf_counter() - t0
        records = MetricsLog(run_dir / "metrics.jsonl").read(arm)
        consumed = int(sum(r.get("rollouts", 0) for r in records))
        dropped = int(sum(r.get("stale_dropped", 0) for r in records))
        # held-out success without injected latency (it changes timing, never outcomes)
        eval_cfg = load_config(DEMO, [*common, f"run_dir={run_dir / 'heldout'}", f"model.path={sft}"])
        ews = open_workspace(eval_cfg, show_progress=False)
        ews.bind_tokenizer(tokenizer)
        if start is None:
            _, sft_model = load_policy(sft)
            start = evaluate(ews, sft_model, "sft")
        heldout = evaluate(ews, model, arm)
        results[arm] = {
            "trajectories": consumed,
            "stale_dropped": dropped,
            "wall_s": wall,
            "traj_per_s": consumed / wall,
            "heldout_success": heldout["success"],
            "heldout_ci95": heldout["success_ci95"],
        }
        con.print(
            f"{arm}: {consumed} trajectories in {wall:.1f}s = {consumed / wall:.2f}/s; "
            f"held-out {100 * heldout['success']:.1f}%"
        )

    table = Table(title=f"Straggler bench ({_fmt_latency(cfg)})")
    for col in ("arm", "trajs", "dropped", "wall s", "traj/s", "held-out", "95% CI"):
        table.add_column(col, justify="left" if col == "arm" else "right", no_wrap=True)
    lo, hi = start["success_ci95"]
    table.add_row(
        "sft (start)", "-", "-", "-", "-", f"{100 * start['success']:.1f}%", f"{100 * lo:.1f}-{100 * hi:.1f}%"
    )
    for arm, r in results.items():
        lo, hi = r["heldout_ci95"]
        table.add_row(
            arm,
            str(r["trajectories"]),
            str(r["stale_dropped"]),
            f"{r['wall_s']:.1f}",
            f"{r['traj_per_s']:.2f}",
            f"{100 * r['heldout_success']:.1f}%",
            f"{100 * lo:.1f}-{100 * hi:.1f}%",
        )
    con.print(table)
    ratio = None
    if {"grpo", "sao"} <= set(results):
        g, s = results["grpo"], results["sao"]
        ratio = s["traj_per_s"] / g["traj_per_s"]
        con.print(f"SAO / GRPO trajectories per second: {ratio:.2f}x")
        con.print(
            f"held-out success SAO minus GRPO: {100 * (s['heldout_success'] - g['heldout_success']):+.1f} points "
            f"(start {100 * start['success']:.1f}%)"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "arms": results,
                    "ratio": ratio,
                    "sft_success": start["success"],
                    "latency": cfg.env.latency.model_dump(),
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
