"""Shared by the benches that time the rollout engine on one GRPO step's rollouts (``rollout_cpu.py``,
``decoders.py``): their common arguments, the start-up (run config, workspace, torch threads, the checkpoint)
and one timed ``RolloutEngine.run`` over fresh environments."""

from __future__ import annotations

import argparse
import gc
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from mentorrl.cli_common import load_run_config  # noqa: E402
from mentorrl.models.build import load_policy  # noqa: E402
from mentorrl.rollout.engine import RolloutEngine  # noqa: E402
from mentorrl.rollout.episode import Episode  # noqa: E402
from mentorrl.train.workspace import open_workspace  # noqa: E402


def engine_parser(doc: str | None, reps: int) -> argparse.ArgumentParser:
    """The arguments both benches take: ``--model``, ``--config``, ``--tasks`` x ``--group`` (the demo's GRPO
    shape), ``--reps``, ``--threads`` and ``--json``."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF checkpoint dir (e.g. the demo's SFT checkpoint)")
    p.add_argument("--config", default=None, help="run config (default: the demo recipe)")
    p.add_argument("--tasks", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--reps", type=int, default=reps)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    return p


def open_engine_bench(args: argparse.Namespace, run_dir: str) -> tuple[Any, Any, Any]:
    """The run config (``--config``, default the demo recipe) with its workspace under ``/tmp/RUN_DIR``, torch
    at ``--threads`` threads, and the ``--model`` checkpoint bound to the workspace in eval mode:
    ``(cfg, ws, model)``."""
    cfg = load_run_config(Path(args.config) if args.config else None, [], str(Path("/tmp") / run_dir), "demo.yaml")
    ws = open_workspace(cfg, show_progress=False)
    torch.set_num_threads(args.threads)  # after the workspace, which sets the recipe's own (the demo's: 2)
    tok, model = load_policy(args.model)
    ws.bind_tokenizer(tok)
    model.eval()
    return cfg, ws, model


@contextmanager
def collector_clock():
    """The cyclic collector's runs within it: ``collections``, ``full`` (the oldest generation's) and their
    CPU seconds, ``gc_cpu_s`` (this process, from each run's start to its end)."""
    got = {"collections": 0, "full": 0, "gc_cpu_s": 0.0}
    began = [0.0]

    def seen(phase: str, info: dict) -> None:
        if phase == "start":
            began[0] = time.process_time()
            return
        got["collections"] += 1
        got["full"] += info["generation"] == 2
        got["gc_cpu_s"] += time.process_time() - began[0]

    gc.callbacks.append(seen)
    try:
        yield got
    finally:
        gc.callbacks.remove(seen)


def timed_rollout(model, ws, tasks, decoder: str, seed: int, weights) -> tuple[list, dict, float, float]:
    """One ``RolloutEngine`` run of ``tasks`` (an environment each, closed after): the trajectories, the
    engine's ``last_stats`` with the collector's runs (:func:`collector_clock`), and this process's CPU
    seconds (every thread) and wall seconds of the run."""
    envs = [ws.make_env() for _ in tasks]
    try:
        eps = [Episode(ws.contract, e, t, weights=weights) for e, t in zip(envs, tasks)]
        engine = RolloutEngine(model, ws.contract, decoder=decoder)
        with collector_clock() as collector:
            c0, t0 = time.process_time(), time.perf_counter()
            trajs = engine.run(eps, seed=seed)
            cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    finally:
        for e in envs:
            e.close()
    return trajs, {**engine.last_stats, "gc": collector}, cpu, wall
