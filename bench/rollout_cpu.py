"""The rollout engine's tokens per CPU-second on one GRPO step's rollouts, against the arithmetic bound.

One arm only (the engine as the run config builds it, ``--decoder`` picks the decoder), ``--tasks`` train
tasks x ``--group`` samples (the demo's GRPO shape), ``--reps`` reps with seeds 0.. on tasks drawn per rep.
Each rep measures this process's CPU seconds (every thread: the tool pool and the verifier too) and wall.

The bound (as ``bench/bound.py`` computes it): FLOPs x tokens / the matmul rate this machine measures at
``--threads`` on the model's largest projection shape (2048 rows). FLOPs: every token the engine feeds passes
through every decoder Linear (2 x those parameters), each fed row's last token through the LM head
(2 x its parameters), and attention's ``QK^T`` and ``PV`` over each trajectory's context (4 x layers x
context x width a token). ``bound_fraction`` is the rollout's achieved FLOP rate (per CPU-second) as a
share of that rate.

Prints a digest of every trajectory's token ids, log-probs (their exact float bits) and reward: two builds
that print the same digest for the same arguments rolled out bit-identical trajectories.

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE nice -n 19 python bench/rollout_cpu.py \\
        --model runs/demo/sft/final --reps 3 --json out.json
"""

from __future__ import annotations

import hashlib
import json
import statistics
import struct
import sys
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from _engine import engine_parser, open_engine_bench, timed_rollout  # noqa: E402

# after mentorrl (which _engine imports): bound.py puts this checkout first on sys.path, and the mentorrl
# measured must stay the one on PYTHONPATH (an A/B run of another checkout)
from bound import linear_params, matmul_gflops  # noqa: E402

from mentorrl.core.lifetime import frozen_heap  # noqa: E402


def digest(trajs) -> str:
    h = hashlib.sha256()
    for t in trajs:
        h.update(struct.pack(f"{len(t.token_ids)}q", *t.token_ids))
        h.update(struct.pack(f"{len(t.logprobs)}d", *t.logprobs))
        h.update(repr(t.reward.total if t.reward is not None else None).encode())
    return h.hexdigest()[:16]


def rollout_flops(model, trajs, stats) -> float:
    cfg = model.config
    head = model.lm_head.weight.numel()
    body = linear_params(model) - head
    width = cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads)
    if "attended" in stats:  # the slot decoder's count of (token, context position) pairs
        attn = 4 * cfg.num_hidden_layers * width * stats["attended"]
    else:  # every trajectory's tokens over their whole context
        attn = sum(2 * cfg.num_hidden_layers * width * len(t.token_ids) * (len(t.token_ids) + 1) for t in trajs)
    tokens = stats.get("computed_tokens", stats["fed_tokens"])  # the slot decoder computes a follower's once
    rows_out = stats.get("logit_rows", stats["generated_tokens"])
    return 2 * body * tokens + 2 * head * rows_out + attn


def one_rep(model, ws, tasks, decoder: str, seed: int, weights) -> dict:
    trajs, st, cpu, wall = timed_rollout(model, ws, tasks, decoder, seed, weights)
    policy = sum(t.num_policy_tokens for t in trajs)
    return {
        "cpu_s": cpu,
        "wall_s": wall,
        "policy_tokens": policy,
        "fed_tokens": st["fed_tokens"],
        "forward_passes": st["forward_passes"],
        "tok_per_cpu_s": policy / cpu,
        "fed_per_cpu_s": st["fed_tokens"] / cpu,
        "gflop": rollout_flops(model, trajs, st) / 1e9,
        "digest": digest(trajs),
        "inline_calls": st.get("inline_calls", 0),
        "pool_calls": st.get("pool_calls", 0),
        "gc_full": st["gc"]["full"],
        "gc_cpu_s": st["gc"]["gc_cpu_s"],
    }


def timed_reps(args, cfg, ws, model, rate: float) -> list[dict]:
    """``--reps`` timed rollouts of ``--tasks`` x ``--group`` (rep ``r``: tasks seed 1000 + r, sampling seed r)."""
    runs = []
    for rep in range(args.reps):
        tasks = [t for t in ws.train_tasks(args.tasks, 1000 + rep) for _ in range(args.group)]
        r = one_rep(model, ws, tasks, args.decoder, rep, cfg.reward)
        r["bound_fraction"] = r["gflop"] / r["cpu_s"] / rate
        r["torch_threads"] = torch.get_num_threads()
        runs.append(r)
        print(
            f"rep {rep} cpu {r['cpu_s']:.2f} s  wall {r['wall_s']:.2f} s  {r['tok_per_cpu_s']:.0f} policy tok/CPU-s  "
            f"{r['fed_per_cpu_s']:.0f} fed tok/CPU-s  passes {r['forward_passes']}  "
            f"bound {100 * r['bound_fraction']:.2f}%  collector {r['gc_full']} full, {r['gc_cpu_s']:.2f} s  "
            f"digest {r['digest']}",
            flush=True,
        )
    return runs


def main(argv=None) -> int:
    p = engine_parser(__doc__, reps=3)
    p.add_argument("--decoder", default="slots", help="slots, hf or auto")
    p.add_argument(
        "--no-freeze",
        action="store_true",
        help="leave the loaded modules in the collector's scans (`mentorrl train` "
        "and `mentorrl eval` freeze them: mentorrl.core.lifetime.frozen_heap)",
    )
    args = p.parse_args(argv)
    cfg, ws, model = open_engine_bench(args, "mentorrl-bench-rcpu")
    one_rep(model, ws, ws.train_tasks(2, 999), args.decoder, 0, cfg.reward)  # warm-up (and the slot self-check)
    mm = model.config
    rate = matmul_gflops(next(model.parameters()).dtype, 2048, mm.hidden_size, mm.intermediate_size)
    with nullcontext() if args.no_freeze else frozen_heap():
        runs = timed_reps(args, cfg, ws, model, rate)
    keys = ("cpu_s", "wall_s", "tok_per_cpu_s", "fed_per_cpu_s", "bound_fraction")
    med = {k: statistics.median(r[k] for r in runs) for k in keys}
    print(
        f"mentorrl from {Path(sys.modules['mentorrl'].__file__).parent.parent}; "
        f"median over {args.reps} reps: {med['tok_per_cpu_s']:.0f} policy tok/CPU-s, {med['fed_per_cpu_s']:.0f} fed "
        f"tok/CPU-s, CPU {med['cpu_s']:.2f} s, wall {med['wall_s']:.2f} s; matmul {rate:.1f} GFLOP/s; "
        f"{100 * med['bound_fraction']:.2f}% of the bound; digests {' '.join(r['digest'] for r in runs)}"
    )
    if args.json:
        out = {
            "command": " ".join(["python", "bench/rollout_cpu.py", *(argv if argv is not None else sys.argv[1:])]),
            "threads": args.threads,
            "matmul_gflops": rate,
            "linear_params": linear_params(model),
            "runs": runs,
            "median": med,
        }
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
