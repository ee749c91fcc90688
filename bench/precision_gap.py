"""The train/rollout log-prob gap a lower-precision rollout causes against an fp32 learner.

The same held-out tasks are rolled out (the demo's contract, the project's hf engine) by the policy's
copy in each rollout dtype (``rollout.dtype``: float32, bfloat16, float16; a synced copy, as a run
with ``rollout.dtype`` below ``model.dtype`` decodes), then the fp32 learner (and, for comparison, a
bfloat16-autocast learner: ``model.dtype: bfloat16``) recomputes the behaviour log-probs. Per pair it
prints the metrics every policy-update step logs: the mean |behaviour - learner| log-prob over
policy tokens (``logprob_abs_gap``), a k3 estimate of KL(rollout || learner) (``train_rollout_kl``)
and the largest per-token importance ratio, besides the share of tokens SAO's masked importance
sampling would mask (ratio outside [0.8, 1.28]).

    python bench/precision_gap.py                      # the shipped 1M-parameter base, 32 tasks, CPU
    python bench/precision_gap.py --size 20m --tasks 16
    python bench/precision_gap.py --device cuda        # on a GPU (float16 included)
    python bench/precision_gap.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore")

import torch  # noqa: E402

from mentorrl.config import load_config  # noqa: E402
from mentorrl.contract import contract_for_env  # noqa: E402
from mentorrl.envs import get_env  # noqa: E402
from mentorrl.models.batch import collate, forward_logprobs  # noqa: E402
from mentorrl.models.build import load_policy  # noqa: E402
from mentorrl.models.device import Placement, autocast, resolve_device, resolve_dtype  # noqa: E402
from mentorrl.models.spec import ModelSpec  # noqa: E402
from mentorrl.rollout import BackendChoice, Rollout  # noqa: E402
from mentorrl.train.consistency import logprob_gap_metrics  # noqa: E402
from mentorrl.train.models_init import build_tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEMO = load_config(ROOT / "mentorrl" / "configs" / "demo.yaml")
SHIPPED = ROOT / "mentorrl" / "models" / "bases" / "orders-tiny"
SIZES = {"20m": ModelSpec(hidden_size=512, intermediate_size=1536, num_layers=6, num_heads=8, num_kv_heads=2)}
MASK_LOW, MASK_HIGH = 0.8, 1.28  # SAO's default masked-IS band (1 - eps_low, 1 + eps_high)


def prepare(args, entry):
    if args.model:
        return load_policy(Path(args.model)), args.model
    if args.size == "tiny":
        return load_policy(SHIPPED), f"shipped base {SHIPPED.name}"
    out = Path(tempfile.mkdtemp(prefix="mentorrl-bench-")) / f"m{args.size}"
    build_tiny_model(entry, out, SIZES[args.size], corpus_tasks=60, use_shipped=False)
    return load_policy(out), f"random-init Qwen2 {args.size}"


def gap_row(model, trajs, contract, learner_dtype: torch.dtype) -> dict:
    """The learner (fp32 weights, autocast in ``learner_dtype``) against the trajectories' behaviour log-probs."""
    device = next(model.parameters()).device
    batch = collate(trajs, contract.pad_token_id).to(device)
    with torch.no_grad(), autocast(device, learner_dtype):
        lp = forward_logprobs(model, batch, contract.sampling.temperature)[0].float()
    gap = logprob_gap_metrics(batch.old_logprobs, lp, batch.loss_mask)
    keep = batch.loss_mask != 0
    ratio = torch.exp(lp - batch.old_logprobs)[keep]
    return {
        **gap,
        "ratio_max": float(ratio.max()) if ratio.numel() else 1.0,
        "masked_share": float(((ratio < MASK_LOW) | (ratio > MASK_HIGH)).float().mean()) if ratio.numel() else 0.0,
        "policy_tokens": int(keep.sum()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a Hugging Face checkpoint directory (overrides --size)")
    ap.add_argument("--size", choices=["tiny", *SIZES], default="tiny")
    ap.add_argument("--device", default="cpu", help="auto, cpu, cuda or cuda:N (the learner and the rollout)")
    ap.add_argument("--tasks", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    entry = get_env("orders")
    (tok, model), desc = prepare(args, entry)
    model.to(device).eval()
    env = entry.make_env()
    try:
        contract = contract_for_env(tok, env, DEMO.sampling, DEMO.limits, DEMO.prompt)
    finally:
        env.close()
    tasks = entry.make_tasks().tasks("heldout", n=args.tasks, seed=args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {desc} ({n_params / 1e6:.2f}M parameters); {len(tasks)} tasks; "
        f"T={contract.sampling.temperature}; device {device}; torch threads {args.threads}"
    )
    rollout_dtypes = ["float32", "bfloat16"] + (["float16"] if device.type == "cuda" else [])
    rows = []
    for name in rollout_dtypes:
        rollout = Rollout(
            contract, entry.make_env, DEMO.reward, BackendChoice(None, Placement(device, resolve_dtype(name)))
        )
        t0 = time.perf_counter()
        trajs = rollout.run(model, tasks, seed=args.seed)
        wall = time.perf_counter() - t0
        for learner in ("float32", "bfloat16"):
            row = {"rollout": name, "learner": learner, "rollout_s": wall}
            row.update(gap_row(model, trajs, contract, resolve_dtype(learner)))
            rows.append(row)
    head = f"{'rollout':>9} {'learner':>9} {'|dlogp|':>9} {'KL(k3)':>10} {'ratio max':>10} {'masked':>7} {'tokens':>7}"
    print(head)
    for r in rows:
        print(
            f"{r['rollout']:>9} {r['learner']:>9} {r['logprob_abs_gap']:9.5f} {r['train_rollout_kl']:10.2e} "
            f"{r['ratio_max']:10.4f} {r['masked_share']:7.2%} {r['policy_tokens']:7d}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"model": desc, "device": str(device), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
