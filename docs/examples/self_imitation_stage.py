"""A new training stage: self-imitation. Each step the policy plays a few train tasks, the
verifier keeps its successes, and the policy is fine-tuned on them (a one-round, on-line RFT).

A stage is a :class:`~mentorrl.train.loop.Stage` subclass that overrides only the hooks that
differ; the one loop (:class:`~mentorrl.train.loop.RLLoop`) runs them in order (tasks ->
rollout -> score -> advantages -> update -> after) and gives it checkpoints every N steps,
``--resume``, ``metrics.jsonl``, trackers, the policy version and the final Hugging Face
directory for free. Here the default ``tasks`` hook draws ``tasks_per_step`` tasks from the
stage's seeded pool and the default ``rollout`` hook rolls each out ``samples_per_task`` times
(checked for train/rollout consistency); the stage adds a ``score`` and an ``update``, and declares
what the one hands the other as its step record (``step_data``: a fresh one per step).

``@register_stage`` with ``config=`` gives it a YAML section: ``recipe: [sft, self_imitation]``
runs it, and ``self_imitation: {steps: 4}`` (or ``--set self_imitation.steps=4``) configures it,
validated with dotted errors. This file is the whole change: nothing else is edited. As a plugin
it runs from the command line: ``mentorrl train recipe.yaml --plugin my_module``.

Run it: ``python docs/examples/self_imitation_stage.py RUN_DIR`` trains the shipped tiny base for
two steps.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, ClassVar

from mentorrl.config import RolloutStageConfig
from mentorrl.train.loop import Stage, StepBatch, StepData
from mentorrl.train.registry import register_stage
from mentorrl.trajectory import Trajectory


class SelfImitationConfig(RolloutStageConfig):
    """The stage's own settings: the shared ones (steps, optim, tasks_per_step, ...) with its defaults."""

    defaults: ClassVar[dict[str, Any]] = {
        "steps": 10,
        "tasks_per_step": 8,
        "checkpoint_every": 5,
        "optim": {"lr": 1e-4},
    }


@dataclass(slots=True)
class SelfImitationStepData(StepData):
    """What ``score`` hands ``update`` within a step (``b.data``): the verified successes."""

    wins: list[Trajectory] = field(default_factory=list)


@register_stage(
    "self_imitation",
    config=SelfImitationConfig,
    title="Self-imitation on verified successes",
    label="Self-imitation",
    rl=True,
)
class SelfImitationStage(Stage):
    """Fine-tune on the step's verified successes."""

    name = "self_imitation"
    update_metrics = ()  # its update reports the SFT step's metrics itself
    step_data = SelfImitationStepData

    def score(self, b: StepBatch) -> None:
        b.data.wins = [t for t in b.trajs if t.reward.success]
        b.metrics["task_success"] = len(b.data.wins) / max(len(b.trajs), 1)

    def update(self, b: StepBatch) -> None:
        if b.data.wins:
            b.metrics.update(self.learner.sft_step(b.data.wins))


if __name__ == "__main__":
    from mentorrl.config import load_config
    from mentorrl.models.build import load_policy
    from mentorrl.models.shipped import SHIPPED_ROOT
    from mentorrl.train.loop import RLLoop
    from mentorrl.train.workspace import open_workspace

    run_dir = sys.argv[1] if len(sys.argv) > 1 else "runs/self-imitation"
    cfg = load_config(
        None, [f"run_dir={run_dir}", "threads=1", "self_imitation.steps=2", "self_imitation.tasks_per_step=4"]
    )
    ws = open_workspace(cfg)
    tokenizer, model = load_policy(SHIPPED_ROOT / "orders-tiny")
    ws.bind_tokenizer(tokenizer)
    print(RLLoop(SelfImitationStage(ws, model)).run())
