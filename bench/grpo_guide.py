"""Does expert guidance (``grpo.guide: expert``) help GRPO? A paired comparison over seeds.

For each seed, two GRPO runs start from that seed's SFT checkpoint with the demo's settings and
the same GRPO seed, so they see the same tasks; they differ only in ``grpo.guide``:

* ``plain``: GRPO as it is (a group whose rollouts all failed has no signal towards success);
* ``guide``: such a group also gets the scripted expert's verified demonstration as one more member;
* ``guide_sft``: as ``guide``, plus an SFT term on those demonstrations (``grpo.guide_sft: 1.0``).

Each run is ``mentorrl train mentorrl/configs/demo.yaml --set model.path=SFT --set recipe=[grpo]``
in its own process and run directory ``OUT/ARM-sSEED`` (threads 1, so two arms or seeds can share
the two cores); a finished run (its ``eval_grpo.json``) is read back, not rerun. The SFT figure is
the SFT run's own ``eval_sft.json`` (``SFT/../../eval_sft.json``); an arm evaluated on other tasks
than it (e.g. another draw: ``eval.stratify``) is refused, by the task ids of the ``.jsonl`` beside each. Prints held-out success after
SFT and after each arm (95% Wilson intervals, 500 tasks), the hidden set and the violation rate,
then the mean ± sd and Student-t 95% interval of the per-seed differences (guide minus plain,
and each arm minus SFT), and writes them to ``OUT/grpo_guide.json``.

    python bench/grpo_guide.py --sft 'runs/seeds-lift/seed-{seed}/sft/final' --out runs/grpo-guide --seeds 0 1 2
    python bench/grpo_guide.py ... --arms guide     # run (or read back) one arm only
    python bench/grpo_guide.py ... --arms guide guide_sft   # the SFT term against guidance alone
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _seeds import final_eval, same_tasks, summary, train_run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ARMS = {
    "plain": ["grpo.guide=none"],
    "guide": ["grpo.guide=expert"],
    "guide_sft": ["grpo.guide=expert", "grpo.guide_sft=1.0"],
}
# each arm after the first in a pair is reported minus the second, per seed
PAIRS = [("guide", "plain"), ("guide_sft", "guide")]


def run_arm(out: Path, arm: str, seed: int, sft: Path, overrides: list[str]) -> Path:
    run_dir = out / f"{arm}-s{seed}"
    if not (run_dir / "eval_grpo.json").exists():
        train_run(
            ROOT / "mentorrl/configs/demo.yaml",
            [
                f"model.path={sft}",
                "recipe=[grpo]",
                f"run_dir={run_dir}",
                f"seed={seed}",
                "threads=1",
                "audit.preflight=false",
                "eval.final_splits=[hidden, novel_wording]",
                *ARMS[arm],
                *overrides,
            ],
            f"{arm} seed {seed}",
        )
    return run_dir


def seed_row(out: Path, seed: int, sft: Path, arms: list[str], overrides: list[str]) -> dict:
    sft_eval = sft.parents[1] / "eval_sft.json"
    row = {"seed": seed, "sft": final_eval(sft_eval)}
    for arm in arms:
        run_dir = run_arm(out, arm, seed, sft, overrides)
        same_tasks(sft_eval, run_dir / "eval_grpo.json")
        row[arm] = final_eval(run_dir / "eval_grpo.json")
        hidden = run_dir / "eval_grpo_hidden.json"
        row[arm]["hidden"] = final_eval(hidden)["success"] if hidden.exists() else None
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sft", required=True, help="each seed's SFT checkpoint; may hold {seed}")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", type=Path, default=Path("runs/grpo-guide"))
    ap.add_argument("--arms", nargs="+", choices=list(ARMS), default=["plain", "guide"])
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="a config override for every run")
    args = ap.parse_args(argv)
    rows = [seed_row(args.out, s, Path(args.sft.format(seed=s)), args.arms, args.overrides) for s in args.seeds]

    def pct(e: dict) -> str:
        return f"{100 * e['success']:.1f}% [{100 * e['ci95'][0]:.1f}, {100 * e['ci95'][1]:.1f}]"

    print(
        f"| seed | after SFT | {' | '.join(f'after GRPO {a}' for a in args.arms)} | "
        f"{' | '.join(f'hidden {a}' for a in args.arms)} | violations SFT → {' / '.join(args.arms)} |"
    )
    print("|---" * (2 + 2 * len(args.arms) + 1) + "|")
    for r in rows:
        hid = [f"{100 * r[a]['hidden']:.1f}%" if r[a]["hidden"] is not None else "–" for a in args.arms]
        vio = " / ".join(f"{100 * r[a]['violations']:.1f}%" for a in args.arms)
        print(
            f"| {r['seed']} | {pct(r['sft'])} | {' | '.join(pct(r[a]) for a in args.arms)} | {' | '.join(hid)} | "
            f"{100 * r['sft']['violations']:.1f}% → {vio} |"
        )
    result = {"seeds": rows, "overrides": args.overrides}
    for a in args.arms:
        result[f"{a}_minus_sft"] = summary(
            f"{a} minus SFT", [100 * (r[a]["success"] - r["sft"]["success"]) for r in rows]
        )
    for a, b in PAIRS:
        if {a, b} <= set(args.arms):
            result[f"{a}_minus_{b}"] = summary(
                f"{a} minus {b}", [100 * (r[a]["success"] - r[b]["success"]) for r in rows]
            )
            result[f"violations_{a}_minus_{b}"] = summary(
                f"violation rate, {a} minus {b}", [100 * (r[a]["violations"] - r[b]["violations"]) for r in rows]
            )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "grpo_guide.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out / 'grpo_guide.json'}")


if __name__ == "__main__":
    main()
