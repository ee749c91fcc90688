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
restored learner) are gone and entries they evicted are back; a stage that starts from step 0
starts from an empty buffer. A buffer file that was replaced raises :class:`ReplayBufferError`
naming it. The per-step records (``metrics.jsonl``, ``samples/sao-step-N.jsonl``,
``sao/consumed/step-N.json``) are rewritten when a step is redone. Trajectories in flight when
the run died are simply lost; the resumed worker starts new ones.
"""

from __future__ import annotations

import functools
import json
import random
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from mentorrl.replay.buffer import BatchItem, ReplayBuffer, hybrid_batch, segment_replay
from mentorrl.train.async_rl import RolloutPool, WeightBox, lag_histogram, staleness_weights
from mentorrl.train.audit import GapMonitor
from mentorrl.train.learner import Learner
from mentorrl.replay.checkpointing import BufferCheckpoints
from mentorrl.train.rundir import KEEP_CHECKPOINTS
from mentorrl.train.critic import Critic
from mentorrl.train.loop import (
    gap_check,
    outcome_rewards,
    pg_update,
    relabel_behaviour,
    reduce_updates,
    require_consistent,
    reward_debugger,
    rollout_metrics,
    train_pool,
)
from mentorrl.train.registry import register_stage
from mentorrl.train.stage_runner import run_stage
from mentorrl.train.workspace import Workspace
from mentorrl.trajectory import Trajectory, write_jsonl

SAO_POOL_SEED_OFFSET = 6007


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


@register_stage("sao", config="sao", title="SAO: asynchronous single-rollout optimisation", label="SAO", rl=True)
def sao_stage(ws: Workspace, model, resume: bool = False) -> Path:
    run = SAORun(ws, model)
    try:
        final = run_stage(ws, "sao", model, run.learner, ws.cfg.sao.steps, run.step, ws.cfg.sao.checkpoint_every,
                          resume, extra_state=run.extra_state, restore_extra=run.restore)
    finally:
        if run.worker is not None:
            run.worker.close()
        if run.buffer is not None:
            run.buffer.close()
    run.critic.save(run.stage_dir)
    return final


SAO_METRICS = ("pg_loss", "masked_frac", "ratio_p05", "ratio_p50", "ratio_p95", "ratio_max", "entropy", "grad_norm",
               "approx_kl", "logprob_abs_gap", "train_rollout_kl", "policy_lag_mean", "policy_lag_max")


class SAORun:
    """The SAO stage's state (learner, critic, replay buffer, rollout worker) and its learner step."""

    def __init__(self, ws: Workspace, model):
        cfg, s, audit = ws.cfg, ws.cfg.sao, ws.cfg.audit
        self.ws, self.model, self.s = ws, model, s
        self.pool = train_pool(ws, s.batch_size, s.steps)
        self.temperature = ws.contract.sampling.temperature
        self.learner = Learner(model, s.optim, ws.contract.pad_token_id, self.temperature)
        self.critic = Critic(model, s.critic, ws.contract.pad_token_id)
        self.state: dict[str, Any] = {"policy": 0, "dirty": False, "consumed": 0}
        self.monitor = GapMonitor(audit.reward_window, audit.reward_rise, audit.success_rise)
        self.stage_dir = ws.run_dir / "sao"
        self.buffer = ReplayBuffer(self.stage_dir / "replay.sqlite", s.replay) if s.replay is not None else None
        self.demos: list[Trajectory] = []
        if s.mix["expert"] > 0:
            tasks = ws.train_tasks(s.num_demos, cfg.seed + SAO_POOL_SEED_OFFSET)
            self.demos = ws.rollout.demonstrations(ws.env_entry.make_expert(), tasks)
        self.box = WeightBox()
        self.worker: RolloutPool | None = None
        self.t0: float | None = None
        self.consumed_here = 0
        self.replay = BufferCheckpoints(self.buffer, KEEP_CHECKPOINTS, "sao", ws.console.print) \
            if self.buffer is not None else None

    def worker_for(self, step: int) -> RolloutPool:
        if self.replay is not None:
            self.replay.start()  # no checkpoint was restored: the stage starts empty
        if self.worker is None:  # started lazily: after run_stage restored the weights of a resumed run
            cfg, s, r = self.ws.cfg, self.s, self.s.rollout
            self.box.publish(self.model, self.state["policy"])
            pool_cls = RolloutPool
            if cfg.distributed.backend == "ray":  # rollout actors (mentorrl.distributed.ray_workers, docs/ray.md)
                from mentorrl.distributed.ray_workers import RayRolloutPool
                self.ws.close_ray_rollouts()  # a GRPO stage's actors (idle now) are this stream's: no CPUs for more
                pool_cls = functools.partial(RayRolloutPool, dist=cfg.distributed)
            w = pool_cls(self.model, self.ws.rollout, task_stream(self.pool, cfg.seed * 7_919 + step),
                            self.box, slots=r.slots, queue_size=r.queue_size or s.batch_size,
                            seed=cfg.seed * 104_729 + step, recompute_kv=r.recompute_kv, workers=r.workers)
            w.start()
            self.worker, self.t0 = w, time.perf_counter()
        return self.worker

    def step(self, step: int) -> dict[str, float]:
        ws, cfg, s, r, audit = self.ws, self.ws.cfg, self.s, self.s.rollout, self.ws.cfg.audit
        worker = self.worker_for(step)
        t0 = time.perf_counter()
        online = worker.get(s.batch_size, r.get_timeout_s)
        t_wait = time.perf_counter() - t0
        current = self.state["policy"]
        lags = [current - t.policy_version for t in online]
        weights = staleness_weights(lags, r.max_staleness, r.stale, r.staleness_decay)
        fresh = [(t, w) for t, w in zip(online, weights) if w > 0]
        rng = random.Random(cfg.seed * 1_000_003 + 31 * step + 7)
        items = _hybrid(s, [t for t, _ in fresh], self.demos, self.buffer, current, rng)
        rl = [it.trajectory for it in items if it.source != "expert"]
        expert = relabel_behaviour(self.model, [it.trajectory for it in items if it.source == "expert"],
                                   ws.contract.pad_token_id, self.temperature)
        require_consistent(ws, rl + expert, current, f"SAO step {step + 1}")
        metrics: dict[str, float | dict] = {"rollouts": float(len(online)), "policy_lag_hist": lag_histogram(lags),
                                            "stale_dropped": float(sum(w == 0 for w in weights)),
                                            "stale_downweighted": float(sum(0 < w < 1 for w in weights)),
                                            "online_items": float(len(fresh)), "wait_s": t_wait,
                                            "replay_items": float(sum(it.source == "replay" for it in items)),
                                            "expert_items": float(len(expert))}
        metrics.update(rollout_metrics(online))
        rewards_online, clipped = outcome_rewards(online, audit)
        metrics.update(reward_mean=rewards_online.mean().item(),
                       reward_std=rewards_online.std().item() if len(online) > 1 else 0.0,
                       reward_clipped=clipped["clipped"])
        metrics.update(reward_debugger(online, audit.flag_reward,
                                       ws.run_dir / "audit" / f"flagged-sao-step-{step + 1:06d}.jsonl"))
        t1 = time.perf_counter()
        self._learn(step, rl, expert, {t.id: w for t, w in fresh}, metrics)
        self.state["consumed"] += len(online)
        self.consumed_here += len(online)
        elapsed = time.perf_counter() - self.t0
        metrics.update(policy_version=float(self.state["policy"]), update_s=time.perf_counter() - t1,
                       trajectories_consumed=float(self.state["consumed"]), traj_per_s=self.consumed_here / elapsed,
                       worker_produced=float(worker.produced), worker_syncs=float(worker.syncs),
                       queue_depth=float(worker.out.qsize()))
        if self.buffer is not None:
            metrics["buffer_size"] = float(len(self.buffer))
        self.monitor.observe_reward(step + 1, metrics["reward_mean"])
        if audit.eval_every and (step + 1) % audit.eval_every == 0:
            metrics.update(gap_check(ws, self.model, self.monitor, step + 1))
        _record_batch(ws.run_dir, step + 1, items, s.sample_trajectories)
        return metrics

    def _learn(self, step: int, rl: list[Trajectory], expert: list[Trajectory], weight_of: dict[str, float],
               metrics: dict) -> None:
        """The critic's update and GAE advantages, replay admission, the masked-IS policy minibatches and,
        every ``sync_every`` steps that changed the policy, the weight sync to the worker."""
        s, audit = self.s, self.ws.cfg.audit
        batch = rl + expert
        token_adv: list[torch.Tensor] = []
        metrics.update(reduce_updates([], Critic.METRICS))  # 0s when no trajectory is left to fit
        if rl:
            rewards, _ = outcome_rewards(rl, audit)
            adv, old_values, value_metrics = self.critic.step(rl, rewards, s.gae, seed=step * 7 + 1)
            metrics.update(value_metrics)
            token_adv = [a * weight_of.get(t.id, 1.0) for t, a in zip(rl, adv)]  # replayed data: weight 1
            if self.buffer is not None:
                added = [self.buffer.add(t, advantage=rewards[i].item() - _first_policy_value(t, old_values[i]))
                         for i, t in enumerate(rl) if weight_of.get(t.id) is not None]
                metrics["replay_admitted"] = float(sum(bool(a) for a in added))
        token_adv += [torch.tensor(t.loss_mask, dtype=torch.float32) * s.expert_advantage for t in expert]
        am: list[dict[str, float]] = []
        if step >= s.critic.warmup_steps and batch:
            am = pg_update(self.learner, batch, token_adv, s.updates_per_step, step * 7 + 2, self.state,
                           kind="masked_is", bump=False, eps_low=s.eps_low, eps_high=s.eps_high, agg=s.loss_agg,
                           sync=self.ws.rollout.sync)
            self.state["dirty"] = True
        if (step + 1) % s.rollout.sync_every == 0 and self.state["dirty"]:
            self.state["policy"] += 1
            self.state["dirty"] = False
            self.box.publish(self.model, self.state["policy"])
        metrics.update(reduce_updates(am, SAO_METRICS))
        metrics["loss"] = metrics.pop("pg_loss")
        metrics["actor_updated"] = float(bool(am))

    def extra_state(self) -> dict[str, Any]:
        out = {**self.state, "gap_monitor": self.monitor.state_dict(), **self.critic.state_dict()}
        if self.replay is not None:
            out.update(self.replay.state())
        return out

    def restore(self, saved: dict[str, Any]) -> None:
        if self.replay is not None:
            self.replay.restore(saved)
        self.state.update({k: saved[k] for k in ("policy", "dirty", "consumed") if k in saved})
        self.monitor.load_state_dict(saved.get("gap_monitor", {}))
        self.critic.load_state_dict(saved)


def _hybrid(s, online: list[Trajectory], demos: list[Trajectory], buffer: ReplayBuffer | None, current: int,
            rng: random.Random) -> list[BatchItem]:
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
    return [BatchItem("replay", rng.choice(segment_replay(it.trajectory, seg.turns_per_segment, seg.min_tokens)))
            if it.source == "replay" else it for it in items]


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
        write_jsonl(samples / f"sao-step-{step:06d}.jsonl", [it.trajectory for it in items if it.source == "online"][:n_samples])
