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

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from mentorrl.cli_common import load_run_config  # noqa: E402
from mentorrl.models.build import load_policy  # noqa: E402
from mentorrl.rollout.engine import RolloutEngine  # noqa: E402
from mentorrl.rollout.episode import Episode  # noqa: E402
from mentorrl.train.workspace import open_workspace  # noqa: E402


def one_arm(model, ws, tasks, decoder: str, seed: int, weights) -> dict:
    envs = [ws.make_env() for _ in tasks]
    try:
        eps = [Episode(ws.contract, e, t, weights=weights) for e, t in zip(envs, tasks)]
        engine = RolloutEngine(model, ws.contract, decoder=decoder)
        c0, t0 = time.process_time(), time.perf_counter()
        trajs = engine.run(eps, seed=seed)
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    finally:
        for e in envs:
            e.close()
    toks = sum(t.num_policy_tokens for t in trajs)
    return {
        "cpu_s": cpu,
        "wall_s": wall,
        "policy_tokens": toks,
        "tok_per_cpu_s": toks / cpu,
        "forward_passes": engine.last_stats["forward_passes"],
        "fed_tokens": engine.last_stats["fed_tokens"],
        "token_ids": [t.token_ids for t in trajs],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF checkpoint dir (e.g. the demo's SFT checkpoint)")
    p.add_argument("--config", default=None, help="run config (default: the demo recipe)")
    p.add_argument("--tasks", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    cfg = load_run_config(
        Path(args.config) if args.config else None, [], str(Path("/tmp") / "mentorrl-bench-dec"), "demo.yaml"
    )
    ws = open_workspace(cfg, show_progress=False)
    torch.set_num_threads(args.threads)  # after the workspace, which sets the recipe's own (the demo's: 2)
    tok, model = load_policy(args.model)
    ws.bind_tokenizer(tok)
    model.eval()
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
