"""Post-training methods against GRPO over seeds, from the same SFT checkpoints.

For each seed, each method in ``--methods`` runs in its own process from that seed's SFT
checkpoint, with the method's shipped config and the stage it names
(``mentorrl train CONFIG --set model.path=SFT --set recipe=[STAGE]``, threads 1, run directory
``OUT/METHOD-sSEED``; a finished run, one with its ``eval_STAGE.json``, is read back, not rerun).
The baseline is an existing GRPO run per seed (``--grpo-run``, e.g. the plain arm of
``bench/grpo_guide.py``) from the same SFT checkpoint, with held-out checks
(``audit.eval_every``) on the first ``--check-tasks`` held-out tasks.

Printed per seed and as mean ± sd with a Student-t 95% interval over seeds:

* held-out success after SFT, after GRPO and after the method (the final evaluation, 500 tasks);
* method minus SFT and method minus GRPO;
* for a method with held-out checks (OPD and its variants: ``opd.eval_every``): the student
  rollout tokens it spent to first reach GRPO's final success (the mean of GRPO's last two
  checks; each curve smoothed by averaging a check with the one before), against GRPO's own
  tokens to reach it, and their ratio;
* for a method without checks (SAO): GRPO's check at the largest step whose trajectories do not
  exceed the method's, against the method's final evaluation on the same first
  ``--check-tasks`` tasks (equal trajectories, the same tasks).

Teachers are fixed checkpoints given on the command line (``--teacher`` for same-tokenizer
methods, ``--cross-teacher`` for ``opd_cross``), so every seed distils from the same teacher.

    python bench/methods_seeds.py --sft 'RUNS/s{seed}/sft/final' --grpo-run 'RUNS/plain-s{seed}' \\
        --teacher TEACHER --cross-teacher CROSS_TEACHER --methods opd opd_cross sao --out RUNS/methods
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _seeds import final_eval, same_tasks, summary, train_run  # noqa: E402
from opd_vs_grpo import curve, smoothed, tokens_to_reach  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "mentorrl" / "configs"


@dataclass(frozen=True)
class Method:
    config: str
    stage: str
    overrides: tuple[str, ...] = ()
    teacher: str | None = None  # "teacher", "cross", "both" (OPD teachers) or "bb" (a served black-box teacher)
    checks: bool = field(default=False)  # held-out checks during training (opd.eval_every)


OPD_CHECKS = ("opd.steps=40", "opd.eval_every=4")
METHODS: dict[str, Method] = {
    "opd": Method("opd.yaml", "opd", OPD_CHECKS, teacher="teacher", checks=True),
    "opd_cross": Method("opd_cross.yaml", "opd", OPD_CHECKS, teacher="cross", checks=True),
    "shortopd": Method("shortopd.yaml", "opd", OPD_CHECKS, teacher="teacher", checks=True),
    "reward_weighted": Method("reward_weighted.yaml", "opd", (), checks=True),
    "rlsd": Method("rlsd.yaml", "opd", ("opd.eval_every=4",), checks=True),
    "mopd": Method("mopd.yaml", "opd", OPD_CHECKS, teacher="both", checks=True),
    "evolve": Method("evolve.yaml", "evolve"),
    "sao": Method("sao.yaml", "sao"),
    "ppo": Method("ppo.yaml", "ppo"),
}
# The six black-box recipes (docs/blackbox.md), each against a teacher served by `mentorrl serve` from
# --bb-teacher and reached only over HTTP; bb_dpo.yaml's budget unless the recipe's config sets its own.
BB_RECIPES = ("correction", "ranking", "score", "critique", "soft_labels", "actions")
BB_CONFIG = {"score": "bb_score.yaml", "actions": "bb_action_dpo.yaml"}
METHODS.update(
    {
        f"bb_{r}": Method(BB_CONFIG.get(r, "bb_dpo.yaml"), "blackbox", (f"blackbox.recipe={r}",), teacher="bb")
        for r in BB_RECIPES
    }
)


def run_method(
    out: Path, name: str, seed: int, sft: Path, teachers: dict[str, str | None], extra: list[str], check_tasks: int
) -> Path:
    m, run_dir = METHODS[name], out / f"{name}-s{seed}"
    if (run_dir / f"eval_{m.stage}.json").exists():
        return run_dir
    overrides = [
        f"model.path={sft}",
        f"recipe=[{m.stage}]",
        f"run_dir={run_dir}",
        f"seed={seed}",
        "threads=1",
        "audit.preflight=false",
        f"opd.eval_tasks={check_tasks}",
        *m.overrides,
        *extra,
    ]
    if m.teacher == "bb":
        if teachers["bb"] is None:
            raise SystemExit(f"method {name} asks a served teacher: give --bb-teacher")
        overrides.append(f"blackbox.teacher.serve={{path: {teachers['bb']}}}")
    elif m.teacher is not None:
        wanted = ["teacher", "cross"] if m.teacher == "both" else [m.teacher]
        for w in wanted:
            if teachers[w] is None:
                raise SystemExit(f"method {name} distils from --{'cross-' if w == 'cross' else ''}teacher: give one")
        listed = ", ".join(
            f"{{name: {'cross-teacher' if w == 'cross' else 'teacher'}, path: {teachers[w]}}}" for w in wanted
        )
        overrides.append(f"opd.teachers=[{listed}]")
    run_dir.mkdir(parents=True, exist_ok=True)
    train_run(CONFIGS / m.config, overrides, f"{name} seed {seed}", log=out / f"{name}-s{seed}.log")
    return run_dir


def prefix_success(jsonl: Path, n: int) -> float:
    """Success on the first ``n`` tasks of an evaluation (the tasks of a run's ``n``-task held-out checks:
    a split's task list of ``n`` is the prefix of a longer one with the same seed)."""
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()[:n]]
    return sum(bool(r["reward"] and r["reward"]["success"]) for r in rows) / len(rows)


def records(run_dir: Path, stage: str) -> list[dict]:
    return [
        r
        for r in (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())
        if r.get("stage") == stage
    ]


def seed_row(args, seed: int, name: str) -> dict:
    sft = Path(args.sft.format(seed=seed))
    grpo_dir = Path(args.grpo_run.format(seed=seed))
    start = prefix_success(sft.parents[1] / "eval_sft.jsonl", args.check_tasks)
    grpo_recs = records(grpo_dir, "grpo")
    grpo_curve = curve(grpo_recs, start)
    teachers = {"teacher": args.teacher, "cross": args.cross_teacher, "bb": args.bb_teacher}
    run_dir = run_method(args.out, name, seed, sft, teachers, args.overrides, args.check_tasks)
    m = METHODS[name]
    sft_eval = sft.parents[1] / "eval_sft.json"
    for other in (grpo_dir / "eval_grpo.json", run_dir / f"eval_{m.stage}.json"):
        same_tasks(sft_eval, other)
    row = {
        "seed": seed,
        "sft": final_eval(sft_eval),
        "grpo": final_eval(grpo_dir / "eval_grpo.json"),
        name: final_eval(run_dir / f"eval_{m.stage}.json"),
    }
    recs = records(run_dir, m.stage)
    if m.checks:
        mcurve = curve(recs, start)
        target = smoothed(grpo_curve)[-1][2]
        g_tok, m_tok = tokens_to_reach(grpo_curve, target), tokens_to_reach(mcurve, target)
        row["tokens"] = {
            "target": target,
            "grpo_curve": grpo_curve,
            "curve": mcurve,
            "grpo_to_target": g_tok,
            "to_target": m_tok,
            "total": mcurve[-1][1],
            "grpo_total": grpo_curve[-1][1],
            "best_two_check_mean": max(s for *_, s in smoothed(mcurve)),
            "teacher_tokens": recs[-1].get("teacher_tokens_total", 0.0) if recs else 0.0,
            "fraction_of_grpo": (m_tok / g_tok) if (m_tok is not None and g_tok) else None,
        }
    else:
        trajs = int(sum(r.get("rollouts", 0) for r in recs))
        per_step = [
            (r["step"], sum(x.get("rollouts", 0) for x in grpo_recs if x["step"] <= r["step"]), r["heldout_success"])
            for r in grpo_recs
            if "heldout_success" in r
        ]
        at = [p for p in per_step if p[1] <= trajs]
        # GRPO's checks are every audit.eval_every steps, so the one at or below may be its start (step 0):
        # also its first check at or above the method's trajectories, GRPO given at least as many
        above = [p for p in per_step if p[1] >= trajs]
        row["equal_trajectories"] = {
            "trajectories": trajs,
            "grpo_step": at[-1][0] if at else 0,
            "grpo_trajectories": int(at[-1][1]) if at else 0,
            "grpo": at[-1][2] if at else start,
            "grpo_at_or_above": (
                {"step": above[0][0], "trajectories": int(above[0][1]), "success": above[0][2]} if above else None
            ),
            "method": prefix_success(run_dir / f"eval_{m.stage}.jsonl", args.check_tasks),
            "straggler_metrics": {
                k: recs[-1][k] for k in ("policy_lag_mean", "stale_dropped") if recs and k in recs[-1]
            },
        }
    return row


def pct(e: dict) -> str:
    return f"{100 * e['success']:.1f}% [{100 * e['ci95'][0]:.1f}, {100 * e['ci95'][1]:.1f}]"


def report(name: str, rows: list[dict]) -> dict:
    print(f"\n## {name} ({METHODS[name].config}, stage {METHODS[name].stage})\n")
    checks = METHODS[name].checks
    extra = (
        "target (GRPO's end) | GRPO tokens to it | method tokens to it | fraction"
        if checks
        else "trajectories | GRPO at equal trajectories (first tasks) | method (same tasks)"
    )
    print(f"| seed | after SFT | after GRPO | after {name} | {extra} |")
    print("|---" * (4 + extra.count("|") + 1) + "|")
    for r in rows:
        if checks:
            t = r["tokens"]
            reach = (
                f"{t['to_target']:,.0f}"
                if t["to_target"] is not None
                else f"not within {t['total']:,.0f} (best {100 * t['best_two_check_mean']:.1f}%)"
            )
            frac = f"{t['fraction_of_grpo']:.2f}" if t["fraction_of_grpo"] is not None else "–"
            cols = f"{100 * t['target']:.1f}% | {t['grpo_to_target']:,.0f} | {reach} | {frac}"
        else:
            e = r["equal_trajectories"]
            cols = (
                f"{e['trajectories']} | {100 * e['grpo']:.1f}% (step {e['grpo_step']}, {e['grpo_trajectories']}) | "
                f"{100 * e['method']:.1f}%"
            )
        print(f"| {r['seed']} | {pct(r['sft'])} | {pct(r['grpo'])} | {pct(r[name])} | {cols} |")
    out = {
        "seeds": rows,
        "minus_sft": summary(
            f"{name} minus SFT", [100 * (r[name]["success"] - r["sft"]["success"]) for r in rows], indent="  "
        ),
        "minus_grpo": summary(
            f"{name} minus GRPO (final evaluations)",
            [100 * (r[name]["success"] - r["grpo"]["success"]) for r in rows],
            indent="  ",
        ),
    }
    if checks:
        fracs = [r["tokens"]["fraction_of_grpo"] for r in rows]
        if all(f is not None for f in fracs):
            out["fraction_of_grpo_tokens"] = summary(
                f"{name}'s rollout tokens to GRPO's final success, as a share of GRPO's",
                [100 * f for f in fracs],
                "% of GRPO's tokens",
                difference=False,
                indent="  ",
            )
        else:
            print(
                f"  {name} did not reach GRPO's final success on {sum(f is None for f in fracs)} of {len(fracs)} seeds"
            )
    else:
        out["equal_trajectories_minus_grpo"] = summary(
            f"{name} minus GRPO at equal trajectories",
            [100 * (r["equal_trajectories"]["method"] - r["equal_trajectories"]["grpo"]) for r in rows],
            indent="  ",
        )
        above = [r["equal_trajectories"]["grpo_at_or_above"] for r in rows]
        if all(a is not None for a in above):
            out["minus_grpo_at_or_above"] = summary(
                f"{name} minus GRPO's first check at or above its trajectories",
                [100 * (r["equal_trajectories"]["method"] - a["success"]) for r, a in zip(rows, above)],
                indent="  ",
            )
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sft", required=True, help="each seed's SFT checkpoint; may hold {seed}")
    ap.add_argument("--grpo-run", required=True, help="each seed's GRPO run directory (with held-out checks); {seed}")
    ap.add_argument("--methods", nargs="+", choices=list(METHODS), required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--teacher", help="same-tokenizer teacher checkpoint for every seed")
    ap.add_argument("--cross-teacher", help="teacher checkpoint with its own tokenizer (opd_cross)")
    ap.add_argument("--bb-teacher", help="checkpoint served as the black-box teacher (bb_* methods; any tokenizer)")
    ap.add_argument("--check-tasks", type=int, default=200, help="tasks of the GRPO run's held-out checks")
    ap.add_argument("--out", type=Path, default=Path("runs/methods-seeds"))
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="a config override for every run")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "teacher": args.teacher,
        "cross_teacher": args.cross_teacher,
        "bb_teacher": args.bb_teacher,
        "overrides": args.overrides,
    }
    for name in args.methods:
        result[name] = report(name, [seed_row(args, s, name) for s in args.seeds])
    path = args.out / f"methods_{'_'.join(args.methods)}_s{''.join(map(str, args.seeds))}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
