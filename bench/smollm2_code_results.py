"""Collect the SmolLM2 code-environment runs into one results file (issue 56): per seed, held-out success with its
Wilson interval, per family, violations and mean policy tokens after SFT and after GRPO, the paired GRPO - SFT
difference on the same tasks (a paired bootstrap), and the zero-shot evaluation (``mentorrl eval --out``) if given.

    python bench/smollm2_code_results.py --runs RUNS/smol-code-s0 RUNS/smol-code-s1 --zero-shot RUNS/smol-code-zeroshot \\
        --out bench/results/smollm2_code.json
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

FAMILIES = ("strings", "lists", "parsing", "stateful")


def successes(path: Path) -> dict[str, float]:
    """task id -> 1.0 / 0.0 from an evaluation's trajectories."""
    out = {}
    for line in path.read_text().splitlines():
        if line.strip():
            t = json.loads(line)
            out[t["task_id"]] = 1.0 if t["reward"]["success"] else 0.0
    return out


def paired(a: dict[str, float], b: dict[str, float], reps: int = 10000, seed: int = 0) -> dict:
    """b - a over the tasks both hold, in points, with a paired bootstrap 95% interval."""
    ids = sorted(set(a) & set(b))
    d = [b[i] - a[i] for i in ids]
    rng = random.Random(seed)
    boots = sorted(sum(rng.choice(d) for _ in d) / len(d) for _ in range(reps))
    return {
        "n": len(d),
        "diff": 100 * sum(d) / len(d),
        "ci95": [100 * boots[int(0.025 * reps)], 100 * boots[int(0.975 * reps)]],
    }


def summary(ev: dict) -> dict:
    return {
        "n": ev["n"],
        "success": ev["success"],
        "ci95": ev["success_ci95"],
        "violations": ev["violation_rate"],
        "mean_policy_tokens": ev["mean_policy_tokens"],
        "families": {f: ev["by_group"][f] for f in FAMILIES if f in ev["by_group"]},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="+", type=Path, required=True)
    ap.add_argument("--zero-shot", type=Path, default=None, help="a `mentorrl eval --out` directory")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    out: dict = {"seeds": {}}
    for run in a.runs:
        cfg = (run / "config.yaml").read_text()
        seed = next(int(x.split(":")[1]) for x in cfg.splitlines() if x.startswith("seed:"))
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
