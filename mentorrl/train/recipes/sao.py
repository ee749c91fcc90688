"""SAO: asynchronous single-rollout optimisation for agents.

One rollout per task and no group barrier: a rollout worker (:mod:`mentorrl.train.async_rl`)
keeps ``sao.rollout.slots`` episodes in flight and hands each trajectory to the learner as soon
as it finishes. A learner step takes the next ``sao.batch_size`` finished trajectories, applies
the staleness rule, optionally mixes in replayed and expert data (hybrid batch), and then

- advantages come from the critic: GAE over policy tokens on the outcome reward;
- the policy loss is token-level double-sided importance *masking* (``masked_is``) against the
  behaviour log-probs recorded at rollout: a token whose ratio leaves
  ``[1 - eps_low, 1 + eps_high]`` drops out of the gradient;
- every ``sao.rollout.sync_every`` learner steps that changed the policy, the weights go to the
  worker and the policy version increments.

Expert demonstrations in a hybrid batch have no behaviour log-probs of this policy; they are
relabelled with the current policy's own log-probs (ratio 1 at the update) and a fixed positive
advantage, which turns their share of the loss into weighted maximum likelihood.

Crash safety: checkpoints hold the weights, optimiser, critic and policy version, and the replay
buffer's mark (:meth:`ReplayBuffer.mark`: its id and high-water entry). The buffer is SQLite (each
insert one transaction); on resume it is rolled back to the restored checkpoint's mark in one
transaction, so entries added by the discarded steps (possibly of a policy version newer than the
restored learner) are gone and entries they evicted are back; then any entry still from a policy
version above the restored learner's is dropped (the version rule of
:mod:`mentorrl.replay.checkpointing`, which holds whoever wrote the entry); both counts are printed
and logged on the first step after the resume. A stage that starts from step 0 starts from an
empty buffer. A buffer file that was replaced raises :class:`ReplayBufferError`
naming it. The per-step records (``metrics.jsonl``, ``samples/sao-step-N.jsonl``,
``sao/consumed/step-N.json``) are rewritten when a step is redone. Trajectories in flight when
the run died are simply lost; the resumed worker starts new ones.
"""

from __future__ import annotations

import functools
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from mentorrl.replay.buffer import BatchItem, ReplayBuffer, hybrid_batch, segment_replay
from mentorrl.replay.checkpointing import BufferCheckpoints
from mentorrl.train.async_rl import RolloutPool, WeightBox, lag_histogram, staleness_weights
from mentorrl.train.critic import Critic
from mentorrl.train.loop import Stage, StepBatch, StepData, run_on_loop
from mentorrl.train.rundir import KEEP_CHECKPOINTS
from mentorrl.train.stage_helpers import (
    UPDATE_HEALTH,
    RewardGapWatch,
    outcome_rewards,
    pg_update,
    reduce_updates,
    relabel_behaviour,
    require_consistent,
    rollout_metrics,
    score_outcomes,
)
from mentorrl.train.workspace import Workspace
from mentorrl.trajectory import Trajectory, write_jsonl


def task_stream(pool: list, seed: int) -> Iterator:
    """Endless task order: the pool reshuffled every epoch with a seeded RNG."""
    rng = random.Random(seed)
    while True:
        order = list(pool)
        rng.shuffle(order)
        yield from order


def _first_policy_value(traj: Trajectory, values: torch.Tensor) -> float:
    first = next((i for i, m in enumerate(traj.loss_mask) if m), 0)
    return float(values[first])


SAO_METRICS = ("pg_loss", "masked_frac", "ratio_p05", "ratio_p50", "ratio_p95", "ratio_max", *UPDATE_HEALTH)


@dataclass(slots=True)
class SAOStepData(StepData):
    """What SAO's rollout hook hands the later hooks: the hybrid batch's ``items`` (online, replayed,
    expert; recorded by ``after``), its ``rl`` trajectories (online and replayed) and ``expert`` ones
    (relabelled with the policy's log-probs), and ``weight_of``: each fresh online trajectory's
    staleness weight by id."""

    items: list[BatchItem] = field(default_factory=list)
    rl: list[Trajectory] = field(default_factory=list)
    expert: list[Trajectory] = field(default_factory=list)
    weight_of: dict[str, float] = field(default_factory=dict)


class SAOStage(Stage):
    """SAO on the loop: the rollout hook takes finished trajectories from the asynchronous worker,
    the critic gives GAE advantages, the update is token-level masked importance sampling, and the
    policy version moves only when the weights go to the worker (every ``rollout.sync_every`` steps
    that changed them)."""

    name = "sao"
    update_metrics = ()  # reduced in the update hook (its pg_loss is the stage's loss)
    learner_options = {"version_per_update": False}  # the version moves when the weights go to the worker
    step_data = SAOStepData

    def __init__(self, ws: Workspace, model):
        super().__init__(ws, model)
        s = self.cfg
        self.temperature = ws.contract.sampling.temperature
        self.critic = Critic(model, s.critic, ws.contract.pad_token_id, precision=ws.cfg.model.dtype)
        self.state: dict[str, Any] = {"dirty": False, "consumed": 0}
        self.gap = RewardGapWatch(ws, model)
        self.stage_dir = ws.run_dir / "sao"
        self.buffer = ReplayBuffer(self.stage_dir / "replay.sqlite", s.replay) if s.replay is not None else None
        self.demos: list[Trajectory] = []
        if s.mix["expert"] > 0:
            tasks = ws.train_tasks(s.num_demos, self.seeds("demos"))
            self.demos = ws.rollout.demonstrations(ws.env_entry.make_expert(), tasks)
        self.box = WeightBox()
        self.worker: RolloutPool | None = None
        self.t0: float | None = None
        self.consumed_here = 0
        self.replay = (
            BufferCheckpoints(self.buffer, KEEP_CHECKPOINTS, "sao", ws.console.print)
            if self.buffer is not None
            else None
        )

    def make_pool(self) -> list:
        return self.ws.train_tasks(max(self.cfg.batch_size * max(self.steps, 1), self.pool_least), self.seeds("pool"))

    def worker_for(self, b: StepBatch) -> RolloutPool:
        if self.replay is not None:
            self.replay.start()  # no checkpoint was restored: the stage starts empty
        if self.worker is None:  # started lazily: after the runner restored the weights of a resumed run
            cfg, s, r = self.ws.cfg, self.cfg, self.cfg.rollout
            self.box.publish(self.model, self.learner.version)
            pool_cls = RolloutPool
            if cfg.distributed.backend == "ray":  # rollout actors (mentorrl.distributed.ray_workers, docs/ray.md)
                from mentorrl.distributed.ray_workers import RayRolloutPool

                self.ws.close_ray_rollouts()  # a GRPO stage's actors (idle now) are this stream's: no CPUs for more
                pool_cls = functools.partial(RayRolloutPool, dist=cfg.distributed)
            w = pool_cls(
                self.model,
                self.ws.rollout,
                task_stream(self.pool, b.seeds("task-stream")),
                self.box,
                slots=r.slots,
                queue_size=r.queue_size or s.batch_size,
                seed=b.seeds("worker"),
                recompute_kv=r.recompute_kv,
                workers=r.workers,
            )
            w.start()
            self.worker, self.t0 = w, time.perf_counter()
        return self.worker

    def tasks(self, b: StepBatch) -> None:
        """The worker draws its own tasks (an endless seeded stream over the pool)."""

    def rollout(self, b: StepBatch) -> None:
        """The next ``batch_size`` finished trajectories, the staleness rule, and the hybrid batch."""
        s, r = self.cfg, self.cfg.rollout
        worker = self.worker_for(b)
        t0 = time.perf_counter()
        online = worker.get(s.batch_size, r.get_timeout_s)
        t_wait = time.perf_counter() - t0
        current = self.learner.version
        lags = [current - t.policy_version for t in online]
        weights = staleness_weights(lags, r.max_staleness, r.stale, r.staleness_decay)
        fresh = [(t, w) for t, w in zip(online, weights) if w > 0]
        items = _hybrid(s, [t for t, _ in fresh], self.demos, self.buffer, current, b.seeds.rng("hybrid"))
        rl = [it.trajectory for it in items if it.source != "expert"]
        expert = relabel_behaviour(
            self.model,
            [it.trajectory for it in items if it.source == "expert"],
            self.ws.contract.pad_token_id,
            self.temperature,
            precision=self.ws.cfg.model.dtype,
        )
        require_consistent(self.ws, rl + expert, current, f"SAO step {b.step + 1}")
        b.trajs = online
        b.data.items, b.data.rl, b.data.expert = items, rl, expert
        b.data.weight_of = {t.id: w for t, w in fresh}
        b.metrics.update(
            {
                "rollouts": float(len(online)),
                "policy_lag_hist": lag_histogram(lags),
                "stale_dropped": float(sum(w == 0 for w in weights)),
                "stale_downweighted": float(sum(0 < w < 1 for w in weights)),
                "online_items": float(len(fresh)),
                "wait_s": t_wait,
                "replay_items": float(sum(it.source == "replay" for it in items)),
                "expert_items": float(len(expert)),
            }
        )
        b.metrics.update(rollout_metrics(online))

    def score(self, b: StepBatch) -> None:
        b.metrics.update(score_outcomes(self.ws, "sao", b.step, b.trajs)[1])

    def advantages(self, b: StepBatch) -> None:
        """The critic's update and GAE advantages (stale data down-weighted), replay admission, and
        the expert items' fixed advantage."""
        s, rl, weight_of = self.cfg, b.data.rl, b.data.weight_of
        b.adv = []
        b.metrics.update(reduce_updates([], Critic.METRICS))  # 0s when no trajectory is left to fit
        if rl:
            rewards, _ = outcome_rewards(rl, self.ws.cfg.audit)
            adv, old_values, value_metrics = self.critic.step(rl, rewards, s.gae, seed=b.seeds("critic"))
            b.metrics.update(value_metrics)
            b.adv = [a * weight_of.get(t.id, 1.0) for t, a in zip(rl, adv)]  # replayed data: weight 1
            if self.buffer is not None:
                added = [
                    self.buffer.add(t, advantage=rewards[i].item() - _first_policy_value(t, old_values[i]))
                    for i, t in enumerate(rl)
                    if weight_of.get(t.id) is not None
                ]
                b.metrics["replay_admitted"] = float(sum(bool(a) for a in added))
        b.adv += [torch.tensor(t.loss_mask, dtype=torch.float32) * s.expert_advantage for t in b.data.expert]

    def update(self, b: StepBatch) -> None:
        """Masked-IS minibatches; every ``sync_every`` steps that changed the policy, a new version to the worker."""
        s, batch = self.cfg, b.data.rl + b.data.expert
        if b.step >= s.critic.warmup_steps and batch:
            b.updates += pg_update(
                self.learner,
                batch,
                b.adv,
                s.updates_per_step,
                b.seeds("minibatches"),
                kind="masked_is",
                eps_low=s.eps_low,
                eps_high=s.eps_high,
                agg=s.loss_agg,
            )
            self.state["dirty"] = True
        if (b.step + 1) % s.rollout.sync_every == 0 and self.state["dirty"]:
            self.state["dirty"] = False
            self.box.publish(self.model, self.learner.publish())
        b.metrics.update(reduce_updates(b.updates, SAO_METRICS))
        b.metrics["loss"] = b.metrics.pop("pg_loss")
        b.metrics["actor_updated"] = float(bool(b.updates))

    def after(self, b: StepBatch) -> None:
        worker, n = self.worker, len(b.trajs)
        self.state["consumed"] += n
        self.consumed_here += n
        b.metrics.update(
            trajectories_consumed=float(self.state["consumed"]),
            traj_per_s=self.consumed_here / (time.perf_counter() - self.t0),
            worker_produced=float(worker.produced),
            worker_syncs=float(worker.syncs),
            queue_depth=float(worker.out.qsize()),
        )
        if self.buffer is not None:
            b.metrics["buffer_size"] = float(len(self.buffer))
        if self.replay is not None:
            b.metrics.update(self.replay.take_metrics())  # the first step after a resume: what it dropped
        b.metrics.update(self.gap.observe(b.step, b.metrics["reward_mean"]))
        _record_batch(self.ws.run_dir, b.step + 1, b.data.items, self.cfg.sample_trajectories)

    def state_dict(self) -> dict[str, Any]:
        out = {**self.state, "gap_monitor": self.gap.state_dict(), **self.critic.state_dict()}
        if self.replay is not None:
            out.update(self.replay.state())
        return out

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        if self.replay is not None:
            self.replay.restore(saved, self.learner.version)  # the learner was restored first
        self.state.update({k: saved[k] for k in ("dirty", "consumed") if k in saved})
        self.gap.load_state_dict(saved.get("gap_monitor", {}))
        self.critic.load_state_dict(saved)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.buffer is not None:
            self.buffer.close()

    def finish(self, final: Path) -> Path:
        self.critic.save(self.stage_dir)
        return final


sao_stage = run_on_loop(SAOStage)


def _hybrid(
    s, online: list[Trajectory], demos: list[Trajectory], buffer: ReplayBuffer | None, current: int, rng: random.Random
) -> list[BatchItem]:
    """All fresh online trajectories plus replayed and expert data in the configured ratios to them.

    The replay draw happens before this step's trajectories enter the buffer, so a batch never
    holds the same trajectory twice."""
    if s.mix["expert"] <= 0 and s.mix["replay"] <= 0:
        return [BatchItem("online", t) for t in online]
    total = sum(s.mix.values())
    n = round(len(online) * total / s.mix["online"])
    items = hybrid_batch(online, demos, buffer, s.mix, n, current, rng)
    if s.segment_replay is None:
        return items
    seg = s.segment_replay  # a long replayed trajectory contributes one window of its turns
    return [
        BatchItem("replay", rng.choice(segment_replay(it.trajectory, seg.turns_per_segment, seg.min_tokens)))
        if it.source == "replay"
        else it
        for it in items
    ]


def _record_batch(run_dir: Path, step: int, items: list[BatchItem], n_samples: int) -> None:
    """Which trajectory ids step ``step`` trained on, by source, and a sample of its online trajectories.

    One file per step: a step redone after a resume overwrites its record, never appends to it."""
    consumed = run_dir / "sao" / "consumed"
    consumed.mkdir(parents=True, exist_ok=True)
    ids: dict[str, list[str]] = {"online": [], "replay": [], "expert": []}
    for it in items:
        ids[it.source].append(it.trajectory.id)
    tmp = consumed / f".step-{step:06d}.json.tmp"
    tmp.write_text(json.dumps(ids))
    tmp.replace(consumed / f"step-{step:06d}.json")
    if n_samples:
        samples = run_dir / "samples"
        samples.mkdir(exist_ok=True)
        write_jsonl(
            samples / f"sao-step-{step:06d}.jsonl", [it.trajectory for it in items if it.source == "online"][:n_samples]
        )
