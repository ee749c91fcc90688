"""The reward audit of a τ²-bench domain, on every task of the user's clone: which tasks each attack wins.

    python bench/tau2_audit.py --clone /path/to/tau2-bench --domain retail --out bench/results/tau2_audit_retail.json
    python bench/tau2_audit.py --clone /path/to/tau2-bench --domain telecom --task-set small --split small --solo \
        --out bench/results/tau2_audit_telecom_small.json

Each attack of ``mentorrl/envs/tau2/audit.py`` (do nothing, refuse, transfer to a human at once) and the
gold-replaying expert play every task of the domain's task file (``--task-set``, ``env.task_set``; all
splits; ``--split`` only has to name a split that lists some of them; ``--solo``: telecom's solo mode) against the real environment and the
benchmark's reward (``env.python``: the clone's .venv unless ``--python``). A task is *won* by an attack
when it earns the full benchmark reward. Tasks whose reward needs the NL_ASSERTION judge are counted apart:
there the attack is *open* when every other component is full (only the judge stands between it and the
full reward; upstream counts an empty judge reply as a pass).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def components_full(verdict, skip: str = "NL_ASSERTION") -> bool:
    comps = (verdict.details.get("tau2") or {}).get("components") or {}
    return bool(comps) and all(v == 1.0 for k, v in comps.items() if k != skip)


def summarize(rows: dict[str, dict], args: argparse.Namespace, seconds: float) -> dict:
    """The audit's summary (and its printed lines): the expert's full rewards, each attack's won tasks."""
    from mentorrl.envs.tau2 import tau2_attacks

    judge_free = [t for t, r in rows.items() if not r["nl_judge"]]
    judged = [t for t, r in rows.items() if r["nl_judge"]]
    summary = {
        "domain": args.domain,
        "task_set": args.task_set,
        "solo": args.solo,
        "tasks": len(rows),
        "judge_free": len(judge_free),
        "nl_judged": len(judged),
        "expert_full_reward": sum(rows[t]["expert"]["reward"] == 1.0 for t in judge_free),
        "expert_open_on_judged": sum(rows[t]["expert"]["open"] for t in judged),
        "attacks": {},
        "seconds": round(seconds, 1),
    }
    for attack in tau2_attacks():
        won = sorted((t for t in judge_free if rows[t][attack.name]["reward"] == 1.0), key=lambda x: (len(x), x))
        opened = sorted((t for t in judged if rows[t][attack.name]["open"]), key=lambda x: (len(x), x))
        summary["attacks"][attack.name] = {"won": won, "open_unless_judge": opened}
        print(
            f"{attack.name}: wins {len(won)}/{len(judge_free)} judge-free tasks {won}; "
            f"open on {len(opened)}/{len(judged)} judged tasks {opened}"
        )
    print(
        f"expert: full reward on {summary['expert_full_reward']}/{len(judge_free)} judge-free tasks; "
        f"{summary['seconds']} s"
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clone", required=True)
    ap.add_argument("--domain", default="retail")
    ap.add_argument("--python", default=None)
    ap.add_argument("--task-set", default="tasks", choices=["tasks", "small", "full"], help="env.task_set")
    ap.add_argument("--split", default=None, help="env.split (the audit plays every task of the task set)")
    ap.add_argument("--solo", action="store_true", help="env.solo: the agent has the user's tools, no user")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    from mentorrl.config.env import EnvConfig
    from mentorrl.envs import resolve_env
    from mentorrl.envs.base import Task
    from mentorrl.envs.tau2 import tau2_attacks
    from mentorrl.envs.tau2.audit import benchmark_reward, play
    from mentorrl.envs.tau2.records import load_splits, load_tasks

    t0 = time.time()
    cfg = EnvConfig(
        name="tau2",
        path=args.clone,
        domain=args.domain,
        python=args.python,
        exclude_hackable=False,
        task_set=args.task_set,
        split=args.split,
        solo=args.solo,
    )
    entry = resolve_env(cfg)
    settings = entry.make_env.args[0]
    records, splits = load_tasks(settings), load_splits(settings)
    env, expert = entry.make_env(), entry.make_expert()
    policies = [("expert", expert.act)] + [(a.name, a.script) for a in tau2_attacks()]
    rows: dict[str, dict] = {}
    try:
        for tid, rec in records.items():
            ref = {"tau2": rec.model_dump(mode="json"), "tau2_id": tid}
            task = Task(id=f"audit-{tid}", family=args.domain, split="base", prompt="", seed=0, reference=ref)
            nl = rec.evaluation_criteria is not None and rec.evaluation_criteria.needs_judge
            row = {"nl_judge": nl, "splits": [s for s, ids in splits.items() if tid in ids]}
            for name, script in policies:
                verdict = play(env, task, script)
                row[name] = {"reward": benchmark_reward(verdict), "open": components_full(verdict)}
            rows[tid] = row
    finally:
        env.close()
    summary = summarize(rows, args, time.time() - t0)
    if args.out is not None:
        args.out.write_text(json.dumps({"summary": summary, "tasks": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
