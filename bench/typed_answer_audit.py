"""Verifier v4's typed-answer attack suite and honest probes, with more tasks than the preflight audit.

    python bench/typed_answer_audit.py --tasks 12 --out bench/results/typed_answer_audit.json

Each attack (``mentorrl/envs/orders/typed_attacks.py``) runs on ``--tasks`` train tasks it applies to, beside
the honest expert on the same tasks; an attack passes when its best reward is below the lowest honest reward,
and below 0 for a hard-constraint attack. Each honest probe (an honest record in unusual but valid form) runs
on ``--tasks`` tasks and must succeed. Prints one line per failure and the totals; exits 1 on any false accept
or more than two honest rejections.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=12, help="tasks per attack and per probe")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write the per-attack figures here (JSON)")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from mentorrl.contract import contract_for_env
    from mentorrl.envs.orders import OrdersEnv, OrdersTasks
    from mentorrl.envs.orders.typed_attacks import typed_attacks, typed_probes
    from mentorrl.integrity.attacks import AttackAuditConfig, audit_env, run_script, select_tasks, task_pool
    from mentorrl.models.shipped import SHIPPED_ROOT

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(SHIPPED_ROOT / "orders-tiny")  # the demo's tokenizer
    cfg = AttackAuditConfig(tasks_per_attack=args.tasks, seed=args.seed)
    report = audit_env("orders", tok, cfg, attacks=typed_attacks())
    env = OrdersEnv()
    contract = contract_for_env(tok, env, limits=cfg.limits)
    probes = []
    for probe in typed_probes():
        for t in select_tasks(task_pool(OrdersTasks, cfg), probe.applies, args.tasks):
            traj = run_script(contract, env, t, probe.script, cfg.weights)
            probes.append({"probe": probe.name, "task": t.id, "success": traj.reward.success,
                           "problems": traj.reward.details.get("answer_problems")})  # fmt: skip
    env.close()
    false_accepts = [a for a in report.attacks if not a.passed]
    rejected = [p for p in probes if not p["success"]]
    for a in false_accepts:
        print(f"FALSE ACCEPT {a.name}: {a.reason}")
    for p in rejected:
        print(f"HONEST REJECTED {p['probe']} on {p['task']}: {p['problems']}")
    summary = {
        "command": "python bench/typed_answer_audit.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "attacks": len(report.attacks),
        "attack_episodes": sum(len(a.rewards) for a in report.attacks),
        "false_accepts": len(false_accepts),
        "honest_probes": len(probes),
        "honest_rejections": len(rejected),
        "honest_expert_failures": report.honest_failures,
        "seconds": round(time.perf_counter() - t0, 1),
        "per_attack": [
            {"name": a.name, "hard": a.hard, "tasks": len(a.rewards), "best": a.max_reward, "honest_min": a.honest_min}
            for a in report.attacks
        ],
    }
    print(
        f"{summary['attacks']} attacks on {summary['attack_episodes']} episodes: {summary['false_accepts']} false "
        f"accepts; {summary['honest_probes']} honest probes: {summary['honest_rejections']} rejected "
        f"({summary['seconds']} s)"
    )
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
    return 1 if false_accepts or len(rejected) > 2 or report.honest_failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
