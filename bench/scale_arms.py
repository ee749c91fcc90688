"""Peak memory and time per GRPO step of the learner's memory levers (issue 37, item 7), each arm a
separate ``mentorrl train`` process (the real path) on a Qwen2 of a given shape built locally.

Arms (``--arms``, comma-separated; any ``--set`` is added to every arm):

* ``full``: fp32 full fine-tuning (the default learner);
* ``bf16``: ``model.dtype: bfloat16`` (bf16 autocast, fp32 master weights and AdamW state);
* ``lora``: ``model.lora`` r 16, alpha 32, on every attention and MLP projection;
* ``lora-ckpt``: ``lora`` plus ``grpo.optim.gradient_checkpointing: true``;
* ``fsdp2``: fp32 full fine-tuning sharded over 2 ranks (``torchrun --standalone --nproc-per-node 2``,
  ``distributed.strategy: fsdp2``, ``threads: 1`` per rank; gloo on the CPU);
* ``lora-ckpt-bf16`` (not in the default set): ``lora-ckpt`` with ``model.dtype: bfloat16``;
* ``lora-ckpt-mbt`` (not in the default set): ``lora-ckpt`` with ``grpo.optim.micro_batch_tokens: 512``
  (micro-batches of at most 512 padded tokens: the activation lever).

Every arm runs the demo recipe's GRPO (``mentorrl/configs/demo.yaml``: the ``orders`` environment, its
tools and reward, ``grpo.guide: expert`` so that a group where every rollout fails, as a random-init
model's do, gets the expert's demonstration as one more member and the update has non-zero advantages;
no KL reference, ``grpo.kl_coef: 0``) with ``--tasks`` x ``--group`` trajectories per step,
``--max-new-tokens`` per turn and ``--max-turns`` turns, ``threads: 1`` per process,
``OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE``; no evaluation, no preflight audit, no checkpoint before
the final one. ``--warmup`` (1) step, then ``--steps`` (2) timed ones.

Measured per arm:

* step, rollout and update seconds: the medians over the timed steps of ``step_s``, ``rollout_s`` and
  ``update_s`` in the run's ``metrics.jsonl`` (also the warm-up step's ``step_s``), and the mean
  ``logprob_abs_gap`` (behaviour against the learner's recomputed log-probs) of the timed steps;
* peak RSS: every process of the arm's tree sampled from ``/proc/<pid>/status`` (``VmRSS``) every
  ``--sample-s`` (0.1 s): the peak of each process (per rank under torchrun) and the peak of their sum,
  and the children's ``ru_maxrss`` from ``wait4`` (the largest single process; the sampled peak can miss
  a spike shorter than the sampling period, ``ru_maxrss`` cannot);
* the model's parameter count and each arm's trainable count (from the run's log line).

    python bench/scale_arms.py --size 20m --steps 1 --warmup 1            # the plumbing, a few minutes
    python bench/scale_arms.py --size 0.5b --json bench/results/scale_arms_0.5b.json

The 0.5b shape is Qwen2-0.5B's (24 layers of width 896, 14 heads, 2 KV heads, MLP 4864) with the project's
1024-token vocabulary: 0.36B parameters, random init (``bench/rollout_backends.py``'s ``SPEC_05B``).
The target checked: LoRA with checkpointing at most 1/3 of fp32 full fine-tuning's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
DEMO = ROOT / "mentorrl" / "configs" / "demo.yaml"

LORA = "model.lora={r: 16, alpha: 32, target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]}"
CKPT = "grpo.optim.gradient_checkpointing=true"
ARMS: dict[str, dict[str, Any]] = {
    "full": {"sets": []},
    "bf16": {"sets": ["model.dtype=bfloat16"]},
    "lora": {"sets": [LORA]},
    "lora-ckpt": {"sets": [LORA, CKPT]},
    "fsdp2": {"sets": ["distributed.strategy=fsdp2"], "ranks": 2},
    "lora-ckpt-bf16": {"sets": [LORA, CKPT, "model.dtype=bfloat16"]},
    "lora-ckpt-mbt": {"sets": [LORA, CKPT, "grpo.optim.micro_batch_tokens=512"]},
}
DEFAULT_ARMS = ("full", "bf16", "lora", "lora-ckpt", "fsdp2")
TARGET_LORA_CKPT_OVER_FULL = 1 / 3


# ------------------------------------------------------------------------- pure helpers (tested) ---
def train_overrides(
    model_dir: Path | str, run_dir: Path | str, steps: int, tasks: int, group: int, max_new_tokens: int, max_turns: int
) -> list[str]:
    """``--set`` overrides of the demo recipe shared by every arm (a GRPO stage of ``steps`` steps)."""
    return [
        f"model.path={model_dir}",
        "recipe=[grpo]",
        f"run_dir={run_dir}",
        "threads=1",
        "audit.preflight=false",
        "audit.eval_every=0",
        "eval.num_tasks=0",
        "grpo.kl_coef=0",
        f"grpo.steps={steps}",
        f"grpo.tasks_per_step={tasks}",
        f"grpo.samples_per_task={group}",
        f"grpo.checkpoint_every={steps + 1000}",
        f"sampling.max_new_tokens={max_new_tokens}",
        f"limits.max_turns={max_turns}",
    ]


def arm_command(arm: str, overrides: Iterable[str], python: str = sys.executable) -> list[str]:
    """The command line of one arm: ``mentorrl train`` on the demo recipe, under torchrun for a sharded arm."""
    spec = ARMS[arm]
    args = ["train", str(DEMO)]
    for s in [*overrides, *spec["sets"]]:
        args += ["--set", s]
    ranks = spec.get("ranks", 1)
    if ranks > 1:
        head = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
        return [*head, "-m", "mentorrl.cli", *args]
    return [python, "-m", "mentorrl.cli", *args]


def descendants(root: int, parents: Mapping[int, int]) -> set[int]:
    """``root`` and every process below it, from a pid -> parent pid map."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in out:
            continue
        out.add(pid)
        todo.extend(children.get(pid, ()))
    return out


class RssPeaks:
    """Peak RSS of each process and of their sum, over samples of ``{pid: rss_bytes}``."""

    def __init__(self, exclude: Iterable[int] = ()) -> None:
        self.exclude = set(exclude)
        self.per_pid: dict[int, int] = {}
        self.sum_peak = 0
        self.samples = 0
        self.timeline: list[tuple[float, int]] = []  # (seconds since the first sample, the sum)
        self._t0: float | None = None
        self.marks: list[float] = []  # seconds since the first sample at which the watched file grew (a step ended)

    def add(self, sample: Mapping[int, int], t: float | None = None) -> None:
        """One sample; the processes in ``exclude`` (a torchrun launcher) count per process but not in the sum."""
        self.samples += 1
        for pid, rss in sample.items():
            self.per_pid[pid] = max(self.per_pid.get(pid, 0), rss)
        total = sum(v for p, v in sample.items() if p not in self.exclude)
        self.sum_peak = max(self.sum_peak, total)
        now = time.perf_counter() if t is None else t
        self._t0 = now if self._t0 is None else self._t0
        self.timeline.append((now - self._t0, total))

    def top(self, n: int) -> list[int]:
        """The ``n`` largest per-process peaks, largest first (the ranks of a torchrun tree: its launcher is small)."""
        return sorted(self.per_pid.values(), reverse=True)[:n]


def step_figures(records: Iterable[Mapping[str, Any]], warmup: int, stage: str = "grpo") -> dict[str, Any]:
    """Medians of the timed steps (after the first ``warmup``) of a run's ``metrics.jsonl`` records."""
    steps = [r for r in records if r.get("stage") == stage and "step_s" in r]
    timed = steps[warmup:]
    if not timed:
        raise ValueError(f"{len(steps)} {stage} step records, none after {warmup} warm-up step(s)")
    out: dict[str, Any] = {"timed_steps": len(timed), "warmup_step_s": [r["step_s"] for r in steps[:warmup]]}
    for key in ("step_s", "rollout_s", "update_s", "rollout_tokens", "trained_trajectories", "cpu_s", "rollout_cpu_s"):
        vals = [r[key] for r in timed if isinstance(r.get(key), (int, float))]
        if vals:
            out[key] = statistics.median(vals)
            out[f"{key}_all"] = vals
    gaps = [r["logprob_abs_gap"] for r in timed if isinstance(r.get("logprob_abs_gap"), (int, float))]
    if gaps:
        out["logprob_abs_gap"] = sum(gaps) / len(gaps)
    return out


def thin_timeline(timeline: Iterable[tuple[float, int]], every_s: float) -> list[tuple[float, float]]:
    """``(t, bytes)`` samples as ``(t, MiB)`` at most one per ``every_s`` seconds, each the largest of its window."""
    out: dict[int, tuple[float, float]] = {}
    for t, b in timeline:
        k = int(t // every_s)
        if k not in out or b / 2**20 > out[k][1]:
            out[k] = (round(t, 1), round(b / 2**20, 1))
    return [out[k] for k in sorted(out)]


def memory_target(rows: Mapping[str, Mapping[str, Any]], key: str = "peak_rss_sum_mib") -> dict[str, Any] | None:
    """LoRA with checkpointing against fp32 full fine-tuning: the ratio of their peaks and the 1/3 target."""
    if "full" not in rows or "lora-ckpt" not in rows:
        return None
    ratio = rows["lora-ckpt"][key] / rows["full"][key]
    return {"ratio": ratio, "target": TARGET_LORA_CKPT_OVER_FULL, "met": ratio <= TARGET_LORA_CKPT_OVER_FULL}


_TRAINABLE = re.compile(r"LoRA r=\S+ alpha=\S+ on .*?: ([0-9.]+M of [0-9.]+M parameters train)")


# ------------------------------------------------------------------------------------ sampling ---
def _proc_parents() -> dict[int, int]:
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        # the command name (field 2) may hold spaces and parentheses: the fields after its last ')'
        out[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
    return out


def _rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def sample_tree(root: int, peaks: RssPeaks, stop: threading.Event, period: float, watch: Path | None = None) -> None:
    """Sample the tree's RSS into ``peaks`` every ``period`` s; mark when ``watch`` (metrics.jsonl) grows."""
    size = 0
    while not stop.is_set():
        if watch is not None and watch.exists() and watch.stat().st_size != size:
            size = watch.stat().st_size
            if peaks._t0 is not None:
                peaks.marks.append(time.perf_counter() - peaks._t0)
        sample = {}
        for pid in descendants(root, _proc_parents()):
            rss = _rss_bytes(pid)
            if rss:
                sample[pid] = rss
        if sample:
            peaks.add(sample)
        stop.wait(period)


# ---------------------------------------------------------------------------------------- arms ---
def build_model(size: str, out: Path) -> Path:
    """A random-init Qwen2 of ``size``'s shape and the project's tokenizer, built once into ``out``."""
    from bench.rollout_backends import SIZES
    from mentorrl.envs import get_env
    from mentorrl.train.models_init import build_tiny_model

    return build_tiny_model(get_env("orders"), out, SIZES[size], corpus_tasks=60, use_shipped=False)


def run_arm(arm: str, model_dir: Path, work: Path, args) -> dict[str, Any]:
    run_dir = work / f"run-{arm}"
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = train_overrides(
        model_dir, run_dir, args.warmup + args.steps, args.tasks, args.group, args.max_new_tokens, args.max_turns
    )
    cmd = arm_command(arm, [*overrides, *args.set])
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "OMP_WAIT_POLICY": "PASSIVE",
        "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "COLUMNS": "200",  # the console's lines unwrapped in the log
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    log = work / f"{arm}.log"
    ranks = ARMS[arm].get("ranks", 1)
    stop = threading.Event()
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
        peaks = RssPeaks(exclude=[proc.pid] if ranks > 1 else ())  # under torchrun: the ranks' sum
        sampler = threading.Thread(
            target=sample_tree, args=(proc.pid, peaks, stop, args.sample_s, run_dir / "metrics.jsonl"), daemon=True
        )
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        stop.set()
        sampler.join()
    wall = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    text = log.read_text(errors="replace")
    if code != 0:
        tail = "".join(text.splitlines(keepends=True)[-40:])
        raise SystemExit(f"arm {arm}: `{' '.join(cmd)}` exited {code}; log {log}:\n{tail}")
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    trainable = _TRAINABLE.search(text)
    row: dict[str, Any] = {
        "arm": arm,
        "sets": ARMS[arm]["sets"],
        "ranks": ranks,
        **step_figures(records, args.warmup),
        "peak_rss_sum_mib": peaks.sum_peak / 2**20,
        "peak_rss_per_rank_mib": [b / 2**20 for b in peaks.top(ranks)],
        "launcher_peak_rss_mib": peaks.per_pid.get(proc.pid, 0) / 2**20 if ranks > 1 else None,
        "ru_maxrss_mib": usage.ru_maxrss / 1024.0,
        "process_wall_s": wall,
        "process_cpu_s": usage.ru_utime + usage.ru_stime,
        "rss_samples": peaks.samples,
        # the summed RSS over the run, one point a second (MiB), and when each step's record was written
        "rss_timeline_mib": thin_timeline(peaks.timeline, 1.0),
        "metrics_written_s": [round(t, 1) for t in peaks.marks],
        "trainable": trainable.group(1) if trainable else "all",
        "command": " ".join(cmd),
    }
    if not args.keep_runs:
        shutil.rmtree(run_dir, ignore_errors=True)
    return row


def print_rows(rows: dict[str, dict[str, Any]]) -> None:
    print(
        f"\n{'arm':15} {'step s':>8} {'rollout s':>9} {'update s':>9} {'peak RSS MiB':>13} {'per rank':>14} "
        f"{'ru_maxrss':>10} {'|lp gap|':>9}"
    )
    full = rows.get("full")
    for r in rows.values():
        per = "/".join(f"{x:.0f}" for x in r["peak_rss_per_rank_mib"])
        print(
            f"{r['arm']:15} {r.get('step_s', float('nan')):8.1f} {r.get('rollout_s', float('nan')):9.1f} "
            f"{r.get('update_s', float('nan')):9.1f} {r['peak_rss_sum_mib']:13.0f} {per:>14} "
            f"{r['ru_maxrss_mib']:10.0f} {r.get('logprob_abs_gap', float('nan')):9.2e}"
            + (f"  ({r['peak_rss_sum_mib'] / full['peak_rss_sum_mib']:.2f}x full's memory)" if full else "")
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=["0.5b", "20m"], default="20m")
    ap.add_argument("--model", default=None, help="a model directory built before (skips the build)")
    ap.add_argument("--arms", default=",".join(DEFAULT_ARMS), help="comma-separated, of: " + ", ".join(ARMS))
    ap.add_argument("--steps", type=int, default=2, help="timed GRPO steps per arm (default 2)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed GRPO steps first (default 1)")
    ap.add_argument("--tasks", type=int, default=1, help="tasks per step (default 1)")
    ap.add_argument("--group", type=int, default=8, help="samples per task (default 8)")
    ap.add_argument("--max-new-tokens", type=int, default=48, help="per turn (default 48)")
    ap.add_argument(
        "--max-turns", type=int, default=6, help="(default 6, the demo's: the expert's demonstration needs them)"
    )
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="one more --set for every arm")
    ap.add_argument("--sample-s", type=float, default=0.25, help="RSS sampling period (default 0.25 s)")
    ap.add_argument("--work", default=None, help="model, runs and logs (default: a temporary dir, removed)")
    ap.add_argument("--keep-runs", action="store_true")
    ap.add_argument("--json", default=None, metavar="OUT")
    ap.add_argument("--append", action="store_true", help="keep the rows already in --json (other arms, other steps)")
    args = ap.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arms {unknown}; known: {', '.join(ARMS)}")
    own = args.work is None
    work = Path(tempfile.mkdtemp(prefix="scale-arms-")) if own else Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        model_dir = Path(args.model) if args.model else build_model(args.size, work / f"model-{args.size}")
        build_s = time.perf_counter() - t0
        from safetensors import safe_open

        with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
            n_params = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())
        print(
            f"model {model_dir} ({n_params / 1e6:.1f}M parameters, built in {build_s:.0f} s); arms {arms}; "
            f"{args.warmup} warm-up + {args.steps} timed steps of {args.tasks} x {args.group} trajectories; "
            f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        command = " ".join(["python", "bench/scale_arms.py", *(argv if argv is not None else sys.argv[1:])])
        prev = json.loads(Path(args.json).read_text()) if args.append and args.json and Path(args.json).exists() else {}
        rows: dict[str, dict[str, Any]] = dict(prev.get("rows", {}))
        for arm in arms:
            load = os.getloadavg()[0]
            rows[arm] = {
                **run_arm(arm, model_dir, work, args),
                "load_average_at_start": load,
                "warmup": args.warmup,
                "bench_command": command,
            }
            r = rows[arm]
            print(
                f"{arm}: step {r.get('step_s', float('nan')):.1f} s (all {r.get('step_s_all')}), "
                f"{r.get('cpu_s', float('nan')):.1f} CPU-s, peak RSS "
                f"{r['peak_rss_sum_mib']:.0f} MiB (per rank {[round(x) for x in r['peak_rss_per_rank_mib']]}), "
                f"ru_maxrss {r['ru_maxrss_mib']:.0f} MiB, trainable {r['trainable']} [{r['process_wall_s']:.0f} s]",
                flush=True,
            )
            write_doc(args, prev, command, n_params, rows)  # after every arm: a killed run keeps what it measured
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)
    print_rows(rows)
    doc = write_doc(args, prev, command, n_params, rows)
    target = doc["target_lora_ckpt_over_full"]
    if target:
        print(
            f"target LoRA + checkpointing <= 1/3 of fp32 full's peak RSS: {target['ratio']:.2f}x: "
            + ("met" if target["met"] else "NOT met")
        )
    return doc


def write_doc(args, prev: dict[str, Any], command: str, n_params: int, rows: dict[str, dict[str, Any]]) -> dict:
    """The result document (``--append``: the rows of ``--json`` kept, the commands of every invocation listed)."""
    doc = {
        "commands": [*prev.get("commands", []), command] if prev else [command],
        "size": args.size,
        "params": n_params,
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "arms")},
        "machine": {"cpu_count": os.cpu_count(), "omp": "OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE", "threads": 1},
        "rows": rows,
        "target_lora_ckpt_over_full": memory_target(rows),
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return doc


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


if __name__ == "__main__":
    main()
