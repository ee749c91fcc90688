"""The rollout engine's two decoders on one GRPO step's rollouts, alternating.

``slots`` (per-row KV slots written in place, a step's real tokens packed flat, rows with one
context computed once) against ``hf`` (the model's own forward over left-padded rows with a
``DynamicCache``): the same checkpoint, contract, tasks (``--tasks`` train tasks × ``--group``
samples, the demo's GRPO shape) and seeds. Each rep runs both arms in this process, in alternating
order, and measures this process's CPU seconds (every thread: the tool pool and the verifier too).
Prints medians over reps of CPU-s, wall-s and policy tokens per CPU-second, their ratio, and whether
the two arms sampled the same tokens.

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python bench/decoders.py --model RUNS/s0/sft/final --reps 5
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _engine import engine_parser, open_engine_bench, timed_rollout  # noqa: E402


def one_arm(model, ws, tasks, decoder: str, seed: int, weights) -> dict:
    trajs, st, cpu, wall = timed_rollout(model, ws, tasks, decoder, seed, weights)
    toks = sum(t.num_policy_tokens for t in trajs)
    return {
        "cpu_s": cpu,
        "wall_s": wall,
        "policy_tokens": toks,
        "tok_per_cpu_s": toks / cpu,
        "forward_passes": st["forward_passes"],
        "fed_tokens": st["fed_tokens"],
        "token_ids": [t.token_ids for t in trajs],
    }


def main(argv=None) -> int:
    args = engine_parser(__doc__, reps=5).parse_args(argv)
    cfg, ws, model = open_engine_bench(args, "mentorrl-bench-dec")
    one_arm(model, ws, ws.train_tasks(2, 999), "slots", 0, cfg.reward)  # warm-up (and the slot self-check)
    runs: dict[str, list[dict]] = {"slots": [], "hf": []}
    same = True
    for rep in range(args.reps):
        tasks = [t for t in ws.train_tasks(args.tasks, 1000 + rep) for _ in range(args.group)]
        order = ("slots", "hf") if rep % 2 == 0 else ("hf", "slots")
        out = {arm: one_arm(model, ws, tasks, arm, rep, cfg.reward) for arm in order}
        same &= out["slots"]["token_ids"] == out["hf"]["token_ids"]
        for arm in order:
            out[arm].pop("token_ids")
            runs[arm].append(out[arm])
            print(
                f"rep {rep} {arm:5s} cpu {out[arm]['cpu_s']:.2f} s  wall {out[arm]['wall_s']:.2f} s  "
                f"{out[arm]['tok_per_cpu_s']:.0f} policy tok/CPU-s  passes {out[arm]['forward_passes']}",
                flush=True,
            )
    med = {
        arm: {k: statistics.median(r[k] for r in rs) for k in ("cpu_s", "wall_s", "tok_per_cpu_s")}
        for arm, rs in runs.items()
    }
    ratios = [s["tok_per_cpu_s"] / h["tok_per_cpu_s"] for s, h in zip(runs["slots"], runs["hf"])]
    print(
        f"median over {args.reps} reps: slots {med['slots']['tok_per_cpu_s']:.0f}, hf {med['hf']['tok_per_cpu_s']:.0f} "
        f"policy tok/CPU-s; slots / hf {statistics.median(ratios):.2f}x (per rep {min(ratios):.2f}-{max(ratios):.2f}); "
        f"CPU-s {med['slots']['cpu_s']:.2f} vs {med['hf']['cpu_s']:.2f}; wall {med['slots']['wall_s']:.2f} vs "
        f"{med['hf']['wall_s']:.2f}; same tokens: {same}"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "command": " ".join(["python", "bench/decoders.py", *(argv or sys.argv[1:])]),
                    "runs": runs,
                    "median": med,
                    "ratio_median": statistics.median(ratios),
                    "ratios": ratios,
                    "same_tokens": same,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
