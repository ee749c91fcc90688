"""Print the table "every method on the current demo base" from the results file of ``bench/methods_seeds.py
--results`` alone (no run directory): per method, its baseline, each seed's success, the paired difference from
the baseline on the same held-out tasks (per seed, and pooled over the seeds' tasks, with paired bootstrap 95%
intervals), violations and the command that produced it.

    python bench/methods_table.py bench/results/methods_arms.jsonl
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _arms import ArmStore, pairable, pooled_bits  # noqa: E402


def pooled(store: ArmStore, arm: str, base: str, seeds: list[int]) -> dict | None:
    """``arm`` minus ``base`` over every seed both hold on the same tasks, clustered by task
    (:func:`_arms.pooled_bits`)."""
    pairs = []
    for s in seeds:
        x, y = store.find(arm, s), store.find(base, s)
        if pairable(x, y):
            pairs.append((x["tasks"], y["bits"], x["bits"]))
    return pooled_bits(pairs) if pairs else None


def fmt(p: dict | None) -> str:
    return "–" if p is None else f"{p['diff']:+.1f} [{p['ci95'][0]:+.1f}, {p['ci95'][1]:+.1f}]"


def table(store: ArmStore) -> str:
    arms = list(dict.fromkeys(r["arm"] for r in store.lines))
    out = [
        "| method | baseline | seeds | success per seed | − baseline per seed (paired) | − baseline, pooled "
        "| violations | command |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm in arms:
        seeds = sorted({r["seed"] for r in store.lines if r["arm"] == arm})
        rows = [store.find(arm, s) for s in seeds]
        base = next((r.get("baseline") for r in rows if r.get("baseline")), None)
        succ = " / ".join(f"{100 * r['success']:.1f}%" for r in rows)
        viol = " / ".join(f"{100 * r['violations']:.1f}%" for r in rows)
        per = " / ".join(fmt(store.paired(arm, base, s)) for s in seeds) if base else "–"
        pool = fmt(pooled(store, arm, base, seeds)) if base else "–"
        cmd = next((r.get("command") for r in rows if r.get("command")), None)
        out.append(
            f"| `{arm}` | {base or '–'} | {', '.join(map(str, seeds))} | {succ} | {per} | {pool} | {viol} | "
            + (f"`{cmd}`" if cmd else "reference run")
            + " |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path)
    a = ap.parse_args(argv)
    print(table(ArmStore.open(a.results)))


if __name__ == "__main__":
    main()
