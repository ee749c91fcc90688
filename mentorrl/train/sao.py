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

import json
import random
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from mentorrl.replay.buffer import BatchItem, ReplayBuffer, hybrid_batch, segment_replay
from mentorrl.rollout.runner import expert_demonstrations
from mentorrl.train.async_rl import RolloutPool, WeightBox, lag_histogram, staleness_weights
from mentorrl.train.audit import GapMonitor
from mentorrl.train.batch import collate, forward_logprobs
from mentorrl.train.consistency import policy_lag
from mentorrl.train.learner import Learner
from mentorrl.replay.checkpointing import BufferCheckpoints
from mentorrl.train.rundir import KEEP_CHECKPOINTS
from mentorrl.train.stages import (
    TRAIN_POOL_SEED_OFFSET,
    Critic,
    Workspace,
    _gap_check,
    _minibatches,
    _reduce_updates,
    _require_consistent,
    _reward_debugger,
    outcome_rewards,
    rollout_metrics,
    run_stage,
)
from mentorrl.trajectory import Trajectory, write_jsonl

SAO_POOL_SEED_OFFSET = 6007


def task_stream(pool: list, seed: int) -> Iterator:
    """Endless task order: the pool reshuffled every epoch with a seeded RNG."""
    rng = random.Random(seed)
    while True:
        order = list(pool)
        rng.shuffle(order)
        yield from order


@torch.no_grad()
def relabel_behaviour(model, trajs: list[Trajectory], pad_id: int, temperature: float) -> list[Trajectory]:
    """Copies of ``trajs`` whose behaviour log-probs are the current policy's (for off-policy demonstrations)."""
    if not trajs:
        return []
    device = next(model.parameters()).device
    lp = forward_logprobs(model, collate(trajs, pad_id).to(device), temperature)[0].cpu()
    return [t.model_copy(update={"logprobs": [float(x) if m else 0.0 for x, m in zip(lp[b, : len(t.token_ids)].tolist(),
                                                                                     t.loss_mask)]})
            for b, t in enumerate(trajs)]


def _first_policy_value(traj: Trajectory, values: torch.Tensor) -> float:
    first = next((i for i, m in enumerate(traj.loss_mask) if m), 0)
    return float(values[first])


def sao_stage(ws: Workspace, model, resume: bool = False) -> Path:
    cfg, s, audit = ws.cfg, ws.cfg.sao, ws.cfg.audit
    r = s.rollout
    pool = ws.train_tasks(max(s.batch_size * max(s.steps, 1), 64), cfg.seed + TRAIN_POOL_SEED_OFFSET)
    temperature = ws.contract.sampling.temperature
    learner = Learner(model, s.optim, ws.contract.pad_token_id, temperature)
    critic = Critic(model, s.critic, ws.contract.pad_token_id)
    state: dict[str, Any] = {"policy": 0, "dirty": False, "consumed": 0}
    monitor = GapMonitor(audit.reward_window, audit.reward_rise, audit.success_rise)
    stage_dir = ws.run_dir / "sao"
    buffer = ReplayBuffer(stage_dir / "replay.sqlite", s.replay) if s.replay is not None else None
    demos: list[Trajectory] = []
    if s.mix["expert"] > 0:
        tasks = ws.train_tasks(s.num_demos, cfg.seed + SAO_POOL_SEED_OFFSET)
        demos = expert_demonstrations(ws.contract, ws.make_env, ws.env_entry.make_expert(), tasks, weights=cfg.reward)
    box = WeightBox()
    run: dict[str, Any] = {"worker": None, "t0": None, "consumed_here": 0}
    replay = BufferCheckpoints(buffer, KEEP_CHECKPOINTS, "sao", ws.console.print) if buffer is not None else None

    def worker_for(step: int) -> RolloutPool:
        if replay is not None:
            replay.start()  # no checkpoint was restored: the stage starts empty
        if run["worker"] is None:  # started lazily: after run_stage restored the weights of a resumed run
            box.publish(model, state["policy"])
            w = RolloutPool(model, ws.contract, ws.make_env, task_stream(pool, cfg.seed * 7_919 + step), box,
                            slots=r.slots, queue_size=r.queue_size or s.batch_size, seed=cfg.seed * 104_729 + step,
                            weights=cfg.reward, recompute_kv=r.recompute_kv, workers=r.workers)
            w.start()
            run["worker"], run["t0"] = w, time.perf_counter()
        return run["worker"]

    def step_fn(step: int) -> dict[str, float]:
        worker = worker_for(step)
        t0 = time.perf_counter()
        online = worker.get(s.batch_size, r.get_timeout_s)
        t_wait = time.perf_counter() - t0
        current = state["policy"]
        lags = [current - t.policy_version for t in online]
        weights = staleness_weights(lags, r.max_staleness, r.stale, r.staleness_decay)
        fresh = [(t, w) for t, w in zip(online, weights) if w > 0]
        rng = random.Random(cfg.seed * 1_000_003 + 31 * step + 7)
        items = _hybrid(s, [t for t, _ in fresh], demos, buffer, current, rng)
        weight_of = {t.id: w for t, w in fresh}
        rl = [it.trajectory for it in items if it.source != "expert"]
        expert = relabel_behaviour(model, [it.trajectory for it in items if it.source == "expert"],
                                   ws.contract.pad_token_id, temperature)
        batch = rl + expert
        _require_consistent(ws, batch, current, f"SAO step {step + 1}")

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
        metrics.update(_reward_debugger(online, audit.flag_reward, ws.run_dir / "audit" / f"flagged-sao-step-{step + 1:06d}.jsonl"))

        t1 = time.perf_counter()
        am: list[dict[str, float]] = []
        token_adv: list[torch.Tensor] = []
        metrics.update(_reduce_updates([], Critic.METRICS))  # 0s when no trajectory is left to fit
        if rl:
            rewards, _ = outcome_rewards(rl, audit)
            adv, old_values, value_metrics = critic.step(rl, rewards, s.gae, seed=step * 7 + 1)
            metrics.update(value_metrics)
            token_adv = [a * weight_of.get(t.id, 1.0) for t, a in zip(rl, adv)]  # replayed data: weight 1
            if buffer is not None:
                added = [buffer.add(t, advantage=rewards[i].item() - _first_policy_value(t, old_values[i]))
                         for i, t in enumerate(rl) if weight_of.get(t.id) is not None]
                metrics["replay_admitted"] = float(sum(bool(a) for a in added))
        token_adv += [torch.tensor(t.loss_mask, dtype=torch.float32) * s.expert_advantage for t in expert]
        if step >= s.critic.warmup_steps and batch:
            for idx in _minibatches(list(range(len(batch))), s.updates_per_step, seed=step * 7 + 2):
                part = [batch[i] for i in idx]
                am.append({**learner.token_policy_step(part, [token_adv[i] for i in idx], "masked_is",
                                                       eps_low=s.eps_low, eps_high=s.eps_high, agg=s.loss_agg),
                           **policy_lag(part, current)})
            state["dirty"] = True
        if (step + 1) % r.sync_every == 0 and state["dirty"]:
            state["policy"] += 1
            state["dirty"] = False
            box.publish(model, state["policy"])
        metrics.update(_reduce_updates(am, ("pg_loss", "masked_frac", "ratio_p05", "ratio_p50", "ratio_p95", "ratio_max",
                                            "entropy", "grad_norm", "approx_kl", "logprob_abs_gap", "train_rollout_kl",
                                            "policy_lag_mean", "policy_lag_max")))
        metrics["loss"] = metrics.pop("pg_loss")
        state["consumed"] += len(online)
        run["consumed_here"] += len(online)
        elapsed = time.perf_counter() - run["t0"]
        metrics.update(actor_updated=float(bool(am)), policy_version=float(state["policy"]), update_s=time.perf_counter() - t1,
                       trajectories_consumed=float(state["consumed"]), traj_per_s=run["consumed_here"] / elapsed,
                       worker_produced=float(worker.produced), worker_syncs=float(worker.syncs),
                       queue_depth=float(worker.out.qsize()))
        if buffer is not None:
            metrics["buffer_size"] = float(len(buffer))
        monitor.observe_reward(step + 1, metrics["reward_mean"])
        if audit.eval_every and (step + 1) % audit.eval_every == 0:
            metrics.update(_gap_check(ws, model, monitor, step + 1))
        _record_batch(ws.run_dir, step + 1, items, s.sample_trajectories)
        return metrics

    def extra_state() -> dict[str, Any]:
        out = {**state, "gap_monitor": monitor.state_dict(), **critic.state_dict()}
        if replay is not None:
            out.update(replay.state())
        return out

    def restore(saved: dict[str, Any]) -> None:
        if replay is not None:
            replay.restore(saved)
        state.update({k: saved[k] for k in ("policy", "dirty", "consumed") if k in saved})
        monitor.load_state_dict(saved.get("gap_monitor", {}))
        critic.load_state_dict(saved)

    try:
        final = run_stage(ws, "sao", model, learner, s.steps, step_fn, s.checkpoint_every, resume,
                          extra_state=extra_state, restore_extra=restore)
    finally:
        if run["worker"] is not None:
            run["worker"].close()
        if buffer is not None:
            buffer.close()
    critic.save(stage_dir)
    return final


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
