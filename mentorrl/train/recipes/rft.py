"""Rejection-sampling fine-tuning rounds (``recipe: [sft, rft, ...]``); the data selection is
:mod:`mentorrl.train.rft`."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from mentorrl.train.learner import Learner
from mentorrl.train.registry import register_stage
from mentorrl.train.rft import rft_round_stats, rising, select_rft_data, task_outcomes
from mentorrl.train.stage_runner import run_stage
from mentorrl.train.workspace import Workspace, load_weights_into
from mentorrl.trajectory import read_jsonl, write_jsonl

RFT_POOL_SEED_OFFSET = 4099


@register_stage("rft", config="rft", title="RFT: sample, verify, fine-tune", label="RFT")
def rft_stage(ws: Workspace, model, resume: bool = False) -> Path:
    """Rejection-sampling fine-tuning rounds (see :mod:`mentorrl.train.rft`: the selection); one round per step.

    Each round's kept trajectories are written to ``rft/data-round-N.jsonl`` (a redone round
    overwrites its file) and the training set is the union of all rounds so far. When the
    positive-task rate stops rising, the stage stops and keeps the weights that measured best.
    """
    cfg, r = ws.cfg, ws.cfg.rft
    tasks = ws.train_tasks(r.num_tasks, cfg.seed + RFT_POOL_SEED_OFFSET)
    learner = Learner(model, r.optim, ws.contract.pad_token_id, ws.contract.sampling.temperature)
    stage_dir, best_dir = ws.run_dir / "rft", ws.run_dir / "rft" / "best"
    state: dict[str, Any] = {"history": [], "best_rate": -1.0}

    def data_file(round_: int) -> Path:
        return stage_dir / f"data-round-{round_:03d}.jsonl"

    def step_fn(step: int) -> dict[str, float]:
        grouped = [t for t in tasks for _ in range(r.samples_per_task)]
        t0 = time.perf_counter()
        trajs = ws.rollout.run(model, grouped, seed=cfg.seed * 9_973 + 101 * step, batch_size=r.rollout_batch)
        stats = rft_round_stats(task_outcomes(trajs))
        rate = stats["positive_task_rate"]
        state["history"] = state["history"][:step] + [rate]
        m: dict[str, float] = {**stats, "rollouts": len(trajs), "rollout_s": time.perf_counter() - t0}
        if rate > state["best_rate"]:  # the weights that sampled this round are the best so far
            state["best_rate"] = rate
            model.save_pretrained(best_dir, safe_serialization=True)
        if not rising(state["history"], r.min_gain):
            if rate < state["best_rate"]:
                load_weights_into(model, best_dir)
            m.update(stop=True, stopped_on_plateau=1.0, kept_best_rate=state["best_rate"])
            return m
        kept, counts = select_rft_data(trajs, r.top_k, tuple(r.band), seed=cfg.seed + step)
        stage_dir.mkdir(parents=True, exist_ok=True)
        write_jsonl(data_file(step), kept)
        data = [t for i in range(step + 1) if data_file(i).exists() for t in read_jsonl(data_file(i))]
        m.update(counts, dataset_size=len(data))
        losses = []
        if data:
            for k in range(r.sft_steps):
                batch_rng = random.Random(cfg.seed * 1_000_033 + 1_000 * step + k)
                batch = [data[i] for i in batch_rng.sample(range(len(data)), min(r.batch_size, len(data)))]
                losses.append(learner.sft_step(batch, agg=cfg.sft.loss_agg)["loss"])
        m["loss"] = sum(losses) / len(losses) if losses else 0.0
        return m

    return run_stage(
        ws, "rft", model, learner, r.max_iterations, step_fn, checkpoint_every=1, resume=resume,
        extra_state=lambda: dict(state), restore_extra=lambda st: state.update(st),
    )
