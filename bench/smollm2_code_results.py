"""Collect the SmolLM2 code-environment runs into one results file (issue 56): per seed, held-out success with its
Wilson interval, per family, violations and mean policy tokens after SFT and after GRPO, the paired GRPO - SFT
difference on the same tasks (a paired bootstrap), and the zero-shot evaluation (``mentorrl eval --out``) if given.

    python bench/smollm2_code_results.py --runs RUNS/smol-code-s0 RUNS/smol-code-s1 --zero-shot RUNS/smol-code-zeroshot \\
        --out bench/results/smollm2_code.json

A seed is merged into a results file as it finishes (``runs[KEY]``), with its per-task outcomes and its GRPO steps
summarised (sampled success, dynamic-sampling rounds, seconds); the SFT and GRPO runs may be one directory or two
(``recipe=[grpo]`` from the first's ``sft/final``). Finished seeds are then pooled from the file alone:

    python bench/smollm2_code_results.py --update bench/results/smollm2_code_500.json --key seed1_lr2e-5 \\
        --sft RUNS/smol-code-s1 --grpo RUNS/smol-code-s1
    python bench/smollm2_code_results.py --pool bench/results/smollm2_code_500.json --keys seed1_lr2e-5 seed2_lr2e-5
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _arms import commit, paired_outcomes, pooled_bits, task_bits, task_outcomes  # noqa: E402

FAMILIES = ("strings", "lists", "parsing", "stateful")


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


def grpo_lr(run: Path) -> float:
    """The GRPO stage's learning rate from the run's resolved ``config.yaml``."""
    return float(yaml.safe_load((run / "config.yaml").read_text())["grpo"]["optim"]["lr"])


def split_seed(sft: Path, grpo: Path) -> dict:
    """One seed from its SFT run and the GRPO run started from its ``sft/final``, paired on the same tasks."""
    if run_seed(sft) != run_seed(grpo):
        raise SystemExit(f"{sft} and {grpo} are different seeds")
    row: dict = {"sft_run": f"RUNS/{sft.name}", "grpo_run": f"RUNS/{grpo.name}", "grpo_lr": grpo_lr(grpo)}
    row["sft"] = summary(json.loads((sft / "eval_sft.json").read_text()))
    row["grpo"] = summary(json.loads((grpo / "eval_grpo.json").read_text()))
    row["grpo_minus_sft"] = paired_outcomes(
        task_outcomes(sft / "eval_sft.jsonl"), task_outcomes(grpo / "eval_grpo.jsonl")
    )
    if row["grpo_minus_sft"]["n"] != row["sft"]["n"]:
        raise SystemExit("the SFT and GRPO evaluations are not on the same tasks")
    (tasks, row["sft_bits"]), (tasks_g, row["grpo_bits"]) = (
        task_bits(sft / "eval_sft.jsonl"),
        task_bits(grpo / "eval_grpo.jsonl"),
    )
    if tasks != tasks_g:
        raise SystemExit("the SFT and GRPO evaluations are not on the same tasks in the same order")
    row["tasks"] = tasks
    row["grpo_steps"] = grpo_steps(grpo)
    return row


def pooled(runs: dict, keys: list[str]) -> dict:
    """GRPO - SFT over the named runs together, from the file alone (``sft_bits`` / ``grpo_bits``): the paired
    bootstrap clustered by task (:func:`_arms.pooled_bits`)."""
    missing = [k for k in keys if k not in runs or "grpo_bits" not in runs[k]]
    if missing:
        raise SystemExit(f"no per-task outcomes for {missing}: merge them with --update first")
    return {"runs": keys, **pooled_bits([(runs[k]["tasks"], runs[k]["sft_bits"], runs[k]["grpo_bits"]) for k in keys])}


def update(path: Path, sft: Path, grpo: Path, key: str | None = None, measured_at: str | None = None) -> None:
    """Merge one seed into the results file ``path`` under ``runs[key]`` (default ``seedS``), written whole,
    atomically, with the commit that measured it (default: this checkout's)."""
    out = json.loads(path.read_text()) if path.exists() else {}
    key = key or f"seed{run_seed(sft)}"
    runs = out.setdefault("runs", {})
    runs[key] = {**runs.get(key, {}), **split_seed(sft, grpo), "commit": measured_at or commit()}
    write(path, out)
    row = out["runs"][key]
    print(json.dumps({k: v for k, v in row.items() if k not in ("grpo_steps", "sft_bits", "grpo_bits")}, indent=1))


def signed(p: dict) -> str:
    """A paired difference as the docs write it: ``+1.4 [−0.2, +3.2]`` (a true minus sign)."""
    return f"{p['diff']:+.1f} [{p['ci95'][0]:+.1f}, {p['ci95'][1]:+.1f}]".replace("-", "\u2212")


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def row_cells(label: str, ev: dict, diff: dict | None, bold: bool = False) -> str:
    """One markdown table row: held-out success with its interval, the paired difference, families, violations."""
    lo, hi = ev["ci95"]
    head = f"{pct(ev['success'])} [{100 * lo:.1f}, {100 * hi:.1f}]"
    head = f"**{head}**" if bold else head
    d = "" if diff is None else signed(diff)
    fams = " | ".join(pct(ev["families"][f]["success"]) if f in ev["families"] else "–" for f in FAMILIES)
    return f"| {label} | {head} | {d} | {fams} | {pct(ev['violations'])} |"


def table(out: dict) -> str:
    """The results file as the markdown table of ``docs/results.md``: each run's SFT (once per SFT run) and its GRPO
    with the paired difference; then each pooled difference."""
    lines = [
        "| checkpoint | held-out, 500 tasks | paired vs SFT | " + " | ".join(FAMILIES) + " | violations |",
        "|---|---|---|" + "---|" * len(FAMILIES) + "---|",
    ]
    seen: set[str] = set()
    for key, r in out.get("runs", {}).items():
        seed = key.split("_")[0].replace("seed", "seed ")
        sft = json.dumps([seed, r["sft"]], sort_keys=True)  # one SFT checkpoint copied into several runs: once
        if sft not in seen:
            seen.add(sft)
            lines.append(row_cells(f"{seed}, SFT", r["sft"], None, bold=True))
        if "grpo" in r:
            lr = f"{r['grpo_lr']:.0e}".replace("e-0", "e-")
            lines.append(row_cells(f"{seed}, GRPO lr {lr}", r["grpo"], r["grpo_minus_sft"]))
    for name, p in out.get("pooled", {}).items():
        lines.append(f"\n{name}, pooled over {', '.join(p['runs'])} ({p['tasks']} tasks): {signed(p)}")
    return "\n".join(lines)


def write(path: Path, out: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=2))
    tmp.replace(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="+", type=Path, default=[])
    ap.add_argument("--zero-shot", type=Path, default=None, help="a `mentorrl eval --out` directory")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--update", type=Path, default=None, help="a results file to merge one split seed into")
    ap.add_argument("--sft", type=Path, default=None, help="with --update: the seed's recipe=[sft] run")
    ap.add_argument("--grpo", type=Path, default=None, help="with --update: its recipe=[grpo] run")
    ap.add_argument("--key", default=None, help="with --update: the run's name in the file (default seedS)")
    ap.add_argument("--commit", default=None, help="with --update: the commit the runs ran at (default: HEAD)")
    ap.add_argument("--pool", type=Path, default=None, help="a results file: pool the runs --keys into pooled[--name]")
    ap.add_argument("--keys", nargs="+", default=[])
    ap.add_argument("--name", default="grpo_minus_sft")
    ap.add_argument("--table", type=Path, default=None, help="a results file: print its markdown table")
    a = ap.parse_args()
    if a.table is not None:
        return print(table(json.loads(a.table.read_text())))
    if a.update is not None:
        if a.sft is None or a.grpo is None:
            raise SystemExit("--update needs --sft and --grpo")
        return update(a.update, a.sft, a.grpo, a.key, a.commit)
    if a.pool is not None:
        out = json.loads(a.pool.read_text())
        out.setdefault("pooled", {})[a.name] = pooled(out["runs"], a.keys)
        write(a.pool, out)
        return print(json.dumps(out["pooled"][a.name], indent=1))
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
            row["grpo_minus_sft"] = paired_outcomes(
                task_outcomes(run / "eval_sft.jsonl"), task_outcomes(run / "eval_grpo.jsonl")
            )
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
