"""A new training stage: self-imitation. Each step the policy plays a few train tasks, the
verifier keeps its successes, and the policy is fine-tuned on them (a one-round, on-line RFT).

A stage is one function ``stage(ws, model, resume) -> final weights dir`` built on
:func:`mentorrl.train.stage_runner.run_stage`, which gives it checkpoints every N steps, ``--resume``,
``metrics.jsonl`` and the final Hugging Face directory for free; ``@register_stage`` makes
``recipe: [sft, self_imitation]`` run it. This file is the whole change: nothing else is edited.

Run it: ``python docs/examples/self_imitation_stage.py RUN_DIR`` trains the shipped tiny base for
two steps.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

from pydantic import BaseModel, Field

from mentorrl.config import OptimConfig
from mentorrl.train.learner import Learner
from mentorrl.train.loop import rollout_metrics
from mentorrl.train.registry import register_stage
from mentorrl.train.stage_runner import run_stage
from mentorrl.train.workspace import Workspace


class SelfImitationConfig(BaseModel):
    """The stage's own settings (its defaults here; pass another instance to change them)."""

    steps: int = Field(10, ge=1, description="steps (one rollout batch each)")
    tasks_per_step: int = Field(8, ge=1, description="train tasks played per step")
    checkpoint_every: int = Field(5, ge=1, description="steps between checkpoints")
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-4), description="the optimiser")


@register_stage("self_imitation", title="Self-imitation on verified successes", label="Self-imitation", rl=True)
def self_imitation_stage(ws: Workspace, model, resume: bool = False,
                         sic: SelfImitationConfig | None = None) -> Path:
    cfg, sic = ws.cfg, sic or SelfImitationConfig()
    pool = ws.train_tasks(max(64, sic.tasks_per_step), cfg.seed + 31)  # refuses the hidden set
    learner = Learner(model, sic.optim, ws.contract.pad_token_id, ws.contract.sampling.temperature, dp=ws.dp)

    def step_fn(step: int) -> dict[str, float]:
        rng = random.Random(cfg.seed * 1_000_003 + step)  # seeded by step: a resumed run redoes it exactly
        tasks = rng.sample(pool, sic.tasks_per_step)
        trajs = ws.rollout.run(model, tasks, policy_version=step, seed=cfg.seed * 7_777 + step)
        wins = [t for t in trajs if t.reward.success]
        metrics = {**rollout_metrics(trajs), "rollouts": float(len(trajs)), "task_success": len(wins) / len(trajs)}
        if wins:
            metrics.update(learner.sft_step(wins))
        return metrics

    return run_stage(ws, "self_imitation", model, learner, sic.steps, step_fn, sic.checkpoint_every, resume)


if __name__ == "__main__":
    from mentorrl.config import load_config
    from mentorrl.models.build import load_policy
    from mentorrl.models.shipped import SHIPPED_ROOT
    from mentorrl.train.workspace import open_workspace

    run_dir = sys.argv[1] if len(sys.argv) > 1 else "runs/self-imitation"
    cfg = load_config(None, [f"run_dir={run_dir}", "threads=1"])
    ws = open_workspace(cfg)
    tokenizer, model = load_policy(SHIPPED_ROOT / "orders-tiny")
    ws.bind_tokenizer(tokenizer)
    print(self_imitation_stage(ws, model, sic=SelfImitationConfig(steps=2, tasks_per_step=4)))
