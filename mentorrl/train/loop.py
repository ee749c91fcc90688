"""The training loop: from a recipe down to a stage's hooks, read top to bottom.

``mentorrl train recipe.yaml`` (and ``mentorrl demo``) calls :func:`mentorrl.train.pipeline.train`,
which runs the recipe (:func:`~mentorrl.train.pipeline.run_recipe`: preflight, workspace, base model)
and then its stages in order (:func:`~mentorrl.train.pipeline.run_stages`, evaluating after each).
From there on everything is in this module::

    for stage in recipe:                    registry: a Stage class, wrapped by run_on_loop
        loop_for(stage).run(resume)         RLLoop (or OverlapLoop under overlap: one_step)
            run_stage(...)                  the step loop: resume, metrics.jsonl, checkpoints
                for step in steps:
                    RLLoop.step(step)       a new StepBatch, then the hooks in order:
                        tasks -> rollout -> score -> advantages -> update -> after

A stage is a small class of hooks (:class:`Stage`) plus its own config section; :class:`RLLoop`
owns everything else:

- each hook reads and fills one typed record, the step's :class:`StepBatch` (tasks, trajectories,
  rewards, advantages, the updates' metrics, and ``data``: the stage's own :class:`StepData` record,
  declared by :attr:`Stage.step_data`, for what it carries between its own hooks);
- :class:`StepSeeds` hands out every seed: a pure function of (run seed, stage, step, purpose),
  so a resumed stage redoes a step exactly and no two purposes share a stream by accident;
- the :class:`~mentorrl.train.learner.Learner` owns the policy version (one per optimizer step,
  or one per :meth:`~mentorrl.train.learner.Learner.publish` for SAO's periodic sync);
- the loop times the rollout and the update, reduces the updates' metrics, and :func:`run_stage`
  checkpoints the weights, the learner (with its version) and the stage's own
  :meth:`Stage.state_dict` (how: :mod:`mentorrl.train.stage_checkpoints`).

The hooks' shared parts (the rollout, the policy-gradient update, rewards and metrics) are
:mod:`mentorrl.train.stage_helpers`. A stage says only what differs: GRPO its group advantages and
guidance, PPO its critic, SAO that its rollouts come from an asynchronous worker, OPD its teachers'
scores, the black-box recipes their teacher calls, evolve its curriculum and version gate, SFT and
RFT that their data is a dataset (their rollout hook does nothing or samples and filters). A new
stage is one class and one registry entry (see ``docs/extending/stage.md`` for a worked example).
"""

from __future__ import annotations

import hashlib
import random
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch

from mentorrl.train.learner import Learner
from mentorrl.train.parallelism import cpu_clock
from mentorrl.train.progress import stage_progress
from mentorrl.train.stage_checkpoints import (
    ranks_cpu,
    record_step,
    resume_stage,
    rewind,
    save_final,
    save_sharded,
    step_timing,
)
from mentorrl.train.stage_helpers import (
    PG_METRICS,
    Collected,
    collect_group,
    group_rewards,
    reduce_updates,
    rollout_cost,
)
from mentorrl.train.workspace import Workspace
from mentorrl.trajectory import Trajectory, write_jsonl

SEED_SPACE = 2**31 - 1  # seeds fit torch, numpy and the rollout's turn seeds
HOOKS = ("tasks", "rollout", "score", "advantages", "update", "after")
STOPPABLE = ("tasks", "rollout", "score")  # a stop set by one of these skips the hooks after it


def pool_size(per_step: int, steps: int, least: int = 64) -> int:
    """Tasks in a stage's training pool: enough for ``per_step`` at every step, at least ``least``."""
    return max(per_step * max(steps, 1), least)


def derive_seed(*parts: Any) -> int:
    """A seed in ``[0, SEED_SPACE)`` that is a pure function of ``parts`` (their ``str``), the same in
    every process and Python version (blake2b, not ``hash``)."""
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % SEED_SPACE


@dataclass(frozen=True)
class StepSeeds:
    """Every seed of a stage: ``seeds("purpose")`` at one step (or stage-wide when ``step`` is None,
    e.g. the task pool), derived from (run seed, stage, step, purpose)."""

    run: int
    stage: str
    step: int | None = None

    def __call__(self, purpose: str) -> int:
        return derive_seed(self.run, self.stage, self.step, purpose)

    def rng(self, purpose: str) -> random.Random:
        return random.Random(self(purpose))

    def at(self, step: int) -> "StepSeeds":
        return StepSeeds(self.run, self.stage, step)


@dataclass(slots=True)
class StepData:
    """What a stage carries between its own hooks within one step: nothing here. A stage that carries
    something declares its own record, a ``@dataclass(slots=True)`` subclass with a default for every
    field, and names it in :attr:`Stage.step_data`; the loop makes a fresh one per step, so a misspelt
    field is an AttributeError, never a silent new key."""


def step_data_state(d: StepData) -> dict[str, Any]:
    """``d``'s fields by name (shallow), e.g. for a checkpoint; ``type(d)(**state)`` restores it."""
    return {f.name: getattr(d, f.name) for f in fields(d)}


@dataclass
class StepBatch:
    """One step's data as it moves through the hooks."""

    step: int
    seeds: StepSeeds
    tasks: list = field(default_factory=list)
    trajs: list[Trajectory] = field(default_factory=list)
    group_size: int = 1
    rewards: torch.Tensor | None = None  # [tasks, group_size], sanitised (or [B] for outcome rewards)
    adv: Any = None  # one advantage per trajectory (a tensor), or a token advantage tensor per trajectory
    groups: list[list[int]] | None = None  # trajectories an update deals together (a GRPO group)
    updates: list[dict[str, float]] = field(default_factory=list)  # each optimizer update's metrics
    metrics: dict[str, Any] = field(default_factory=dict)
    data: StepData = field(default_factory=StepData)  # the stage's own record (Stage.step_data), fresh per step
    stop: bool = False  # end the stage after this step (checkpointed)
    policy: Any = None  # the model that rolls this batch out (None: the stage's policy; overlap: a snapshot)
    behaviour_version: int | None = None  # the policy version that rolls it out (None: the learner's now)

    @property
    def policy_tokens(self) -> int:
        return sum(t.num_policy_tokens for t in self.trajs)

    def raw_rewards(self) -> torch.Tensor:
        """The trajectories' total rewards as ``[tasks, group_size]``."""
        return torch.tensor([t.reward.total for t in self.trajs], dtype=torch.float32).view(-1, self.group_size)

    def group_indices(self) -> list[list[int]]:
        """Trajectory indices per task, in rollout order."""
        g = self.group_size
        return [list(range(i, i + g)) for i in range(0, len(self.trajs), g)]


class Stage:
    """A training stage as hooks on :class:`RLLoop`. Subclasses set ``name`` and ``section`` and
    override only the hooks that differ; every hook takes the step's :class:`StepBatch`."""

    name: ClassVar[str]
    section: ClassVar[str | None] = None  # the RunConfig section of this stage (defaults to ``name``)
    data_parallel: ClassVar[bool] = False  # the learner trains data-parallel under a torchrun launch
    update_metrics: ClassVar[tuple[str, ...]] = PG_METRICS  # reduced over a step's updates
    pool_least: ClassVar[int] = 64
    learner_options: ClassVar[dict[str, Any]] = {}  # extra Learner arguments (SAO: version_per_update=False)
    overlappable: ClassVar[bool] = False  # its tasks + rollout may run a step ahead (``overlap: one_step``)
    step_data: ClassVar[type[StepData]] = StepData  # what its hooks carry between them in a step (StepBatch.data)

    def __init__(self, ws: Workspace, model):
        self.ws, self.model = ws, model
        self.cfg = getattr(ws.cfg, self.section or self.name)
        self.seeds = StepSeeds(ws.cfg.seed, self.name)
        self.learner = self.make_learner()
        self.pool = self.make_pool()

    # ---- set-up -------------------------------------------------------------------------------
    def make_learner(self) -> Learner:
        """The stage's learner over its model, with :attr:`learner_options` (e.g. SAO's policy versions)."""
        ws = self.ws
        return Learner(
            self.model,
            self.cfg.optim,
            ws.contract.pad_token_id,
            ws.contract.sampling.temperature,
            dp=ws.dp if self.data_parallel else None,
            precision=ws.cfg.model.dtype,
            **self.learner_options,
        )

    @property
    def steps(self) -> int:
        return self.cfg.steps

    @property
    def checkpoint_every(self) -> int:
        return self.cfg.checkpoint_every

    def pool_per_step(self) -> int | None:
        """Tasks a step may draw from the pool: ``tasks_per_step`` (None for a stage without it)."""
        return getattr(self.cfg, "tasks_per_step", None)

    def make_pool(self) -> list:
        """The stage's training tasks: enough for :meth:`pool_per_step` at every step (at least
        ``pool_least``), seeded by the stage; none for a stage without ``tasks_per_step``."""
        per_step = self.pool_per_step()
        if per_step is None:
            return []
        return self.ws.train_tasks(pool_size(per_step, self.steps, self.pool_least), self.seeds("pool"))

    # ---- hooks, in the order the loop runs them ---------------------------------------------
    def tasks(self, b: StepBatch) -> None:
        """Choose the step's tasks (default: ``tasks_per_step`` drawn from the stage's pool, if it has one)."""
        if not self.pool:
            return
        rng = b.seeds.rng("tasks")
        b.tasks = rng.sample(self.pool, min(self.cfg.tasks_per_step, len(self.pool)))

    def rollout(self, b: StepBatch) -> None:
        """Roll every task out ``samples_per_task`` times with the current policy (checked for consistency)."""
        self.collect(b, self.cfg.samples_per_task)

    def score(self, b: StepBatch) -> None:
        """Rewards (default: the verifier's, sanitised per group, with their statistics)."""
        rewards, clipped, stats = group_rewards(b.raw_rewards(), self.ws.cfg.audit)
        b.rewards = rewards
        b.metrics.update(stats, reward_clipped=clipped["clipped"])

    def advantages(self, b: StepBatch) -> None:
        """Advantages into ``b.adv`` (default: none)."""

    def update(self, b: StepBatch) -> None:
        """Optimizer updates; append each one's metrics to ``b.updates`` (default: none)."""

    def after(self, b: StepBatch) -> None:
        """Anything after the update: held-out checks, sample files (default: nothing)."""

    # ---- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What the stage keeps across steps beyond the weights and the learner (checkpointed)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` from a checkpoint."""

    def close(self) -> None:
        """Release what the stage holds (workers, teacher servers, buffers); runs however the stage ends."""

    def finish(self, final: Path) -> Path:
        """After the last step (e.g. save a critic beside the weights); returns the stage's weights dir."""
        return final

    # ---- shared helpers -----------------------------------------------------------------------
    def roll(
        self,
        b: StepBatch,
        tasks: list,
        group_size: int,
        purpose: str = "rollout",
        where: str | None = None,
        token_budgets: list[int] | None = None,
        shard: bool = False,
    ) -> Collected:
        """``tasks`` each rolled out ``group_size`` times by the step's policy at its behaviour version (a snapshot's
        under ``overlap``), seeded by ``b.seeds(purpose)``, timed and checked for consistency (``where`` names the
        rollout in an error; default the stage and step)."""
        return collect_group(
            self.ws,
            self.model if b.policy is None else b.policy,
            tasks,
            group_size,
            self.learner.version if b.behaviour_version is None else b.behaviour_version,
            b.seeds(purpose),
            where or f"{self.name} step {b.step + 1}",
            token_budgets=token_budgets,
            shard=shard,
        )

    def collect(
        self, b: StepBatch, group_size: int, token_budgets: list[int] | None = None, shard: bool = False
    ) -> None:
        """The common rollout: ``b.tasks`` each rolled out ``group_size`` times (:meth:`roll`), with the rollout
        metrics."""
        grp = self.roll(b, b.tasks, group_size, token_budgets=token_budgets, shard=shard)
        b.trajs, b.group_size = list(grp.trajs), group_size
        b.metrics.update(rollout_cost(grp.trajs, grp.rollout_s, grp.rollout_cpu_s))

    def write_samples(self, b: StepBatch, n: int, trajs: list[Trajectory] | None = None) -> None:
        """``samples/<stage>-step-N.jsonl``: the step's first ``n`` trajectories (a redone step overwrites)."""
        if not n or not self.ws.is_main:
            return
        samples = self.ws.run_dir / "samples"
        samples.mkdir(exist_ok=True)
        write_jsonl(samples / f"{self.name}-step-{b.step + 1:06d}.jsonl", (b.trajs if trajs is None else trajs)[:n])


class RLLoop:
    """Runs a :class:`Stage`'s hooks for its steps, resumably (see the module doc): :meth:`run` hands
    :meth:`step` to :func:`run_stage`, the step loop; :meth:`step` runs the hooks on a new batch."""

    def __init__(self, stage: Stage):
        self.stage = stage

    def run(self, resume: bool = False) -> Path:
        """The stage's steps (:func:`run_stage`: checkpointed, resumable), then :meth:`Stage.finish`;
        :meth:`Stage.close` however it ends. Returns the stage's final weights dir."""
        s = self.stage
        try:
            final = run_stage(
                s.ws,
                s.name,
                s.model,
                s.learner,
                s.steps,
                self.step,
                s.checkpoint_every,
                resume,
                extra_state=self.extra_state,
                restore_extra=self.restore,
            )
            return s.finish(final)
        finally:
            s.close()

    def new_batch(self, step: int) -> StepBatch:
        """Step ``step``'s empty batch: its seeds, and a fresh record of the stage's :attr:`Stage.step_data`."""
        return StepBatch(step, self.stage.seeds.at(step), data=self.stage.step_data())

    def step(self, step: int) -> dict[str, Any]:
        """One step: a new batch, the stage's hooks on it in order (:data:`HOOKS`), its metrics record."""
        b = self.new_batch(step)
        self.run_hooks(b, HOOKS)
        return self.finish(b)

    def run_hooks(self, b: StepBatch, hooks: tuple[str, ...]) -> None:
        """Run ``hooks`` on ``b`` in order (timing the update); a ``stop`` set by tasks, rollout or
        score skips the rest."""
        for hook in hooks:
            self.run_hook(b, hook)
            if b.stop and hook in STOPPABLE:
                return

    def run_hook(self, b: StepBatch, hook: str) -> None:
        stage = self.stage
        t0, c0 = time.perf_counter(), cpu_clock()
        getattr(stage, hook)(b)
        if hook == "update":
            stage.ws.rollout.sync(stage.model, stage.learner.version)  # an engine of its own (vLLM) follows
            b.metrics.setdefault("update_s", time.perf_counter() - t0)
            b.metrics.setdefault("update_cpu_s", cpu_clock() - c0)

    def finish(self, b: StepBatch) -> dict[str, Any]:
        """The step's metrics record: the updates' metrics reduced, the mismatch, the policy version."""
        stage = self.stage
        if stage.update_metrics:
            b.metrics.update(
                {k: v for k, v in reduce_updates(b.updates, stage.update_metrics).items() if k not in b.metrics}
            )
        b.metrics.update(mismatch_metrics(b.updates))
        b.metrics["policy_version"] = float(stage.learner.version)
        if b.stop:
            b.metrics["stop"] = True
        return b.metrics

    def extra_state(self) -> dict[str, Any]:
        return {"stage": self.stage.state_dict()}

    def restore(self, state: dict[str, Any]) -> None:
        self.stage.load_state_dict(state.get("stage", {}))


def run_stage(
    ws: Workspace,
    stage: str,
    model,
    learner: Learner,
    steps: int,
    step_fn: Callable[[int], dict[str, Any]],
    checkpoint_every: int,
    resume: bool,
    extra_state: Callable[[], dict[str, Any]] | None = None,
    restore_extra: Callable[[dict[str, Any]], None] | None = None,
) -> Path:
    """The step loop: ``step_fn`` for steps [start, steps), each step's record to ``metrics.jsonl`` and
    the trackers, a checkpoint every ``checkpoint_every`` steps; returns the stage's final weights dir.

    ``resume`` continues from the stage's newest intact checkpoint (or returns at once when the stage is
    complete); steps past it are redone, never logged twice (:mod:`mentorrl.train.stage_checkpoints`).
    A step whose metrics hold ``stop: True`` ends the stage early (after checkpointing it). Under data
    parallel, rank 0 alone decides where to resume and writes; the other ranks follow it."""
    stage_dir = ws.run_dir / stage
    final = stage_dir / "final"
    where, start = resume_stage(ws, stage, model, learner, steps, restore_extra) if resume else (None, 0)
    if where == final:
        return final  # complete already: its final weights are loaded
    ws.on_main(lambda: rewind(ws, stage, start, resume))  # steps past the checkpoint are redone, never logged twice
    with stage_progress(ws, stage, steps, start) as progress:
        for step in range(start, steps):
            t0, c0 = time.perf_counter(), cpu_clock()
            m = step_fn(step)
            stop = bool(m.pop("stop", False))
            step_s = time.perf_counter() - t0
            m, cpu_s = ranks_cpu(ws.dp, m, cpu_clock() - c0)
            rec = {"stage": stage, "step": step + 1, **m, **step_timing(m, step_s, cpu_s)}
            save = stop or (step + 1) % checkpoint_every == 0 or step + 1 == steps
            # under data parallel the others wait, and see a failure
            ws.on_main(lambda: record_step(ws, stage_dir, rec, save, model, learner, extra_state))
            if save and learner.sharded is not None:
                save_sharded(ws, stage_dir, rec["step"], model, learner, extra_state)
            progress.update(step + 1, m, last=stop)
            if stop:
                break
    ws.on_main(lambda: save_final(ws, model, final, steps))
    return final


def mismatch_metrics(updates: list[dict[str, float]]) -> dict[str, float]:
    """The train/rollout mismatch of a step, apart from the policy's own change: the log-prob gap and
    KL of the updates whose batch the current weights sampled (policy lag 0), where the learner
    recomputes exactly what the rollout recorded up to numerics (kernels, precision, templates)."""
    fresh = [u for u in updates if u.get("policy_lag_max", 1) == 0 and "logprob_abs_gap" in u]
    if not fresh:
        return {}
    out = {"mismatch_logprob_gap": sum(u["logprob_abs_gap"] for u in fresh) / len(fresh)}
    if all("train_rollout_kl" in u for u in fresh):
        out["mismatch_kl"] = sum(u["train_rollout_kl"] for u in fresh) / len(fresh)
    return out


def run_on_loop(stage_cls: type[Stage]):
    """The registry's ``run(ws, model, resume=False) -> Path`` for a :class:`Stage` class."""

    def run(ws: Workspace, model, resume: bool = False) -> Path:
        return loop_for(stage_cls(ws, model)).run(resume)

    run.__name__ = f"run_{stage_cls.name}"
    run.__doc__ = stage_cls.__doc__
    run.stage_cls = stage_cls  # type: ignore[attr-defined]  (what the registry and tests introspect)
    return run


LOOPS: dict[str, type[RLLoop]] = {"off": RLLoop}  # a stage's ``overlap`` setting -> the loop that runs it


def register_loop(mode: str):
    """Register a loop class for ``<section>.overlap: mode`` (e.g. :mod:`mentorrl.train.overlap`'s ``one_step``)."""

    def deco(cls: type[RLLoop]) -> type[RLLoop]:
        LOOPS[mode] = cls
        return cls

    return deco


def loop_for(stage: Stage) -> RLLoop:
    """The loop that runs ``stage``: :class:`RLLoop`, or the one registered for its ``overlap`` setting
    (``one_step``: :class:`~mentorrl.train.overlap.OverlapLoop`, which checks the stage before the first step)."""
    mode = getattr(stage.cfg, "overlap", "off")
    if mode not in LOOPS:
        raise ValueError(f"{stage.name}.overlap: {mode!r} has no loop registered (registered: {sorted(LOOPS)})")
    return LOOPS[mode](stage)
