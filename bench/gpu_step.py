"""A GRPO step on a GPU through ``mentorrl train`` (issue 37, item 6): the learner in bf16 with LoRA and
the rollout through vLLM on the GPU, then full-weights FSDP2 under torchrun (NCCL, one rank per GPU).

Arms, each a separate ``mentorrl train`` process on the demo recipe's GRPO (``grpo.guide: expert`` so a
random-init model's all-failed groups still train; no KL reference; no evaluation, no preflight audit):

* ``lora-bf16``: ``model.dtype: bfloat16`` (autocast, fp32 master weights), ``model.lora`` r 16 / alpha 32
  on every attention and MLP projection, ``rollout.backend: vllm`` with ``rollout.dtype: bfloat16`` and
  ``rollout.gpu_memory_utilization`` ``--vllm-mem`` (0.25: vLLM runs in the learner's process and reserves that
  share of the GPU for its weights and KV cache, all of it in the process's peak);
* ``fsdp2``: full fine-tuning in fp32, ``distributed.strategy: fsdp2``, ``torchrun --standalone
  --nproc-per-node`` ``--ranks`` (default: every GPU), the hf rollout on each rank's GPU.

Printed per arm, from the run's ``metrics.jsonl`` (the timed steps after ``--warmup``): step seconds (median),
rollout policy tokens per second (total policy tokens over total rollout seconds), the vLLM/learner log-prob
gap at the same weights ``mismatch_logprob_gap`` (mean and largest over the steps; each step's is its first
update's, before the policy moves; ``logprob_abs_gap``, over every update, is printed beside it), and each process's peak GPU memory
(``torch.cuda.max_memory_allocated`` and ``max_memory_reserved``, written by the process itself at exit;
on the CPU its peak RSS instead).

    python bench/gpu_step.py --device cuda --json $OUT/gpu_step.json     # what bench/gpu_check.sh runs
    python bench/gpu_step.py --device cpu --size 20m                     # the plumbing on a CPU (gloo; hf rollout
                                                                         # unless vllm imports)

On the CPU the arms keep their shapes but run in the CPU's terms: the device is ``cpu``, FSDP2 runs over
gloo on ``--ranks`` (2) processes, and the rollout is vLLM only if ``vllm`` imports (``--vllm auto``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
DEMO = ROOT / "mentorrl" / "configs" / "demo.yaml"
LORA = "model.lora={r: 16, alpha: 32, target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]}"
ARMS = ("lora-bf16", "fsdp2")


def arm_sets(
    arm: str,
    device: str,
    model_dir: Path | str,
    run_dir: Path | str,
    steps: int,
    vllm: bool,
    tasks: int = 8,
    group: int = 8,
    vllm_mem: float = 0.25,
) -> list[str]:
    """``--set`` overrides of the demo recipe for one arm."""
    # under torchrun every rank takes its own GPU only with `auto` (cuda:LOCAL_RANK); plain `cuda` is cuda:0
    placed = "auto" if device == "cuda" and arm == "fsdp2" else device
    sets = [
        f"model.path={model_dir}",
        f"model.device={placed}",
        "recipe=[grpo]",
        f"run_dir={run_dir}",
        "audit.preflight=false",
        "audit.eval_every=0",
        "eval.num_tasks=0",
        "grpo.kl_coef=0",
        f"grpo.steps={steps}",
        f"grpo.tasks_per_step={tasks}",
        f"grpo.samples_per_task={group}",
        f"grpo.checkpoint_every={steps + 1000}",
    ]
    if arm == "lora-bf16":
        sets += [LORA, "model.dtype=bfloat16"]
        if vllm:
            sets += ["rollout.backend=vllm", "rollout.dtype=bfloat16", f"rollout.gpu_memory_utilization={vllm_mem}"]
    elif arm == "fsdp2":
        sets += ["distributed.strategy=fsdp2"]
    else:
        raise ValueError(f"unknown arm {arm!r}; known: {', '.join(ARMS)}")
    if device == "cpu":
        sets.append("threads=1")
    return sets


def summarise_steps(records: Iterable[Mapping[str, Any]], warmup: int, stage: str = "grpo") -> dict[str, Any]:
    """``scale_arms.step_figures`` (medians of the timed steps, the mean log-prob gap), plus what the GPU
    check prints besides: rollout policy tokens per rollout second, the largest gap, the backends."""
    from bench.scale_arms import step_figures

    records = list(records)
    out = step_figures(records, warmup, stage)
    timed = [r for r in records if r.get("stage") == stage and "step_s" in r][warmup:]
    roll = sum(r.get("rollout_s", 0.0) for r in timed)
    if roll > 0:
        out["rollout_tokens_per_s"] = sum(r.get("rollout_tokens", 0.0) for r in timed) / roll
    gaps = [r["logprob_abs_gap"] for r in timed if isinstance(r.get("logprob_abs_gap"), (int, float))]
    if gaps:
        out["logprob_abs_gap_max"] = max(gaps)
    # the rollout/learner mismatch at the same weights: the updates whose batch the current weights sampled
    # (policy lag 0, loop.mismatch_metrics). logprob_abs_gap averages every update of a step, so after the
    # first one it includes the policy's own change (0.098 there where the mismatch was 7e-7).
    same = [r["mismatch_logprob_gap"] for r in timed if isinstance(r.get("mismatch_logprob_gap"), (int, float))]
    if same:
        out["mismatch_logprob_gap"] = sum(same) / len(same)
        out["mismatch_logprob_gap_max"] = max(same)
    out["rollout_backend"] = sorted({r.get("rollout_backend") for r in timed} - {None})
    return out


def child(out_json: str, argv: list[str]) -> None:
    """One ``mentorrl train`` process (a torchrun rank too): run the CLI, then write this process's peak memory."""
    import torch

    from mentorrl.cli import app

    rank = int(os.environ.get("RANK", "0"))
    code = 0
    try:
        app(argv, standalone_mode=False)
    except SystemExit as e:  # a click exit: keep its status
        code = int(e.code or 0)
    finally:
        mem: dict[str, Any] = {"rank": rank, "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        if torch.cuda.is_available():
            mem.update(
                device=torch.cuda.get_device_name(),
                max_memory_allocated_mib=torch.cuda.max_memory_allocated() / 2**20,
                max_memory_reserved_mib=torch.cuda.max_memory_reserved() / 2**20,
            )
        Path(f"{out_json}.rank{rank}").write_text(json.dumps(mem))
    sys.exit(code)


def run_arm(arm: str, args, model_dir: Path, work: Path, use_vllm: bool) -> dict[str, Any]:
    run_dir = work / f"run-{arm}"
    shutil.rmtree(run_dir, ignore_errors=True)
    sets = arm_sets(
        arm, args.device, model_dir, run_dir, args.warmup + args.steps, use_vllm, args.tasks, args.group, args.vllm_mem
    )
    train = ["train", str(DEMO)] + [x for s in sets for x in ("--set", s)]
    mem_json = work / f"{arm}-mem.json"
    me = [str(Path(__file__).resolve()), "--child", str(mem_json), "--"]
    if arm == "fsdp2":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}", *me]
    else:
        cmd = [sys.executable, *me]
    cmd += train
    env = {
        **os.environ,
        "OMP_WAIT_POLICY": "PASSIVE",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "COLUMNS": "200",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    if args.device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    log = work / f"{arm}.log"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    wall = time.perf_counter() - t0
    text = log.read_text(errors="replace")
    if done.returncode != 0:
        tail = "".join(text.splitlines(keepends=True)[-40:])
        return {"arm": arm, "error": f"exit {done.returncode}", "log_tail": tail, "command": " ".join(cmd)}
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    mems = sorted((json.loads(p.read_text()) for p in work.glob(f"{mem_json.name}.rank*")), key=lambda m: m["rank"])
    return {
        "arm": arm,
        "sets": sets,
        **summarise_steps(records, args.warmup),
        "per_rank_memory": mems,
        "process_wall_s": wall,
        "command": " ".join(cmd),
    }


def fmt_mem(row: Mapping[str, Any]) -> str:
    parts = []
    for m in row.get("per_rank_memory", []):
        if "max_memory_allocated_mib" in m:
            parts.append(
                f"rank {m['rank']}: {m['max_memory_allocated_mib']:.0f} MiB allocated "
                f"({m['max_memory_reserved_mib']:.0f} reserved)"
            )
        else:
            parts.append(f"rank {m['rank']}: {m['ru_maxrss_mib']:.0f} MiB RSS")
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child(argv[1], argv[3:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--size", choices=["0.5b", "20m"], default="0.5b")
    ap.add_argument(
        "--model",
        default=None,
        help="a model directory built before, or a GGUF source such as smollm2 (skips the build)",
    )
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--ranks", type=int, default=None, help="FSDP2 ranks (default: every GPU; 2 on the CPU)")
    ap.add_argument("--vllm", choices=["auto", "on", "off"], default="auto", help="auto: vLLM if it imports")
    ap.add_argument("--vllm-mem", type=float, default=0.25, help="rollout.gpu_memory_utilization (default 0.25)")
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per arm (default 2)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--work", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (torch.cuda.is_available() is False); use --device cpu")
    if args.ranks is None:
        args.ranks = torch.cuda.device_count() if args.device == "cuda" else 2
    try:
        import vllm  # noqa: F401

        have_vllm = True
    except Exception as e:  # noqa: BLE001
        have_vllm, why = False, f"{type(e).__name__}: {e}"
    if args.vllm == "on" and not have_vllm:
        raise SystemExit(f"--vllm on: vllm does not import ({why})")
    use_vllm = have_vllm and args.vllm != "off"
    if not use_vllm:
        print(f"vLLM off ({'--vllm off' if args.vllm == 'off' else why}): the lora-bf16 arm rolls out with hf")
    own = args.work is None
    work = Path(tempfile.mkdtemp(prefix="gpu-step-")) if own else Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    try:
        from bench.scale_arms import build_model

        t0 = time.perf_counter()
        model_dir = Path(args.model) if args.model else build_model(args.size, work / f"model-{args.size}")
        print(
            f"model {model_dir} ({args.size}) ready in {time.perf_counter() - t0:.0f} s; device {args.device}",
            flush=True,
        )
        rows = {}
        for arm in [a.strip() for a in args.arms.split(",") if a.strip()]:
            r = run_arm(arm, args, model_dir, work, use_vllm)
            rows[arm] = r
            if "error" in r:
                print(f"{arm}: FAILED ({r['error']}):\n{r['log_tail']}", flush=True)
                continue
            print(
                f"{arm}: step {r['step_s']:.2f} s (timed {[round(x, 2) for x in r['step_s_all']]}, warm-up "
                f"{[round(x, 1) for x in r['warmup_step_s']]}); rollout {r.get('rollout_tokens_per_s', 0):.0f} policy "
                f"tokens/s ({'/'.join(r['rollout_backend'])}); |logprob gap| at the same weights "
                f"{r.get('mismatch_logprob_gap', float('nan')):.2e} (max {r.get('mismatch_logprob_gap_max', float('nan')):.2e}; "
                f"over all updates {r.get('logprob_abs_gap', float('nan')):.2e}); {fmt_mem(r)} [{r['process_wall_s']:.0f} s]",
                flush=True,
            )
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)
    doc = {
        "command": " ".join(["python", "bench/gpu_step.py", *argv]),
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "vllm": use_vllm,
        "versions": {"torch": torch.__version__},
        "rows": rows,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1))
    if any("error" in r for r in rows.values()):
        raise SystemExit("an arm failed (above)")
    return doc


if __name__ == "__main__":
    main()
