"""The cyclic collector's CPU during ``mentorrl train`` stages, with the loaded modules frozen out of its scans
(``mentorrl.core.lifetime.frozen_heap``, what train does) and without (``--arm off``).

Runs ``mentorrl train CONFIG`` in this process (stage processes off, so the stages run here) with a
``gc.callbacks`` hook that counts, while a stage runs, the collector's runs, its full (oldest generation) ones and
their CPU seconds, and the stages' CPU seconds. One arm a process; alternate them for an A/B:

    for a in off on; do OMP_NUM_THREADS=1 python bench/collector.py --arm $a --steps 8 \\
        --model runs/demo/sft/final --json OUT_$a.json; done

Measured: ``bench/results/collector_demo.json`` (docs/scaling.md, "The collector").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _engine import collector_clock  # noqa: E402  (the collector's runs: the rollout benches' hook)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", choices=("on", "off"), default="on", help="off: the heap is not frozen")
    ap.add_argument("--model", required=True, help="the GRPO stage's starting checkpoint (e.g. the demo's SFT)")
    ap.add_argument("--config", default="mentorrl/configs/demo.yaml")
    ap.add_argument("--steps", type=int, default=8, help="GRPO steps")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)

    import mentorrl.train.pipeline as pipeline
    from mentorrl.cli import app

    if a.arm == "off":
        pipeline.frozen_heap = lambda: contextlib.nullcontext(False)
    got = {"arm": a.arm, "collections": 0, "full": 0, "gc_cpu_s": 0.0, "stage_cpu_s": 0.0}
    run_stage = pipeline.run_stage_by_name

    def timed_stage(*args, **kw):  # the collector counted while a stage runs, not while the run starts
        c0 = time.process_time()
        try:
            with collector_clock() as seen:
                return run_stage(*args, **kw)
        finally:
            got["stage_cpu_s"] += time.process_time() - c0
            for k in ("collections", "full", "gc_cpu_s"):
                got[k] += seen[k]

    pipeline.run_stage_by_name = timed_stage
    with tempfile.TemporaryDirectory(prefix="mentorrl-collector-") as tmp:
        sets = ["recipe=[grpo]", f"model.path={a.model}", f"grpo.steps={a.steps}", "eval.num_tasks=0",
                f"threads={a.threads}", "audit.preflight=false", "audit.eval_every=0", "stage_processes=false"]  # fmt: skip
        argv_train = ["train", a.config, "--run-dir", str(Path(tmp) / "run")]
        for s in sets:
            argv_train += ["--set", s]
        app(argv_train, standalone_mode=False)
    got["gc_share"] = got["gc_cpu_s"] / got["stage_cpu_s"] if got["stage_cpu_s"] else None
    got["command"] = " ".join(["python", "bench/collector.py", *(sys.argv[1:] if argv is None else argv)])
    print(json.dumps(got, indent=1))
    if a.json:
        a.json.write_text(json.dumps(got, indent=1) + "\n")
    return got


if __name__ == "__main__":
    main()
