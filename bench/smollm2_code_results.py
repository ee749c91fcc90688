"""Collect the SmolLM2 code-environment runs into one results file (issue 56): per seed, held-out success with its
Wilson interval, per family, violations and mean policy tokens after SFT and after GRPO, the paired GRPO - SFT
difference on the same tasks (a paired bootstrap), and the zero-shot evaluation (``mentorrl eval --out``) if given.

    python bench/smollm2_code_results.py --runs RUNS/smol-code-s0 RUNS/smol-code-s1 --zero-shot RUNS/smol-code-zeroshot \\
        --out bench/results/smollm2_code.json

A seed trained in two runs (``recipe=[sft]``, then ``recipe=[grpo]`` from its ``sft/final``) is merged into a results
file as it finishes, its GRPO steps summarised (sampled success, dynamic-sampling rounds, seconds):

    python bench/smollm2_code_results.py --update RUNS/smollm2_code_seeds.json \\
        --sft RUNS/smol-code-sft-s0 --grpo RUNS/smol-code-grpo-s0
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _arms import paired_bootstrap  # noqa: E402

FAMILIES = ("strings", "lists", "parsing", "stateful")


def successes(path: Path) -> dict[str, float]:
    """task id -> 1.0 / 0.0 from an evaluation's trajectories."""
    out = {}
    for line in path.read_text().splitlines():
        if line.strip():
            t = json.loads(line)
            out[t["task_id"]] = 1.0 if t["reward"]["success"] else 0.0
    return out


def paired(a: dict[str, float], b: dict[str, float]) -> dict:
    """b - a over the tasks both hold, in points, with a paired bootstrap 95% interval."""
    ids = sorted(set(a) & set(b))
    return paired_bootstrap([b[i] - a[i] for i in ids])


def summary(ev: dict) -> dict:
    return {
        "n": ev["n"],
        "success": ev["success"],
        "ci95": ev["success_ci95"],
        "violations": ev["violation_rate"],
        "mean_policy_tokens": ev["mean_policy_tokens"],
        "families": {f: ev["by_group"][f] for f in FAMILIES if f in ev["by_group"]},
    }


def run_seed(run: Path) -> int:
    cfg = (run / "config.yaml").read_text()
    return next(int(x.split(":")[1]) for x in cfg.splitlines() if x.startswith("seed:"))


def grpo_steps(run: Path) -> dict:
    """The GRPO stage's steps from ``metrics.jsonl``: what they sampled and what they cost."""
    rs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rs = [r for r in rs if r.get("stage") == "grpo"]
    keys = (
        "task_success",
        "dynamic_rounds",
        "dynamic_informative_share",
        "rollouts",
        "step_s",
        "rollout_s",
        "rollout_tool_s",
        "rollout_verify_s",
    )
    return {
        "steps": len(rs),
        "seconds": sum(r.get("step_s", 0.0) for r in rs),
        "per_step": [{k: r[k] for k in keys if k in r} for r in rs],
    }


def split_seed(sft: Path, grpo: Path) -> dict:
    """One seed from its SFT run and the GRPO run started from its ``sft/final``, paired on the same tasks."""
    if run_seed(sft) != run_seed(grpo):
        raise SystemExit(f"{sft} and {grpo} are different seeds")
    row: dict = {"sft_run": str(sft), "grpo_run": str(grpo)}
    row["sft"] = summary(json.loads((sft / "eval_sft.json").read_text()))
    row["grpo"] = summary(json.loads((grpo / "eval_grpo.json").read_text()))
    row["grpo_minus_sft"] = paired(successes(sft / "eval_sft.jsonl"), successes(grpo / "eval_grpo.jsonl"))
    if row["grpo_minus_sft"]["n"] != row["sft"]["n"]:
        raise SystemExit("the SFT and GRPO evaluations are not on the same tasks")
    row["grpo_steps"] = grpo_steps(grpo)
    return row


def update(path: Path, sft: Path, grpo: Path) -> None:
    """Merge one seed into the results file ``path`` (written whole, atomically)."""
    out = json.loads(path.read_text()) if path.exists() else {"seeds": {}}
    out["seeds"][str(run_seed(sft))] = split_seed(sft, grpo)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=2))
    tmp.replace(path)
    print(json.dumps({k: v for k, v in out["seeds"][str(run_seed(sft))].items() if k != "grpo_steps"}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="+", type=Path, default=[])
    ap.add_argument("--zero-shot", type=Path, default=None, help="a `mentorrl eval --out` directory")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--update", type=Path, default=None, help="a results file to merge one split seed into")
    ap.add_argument("--sft", type=Path, default=None, help="with --update: the seed's recipe=[sft] run")
    ap.add_argument("--grpo", type=Path, default=None, help="with --update: its recipe=[grpo] run")
    a = ap.parse_args()
    if a.update is not None:
        if a.sft is None or a.grpo is None:
            raise SystemExit("--update needs --sft and --grpo")
        return update(a.update, a.sft, a.grpo)
    if a.out is None or not a.runs:
        raise SystemExit("--runs and --out (or --update with --sft and --grpo)")
    out: dict = {"seeds": {}}
    for run in a.runs:
        seed = run_seed(run)
        row: dict = {"run_dir": str(run)}
        for stage in ("sft", "grpo"):
            p = run / f"eval_{stage}.json"
            if p.exists():
                row[stage] = summary(json.loads(p.read_text()))
        if (run / "eval_sft.jsonl").exists() and (run / "eval_grpo.jsonl").exists():
            row["grpo_minus_sft"] = paired(successes(run / "eval_sft.jsonl"), successes(run / "eval_grpo.jsonl"))
        out["seeds"][str(seed)] = row
    if a.zero_shot is not None:  # `mentorrl eval --out DIR`: DIR/eval_summary.json
        ev = json.loads((a.zero_shot / "eval_summary.json").read_text())
        m = ev["sets"]["heldout"]["metrics"]
        o = m["overall"]
        out["zero_shot"] = {
            "n": o["n"],
            "success": o["success"],
            "ci95": o["success_ci95"],
            "tool_calls": o["tool_calls"],
            "violations": o["violation_rate"],
            "mean_policy_tokens": o["mean_policy_tokens"],
            "families": {f: {"n": v["n"], "success": v["success"]} for f, v in m["by_family"].items()},
            "sampling": ev["sets"]["heldout"]["sampling"],
        }
    a.out.write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2)[:3000])


if __name__ == "__main__":
    main()
