"""Training stages (SFT, GRPO) and evaluation, composed from rollout, rewards, algos and the learner.

Every stage is resumable: batches and task samples are a pure function of (seed, step), the
weights, optimiser and RNG state come back from the latest intact checkpoint (complete, its
checksums verified, loadable; a damaged one is named, moved aside and the one before it used), and
``metrics.jsonl`` is cut back to that step, so a resumed run continues the same step
count and the same metrics file.

Under a data-parallel launch (``ws.dp``, see :mod:`mentorrl.train.distributed`) the SFT and GRPO
learners train on each rank's share of the batch, GRPO rollouts are split over the ranks and
gathered, and only rank 0 writes (metrics, checkpoints, final weights, samples, audits).
"""

from __future__ import annotations

import copy
import json
import os
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from mentorrl.algos.advantages import (
    adaptive_gae_lambda,
    gae_advantages,
    get_advantage_estimator,
    group_reward_stats,
    outcome_token_rewards,
    sanitize_group_rewards,
)
from mentorrl.config import RunConfig, dump_config
from mentorrl.contract import CHAT_TEMPLATE, RolloutContract, contract_for_env
from mentorrl.envs import EnvEntry, get_env
from mentorrl.eval.metrics import summarize
from mentorrl.eval.sets import assert_trainable, assert_trainable_splits
from mentorrl.rollout.runner import expert_demonstrations, rollout_tasks
from mentorrl.flywheel.hard_pool import HardTaskPool
from mentorrl.train.audit import GapMonitor, flag_high_reward_failures
from mentorrl.train.consistency import batch_checks, policy_lag
from mentorrl.models.value import build_critic
from mentorrl.train.learner import CriticLearner, Learner, pad_token_values
from mentorrl.train.rundir import (
    KEEP_CHECKPOINTS,
    CorruptCheckpointError,
    MetricsLog,
    load_trainer_state,
    prune_checkpoints,
    restore_checkpoint,
    save_checkpoint,
    verify_manifest,
    write_manifest,
)
from mentorrl.train.rft import rft_round_stats, rising, select_rft_data, task_outcomes
from mentorrl.trajectory import Trajectory, read_jsonl, write_jsonl

TRAIN_POOL_SEED_OFFSET = 7919
RFT_POOL_SEED_OFFSET = 4099


@dataclass
class Workspace:
    """What every stage needs: config, run directory, environment, tokenizer and contract."""

    cfg: RunConfig
    run_dir: Path
    env_entry: EnvEntry
    tokenizer: Any = None
    contract: RolloutContract | None = None
    console: Console = field(default_factory=Console)
    show_progress: bool = True
    dp: Any = None  # the DataParallel group of a torchrun launch (mentorrl.train.distributed), or None

    @property
    def is_main(self) -> bool:
        """Whether this process writes: always in one process, rank 0 only under data parallel."""
        return self.dp is None or self.dp.is_main

    def on_main(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` run by the writing process only, its result returned on every rank."""
        return fn() if self.dp is None else self.dp.on_main(fn)

    @property
    def metrics(self) -> MetricsLog:
        return MetricsLog(self.run_dir / "metrics.jsonl")

    def make_env(self):
        extra = {"latency": self.cfg.env.latency} if self.cfg.env.latency is not None else {}
        return self.env_entry.make_env(tool_timeout_s=self.cfg.env.tool_timeout_s, **extra)

    def bind_tokenizer(self, tokenizer) -> None:
        """Use ``tokenizer`` for the run; its chat template becomes the contract's
        (:data:`mentorrl.contract.CHAT_TEMPLATE`), so every checkpoint the run saves renders
        conversations with ``apply_chat_template`` as the policy was trained on them."""
        tokenizer.chat_template = CHAT_TEMPLATE
        self.tokenizer = tokenizer
        env = self.make_env()
        try:
            self.contract = contract_for_env(tokenizer, env, self.cfg.sampling, self.cfg.limits, self.cfg.prompt)
        finally:
            env.close()

    def tasks(self, split: str, n: int, seed: int):
        return self.env_entry.make_tasks().tasks(split=split, n=n, seed=seed)

    def train_tasks(self, n: int, seed: int):
        """Tasks for a training stage, from ``cfg.train_split``; refuses the hidden evaluation set."""
        assert_trainable_splits([self.cfg.train_split])
        tasks = self.tasks(self.cfg.train_split, n, seed)
        assert_trainable(tasks)
        return tasks

    def progress(self):
        if not self.show_progress:
            return nullcontext(None)
        return Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            console=self.console,
            transient=False,
        )


def open_workspace(cfg: RunConfig, show_progress: bool = True, dp=None) -> Workspace:
    """The run's workspace; with ``dp`` (a data-parallel rank) only rank 0 writes and shows progress."""
    run_dir = Path(cfg.run_dir)
    main = dp is None or dp.is_main
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_config(cfg))
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    return Workspace(cfg=cfg, run_dir=run_dir, env_entry=get_env(cfg.env.name), show_progress=show_progress and main,
                     console=Console() if main else Console(quiet=True), dp=dp)


def frozen_copy(model):
    """A copy of ``model`` in eval mode with no gradients: a reference policy fixed at a stage's start."""
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def _load_weights_into(model, ckpt: Path) -> None:
    from transformers import AutoModelForCausalLM

    src = AutoModelForCausalLM.from_pretrained(ckpt, dtype=next(model.parameters()).dtype)
    model.load_state_dict(src.state_dict())


def run_stage(
    ws: Workspace,
    stage: str,
    model,
    learner: Learner,
    steps: int,
    step_fn: Callable[[int], dict[str, float]],
    checkpoint_every: int,
    resume: bool,
    extra_state: Callable[[], dict[str, Any]] | None = None,
    restore_extra: Callable[[dict[str, Any]], None] | None = None,
) -> Path:
    """Run ``step_fn`` for steps [start, steps), checkpointing; returns the stage's final weights dir.

    A step whose metrics hold ``stop: True`` ends the stage early (after checkpointing it).
    Under data parallel, rank 0 alone decides where to resume (it may move a damaged checkpoint
    aside) and writes; the other ranks load what it chose and wait for its final weights."""
    stage_dir = ws.run_dir / stage
    final = stage_dir / "final"
    where, start = None, 0
    if resume and ws.dp is not None:
        where, start = ws.on_main(lambda: _resume_point(ws, stage, model, learner, steps, restore_extra))
        if not ws.is_main and where is not None:  # load what rank 0 chose (it may have moved a bad one aside)
            _load_weights_into(model, where)
            if where != final:
                state = load_trainer_state(where)
                learner.load_state_dict(state["learner"])
                if restore_extra is not None:
                    restore_extra(state.get("extra", {}))
    elif resume:
        where, start = _resume_point(ws, stage, model, learner, steps, restore_extra)
    if where == final:
        return final
    ws.on_main(lambda: ws.metrics.truncate_after(stage, start))  # steps past the checkpoint are redone, never logged twice

    def record(rec: dict[str, Any], save: bool) -> None:
        """The step's metrics record and, when due, its checkpoint (rank 0 only: the caller's on_main)."""
        ws.metrics.log(rec)
        if save:
            state = {"learner": learner.state_dict(), "extra": extra_state() if extra_state else {}}
            save_checkpoint(stage_dir, rec["step"], model, ws.tokenizer, state)
            prune_checkpoints(stage_dir, keep=KEEP_CHECKPOINTS)

    with ws.progress() as prog:
        bar = prog.add_task(stage, total=steps, completed=start, info="") if prog else None
        for step in range(start, steps):
            t0, c0 = time.perf_counter(), time.process_time()
            m = step_fn(step)
            stop = bool(m.pop("stop", False))
            rec = {"stage": stage, "step": step + 1, **m, **step_timing(m, time.perf_counter() - t0, time.process_time() - c0)}
            save = stop or (step + 1) % checkpoint_every == 0 or step + 1 == steps
            ws.on_main(lambda: record(rec, save))  # under data parallel the others wait, and see a failure
            if prog:
                info = " ".join(f"{k}={m[k]:.3f}" for k in ("loss", "reward_mean", "task_success", "positive_task_rate") if k in m)
                prog.update(bar, advance=1, info=info)
            if stop:
                break
    ws.on_main(lambda: _save_final(ws, model, final, steps))
    return final


def _resume_point(ws: Workspace, stage: str, model, learner: Learner, steps: int,
                  restore_extra: Callable[[dict[str, Any]], None] | None) -> tuple[Path | None, int]:
    """Load what ``--resume`` continues from into ``model`` / ``learner`` and return it with the step
    to start at: the stage's final dir when it is complete, else its newest intact checkpoint,
    else ``(None, 0)``."""
    final = ws.run_dir / stage / "final"
    stage_dir = final.parent
    warn = lambda msg: ws.console.print(f"[red]{stage}: {escape(msg)}[/red]")  # noqa: E731
    if (final / "DONE").exists():
        try:
            verify_manifest(final)
            _load_weights_into(model, final)
            ws.console.print(f"[dim]{stage}: already complete, loaded {final}[/dim]")
            return final, steps
        except Exception as e:  # a damaged final dir: rewritten from the last checkpoint (the same weights)
            warn(f"final weights are not intact ({e}); rewriting them from the last checkpoint")
            if restore_checkpoint(stage_dir, lambda c: _load_weights_into(model, c), warn) is None:
                raise CorruptCheckpointError(final, f"damaged and no checkpoint to rebuild it from ({e})") from e
            _save_final(ws, model, final, steps)
            return final, steps
    restored = restore_checkpoint(stage_dir, lambda c: _load_weights_into(model, c), warn)
    if restored is None:
        return None, 0
    ckpt, state = restored
    learner.load_state_dict(state["learner"])
    if restore_extra is not None:
        restore_extra(state.get("extra", {}))
    ws.console.print(f"[yellow]{stage}: resuming from {ckpt.name} (step {state['step']}/{steps})[/yellow]")
    return ckpt, int(state["step"])


def cpu_cores() -> int:
    """Cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def step_timing(m: dict[str, Any], step_s: float, cpu_s: float) -> dict[str, float]:
    """A step's wall and CPU time for ``metrics.jsonl``: ``step_s``; ``cpu_s`` (this process's CPU
    seconds, all threads); ``cpu_cores``; ``cpu_util`` = cpu_s / (step_s x cpu_cores), the share of
    the cores the step kept busy; and, for a stage that times its rollout but not its update,
    ``update_s`` = the rest of the step."""
    cores = cpu_cores()
    out = {"step_s": step_s, "cpu_s": cpu_s, "cpu_cores": float(cores), "cpu_util": cpu_s / max(step_s, 1e-9) / cores}
    if "rollout_s" in m and "update_s" not in m:
        out["update_s"] = max(0.0, step_s - m["rollout_s"])
    return out


def _save_final(ws: Workspace, model, final: Path, steps: int) -> None:
    """The stage's last weights as a plain HF directory, with its checksum manifest, then ``DONE``."""
    final.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(final, safe_serialization=True)
    ws.tokenizer.save_pretrained(final)
    write_manifest(final)
    (final / "DONE").write_text(json.dumps({"steps": steps}))


# ---------------------------------------------------------------- SFT -----
def sft_stage(ws: Workspace, model, resume: bool = False) -> Path:
    cfg = ws.cfg
    tasks = ws.train_tasks(cfg.sft.num_demos, cfg.seed)
    demos = expert_demonstrations(ws.contract, ws.make_env, ws.env_entry.make_expert(), tasks, weights=cfg.reward)
    if not demos:
        raise RuntimeError("the scripted expert produced no verified demonstrations")
    learner = Learner(model, cfg.sft.optim, ws.contract.pad_token_id, ws.contract.sampling.temperature, dp=ws.dp)

    def step_fn(step: int) -> dict[str, float]:
        rng = random.Random(cfg.seed * 1_000_003 + step)
        batch = [demos[i] for i in rng.sample(range(len(demos)), min(cfg.sft.batch_size, len(demos)))]
        return learner.sft_step(batch, agg=cfg.sft.loss_agg)

    return run_stage(ws, "sft", model, learner, cfg.sft.steps, step_fn, checkpoint_every=cfg.sft.checkpoint_every,
                     resume=resume)


# ---------------------------------------------------------------- RFT -----
def rft_stage(ws: Workspace, model, resume: bool = False) -> Path:
    """Rejection-sampling fine-tuning rounds (see :mod:`mentorrl.train.rft`); one round per step.

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
        trajs = rollout_tasks(model, ws.contract, ws.make_env, grouped, seed=cfg.seed * 9_973 + 101 * step,
                              batch_size=r.rollout_batch, weights=cfg.reward)
        stats = rft_round_stats(task_outcomes(trajs))
        rate = stats["positive_task_rate"]
        state["history"] = state["history"][:step] + [rate]
        m: dict[str, float] = {**stats, "rollouts": len(trajs), "rollout_s": time.perf_counter() - t0}
        if rate > state["best_rate"]:  # the weights that sampled this round are the best so far
            state["best_rate"] = rate
            model.save_pretrained(best_dir, safe_serialization=True)
        if not rising(state["history"], r.min_gain):
            if rate < state["best_rate"]:
                _load_weights_into(model, best_dir)
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


# --------------------------------------------------------------- GRPO -----
FINISH_REASONS = ("answer", "max_turns", "max_tokens", "length")


def rollout_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """What one step's rollouts did, for ``metrics.jsonl``: success, tool calls per trajectory
    (well-formed ones, whatever the tool answered), the malformed-call rate (turns with unparsable
    tool-call tags, over all call attempts), the share of each finish reason (``finish_answer``,
    ``finish_max_turns``: turn limit, ``finish_max_tokens``: context budget, ``finish_length``:
    a turn cut at ``max_new_tokens``), turns and policy tokens."""
    s = summarize(trajs)
    n = len(trajs)
    calls = [c for t in trajs for c in t.tool_calls]
    malformed = sum(c.error_kind == "malformed" for c in calls)
    out = {
        "task_success": s["success"],
        "tool_success": s["tool_success"],
        "mean_turns": s["mean_turns"],
        "violation_rate": s["violation_rate"],
        "mean_policy_tokens": s["mean_policy_tokens"],
        "rollout_tokens": float(sum(t.num_policy_tokens for t in trajs)),  # policy tokens the student generated
        "tool_calls_per_traj": (len(calls) - malformed) / n if n else 0.0,
        "malformed_call_rate": malformed / len(calls) if calls else 0.0,
    }
    out.update({f"finish_{r}": (sum(t.finish_reason == r for t in trajs) / n if n else 0.0) for r in FINISH_REASONS})
    return out


def grpo_stage(ws: Workspace, model, ref_model=None, resume: bool = False) -> Path:
    cfg, g, audit = ws.cfg, ws.cfg.grpo, ws.cfg.audit
    pool = ws.train_tasks(max(g.tasks_per_step * max(g.steps, 1), 64), cfg.seed + TRAIN_POOL_SEED_OFFSET)
    learner = Learner(model, g.optim, ws.contract.pad_token_id, ws.contract.sampling.temperature, dp=ws.dp)
    estimator = get_advantage_estimator(g.advantage)
    version = {"policy": 0}
    monitor = GapMonitor(audit.reward_window, audit.reward_rise, audit.success_rise)
    samples_dir, audit_dir = ws.run_dir / "samples", ws.run_dir / "audit"
    hard = _hard_pool(g)

    def step_fn(step: int) -> dict[str, float]:
        rng = random.Random(cfg.seed * 1_000_003 + 17 * step + 1)
        n_tasks = min(g.tasks_per_step, len(pool))
        chosen = hard.sample(pool, n_tasks, rng) if hard is not None else rng.sample(pool, n_tasks)
        hard_in_batch = sum(t.id in hard for t in chosen) if hard is not None else 0
        grouped = [t for t in chosen for _ in range(g.group_size)]
        t0, c0 = time.perf_counter(), time.process_time()
        trajs = _rollout_shared(ws, model, grouped, version["policy"], cfg.seed * 7_777 + step)
        t_roll = time.perf_counter() - t0
        rollout_cpu = time.process_time() - c0
        raw = torch.tensor([t.reward.total for t in trajs], dtype=torch.float32).view(len(chosen), g.group_size)
        rewards, clipped = sanitize_group_rewards(raw, audit.reward_low, audit.reward_high, audit.outlier_z)
        adv = estimator(rewards, normalize_std=g.normalize_std).reshape(-1)
        metrics: dict[str, float] = {f"reward_{k}": v for k, v in group_reward_stats(rewards).items()}
        metrics.update({f"reward_{k}": v for k, v in clipped.items()})
        metrics.update(rollout_metrics(trajs), rollouts=len(trajs))
        metrics.update(ws.on_main(lambda: _reward_debugger(trajs, audit.flag_reward,
                                                           audit_dir / f"flagged-grpo-step-{step + 1:06d}.jsonl")))
        # Zero-advantage trajectories give exactly zero policy gradient; without a KL term, skip them.
        keep = [i for i in range(len(trajs)) if g.kl_coef > 0 or adv[i].abs() > 1e-8]
        update_metrics: list[dict[str, float]] = []
        t1 = time.perf_counter()
        _require_consistent(ws, trajs, version["policy"], f"GRPO step {step + 1}")
        if keep:
            for idx in _minibatches(keep, g.updates_per_step, seed=step):
                batch = [trajs[i] for i in idx]
                update_metrics.append({
                    **learner.policy_step(
                        batch, adv[idx], "grpo", ref_model=ref_model if g.kl_coef > 0 else None,
                        kl_coef=g.kl_coef, eps_low=g.eps_low, eps_high=g.eps_high, agg=g.loss_agg,
                    ),
                    **policy_lag(batch, version["policy"]),
                })
                version["policy"] += 1
        metrics.update(_reduce_updates(update_metrics, ("loss", "kl", "clip_frac", "entropy", "grad_norm", "ratio_max",
                                                        "approx_kl", "logprob_abs_gap", "train_rollout_kl",
                                                        "policy_lag_mean", "policy_lag_max")))
        metrics.update(trained_trajectories=len(keep), policy_version=version["policy"],
                       rollout_s=t_roll, update_s=time.perf_counter() - t1,
                       rollout_cpu_util=rollout_cpu / max(t_roll, 1e-9) / cpu_cores())
        if hard is not None:
            hard.update(trajs)
            metrics.update(hard_tasks_in_batch=float(hard_in_batch), hard_pool_size=float(len(hard)))
        monitor.observe_reward(step + 1, metrics["reward_mean"])
        if audit.eval_every and (step + 1) % audit.eval_every == 0:
            gap = ws.on_main(lambda: (_gap_check(ws, model, monitor, step + 1), monitor.state_dict()))
            metrics.update(gap[0])
            monitor.load_state_dict(gap[1])  # every rank keeps the same monitor (it is checkpointed)
        if g.sample_trajectories and ws.is_main:
            samples_dir.mkdir(exist_ok=True)  # one file per step: a redone step overwrites, never duplicates
            write_jsonl(samples_dir / f"grpo-step-{step + 1:06d}.jsonl", trajs[: g.sample_trajectories])
        return metrics

    def extra_state() -> dict[str, Any]:
        return {**version, "gap_monitor": monitor.state_dict(), "hard_pool": hard.state_dict() if hard else None}

    def restore(state: dict[str, Any]) -> None:
        version["policy"] = state.get("policy", 0)
        monitor.load_state_dict(state.get("gap_monitor", {}))
        if hard is not None and state.get("hard_pool"):
            hard.load_state_dict(state["hard_pool"])
            hard.config = g.hard_pool

    return run_stage(ws, "grpo", model, learner, g.steps, step_fn, g.checkpoint_every, resume,
                     extra_state=extra_state, restore_extra=restore)


# ---------------------------------------------------------------- PPO -----
def _rollout_shared(ws: Workspace, model, tasks: list, policy_version: int, seed: int) -> list[Trajectory]:
    """One GRPO step's rollouts, in task order. Under data parallel each rank decodes its
    contiguous share (seeded by its offset in the batch) and all ranks gather every trajectory."""
    cfg = ws.cfg
    if ws.dp is None:
        return rollout_tasks(model, ws.contract, ws.make_env, tasks, policy_version=policy_version, seed=seed,
                             batch_size=len(tasks), weights=cfg.reward)
    own = ws.dp.shard(len(tasks))
    mine = rollout_tasks(model, ws.contract, ws.make_env, tasks[own.start:own.stop], policy_version=policy_version,
                         seed=seed + own.start, batch_size=max(len(own), 1), weights=cfg.reward) if len(own) else []
    return [t for part in ws.dp.all_gather(mine) for t in part]


def critic_advantages(trajs: list[Trajectory], rewards: torch.Tensor, values: list[torch.Tensor], p) -> tuple[
        list[torch.Tensor], list[torch.Tensor]]:
    """Per-trajectory GAE advantages and returns (1-D, aligned to tokens) from outcome rewards and critic values
    (PPO and SAO); ``p`` is a :class:`~mentorrl.config.GAEConfig`.

    Tool-observation and prompt tokens are skipped by the recursion; with ``normalize_advantages``
    the advantages are whitened over all policy tokens of the batch.
    """
    T = max(len(t.token_ids) for t in trajs)
    mask = pad_token_values([torch.tensor(t.loss_mask) for t in trajs], T)
    vals = pad_token_values(values, T)
    lam = adaptive_gae_lambda(mask.sum(1), p.lambda_alpha) if p.lambda_alpha else p.lam
    adv, ret = gae_advantages(outcome_token_rewards(rewards, mask), vals, mask, gamma=p.gamma, lam=lam,
                              value_lam=p.value_lam)
    if p.normalize_advantages:
        keep = mask != 0
        if int(keep.sum()) > 1:
            a = adv[keep]
            adv = torch.where(keep, (adv - a.mean()) / (a.std(unbiased=False) + 1e-6), torch.zeros_like(adv))
    return [adv[b, : len(t.token_ids)] for b, t in enumerate(trajs)], [ret[b, : len(t.token_ids)] for b, t in enumerate(trajs)]


def outcome_rewards(trajs: list[Trajectory], audit) -> tuple[torch.Tensor, dict[str, float]]:
    """Each trajectory's total reward, sanitised (non-finite / out-of-range clipped) without group statistics: ``[B]``."""
    raw = torch.tensor([t.reward.total for t in trajs], dtype=torch.float32).view(-1, 1)
    rewards, clipped = sanitize_group_rewards(raw, audit.reward_low, audit.reward_high, None)
    return rewards.view(-1), clipped


class Critic:
    """A critic, its learner and the per-step update PPO and SAO share: values before the update,
    GAE advantages, then ``cfg.steps`` clipped value-loss minibatches towards the returns."""

    METRICS = ("value_loss", "value_clip_frac", "explained_variance")

    def __init__(self, policy, cfg, pad_id: int):
        self.cfg = cfg
        self.model = build_critic(policy, cfg)
        self.learner = CriticLearner(self.model, cfg.optim, pad_id)

    def step(self, trajs: list[Trajectory], rewards: torch.Tensor, gae, seed: int) -> tuple[
            list[torch.Tensor], list[torch.Tensor], dict[str, float]]:
        """``(advantages, values before the update, value metrics)``, per trajectory aligned to its tokens."""
        old_values = self.learner.values(trajs)
        adv, ret = critic_advantages(trajs, rewards, old_values, gae)
        vm = [self.learner.value_step([trajs[i] for i in idx], [ret[i] for i in idx], [old_values[i] for i in idx],
                                      clip=self.cfg.value_clip)
              for idx in _minibatches(list(range(len(trajs))), self.cfg.steps, seed=seed)]
        return adv, old_values, _reduce_updates(vm, self.METRICS)

    def state_dict(self) -> dict[str, Any]:
        return {"critic": self.model.state_dict(), "critic_learner": self.learner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "critic" in state:
            self.model.load_state_dict(state["critic"])
            self.learner.load_state_dict(state["critic_learner"])

    def save(self, stage_dir: Path) -> None:
        (stage_dir / "critic").mkdir(parents=True, exist_ok=True)
        self.model.save(stage_dir / "critic" / "value_model.safetensors")


def ppo_stage(ws: Workspace, model, resume: bool = False) -> Path:
    """PPO for multi-turn agents: the same rollouts, rewards, checks and learner as GRPO, with a
    critic (a value head on a copy of the policy's decoder) and GAE over policy tokens."""
    cfg, p, audit = ws.cfg, ws.cfg.ppo, ws.cfg.audit
    pool = ws.train_tasks(max(p.tasks_per_step * max(p.steps, 1), 64), cfg.seed + TRAIN_POOL_SEED_OFFSET)
    learner = Learner(model, p.optim, ws.contract.pad_token_id, ws.contract.sampling.temperature)
    critic = Critic(model, p.critic, ws.contract.pad_token_id)
    version = {"policy": 0}
    monitor = GapMonitor(audit.reward_window, audit.reward_rise, audit.success_rise)

    def step_fn(step: int) -> dict[str, float]:
        rng = random.Random(cfg.seed * 1_000_003 + 17 * step + 5)
        chosen = rng.sample(pool, min(p.tasks_per_step, len(pool)))
        grouped = [t for t in chosen for _ in range(p.samples_per_task)]
        t0 = time.perf_counter()
        trajs = rollout_tasks(model, ws.contract, ws.make_env, grouped, policy_version=version["policy"],
                              seed=cfg.seed * 7_919 + step, batch_size=len(grouped), weights=cfg.reward)
        t_roll = time.perf_counter() - t0
        _require_consistent(ws, trajs, version["policy"], f"PPO step {step + 1}")
        rewards, clipped = outcome_rewards(trajs, audit)
        metrics: dict[str, float] = {"reward_mean": rewards.mean().item(),
                                     "reward_std": rewards.std().item() if len(trajs) > 1 else 0.0,
                                     "reward_clipped": clipped["clipped"], "rollouts": float(len(trajs))}
        metrics.update(rollout_metrics(trajs))
        metrics.update(_reward_debugger(trajs, audit.flag_reward, ws.run_dir / "audit" / f"flagged-ppo-step-{step + 1:06d}.jsonl"))
        t1 = time.perf_counter()
        adv, _, value_metrics = critic.step(trajs, rewards, p.gae, seed=step * 7 + 1)
        am: list[dict[str, float]] = []
        if step >= p.critic.warmup_steps:
            for idx in _minibatches(list(range(len(trajs))), p.updates_per_step, seed=step * 7 + 2):
                batch = [trajs[i] for i in idx]
                am.append({**learner.token_policy_step(batch, [adv[i] for i in idx], "clipped", eps_low=p.eps_low,
                                                       eps_high=p.eps_high, agg=p.loss_agg),
                           **policy_lag(batch, version["policy"])})
                version["policy"] += 1
        metrics.update(value_metrics)
        metrics.update(_reduce_updates(am, ("pg_loss", "clip_frac", "entropy", "grad_norm", "approx_kl", "logprob_abs_gap",
                                            "train_rollout_kl", "policy_lag_mean", "policy_lag_max")))
        metrics.update(actor_updated=float(bool(am)), policy_version=version["policy"], rollout_s=t_roll,
                       update_s=time.perf_counter() - t1)
        monitor.observe_reward(step + 1, metrics["reward_mean"])
        if audit.eval_every and (step + 1) % audit.eval_every == 0:
            metrics.update(_gap_check(ws, model, monitor, step + 1))
        return metrics

    def extra_state() -> dict[str, Any]:
        return {**version, **critic.state_dict(), "gap_monitor": monitor.state_dict()}

    def restore(state: dict[str, Any]) -> None:
        version["policy"] = state.get("policy", 0)
        monitor.load_state_dict(state.get("gap_monitor", {}))
        critic.load_state_dict(state)

    final = run_stage(ws, "ppo", model, learner, p.steps, step_fn, p.checkpoint_every, resume,
                      extra_state=extra_state, restore_extra=restore)
    critic.save(ws.run_dir / "ppo")
    return final


def _require_consistent(ws: Workspace, trajs: list[Trajectory], current_version: int, where: str) -> None:
    """Never train on data the policy did not produce under this run's contract: raise on any failed check."""
    checks = batch_checks(trajs, current_version, ws.contract.env_name, ws.contract.env_version,
                          ws.contract.fingerprint())
    failed = [f"{c.name}: {c.detail}" for c in checks if not c.passed]
    if failed:
        raise RuntimeError(f"{where}: train/rollout consistency check failed: " + "; ".join(failed))


def _minibatches(items: list[int], k: int, seed: int) -> list[list[int]]:
    """``items`` shuffled with ``seed`` and dealt round-robin into ``min(k, len(items))`` minibatches."""
    perm = torch.randperm(len(items), generator=torch.Generator().manual_seed(seed)).tolist()
    order = [items[i] for i in perm]
    k = min(k, len(order))
    return [order[i::k] for i in range(k)]


def _reduce_updates(updates: list[dict[str, float]], keys: tuple[str, ...]) -> dict[str, float]:
    """One value per metric over a step's optimizer updates: the max for ``*_max`` keys, else the mean (0 if none)."""
    out = {}
    for key in keys:
        vals = [m[key] for m in updates if key in m]
        out[key] = (max(vals) if key.endswith("_max") else sum(vals) / len(vals)) if vals else 0.0
    return out


def _hard_pool(g) -> HardTaskPool | None:
    """The GRPO stage's hard-task pool, optionally seeded from a saved state (e.g. `mentorrl flywheel`)."""
    if g.hard_pool is None:
        if g.hard_pool_state:
            raise ValueError("grpo.hard_pool_state is set but grpo.hard_pool is null; enable the pool to use it")
        return None
    pool = HardTaskPool(g.hard_pool)
    if g.hard_pool_state:
        path = Path(g.hard_pool_state)
        if not path.exists():
            raise FileNotFoundError(f"grpo.hard_pool_state: {path} does not exist")
        pool.load_state_dict(json.loads(path.read_text()))
        pool.config = g.hard_pool  # the run's settings, the saved failures
    return pool


def _reward_debugger(trajs: list[Trajectory], threshold: float, path: Path) -> dict[str, float]:
    """Flag high-reward failures; write them for review (a redone step overwrites its file)."""
    flagged = flag_high_reward_failures(trajs, threshold)
    if flagged:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(path, flagged)
    return {"reward_flagged": float(len(flagged)), "reward_flagged_share": len(flagged) / len(trajs) if trajs else 0.0}


def _gap_check(ws: Workspace, model, monitor: GapMonitor, step: int) -> dict[str, float]:
    """Held-out success now, fed to the reward-success gap monitor."""
    success = heldout_check(ws, model, ws.cfg.audit.eval_tasks)
    warning = monitor.observe_eval(step, success)
    if warning:
        ws.console.print(f"[bold red]warning:[/bold red] {warning['message']}")
    return {"heldout_success": success, "gap_warning": 1.0 if warning else 0.0}


# --------------------------------------------------------------- eval -----
def heldout_check(ws: Workspace, model, n: int) -> float:
    """Held-out success of the current weights on ``n`` tasks (the same tasks at every check of a run)."""
    tasks = ws.tasks(ws.cfg.eval.split, n, ws.cfg.eval.seed)
    trajs = rollout_tasks(model, eval_contract(ws), ws.make_env, tasks, seed=ws.cfg.eval.seed,
                          batch_size=ws.cfg.eval.batch_size, weights=ws.cfg.reward)
    return float(summarize(trajs)["success"])


def eval_contract(ws: Workspace) -> RolloutContract:
    """The rollout contract with the evaluation temperature, when one is configured."""
    t = ws.cfg.eval.temperature
    if t is None:
        return ws.contract
    return replace(ws.contract, sampling=ws.contract.sampling.model_copy(update={"temperature": t}))


def evaluate(ws: Workspace, model, label: str, resume: bool = False, split: str | None = None) -> dict[str, Any]:
    """Roll out ``eval.num_tasks`` tasks of ``split`` (default ``eval.split``, the held-out set);
    writes eval_<label>.json and eval_<label>.jsonl into the run dir."""
    cfg, e = ws.cfg, ws.cfg.eval
    split = split or e.split
    out_json = ws.run_dir / f"eval_{label}.json"
    if resume and out_json.exists():
        return json.loads(out_json.read_text())
    contract = eval_contract(ws)
    tasks = ws.tasks(split, e.num_tasks, e.seed)
    with ws.progress() as prog:
        bar = prog.add_task(f"eval {label}", total=len(tasks), info="") if prog else None
        trajs = rollout_tasks(
            model, contract, ws.make_env, tasks, seed=e.seed, batch_size=e.batch_size, weights=cfg.reward,
            on_batch=(lambda n: prog.update(bar, advance=n)) if prog else None,
        )
    write_jsonl(ws.run_dir / f"eval_{label}.jsonl", trajs)
    summary = {"label": label, "split": split, **summarize(trajs)}
    out_json.write_text(json.dumps(summary, indent=2))
    return summary
