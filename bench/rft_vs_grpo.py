"""Does an RFT cold start beat more GRPO for the same number of rollouts?

Both arms start from the same SFT checkpoint and are evaluated on the same held-out tasks
with the same seed:

* ``sft+rft+grpo``: RFT rounds (sample N per task, verifier filter, difficulty band, top-K,
  fine-tune; stop when the positive-task rate stops rising), then ``grpo.steps`` GRPO steps;
* ``sft+grpo``: GRPO only, with as many extra steps as it takes to spend at least the
  rollouts the RFT arm spent in RFT (``ceil(rft_rollouts / (tasks_per_step * samples_per_task))``).

Every rollout counts, including RFT's. Prints one table (rollouts per stage and held-out
success with a 95% interval) and writes it as JSON.

    python bench/rft_vs_grpo.py --sft runs/demo/sft/final            # reuse the demo's SFT weights
    python bench/rft_vs_grpo.py --out runs/rft-vs-grpo --eval-tasks 400
    python bench/rft_vs_grpo.py --seeds 0 1 2 --sft 'runs/seeds-lift/seed-{seed}/sft/final'   # mean ± 95% CI

With ``--seeds`` each seed runs both arms from its own SFT checkpoint (``{seed}`` in ``--sft``)
with ``seed=S``, and the bench prints the per-seed difference (RFT arm minus GRPO arm, points)
and its mean with a Student-t 95% interval. A finished seed is read back, not rerun.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore")

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from mentorrl.cli_common import quiet_transformers  # noqa: E402
from mentorrl.config import load_config  # noqa: E402
from mentorrl.eval.metrics import mean_interval  # noqa: E402
from mentorrl.models.build import load_policy  # noqa: E402
from mentorrl.train.pipeline import run_recipe  # noqa: E402
from mentorrl.train.rundir import MetricsLog  # noqa: E402
from mentorrl.train.workspace import evaluate, open_workspace  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "mentorrl" / "configs" / "demo.yaml"


def rollouts(run_dir: Path, stage: str) -> int:
    return int(sum(r.get("rollouts", 0) for r in MetricsLog(run_dir / "metrics.jsonl").read(stage)))


def run_seed(args, seed: int | None, sft: Path | None, out: Path, con: Console) -> dict:
    """Both arms from one SFT checkpoint (``seed``: the config seed of both arms, None: the demo's);
    read back from ``out/rft_vs_grpo.json`` when that seed already finished."""
    done = out / "rft_vs_grpo.json"
    if done.exists():
        return json.loads(done.read_text())
    common = [f"eval.num_tasks={args.eval_tasks}", *([f"seed={seed}"] if seed is not None else []), *args.overrides]
    if sft is None:
        cfg = load_config(DEMO, [*common, f"run_dir={out / 'sft'}", "recipe=[sft]"])
        run_recipe(cfg, resume=args.resume)
        sft = out / "sft" / "sft" / "final"
    cfg = load_config(DEMO, [*common, f"run_dir={out / 'sft-eval'}", f"model.path={sft}"])
    ws = open_workspace(cfg)
    tokenizer, model = load_policy(sft)
    ws.bind_tokenizer(tokenizer)
    start = evaluate(ws, model, "sft", resume=args.resume)

    rft_dir = out / "sft+rft+grpo"
    rft_cfg = load_config(DEMO, [*common, f"run_dir={rft_dir}", f"model.path={sft}", "recipe=[rft, grpo]"])
    rft_res = run_recipe(rft_cfg, resume=args.resume)
    rft_rollouts, grpo_rollouts = rollouts(rft_dir, "rft"), rollouts(rft_dir, "grpo")

    per_step = rft_cfg.grpo.tasks_per_step * rft_cfg.grpo.samples_per_task
    extra = math.ceil(rft_rollouts / per_step)
    base_dir = out / "sft+grpo"
    base_cfg = load_config(
        DEMO,
        [
            *common,
            f"run_dir={base_dir}",
            f"model.path={sft}",
            "recipe=[grpo]",
            f"grpo.steps={rft_cfg.grpo.steps + extra}",
        ],
    )
    base_res = run_recipe(base_cfg, resume=args.resume)

    rows = {
        "sft (start)": {"rft": 0, "grpo": 0, **start},
        "sft+rft+grpo": {"rft": rft_rollouts, "grpo": grpo_rollouts, **rft_res["after"]},
        "sft+grpo": {"rft": 0, "grpo": rollouts(base_dir, "grpo"), **base_res["after"]},
    }
    rows["sft+rft+grpo"]["after_rft"] = rft_res["rows"]["RFT"]["success"]
    table = Table(
        title=f"seed {seed}: RFT cold start vs GRPO alone, rollouts and held-out success ({args.eval_tasks} tasks)"
    )
    for col in ("arm", "RFT", "GRPO", "total", "success", "95% CI"):
        table.add_column(col, justify="left" if col == "arm" else "right", no_wrap=True)
    for arm, r in rows.items():
        lo, hi = r["success_ci95"]
        table.add_row(
            arm,
            str(r["rft"]),
            str(r["grpo"]),
            str(r["rft"] + r["grpo"]),
            f"{100 * r['success']:.1f}%",
            f"{100 * lo:.1f}-{100 * hi:.1f}%",
        )
    con.print(table)
    con.print(f"held-out success right after RFT: {100 * rows['sft+rft+grpo']['after_rft']:.1f}%")
    result = {k: {kk: v for kk, v in r.items() if kk != "by_group"} for k, r in rows.items()}
    out.mkdir(parents=True, exist_ok=True)
    done.write_text(json.dumps(result, indent=2))
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--sft",
        help="SFT checkpoint both arms start from; with --seeds it may hold {seed} "
        "(default: run the demo's SFT for each seed)",
    )
    ap.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        help="config seeds (each its own run dir OUT/seed-S); default: one run with the demo's seed",
    )
    ap.add_argument("--out", type=Path, default=Path("runs/rft-vs-grpo"))
    ap.add_argument("--eval-tasks", type=int, default=400)
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config override for both arms")
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()
    quiet_transformers()
    con = Console()
    seeds = args.seeds or [None]
    results = {}
    for seed in seeds:
        sft = Path(args.sft.format(seed=seed)) if args.sft else None
        out = args.out / f"seed-{seed}" if args.seeds else args.out
        results[seed] = run_seed(args, seed, sft, out, con)
    diffs = [100 * (r["sft+rft+grpo"]["success"] - r["sft+grpo"]["success"]) for r in results.values()]
    for seed, d in zip(seeds, diffs):
        con.print(f"seed {seed}: sft+rft+grpo minus sft+grpo: {d:+.1f} points")
    s = mean_interval(diffs)
    if s["ci95"] is None:
        con.print(f"sft+rft+grpo minus sft+grpo: {s['mean']:+.1f} points (one seed: no interval)")
    else:
        lo, hi = s["ci95"]
        con.print(
            f"sft+rft+grpo minus sft+grpo over {s['n']} seeds: {s['mean']:+.1f} ± {s['sd']:.1f} points "
            f"(mean ± sd); 95% interval of the mean [{lo:+.1f}, {hi:+.1f}]: {s['verdict']}"
        )
    rft_lifts = [100 * (r["sft+rft+grpo"]["after_rft"] - r["sft (start)"]["success"]) for r in results.values()]
    r = mean_interval(rft_lifts)
    if r["ci95"] is not None:
        lo, hi = r["ci95"]
        con.print(
            f"right after RFT minus SFT over {r['n']} seeds: {r['mean']:+.1f} ± {r['sd']:.1f} points; "
            f"95% interval of the mean [{lo:+.1f}, {hi:+.1f}]: {r['verdict']}"
        )
    out = args.out / "rft_vs_grpo_seeds.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "seeds": {str(k): v for k, v in results.items()},
                "difference_points": s,
                "rft_minus_sft_points": r,
                "overrides": args.overrides,
            },
            indent=2,
        )
    )
    con.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
