"""Does an RFT cold start beat more GRPO for the same number of rollouts?

Both arms start from the same SFT checkpoint and are evaluated on the same held-out tasks
with the same seed:

* ``sft+rft+grpo``: RFT rounds (sample N per task, verifier filter, difficulty band, top-K,
  fine-tune; stop when the positive-task rate stops rising), then ``grpo.steps`` GRPO steps;
* ``sft+grpo``: GRPO only, with as many extra steps as it takes to spend at least the
  rollouts the RFT arm spent in RFT (``ceil(rft_rollouts / (tasks_per_step * group_size))``).

Every rollout counts, including RFT's. Prints one table (rollouts per stage and held-out
success with a 95% interval) and writes it as JSON.

    python bench/rft_vs_grpo.py --sft runs/demo/sft/final            # reuse the demo's SFT weights
    python bench/rft_vs_grpo.py --out runs/rft-vs-grpo --eval-tasks 400
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
from mentorrl.models.build import load_policy  # noqa: E402
from mentorrl.train.pipeline import run_recipe  # noqa: E402
from mentorrl.train.rundir import MetricsLog  # noqa: E402
from mentorrl.train.stages import evaluate, open_workspace  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "mentorrl" / "configs" / "demo.yaml"


def rollouts(run_dir: Path, stage: str) -> int:
    return int(sum(r.get("rollouts", 0) for r in MetricsLog(run_dir / "metrics.jsonl").read(stage)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sft", type=Path, help="SFT checkpoint both arms start from (default: run the demo's SFT)")
    ap.add_argument("--out", type=Path, default=Path("runs/rft-vs-grpo"))
    ap.add_argument("--eval-tasks", type=int, default=400)
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config override for both arms")
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()
    quiet_transformers()
    con = Console()
    common = [f"eval.num_tasks={args.eval_tasks}", *args.overrides]

    sft = args.sft
    if sft is None:
        cfg = load_config(DEMO, [*common, f"run_dir={args.out / 'sft'}", "recipe=[sft]"])
        run_recipe(cfg, resume=args.resume)
        sft = args.out / "sft" / "sft" / "final"
    cfg = load_config(DEMO, [*common, f"run_dir={args.out / 'sft-eval'}", f"model.path={sft}"])
    ws = open_workspace(cfg)
    tokenizer, model = load_policy(sft)
    ws.bind_tokenizer(tokenizer)
    start = evaluate(ws, model, "sft", resume=args.resume)

    rft_dir = args.out / "sft+rft+grpo"
    rft_cfg = load_config(DEMO, [*common, f"run_dir={rft_dir}", f"model.path={sft}", "recipe=[rft, grpo]"])
    rft_res = run_recipe(rft_cfg, resume=args.resume)
    rft_rollouts, grpo_rollouts = rollouts(rft_dir, "rft"), rollouts(rft_dir, "grpo")

    per_step = rft_cfg.grpo.tasks_per_step * rft_cfg.grpo.group_size
    extra = math.ceil(rft_rollouts / per_step)
    base_dir = args.out / "sft+grpo"
    base_cfg = load_config(DEMO, [*common, f"run_dir={base_dir}", f"model.path={sft}", "recipe=[grpo]",
                                  f"grpo.steps={rft_cfg.grpo.steps + extra}"])
    base_res = run_recipe(base_cfg, resume=args.resume)

    rows = {
        "sft (start)": {"rft": 0, "grpo": 0, **start},
        "sft+rft+grpo": {"rft": rft_rollouts, "grpo": grpo_rollouts, **rft_res["after"]},
        "sft+grpo": {"rft": 0, "grpo": rollouts(base_dir, "grpo"), **base_res["after"]},
    }
    rows["sft+rft+grpo"]["after_rft"] = rft_res["rows"]["RFT"]["success"]
    table = Table(title=f"RFT cold start vs GRPO alone: rollouts and held-out success ({args.eval_tasks} tasks)")
    for col in ("arm", "RFT", "GRPO", "total", "success", "95% CI"):
        table.add_column(col, justify="left" if col == "arm" else "right", no_wrap=True)
    for arm, r in rows.items():
        lo, hi = r["success_ci95"]
        table.add_row(arm, str(r["rft"]), str(r["grpo"]), str(r["rft"] + r["grpo"]), f"{100 * r['success']:.1f}%",
                      f"{100 * lo:.1f}-{100 * hi:.1f}%")
    con.print(table)
    con.print(f"held-out success right after RFT: {100 * rows['sft+rft+grpo']['after_rft']:.1f}%")
    diff = rows["sft+rft+grpo"]["success"] - rows["sft+grpo"]["success"]
    con.print(f"sft+rft+grpo minus sft+grpo: {100 * diff:+.1f} points")
    out = args.out / "rft_vs_grpo.json"
    out.write_text(json.dumps({k: {kk: v for kk, v in r.items() if kk != "by_group"} for k, r in rows.items()}, indent=2))
    con.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
