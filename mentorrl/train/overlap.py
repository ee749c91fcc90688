"""One-step-off-policy training (``grpo.overlap: one_step``): batch k+1 is rolled out while the
learner trains on batch k.

::

    step k:  tasks(k+1) ─► snapshot <- the weights now (after step k-1) ─► thread: rollout(k+1) ──┐
             score(k) ─► advantages(k) ─► update(k) ─► after(k)   (batch k: rolled out in step k-1) │
             join ◄──────────────────────────────────────────────────────────────────────────────┘
             batch k+1 is the pending batch, checkpointed with step k

- the behaviour policy of batch k+1 is well defined: a frozen copy of the policy taken at the start of
  step k (the weights after step k-1; batches 0 and 1 are both rolled out by the starting weights),
  stamped with the learner's version at that moment (``behaviour_version``, every trajectory's
  ``policy_version``);
- the loss corrects for the lag as it does for every minibatch after a step's first: the clipped ratio of
  the learner's log-probs to the behaviour log-probs recorded while sampling (GRPO's ``grpo`` loss);
- seeds are the batch's own (``StepSeeds`` at k+1) and the rollout samples with per-episode generators,
  so what the thread rolls out does not depend on timing: a fixed seed and configuration trains bit for
  bit the same (``tests/test_overlap.py``);
- resume: the pending batch is in the checkpoint (tasks, trajectories, metrics, behaviour version), so a
  run killed after the checkpoint of step k trains on the same batch k+1 as an uninterrupted run and
  rolls k+2 out by the checkpoint's weights, which are the weights after step k. A checkpoint without one
  (written under ``overlap: off``) rolls its next batch out on-policy;
- where: a thread of this process (the rollout's torch ops release the GIL; each thread runs
  ``threads`` torch threads), or under ``distributed.backend: ray`` the Ray rollout actors (processes),
  sent the snapshot's weights.

Each step also records ``overlap_s`` (how long the rollout ahead ran beside the training hooks),
``overlap_wait_s`` (how long the learner then waited for it) and ``behaviour_version``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from mentorrl.train.loop import HOOKS, RLLoop, Stage, StepBatch, register_loop, step_data_state
from mentorrl.train.parallelism import choose_parallelism, cpu_cores, write_parallelism
from mentorrl.train.workspace import frozen_copy
from mentorrl.trajectory import Trajectory

TRAIN_HOOKS = tuple(h for h in HOOKS if h not in ("tasks", "rollout"))
AHEAD_HOOKS = ("tasks", "rollout")  # both STOPPABLE: a stop there skips the training hooks


@dataclass(frozen=True)
class OverlapEvent:
    """A moment of the overlapped loop: ``rollout_start`` / ``rollout_end`` of a batch rolled out
    ahead, ``train_start`` / ``update_start`` / ``update_end`` / ``train_end`` of the batch trained on."""

    name: str
    step: int  # the batch's step (0-based)
    t: float  # time.perf_counter()


def check_overlap(stage: Stage) -> None:
    """Refuse, before the first step, what the overlapped loop cannot run."""
    name = stage.section or stage.name
    where = f"{name}.overlap: one_step"
    if not stage.overlappable:
        raise ValueError(f"{where}: stage {stage.name!r} cannot roll its batches out a step ahead")
    if stage.ws.dp is not None:
        raise ValueError(
            f"{where} is not supported under a torchrun data-parallel launch (the rollout's gathers would "
            "interleave with the learner's); use distributed.backend: ray for rollout processes"
        )
    if stage.ws.rollout.backend.name != "hf":
        raise ValueError(
            f"{where} needs rollout.backend: hf (the {stage.ws.rollout.backend.name} engine follows the learner's "
            "weights after every update; the rollout ahead needs a behaviour policy of its own)"
        )


@contextmanager
def stage_threads(stage: Stage) -> Iterator[None]:
    """Under ``threads: auto``, the overlapped stage's own choice (the rollout ahead and the learner each get
    half the cores; the other stages keep the run's), printed, written to ``RUN_DIR/parallelism.json`` under
    the stage's name, and undone when the stage ends."""
    ws = stage.ws
    if ws.cfg.threads != "auto":
        yield
        return
    device = next(stage.model.parameters()).device.type
    plan = choose_parallelism(cpu_cores(), device, (stage.name,), overlap=True)
    if ws.is_main:
        write_parallelism(ws.run_dir, plan, stage.name)
        ws.console.print(f"{stage.name}: {plan.line()}", markup=False, highlight=False)
    before = torch.get_num_threads()
    torch.set_num_threads(plan.threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def copy_weights(dst: torch.nn.Module, src: torch.nn.Module) -> None:
    """``src``'s parameters and buffers into ``dst`` in place (a tensor the two share is left alone)."""
    with torch.no_grad():
        for a, b in zip(dst.parameters(), src.parameters()):
            if a is not b:
                a.copy_(b)
        for a, b in zip(dst.buffers(), src.buffers()):
            if a is not b:
                a.copy_(b)


class RolloutAhead(threading.Thread):
    """One batch's rollout hook in a thread of its own; :meth:`result` joins it and raises its error."""

    def __init__(self, run_rollout: Callable[[StepBatch], None], b: StepBatch, record: Callable[[str, int], None]):
        super().__init__(name=f"rollout-ahead-{b.step + 1}", daemon=True)
        self.run_rollout, self.b, self.record = run_rollout, b, record
        self.error: BaseException | None = None

    def run(self) -> None:
        self.record("rollout_start", self.b.step)
        try:
            with torch.no_grad():
                self.run_rollout(self.b)
        except BaseException as e:  # noqa: BLE001 -- raised in the learner's thread by result()
            self.error = e
        finally:
            self.record("rollout_end", self.b.step)

    def result(self) -> StepBatch:
        self.join()
        if self.error is not None:
            raise RuntimeError(f"the rollout of step {self.b.step + 1} (ahead) failed: {self.error!r}") from self.error
        return self.b


PENDING_EMPTY = ("rewards", "adv", "groups")  # filled by the training hooks, so never in a pending batch


def batch_state(b: StepBatch) -> dict[str, Any]:
    """A batch rolled out ahead, as checkpoint state (the trajectories as plain dicts)."""
    filled = [k for k in PENDING_EMPTY if getattr(b, k) is not None] + (["updates"] if b.updates else [])
    if filled:
        raise ValueError(f"a pending batch holds {filled}: its training hooks ran already")
    return {
        "step": b.step,
        "tasks": list(b.tasks),
        "trajs": [t.model_dump() for t in b.trajs],
        "group_size": b.group_size,
        "metrics": dict(b.metrics),
        "data": step_data_state(b.data),
        "stop": b.stop,
        "behaviour_version": b.behaviour_version,
    }


def batch_from_state(state: dict[str, Any], stage: Stage) -> StepBatch:
    """The pending batch of :func:`batch_state` back, with ``stage``'s seeds and step record."""
    step = int(state["step"])
    return StepBatch(
        step,
        stage.seeds.at(step),
        tasks=list(state["tasks"]),
        trajs=[Trajectory.model_validate(t) for t in state["trajs"]],
        group_size=int(state["group_size"]),
        metrics=dict(state["metrics"]),
        data=stage.step_data(**state["data"]),
        stop=bool(state["stop"]),
        behaviour_version=state["behaviour_version"],
    )


@register_loop("one_step")
class OverlapLoop(RLLoop):
    """:class:`RLLoop` with each step's tasks and rollout a step ahead (see the module doc)."""

    def __init__(self, stage: Stage):
        check_overlap(stage)
        super().__init__(stage)
        self.snapshot = frozen_copy(stage.model)  # the behaviour policy of every batch this loop rolls out
        self.pending: StepBatch | None = None
        self.events: deque[OverlapEvent] = deque(maxlen=4096)  # the latest, for overlap_s and tests

    def record(self, name: str, step: int) -> None:
        self.events.append(OverlapEvent(name, step, time.perf_counter()))  # deque.append: safe across threads

    def run_hook(self, b: StepBatch, hook: str) -> None:
        if hook == "update":
            self.record("update_start", b.step)
        super().run_hook(b, hook)
        if hook == "update":
            self.record("update_end", b.step)

    def behaviour(self, step: int) -> StepBatch:
        """A new batch whose rollout is by the policy's weights now (copied into the snapshot)."""
        b = self.new_batch(step)
        copy_weights(self.snapshot, self.stage.model)
        b.policy, b.behaviour_version = self.snapshot, self.stage.learner.version
        return b

    def launch(self, step: int) -> RolloutAhead:
        b = self.behaviour(step)
        self.run_hook(b, "tasks")  # in this thread: task draws read state (a hard pool) the rollouts update
        ahead = RolloutAhead(lambda x: None if x.stop else self.run_hook(x, "rollout"), b, self.record)
        ahead.start()
        return ahead

    def step(self, step: int) -> dict[str, Any]:
        b, self.pending = self.pending, None
        if b is None or b.step != step:  # the first step, or a checkpoint without a pending batch
            b = self.behaviour(step)
            self.run_hooks(b, AHEAD_HOOKS)
        ahead = self.launch(step + 1) if step + 1 < self.stage.steps and not b.stop else None
        try:
            self.train(b)
        except BaseException:
            if ahead is not None:
                ahead.join()
            raise
        t0 = time.perf_counter()
        self.pending = ahead.result() if ahead is not None else None
        if self.pending is not None:
            self.pending.policy = None  # the pending batch keeps its version, not the model
        b.metrics.update(overlap_wait_s=time.perf_counter() - t0, overlap_s=self.overlap_s(step))
        b.metrics["behaviour_version"] = float(b.behaviour_version)
        return self.finish(b)

    def train(self, b: StepBatch) -> None:
        if b.stop:
            return
        self.record("train_start", b.step)
        self.run_hooks(b, TRAIN_HOOKS)
        self.record("train_end", b.step)

    def overlap_s(self, step: int) -> float:
        """How long the rollout of step + 1 ran while step ``step`` trained."""
        at = {(e.name, e.step): e.t for e in self.events if e.step in (step, step + 1)}
        if ("rollout_start", step + 1) not in at or ("train_start", step) not in at:
            return 0.0
        lo = max(at["rollout_start", step + 1], at["train_start", step])
        hi = min(at["rollout_end", step + 1], at["train_end", step])
        return max(0.0, hi - lo)

    def run(self, resume: bool = False):
        with stage_threads(self.stage):
            return super().run(resume)

    def extra_state(self) -> dict[str, Any]:
        return {**super().extra_state(), "overlap": batch_state(self.pending) if self.pending is not None else None}

    def restore(self, state: dict[str, Any]) -> None:
        super().restore(state)
        pending = state.get("overlap")
        self.pending = batch_from_state(pending, self.stage) if pending else None
        if self.pending is not None and (self.pending.behaviour_version or 0) > self.stage.learner.version:
            self.pending = None  # never a batch from a policy ahead of the restored learner: rolled out again
