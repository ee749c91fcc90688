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

MOPD from specialists: ``--spec-a`` and ``--spec-b`` are two specialist teachers, each trained on one half
of the task families (``mentorrl/configs/specialist.yaml`` with ``sft.families``; ``--spec-a-families``,
default the first half of orders' families, spec-b the rest). Every arm is ``opd.yaml`` (same-tokenizer
top-k OPD) with exactly those teachers, named ``spec_a`` and ``spec_b``: ``opd_spec_a`` / ``opd_spec_b``
distil from one; ``mopd_oracle`` routes each family to its own specialist (static ``opd.mopd.routes``, the
per-family oracle router); ``mopd_competence`` measures the routes (``opd.mopd.competence``, soft);
``mopd_mix`` weights them as ``mopd.yaml`` does (confidence and success history, no routes). The
specialists' own held-out success (their run's ``eval_sft.json``, on the same tasks) is reported beside
them, and each MOPD arm's difference from ``mopd_oracle`` when both ran (docs/opd.md):

    python bench/methods_seeds.py --sft 'RUNS/s{seed}/sft/final' --grpo-run 'RUNS/plain-s{seed}' \\
        --spec-a runs/spec-a/sft/final --spec-b runs/spec-b/sft/final \\
        --methods opd_spec_a opd_spec_b mopd_oracle mopd_competence mopd_mix --out RUNS/specialists

Incremental (``--results FILE``, default ``OUT/arms.jsonl``; ``bench/_arms.py``): the estimated time of every arm
still to run is printed before the first starts; each finished (method, seed) is appended to FILE the moment it
finishes, with its per-task outcomes, and a rerun skips every arm FILE already holds with the same config and
overrides. The seeds' SFT and GRPO runs are recorded as arms ``sft`` and ``grpo``. Each arm is paired with its
natural baseline (``BASELINES``) on the same held-out tasks: the difference with a paired bootstrap interval,
printed and kept in the line; ``bench/methods_table.py FILE`` prints the table from the file alone. ``--jobs 2``
trains two arms at once, each a child process at one torch thread (both cores of a 2-core machine); each is
still appended the moment it finishes, and its line records ``jobs`` (its seconds were measured beside another).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _arms import ArmStore, commit, fingerprint, task_bits  # noqa: E402
from _seeds import final_eval, same_tasks, summary, train_run  # noqa: E402
from opd_vs_grpo import curve, smoothed, tokens_to_reach  # noqa: E402

from mentorrl.envs.orders.tasks import FAMILIES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "mentorrl" / "configs"


@dataclass(frozen=True)
class Method:
    config: str
    stage: str
    overrides: tuple[str, ...] = ()
    teacher: str | None = None  # a key of TEACHER_SETS (the OPD teachers) or "bb" (a served black-box teacher)
    checks: bool = field(default=False)  # held-out checks during training (opd.eval_every)
    oracle_routes: bool = False  # opd.mopd.routes: each family to its own specialist (--spec-a-families)


# Method.teacher -> the OPD teachers it lists: (key of the command line's teachers, name in opd.teachers)
TEACHER_SETS: dict[str, tuple[tuple[str, str], ...]] = {
    "teacher": (("teacher", "teacher"),),
    "cross": (("cross", "cross-teacher"),),
    "both": (("teacher", "teacher"), ("cross", "cross-teacher")),
    "spec_a": (("spec_a", "spec_a"),),
    "spec_b": (("spec_b", "spec_b"),),
    "specs": (("spec_a", "spec_a"), ("spec_b", "spec_b")),
}
TEACHER_FLAGS = {
    "teacher": "--teacher",
    "cross": "--cross-teacher",
    "spec_a": "--spec-a",
    "spec_b": "--spec-b",
    "bb": "--bb-teacher",
}
SPEC_A_FAMILIES = FAMILIES[: len(FAMILIES) // 2]  # order_status, stock_check, order_count, cancel_order


OPD_CHECKS = ("opd.steps=40", "opd.eval_every=4")
METHODS: dict[str, Method] = {
    "opd": Method("opd.yaml", "opd", OPD_CHECKS, teacher="teacher", checks=True),
    "opd_cross": Method("opd_cross.yaml", "opd", OPD_CHECKS, teacher="cross", checks=True),
    "shortopd": Method("shortopd.yaml", "opd", OPD_CHECKS, teacher="teacher", checks=True),
    "reward_weighted": Method("reward_weighted.yaml", "opd", (), checks=True),
    "rlsd": Method("rlsd.yaml", "opd", ("opd.eval_every=4",), checks=True),
    "mopd": Method("mopd.yaml", "opd", OPD_CHECKS, teacher="both", checks=True),
    # MOPD from two specialists (--spec-a, --spec-b): opd.yaml's terms for every arm, only the routing differs
    "opd_spec_a": Method("opd.yaml", "opd", OPD_CHECKS, teacher="spec_a", checks=True),
    "opd_spec_b": Method("opd.yaml", "opd", OPD_CHECKS, teacher="spec_b", checks=True),
    "mopd_oracle": Method("opd.yaml", "opd", OPD_CHECKS, teacher="specs", checks=True, oracle_routes=True),
    "mopd_competence": Method(
        "opd.yaml",
        "opd",
        (*OPD_CHECKS, "opd.mopd.competence={tasks_per_family: 8, mode: soft}"),
        teacher="specs",
        checks=True,
    ),
    "mopd_mix": Method(  # mopd.yaml's teacher weighting
        "opd.yaml",
        "opd",
        (*OPD_CHECKS, "opd.mopd.confidence_temperature=1.0", "opd.mopd.success_history=true"),
        teacher="specs",
        checks=True,
    ),
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


# Each method's natural baseline (the arm it is paired with, on the same tasks and seed): what it claims to beat.
BASELINES: dict[str, str] = {
    "opd": "grpo",  # at equal student tokens (opd.eval_every checks: the tokens columns)
    "opd_cross": "opd",  # cross- against same-tokenizer, teachers of equal strength
    "shortopd": "opd",
    "reward_weighted": "grpo",
    "rlsd": "grpo",
    "mopd": "opd",
    "opd_spec_a": "sft",
    "opd_spec_b": "sft",
    "mopd_oracle": "opd_spec_a",
    "mopd_competence": "mopd_oracle",
    "mopd_mix": "mopd_oracle",
    "evolve": "grpo",
    "sao": "grpo",
    "ppo": "grpo",
    **{f"bb_{r}": "sft" for r in BB_RECIPES},
}
DEFAULT_MINUTES = 10.0  # one method run at the demo's size, until the results file has the method's own times


def arm_fingerprint(name: str, args) -> str:
    """What defines arm ``name`` here: its config file's text, its overrides, the bench-wide ones and the teachers."""
    if name in ("sft", "grpo"):
        return fingerprint(name, args.sft if name == "sft" else args.grpo_run)
    m = METHODS[name]
    teachers = [str(getattr(args, k, None)) for k in ("teacher", "cross_teacher", "bb_teacher", "spec_a", "spec_b")]
    return fingerprint(
        (CONFIGS / m.config).read_text(), *m.overrides, *args.overrides, args.sft, str(args.check_tasks), *teachers
    )


def arm_line(name: str, seed: int, fp: str, eval_json: Path, seconds: float | None, row: dict | None) -> dict:
    """The results file's record of a finished arm (``bench/_arms.py``)."""
    ev = final_eval(eval_json)
    bits = task_bits(eval_json.with_suffix(".jsonl"))
    return {
        "arm": name,
        "seed": seed,
        "fingerprint": fp,
        "baseline": BASELINES.get(name, "sft" if name == "grpo" else None),
        **ev,
        "tasks": bits[0] if bits else None,
        "bits": bits[1] if bits else None,
        "seconds": seconds,
        "commit": commit(),
        "row": row,
    }


def record_references(store: ArmStore, args, seed: int) -> None:
    """The seed's SFT and GRPO evaluations as arms ``sft`` and ``grpo`` (once each)."""
    sft_eval = Path(args.sft.format(seed=seed)).parents[1] / "eval_sft.json"
    grpo_eval = Path(args.grpo_run.format(seed=seed)) / "eval_grpo.json"
    for name, ev in (("sft", sft_eval), ("grpo", grpo_eval)):
        fp = arm_fingerprint(name, args)
        if store.find(name, seed, fp) is None and ev.exists():
            store.append(arm_line(name, seed, fp, ev, None, None))


def plan(store: ArmStore, args) -> list[tuple[str, int]]:
    """The (method, seed) arms still to run, printed with their estimated minutes and the expected finish."""
    todo = [(n, s) for n in args.methods for s in args.seeds if store.find(n, s, arm_fingerprint(n, args)) is None]
    est = {n: store.estimate_s(n, 60 * DEFAULT_MINUTES) for n, _ in todo}
    jobs = max(1, min(getattr(args, "jobs", 1), len(todo)))
    total = sum(est[n] for n, _ in todo) / jobs  # arms trained side by side share the wall clock
    done = len(args.methods) * len(args.seeds) - len(todo)
    at_once = f", {jobs} at once" if jobs > 1 else ""
    print(f"{len(todo)} arms to run ({done} already in {store.path}): about {total / 60:.0f} minutes{at_once}")
    for n, s in todo:
        print(f"  {n} seed {s}: ~{est[n] / 60:.0f} min")
    if todo:
        print(f"  expected to finish at {time.strftime('%H:%M', time.localtime(time.time() + total))}")
    return todo


def spec_split(spec_a: list[str] | tuple[str, ...] = SPEC_A_FAMILIES) -> dict[str, list[str]]:
    """Each specialist's families: ``spec_a`` (orders families) and the rest for spec_b."""
    unknown = [f for f in spec_a if f not in FAMILIES]
    if unknown or not spec_a or len(spec_a) == len(FAMILIES):
        raise SystemExit(
            f"--spec-a-families must be some but not all of {', '.join(FAMILIES)}"
            + (f"; unknown: {', '.join(unknown)}" if unknown else "")
        )
    return {"spec_a": list(spec_a), "spec_b": [f for f in FAMILIES if f not in spec_a]}


def teacher_overrides(name: str, m: Method, teachers: dict[str, str | None], spec: dict[str, list[str]]) -> list[str]:
    """The overrides that give method ``m`` its teachers: the served black-box teacher, or ``opd.teachers``
    (``TEACHER_SETS[m.teacher]``) and, for the oracle router, ``opd.mopd.routes`` (after the teachers it names)."""
    if m.teacher is None:
        return []
    if m.teacher == "bb":
        if teachers.get("bb") is None:
            raise SystemExit(f"method {name} asks a served teacher: give --bb-teacher")
        return [f"blackbox.teacher.serve={{path: {teachers['bb']}}}"]
    wanted = TEACHER_SETS[m.teacher]
    for key, _ in wanted:
        if teachers.get(key) is None:
            raise SystemExit(f"method {name} distils from {TEACHER_FLAGS[key]}: give one")
    out = ["opd.teachers=[" + ", ".join(f"{{name: {t}, path: {teachers[key]}}}" for key, t in wanted) + "]"]
    if m.oracle_routes:
        routes = ", ".join(f"{fam}: {{{t}: 1.0}}" for t, fams in spec.items() for fam in fams)
        out.append(f"opd.mopd.routes={{{routes}}}")
    return out


def run_method(
    out: Path,
    name: str,
    seed: int,
    sft: Path,
    teachers: dict[str, str | None],
    extra: list[str],
    check_tasks: int,
    spec: dict[str, list[str]] | None = None,
) -> Path:
    """Method ``name`` from ``sft`` at ``seed`` (read back when finished); ``spec``: each specialist's
    families, for the oracle router (default :func:`spec_split`)."""
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
        *teacher_overrides(name, m, teachers, spec or spec_split()),
    ]
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


def train_arm(args, seed: int, name: str) -> Path:
    """Method ``name`` at ``seed`` from the seed's SFT checkpoint (:func:`run_method`: read back when finished)."""
    teachers = {
        "teacher": args.teacher,
        "cross": args.cross_teacher,
        "bb": args.bb_teacher,
        "spec_a": args.spec_a,
        "spec_b": args.spec_b,
    }
    sft = Path(args.sft.format(seed=seed))
    return run_method(args.out, name, seed, sft, teachers, args.overrides, args.check_tasks, args.spec)


def seed_row(args, seed: int, name: str) -> dict:
    sft = Path(args.sft.format(seed=seed))
    grpo_dir = Path(args.grpo_run.format(seed=seed))
    start = prefix_success(sft.parents[1] / "eval_sft.jsonl", args.check_tasks)
    grpo_recs = records(grpo_dir, "grpo")
    grpo_curve = curve(grpo_recs, start)
    run_dir = train_arm(args, seed, name)
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


def arm_row(store: ArmStore, args, seed: int, name: str, seconds: float | None = None) -> dict:
    """Method ``name`` at ``seed``: read back from the results file when it holds this arm, else run (or read back
    from its run directory), timed and appended to the file at once. ``seconds``: its training's time, measured
    where it ran (:func:`run_concurrently`)."""
    fp = arm_fingerprint(name, args)
    hit = store.find(name, seed, fp)
    if hit is not None and hit.get("row") is not None:
        return hit["row"]
    final = claim_arm(store, args, seed, name, fp)
    ran, t0 = not final.exists(), time.perf_counter()
    row = seed_row(args, seed, name)
    took = seconds if seconds is not None else (time.perf_counter() - t0 if ran else None)
    line = arm_line(name, seed, fp, final, took, row)
    store.append({**line, "command": args.command, "jobs": args.jobs})
    return row


def claim_arm(store: ArmStore, args, seed: int, name: str, fp: str) -> Path:
    """Before arm ``name`` at ``seed`` runs: the seed's references recorded, its run directory marked with the
    arm's fingerprint (a directory run with other settings is refused). Its final evaluation's path."""
    record_references(store, args, seed)
    final = args.out / f"{name}-s{seed}" / f"eval_{METHODS[name].stage}.json"
    mark = final.parent / "arm_fingerprint"
    if mark.exists() and mark.read_text().strip() != fp:
        raise SystemExit(f"{final.parent} was run with other settings: move it away or give another --out")
    final.parent.mkdir(parents=True, exist_ok=True)
    mark.write_text(fp + "\n")
    return final


def run_concurrently(store: ArmStore, args, todo: list[tuple[str, int]]) -> None:
    """The arms of ``todo`` as ``args.jobs`` child processes at a time (each at one torch thread, so ``--jobs 2``
    keeps both cores of a 2-core machine busy), each appended to the results file in this thread the moment it
    finishes, with its own seconds (measured beside the others: ``jobs`` in its line). An arm that fails lets the
    running ones finish and be recorded; then the first failure is raised."""
    claimed = [(name, seed, claim_arm(store, args, seed, name, arm_fingerprint(name, args))) for name, seed in todo]

    def train(name: str, seed: int, final: Path) -> float | None:
        ran, t0 = not final.exists(), time.perf_counter()
        train_arm(args, seed, name)
        return time.perf_counter() - t0 if ran else None

    failed: list[BaseException] = []
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        running = {pool.submit(train, *arm): arm for arm in claimed}
        for done in as_completed(running):
            name, seed, _ = running[done]
            if done.exception() is not None:
                failed.append(done.exception())
                continue
            arm_row(store, args, seed, name, seconds=done.result())
    if failed:
        raise failed[0]


def paired_lines(store: ArmStore, name: str, seeds: list[int]) -> dict:
    """``name`` minus its baseline on the same tasks, per seed (None where either lacks per-task outcomes), printed."""
    base = BASELINES[name]
    out = {}
    for s in seeds:
        p = store.paired(name, base, s)
        out[str(s)] = p
        if p is not None:
            lo, hi = p["ci95"]
            print(
                f"  seed {s}: {name} minus {base} {p['diff']:+.1f} points [{lo:+.1f}, {hi:+.1f}] paired, {p['n']} tasks"
            )
    return {"baseline": base, "seeds": out}


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


def specialists(args) -> dict:
    """Each given specialist's checkpoint, families and own held-out success (its run's ``eval_sft.json``,
    checked to be on the students' tasks), printed."""
    out: dict = {}
    student_eval = Path(args.sft.format(seed=args.seeds[0])).parents[1] / "eval_sft.json"
    for key in ("spec_a", "spec_b"):
        path = getattr(args, key)
        out[key] = {"path": path, "families": args.spec[key]}
        own = Path(path).parents[1] / "eval_sft.json" if path else None
        if own is not None and own.exists():
            same_tasks(student_eval, own)
            out[key]["alone"] = final_eval(own)
            print(f"{key} ({', '.join(args.spec[key])}) alone: {pct(out[key]['alone'])}")
    return out


def minus_oracle(result: dict, methods: list[str]) -> dict:
    """Each other method minus ``mopd_oracle``, seed by seed (final evaluations), printed."""
    oracle = {r["seed"]: r["mopd_oracle"]["success"] for r in result["mopd_oracle"]["seeds"]}
    print("\n## minus the per-family oracle router (mopd_oracle)\n")
    return {
        name: summary(
            f"{name} minus mopd_oracle",
            [100 * (r[name]["success"] - oracle[r["seed"]]) for r in result[name]["seeds"]],
            indent="  ",
        )
        for name in methods
        if name != "mopd_oracle"
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sft", required=True, help="each seed's SFT checkpoint; may hold {seed}")
    ap.add_argument("--grpo-run", required=True, help="each seed's GRPO run directory (with held-out checks); {seed}")
    ap.add_argument("--methods", nargs="+", choices=list(METHODS), required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--teacher", help="same-tokenizer teacher checkpoint for every seed")
    ap.add_argument("--cross-teacher", help="teacher checkpoint with its own tokenizer (opd_cross)")
    ap.add_argument("--bb-teacher", help="checkpoint served as the black-box teacher (bb_* methods; any tokenizer)")
    ap.add_argument("--spec-a", help="specialist teacher checkpoint on --spec-a-families (opd_spec_a, mopd_*)")
    ap.add_argument("--spec-b", help="specialist teacher checkpoint on the other families (opd_spec_b, mopd_*)")
    ap.add_argument(
        "--spec-a-families",
        default=",".join(SPEC_A_FAMILIES),
        help="comma-separated orders families spec-a was trained on; spec-b has the rest (the oracle's routes)",
    )
    ap.add_argument("--check-tasks", type=int, default=200, help="tasks of the GRPO run's held-out checks")
    ap.add_argument("--out", type=Path, default=Path("runs/methods-seeds"))
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="a config override for every run")
    ap.add_argument(
        "--results", type=Path, default=None, help="the results file arms are appended to (default OUT/arms.jsonl)"
    )
    ap.add_argument(
        "--jobs", type=int, default=1, help="arms trained at once, each a child process at one torch thread"
    )
    args = ap.parse_args(argv)
    if args.jobs < 1:
        raise SystemExit("--jobs must be at least 1")
    args.command = shlex.join(["python", "bench/methods_seeds.py", *(sys.argv[1:] if argv is None else argv)])
    args.spec = spec_split([f.strip() for f in args.spec_a_families.split(",") if f.strip()])
    args.out.mkdir(parents=True, exist_ok=True)
    store = ArmStore.open(args.results or args.out / "arms.jsonl")
    todo = plan(store, args)
    if args.jobs > 1:
        run_concurrently(store, args, todo)
    result = {
        "teacher": args.teacher,
        "cross_teacher": args.cross_teacher,
        "bb_teacher": args.bb_teacher,
        "overrides": args.overrides,
    }
    if any(METHODS[n].teacher in ("spec_a", "spec_b", "specs") for n in args.methods):
        result["specialists"] = specialists(args)
    for name in args.methods:
        result[name] = report(name, [arm_row(store, args, s, name) for s in args.seeds])
        result[name]["paired"] = paired_lines(store, name, args.seeds)
    if "mopd_oracle" in args.methods:
        result["minus_oracle"] = minus_oracle(result, args.methods)
    path = args.out / f"methods_{'_'.join(args.methods)}_s{''.join(map(str, args.seeds))}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
