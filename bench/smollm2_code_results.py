"""The SmolLM2 code-environment seeds in one results file (issue 56): per seed, held-out success with its Wilson
interval, per family, violations and mean policy tokens after SFT and after GRPO, the paired GRPO - SFT difference
on the same tasks (a paired bootstrap), the per-task outcomes, the GRPO steps' figures (sampled success,
dynamic-sampling rounds, seconds), and the zero-shot evaluation.

    # each missing seed run whole (resumed where its run directory is) and merged the moment it finishes
    python bench/smollm2_code_results.py seeds bench/results/smollm2_code_500.json --out RUNS/smol-code \
        --seeds 1 2 3 --name lr2e-5 --set "recipe=[sft, grpo]" --set sft.steps=60 --set grpo.steps=10 ...
    # a seed finished elsewhere (SFT and GRPO in one directory, or GRPO from the first's sft/final)
    python bench/smollm2_code_results.py update bench/results/smollm2_code_500.json --key seed1_lr2e-5 \
        --sft RUNS/smol-code-s1 --grpo RUNS/smol-code-s1
    python bench/smollm2_code_results.py zero-shot bench/results/smollm2_code_500.json --eval RUNS/smol-code-zeroshot
    python bench/smollm2_code_results.py pool bench/results/smollm2_code_500.json --keys seed1_lr2e-5 seed2_lr2e-5
    python bench/smollm2_code_results.py table bench/results/smollm2_code_500.json   # docs/results.md's table
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _arms import commit, outcome_bits, paired_outcomes, pooled_bits, task_outcomes  # noqa: E402

from mentorrl.eval.metrics import mean_interval  # noqa: E402

FAMILIES = ("strings", "lists", "parsing", "stateful")
SHIPPED_GRPO_STEPS = 10  # the first design's GRPO steps: a row with another count names its own


def summary(ev: dict) -> dict:
    return {
        "n": ev["n"],
        "success": ev["success"],
        "ci95": ev["success_ci95"],
        "violations": ev["violation_rate"],
        "mean_policy_tokens": ev["mean_policy_tokens"],
        "families": {f: ev["by_group"][f] for f in FAMILIES if f in ev["by_group"]},
    }


def run_config(run: Path) -> dict:
    """The run's resolved ``config.yaml``."""
    return yaml.safe_load((run / "config.yaml").read_text())


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
    """One seed from its SFT run and its GRPO run (the same directory, or one started from the first's
    ``sft/final``), paired on the same tasks in the same order."""
    if run_config(sft)["seed"] != run_config(grpo)["seed"]:
        raise SystemExit(f"{sft} and {grpo} are different seeds")
    before, after = task_outcomes(sft / "eval_sft.jsonl"), task_outcomes(grpo / "eval_grpo.jsonl")
    if list(before) != list(after):
        raise SystemExit("the SFT and GRPO evaluations are not on the same tasks in the same order")
    row: dict = {
        "sft_run": f"RUNS/{sft.name}",
        "grpo_run": f"RUNS/{grpo.name}",
        "grpo_lr": float(run_config(grpo)["grpo"]["optim"]["lr"]),
        "sft": summary(json.loads((sft / "eval_sft.json").read_text())),
        "grpo": summary(json.loads((grpo / "eval_grpo.json").read_text())),
        "grpo_minus_sft": paired_outcomes(before, after),
    }
    if row["grpo_minus_sft"]["n"] != row["sft"]["n"]:
        raise SystemExit("the SFT evaluation's summary and its trajectories count different tasks")
    row["tasks"], row["sft_bits"] = outcome_bits(before.items())
    row["grpo_bits"] = outcome_bits(after.items())[1]
    row["grpo_steps"] = grpo_steps(grpo)
    return row


def pooled(runs: dict, keys: list[str]) -> dict:
    """GRPO - SFT over the named runs together, from the file alone (``sft_bits`` / ``grpo_bits``): the paired
    bootstrap clustered by task (:func:`_arms.pooled_bits`), and ``over_seeds``: each run's own paired difference
    as one value, their mean ± sd and Student-t 95% interval (the seeds as the unit: the results page's rule)."""
    missing = [k for k in keys if k not in runs or "grpo_bits" not in runs[k]]
    if missing:
        raise SystemExit(f"no per-task outcomes for {missing}: merge them with --update first")
    pairs = [(runs[k]["tasks"], runs[k]["sft_bits"], runs[k]["grpo_bits"]) for k in keys]
    per_run = [100 * (sum(map(int, g)) - sum(map(int, s))) / len(s) for _, s, g in pairs]
    seeds = mean_interval(per_run)
    seeds["ci95"] = list(seeds["ci95"]) if seeds["ci95"] is not None else None
    return {"runs": keys, **pooled_bits(pairs), "over_seeds": {"diffs": per_run, **seeds}}


def update(
    path: Path,
    sft: Path,
    grpo: Path,
    key: str | None = None,
    measured_at: str | None = None,
    overrides: list[str] | None = None,
    extra: dict | None = None,
) -> None:
    """Merge one seed into the results file ``path`` under ``runs[key]`` (default ``seedS``), written whole,
    atomically, with the commit that measured it (default: this checkout's) and the overrides it ran with."""
    out = json.loads(path.read_text()) if path.exists() else {}
    key = key or f"seed{run_config(sft)['seed']}"
    runs = out.setdefault("runs", {})
    runs[key] = {**runs.get(key, {}), **split_seed(sft, grpo), "commit": measured_at or commit()}
    if overrides is not None:
        runs[key]["overrides"] = overrides
    runs[key].update(extra or {})
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
    if "zero_shot" in out:
        z = out["zero_shot"]
        lines.append(row_cells(f"zero-shot ({z['n']} tasks)", z, None))
    seen: set[str] = set()
    for key, r in out.get("runs", {}).items():
        seed = key.split("_")[0].replace("seed", "seed ")
        if r.get("ranks", 1) > 1:  # a data-parallel launch: the same recipe, its sums in another order
            seed += f" ({r['ranks']} ranks)"
        sft = json.dumps([seed, r["sft"]], sort_keys=True)  # one SFT checkpoint copied into several runs: once
        if sft not in seen:
            seen.add(sft)
            lines.append(row_cells(f"{seed}, SFT", r["sft"], None, bold=True))
        if "grpo" in r:
            lr = f"{r['grpo_lr']:.0e}".replace("e-0", "e-")
            steps = [o.split("=", 1)[1] for o in r.get("overrides", []) if o.startswith("grpo.steps=")]
            more = "".join(f"{n} steps, " for n in steps[-1:] if n != str(SHIPPED_GRPO_STEPS))  # 10: unsaid
            lines.append(row_cells(f"{seed}, GRPO {more}lr {lr}", r["grpo"], r["grpo_minus_sft"]))
    for name, p in out.get("pooled", {}).items():
        line = f"\n{name}, pooled over {', '.join(p['runs'])} ({p['tasks']} tasks): {signed(p)}"
        s = p.get("over_seeds")
        if s and s.get("ci95"):
            line += f"; over seeds {signed({'diff': s['mean'], 'ci95': s['ci95']})} (mean, Student-t; sd {s['sd']:.1f})"
        lines.append(line)
    return "\n".join(lines)


def write(path: Path, out: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=2))
    tmp.replace(path)


def zero_shot(eval_dir: Path) -> dict:
    """The zero-shot evaluation of ``mentorrl eval --out DIR`` (``DIR/eval_summary.json``), as a table row's fields."""
    ev = json.loads((eval_dir / "eval_summary.json").read_text())
    m = ev["sets"]["heldout"]["metrics"]
    o = m["overall"]
    return {
        "n": o["n"],
        "success": o["success"],
        "ci95": o["success_ci95"],
        "tool_calls": o["tool_calls"],
        "violations": o["violation_rate"],
        "mean_policy_tokens": o["mean_policy_tokens"],
        "families": {f: {"n": v["n"], "success": v["success"]} for f, v in m["by_family"].items()},
        "sampling": ev["sets"]["heldout"]["sampling"],
        **zero_shot_bits(eval_dir / "trajectories-heldout.jsonl"),
    }


def zero_shot_bits(jsonl: Path) -> dict:
    """The zero-shot evaluation's per-task outcomes (``tasks``, ``bits``), to pair with a seed's SFT evaluation
    where both ran on the same tasks (the same fingerprint); nothing when the trajectories are absent."""
    if not jsonl.exists():
        return {}
    tasks, bits = outcome_bits(task_outcomes(jsonl).items())
    return {"tasks": tasks, "bits": bits}


def run_seeds(
    path: Path, out: Path, seeds: list[int], name: str, overrides: list[str], config: str, ranks: int = 1
) -> None:
    """Each seed of ``seeds`` not in the results file under ``seedS_NAME`` with these overrides: run whole
    (``mentorrl train CONFIG``, as ``ranks`` torchrun ranks, resumed where its run directory is), then merged at
    once with its wall time. A rerun skips every merged seed, so the seeds may span sittings."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from seeds_lift import run_seed as train_seed

    held = json.loads(path.read_text()).get("runs", {}) if path.exists() else {}
    launch = [f"--ranks {ranks}"] if ranks > 1 else []  # recorded as seed 5's row records it
    for seed in seeds:
        key = f"seed{seed}_{name}"
        if key in held and held[key].get("overrides") == launch + overrides:
            print(f"{key}: merged already")
            continue
        got = train_seed(out, seed, overrides, config, ranks)
        run = out / f"seed-{seed}"
        extra = {"ranks": ranks} if ranks > 1 else {}
        if "wall_s" in got and not got.get("resumed"):
            extra["wall_s"] = got["wall_s"]  # a resumed seed's wall time covers one sitting only: not recorded
        update(path, run, run, key, overrides=launch + overrides, extra=extra)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("seeds", help="run the missing seeds whole and merge each as it finishes")
    s.add_argument("file", type=Path)
    s.add_argument("--out", type=Path, required=True, help="the seeds' run directories: OUT/seed-S")
    s.add_argument("--seeds", type=int, nargs="+", required=True)
    s.add_argument("--name", required=True, help="the arm: each seed is merged as seedS_NAME")
    s.add_argument("--config", default="mentorrl/configs/smollm2_code.yaml")
    s.add_argument("--set", dest="overrides", action="append", default=[], help="a config override for every seed")
    s.add_argument("--ranks", type=int, default=1, help="launch each seed as N torchrun ranks (`--ranks N`)")
    u = sub.add_parser("update", help="merge one finished seed")
    u.add_argument("file", type=Path)
    u.add_argument("--sft", type=Path, required=True, help="the seed's SFT run")
    u.add_argument("--grpo", type=Path, required=True, help="its GRPO run (the same directory, or one from sft/final)")
    u.add_argument("--key", default=None, help="the run's name in the file (default seedS)")
    u.add_argument("--commit", default=None, help="the commit the runs ran at (default: HEAD)")
    p = sub.add_parser("pool", help="pool finished seeds from the file alone")
    p.add_argument("file", type=Path)
    p.add_argument("--keys", nargs="+", required=True)
    p.add_argument("--name", default="grpo_minus_sft")
    z = sub.add_parser("zero-shot", help="add a `mentorrl eval --out DIR` evaluation as the zero-shot row")
    z.add_argument("file", type=Path)
    z.add_argument("--eval", type=Path, required=True)
    z.add_argument("--commit", default=None, help="the commit the evaluation ran at (default: HEAD)")
    t = sub.add_parser("table", help="print the file's markdown table")
    t.add_argument("file", type=Path)
    a = ap.parse_args(argv)
    if a.cmd == "seeds":
        run_seeds(a.file, a.out, a.seeds, a.name, a.overrides, a.config, a.ranks)
    elif a.cmd == "update":
        update(a.file, a.sft, a.grpo, a.key, a.commit)
    elif a.cmd == "pool":
        doc = json.loads(a.file.read_text())
        doc.setdefault("pooled", {})[a.name] = pooled(doc["runs"], a.keys)
        write(a.file, doc)
        print(json.dumps(doc["pooled"][a.name], indent=1))
    elif a.cmd == "zero-shot":
        doc = json.loads(a.file.read_text()) if a.file.exists() else {}
        doc["zero_shot"] = {**zero_shot(a.eval), "commit": a.commit or commit()}
        write(a.file, doc)
    else:
        print(table(json.loads(a.file.read_text())))


if __name__ == "__main__":
    main()
