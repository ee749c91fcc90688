"""OPD efficiency: student rollout tokens to reach the held-out success GRPO reaches at its end.

Both arms start from the same SFT checkpoint, in this one process:

* ``grpo``: the demo's GRPO (``--grpo-steps`` steps of 16 tasks x 8 samples), a held-out check
  every ``--grpo-eval-every`` steps;
* ``opd``: the recipe in ``--opd-config`` (default ``mentorrl/configs/opd.yaml``: on-policy
  distillation from the stronger local teacher, which that config builds from this same SFT
  checkpoint trained on, or finds cached), a held-out check every step.

Every held-out check rolls out the same ``--eval-tasks`` held-out tasks. A method's *rollout
tokens* are the policy tokens its student generated during training (prompts, tool
observations and evaluation rollouts are not counted; teacher compute is printed separately).

Printed: each arm's learning curve (rollout tokens -> held-out success), the target (GRPO's
success at its end: the mean of its last two checks), the tokens each arm spent to first reach it
on its curve smoothed the same way (each check averaged with the one before), and their ratio
``GRPO tokens / OPD tokens``.

    python bench/opd_vs_grpo.py --sft runs/demo/sft/final
    python bench/opd_vs_grpo.py --sft runs/demo/sft/final --opd-config mentorrl/configs/opd_cross.yaml
"""

from __future__ import annotations

import argparse
import json
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
from mentorrl.train.teachers import build_teacher  # noqa: E402
from mentorrl.train.workspace import heldout_check, open_workspace  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "mentorrl" / "configs" / "demo.yaml"


def curve(records: list[dict], start: float) -> list[tuple[int, float, float]]:
    """``(step, rollout tokens so far, held-out success)`` at step 0 and at every check."""
    out, tokens = [(0, 0.0, start)], 0.0
    for r in records:
        tokens += r.get("rollout_tokens", 0.0)
        if "heldout_success" in r:
            out.append((r["step"], tokens, r["heldout_success"]))
    return out


def smoothed(points: list[tuple[int, float, float]]) -> list[tuple[int, float, float]]:
    """Each check's success averaged with the check before it (the first with step 0's): one held-out
    check of a few hundred tasks moves by a couple of points from sampling alone, and an arm that
    is checked more often would otherwise get more chances to cross a line by luck. The tokens of
    a smoothed point are those of its later check."""
    return points[:1] + [(b[0], b[1], (a[2] + b[2]) / 2) for a, b in zip(points, points[1:])]


def tokens_to_reach(points: list[tuple[int, float, float]], target: float) -> float | None:
    """Rollout tokens at the first smoothed point at or above ``target``; None if none is."""
    return next((tok for _, tok, s in smoothed(points) if s >= target - 1e-12), None)


def with_built_teachers(cfg, con: Console, student, tokenizer):
    """``cfg`` with a path for every local teacher that has none: built once, cached under opd.teachers_dir.
    A ``build.init: student`` teacher trains on from ``student`` (the SFT checkpoint given here); a
    from-scratch one is built from the config as written (the student's tiny tokenizer)."""
    teachers = []
    for t in cfg.opd.teachers:
        if t.kind == "hf" and not t.path:
            ws = open_workspace(cfg.model_copy(update={"run_dir": str(Path(cfg.run_dir) / "teacher-build")}))
            ws.console = con
            ws.bind_tokenizer(tokenizer)
            t = t.model_copy(update={"path": str(build_teacher(ws, t, student))})
        teachers.append(t)
    return cfg.model_copy(update={"opd": cfg.opd.model_copy(update={"teachers": teachers})})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--sft", type=Path, required=True, help="SFT checkpoint both arms start from (e.g. runs/demo/sft/final)"
    )
    ap.add_argument("--opd-config", type=Path, default=ROOT / "mentorrl" / "configs" / "opd.yaml")
    ap.add_argument("--out", type=Path, default=Path("runs/opd-vs-grpo"))
    ap.add_argument("--grpo-steps", type=int, default=20)
    ap.add_argument("--grpo-eval-every", type=int, default=2)
    ap.add_argument("--opd-steps", type=int, default=None, help="default: the OPD config's opd.steps")
    ap.add_argument("--eval-tasks", type=int, default=300)
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config override for the OPD arm")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    quiet_transformers()
    con = Console()
    if not (args.sft / "config.json").exists():
        ap.error(f"--sft {args.sft} is not a checkpoint directory (run `mentorrl demo` first)")
    checks = [f"eval.num_tasks={args.eval_tasks}", "audit.preflight=false"]

    # the start: the SFT checkpoint on the check tasks
    cfg0 = load_config(DEMO, [f"run_dir={args.out / 'start'}", f"model.path={args.sft}", *checks])
    ws0 = open_workspace(cfg0, show_progress=False)
    tok, model = load_policy(args.sft)
    ws0.bind_tokenizer(tok)
    start = heldout_check(ws0, model, args.eval_tasks)
    con.print(f"SFT checkpoint {args.sft}: held-out success {100 * start:.1f}% on {args.eval_tasks} tasks")

    grpo_cfg = load_config(
        DEMO,
        [
            f"run_dir={args.out / 'grpo'}",
            f"model.path={args.sft}",
            "recipe=[grpo]",
            *checks,
            f"grpo.steps={args.grpo_steps}",
            f"audit.eval_every={args.grpo_eval_every}",
            f"audit.eval_tasks={args.eval_tasks}",
        ],
    )
    run_recipe(grpo_cfg)
    grpo = curve(MetricsLog(args.out / "grpo" / "metrics.jsonl").read("grpo"), start)

    built = with_built_teachers(load_config(args.opd_config, args.overrides), con, model, tok)
    opd_over = [
        *args.overrides,
        f"run_dir={args.out / 'opd'}",
        f"model.path={args.sft}",
        "recipe=[opd]",
        *checks,
        "opd.eval_every=1",
        f"opd.eval_tasks={args.eval_tasks}",
    ]
    if args.opd_steps is not None:
        opd_over.append(f"opd.steps={args.opd_steps}")
    opd_cfg = load_config(args.opd_config, opd_over)
    run_recipe(opd_cfg.model_copy(update={"opd": opd_cfg.opd.model_copy(update={"teachers": built.opd.teachers})}))
    opd_recs = MetricsLog(args.out / "opd" / "metrics.jsonl").read("opd")
    opd = curve(opd_recs, start)

    target = smoothed(grpo)[-1][2]  # GRPO's success at its end: the mean of its last two checks
    g_tok, o_tok = tokens_to_reach(grpo, target), tokens_to_reach(opd, target)
    table = Table(title=f"Held-out success ({args.eval_tasks} tasks) against student rollout tokens")
    for col in ("arm", "step", "rollout tokens", "held-out success", "two-check mean"):
        table.add_column(col, justify="right" if col != "arm" else "left")
    for name, pts in (("grpo", grpo), ("opd", opd)):
        means = {step: s for step, _, s in smoothed(pts)[1:]}
        for step, tok_, s in pts:
            table.add_row(
                name, str(step), f"{tok_:,.0f}", f"{100 * s:.1f}%", f"{100 * means[step]:.1f}%" if step in means else ""
            )
    con.print(table)
    teacher_tokens = opd_recs[-1].get("teacher_tokens_total", 0.0) if opd_recs else 0.0
    con.print(f"target (GRPO's success at its end, mean of its last two checks): {100 * target:.1f}%")
    con.print(f"GRPO: {grpo[-1][1]:,.0f} rollout tokens in all; first reached the target after {g_tok:,.0f}")
    if o_tok is None:
        con.print(
            f"OPD: did not reach {100 * target:.1f}% within {opd[-1][1]:,.0f} rollout tokens "
            f"(best two-check mean {100 * max(s for *_, s in smoothed(opd)):.1f}%)"
        )
        ratio = None
    else:
        ratio = g_tok / max(o_tok, 1.0)
        con.print(
            f"OPD: reached it after {o_tok:,.0f} rollout tokens (teacher read {teacher_tokens:,.0f} tokens "
            f"over the whole run)"
        )
        con.print(
            f"[bold]GRPO tokens / OPD tokens to reach GRPO's final success: {ratio:.1f}x "
            f"(OPD needs {100 / ratio:.1f}% of GRPO's)[/bold]"
        )
    result = {
        "start": start,
        "target": target,
        "grpo_curve": grpo,
        "opd_curve": opd,
        "grpo_tokens_to_target": g_tok,
        "opd_tokens_to_target": o_tok,
        "ratio": ratio,
        "opd_teacher_tokens": teacher_tokens,
        "opd_config": str(args.opd_config),
        "eval_tasks": args.eval_tasks,
    }
    (args.out / "result.json").write_text(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
