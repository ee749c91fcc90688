"""Rejection-sampling fine-tuning rounds (``recipe: [sft, rft, ...]``); the data selection is
:mod:`mentorrl.train.rft`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from mentorrl.train.loop import Stage, StepBatch, run_on_loop
from mentorrl.train.rft import rft_round_stats, rising, select_rft_data, task_outcomes
from mentorrl.train.rundir import write_manifest
from mentorrl.train.workspace import Workspace, load_weights_into
from mentorrl.trajectory import Trajectory, read_jsonl, write_jsonl


class RFTStage(Stage):
    """Rejection-sampling fine-tuning rounds (see :mod:`mentorrl.train.rft`: the selection); one round per step.

    Each round's kept trajectories are written to ``rft/data-round-N.jsonl`` (a redone round
    overwrites its file) and the training set is the union of all rounds so far. When the
    positive-task rate stops rising, the stage stops and keeps the weights that measured best.
    """

    name = "rft"
    update_metrics = ()

    def __init__(self, ws: Workspace, model):
        super().__init__(ws, model)
        self.stage_dir = ws.run_dir / "rft"
        self.best_dir = self.stage_dir / "best"
        self.state: dict[str, Any] = {"history": [], "best_rate": -1.0}

    @property
    def steps(self) -> int:
        return self.cfg.max_iterations

    @property
    def checkpoint_every(self) -> int:
        return 1

    def make_pool(self) -> list:
        return self.ws.train_tasks(self.cfg.num_tasks, self.seeds("pool"))

    def tasks(self, b: StepBatch) -> None:
        b.tasks = self.pool

    def rollout(self, b: StepBatch) -> None:
        r, t0 = self.cfg, time.perf_counter()
        grouped = [t for t in b.tasks for _ in range(r.samples_per_task)]
        b.trajs = self.ws.rollout.run(self.model, grouped, seed=b.seeds("rollout"), batch_size=r.rollout_batch)
        b.group_size = r.samples_per_task
        b.metrics.update(rollouts=len(b.trajs), rollout_s=time.perf_counter() - t0)

    def score(self, b: StepBatch) -> None:
        """The round's positive-task rate and what it decides: a new best keeps the weights that
        sampled it (:meth:`keep_if_best`), a plateau stops the stage on the best weights
        (:meth:`stop_on_plateau`)."""
        stats = rft_round_stats(task_outcomes(b.trajs))
        rate, st = stats["positive_task_rate"], self.state
        st["history"] = st["history"][: b.step] + [rate]
        b.metrics.update(stats)
        self.keep_if_best(rate)
        self.stop_on_plateau(b, rate)

    def keep_if_best(self, rate: float) -> None:
        """A round better than every one before it: its sampling weights saved as ``rft/best``."""
        if rate > self.state["best_rate"]:
            self.state["best_rate"] = rate
            self.model.save_pretrained(self.best_dir, safe_serialization=True)
            write_manifest(self.best_dir)  # verified when the best weights are loaded back

    def stop_on_plateau(self, b: StepBatch, rate: float) -> None:
        """The positive-task rate stopped rising: back to the best weights, and the stage stops."""
        st = self.state
        if not rising(st["history"], self.cfg.min_gain):
            if rate < st["best_rate"]:
                load_weights_into(self.model, self.best_dir)
            b.metrics.update(stopped_on_plateau=1.0, kept_best_rate=st["best_rate"])
            b.stop = True

    # RFT has no advantages: a trajectory is kept for the training set or not (select_round, in update)

    def update(self, b: StepBatch) -> None:
        """This round's selection (:meth:`select_round`), then ``sft_steps`` SFT steps on the training
        set of every round so far."""
        r, data, losses = self.cfg, self.select_round(b), []
        for k in range(r.sft_steps if data else 0):
            rng = b.seeds.rng(f"batch-{k}")
            batch = [data[i] for i in rng.sample(range(len(data)), min(r.batch_size, len(data)))]
            losses.append(self.learner.sft_step(batch, agg=self.ws.cfg.sft.loss_agg)["loss"])
        b.metrics["loss"] = sum(losses) / len(losses) if losses else 0.0

    def select_round(self, b: StepBatch) -> list[Trajectory]:
        """The round's kept trajectories (:func:`select_rft_data`), written to its data file; returns
        the training set: the kept trajectories of every round so far."""
        r = self.cfg
        kept, counts = select_rft_data(b.trajs, r.top_k, tuple(r.band), seed=b.seeds("select"))
        self.stage_dir.mkdir(parents=True, exist_ok=True)
        write_jsonl(self.data_file(b.step), kept)
        train = [t for i in range(b.step + 1) if self.data_file(i).exists() for t in read_jsonl(self.data_file(i))]
        b.metrics.update(counts, dataset_size=len(train))
        return train

    def data_file(self, round_: int) -> Path:
        return self.stage_dir / f"data-round-{round_:03d}.jsonl"

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state.update(state)


rft_stage = run_on_loop(RFTStage)
