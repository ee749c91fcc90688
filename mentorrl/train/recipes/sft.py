"""SFT on the scripted expert's verified demonstrations, or on a dataset of conversations
(``sft.demos``: TRL's conversational format, e.g. from ``mentorrl export``) (``recipe: [sft, ...]``)."""

from __future__ import annotations

import random
from pathlib import Path

from mentorrl.train.learner import Learner
from mentorrl.train.registry import register_stage
from mentorrl.train.stage_runner import run_stage
from mentorrl.train.workspace import Workspace


def sft_demonstrations(ws: Workspace) -> list:
    """The SFT set: ``sft.demos`` tokenised with this run's tokenizer, else the scripted expert's
    verified demonstrations on ``sft.num_demos`` train tasks."""
    cfg = ws.cfg
    if cfg.sft.demos:
        from mentorrl.datasets_io import import_demos, load_rows

        demos = import_demos(load_rows(Path(cfg.sft.demos)), ws.tokenizer)
        if not demos:
            raise RuntimeError(f"sft.demos {cfg.sft.demos}: no train-split conversation to learn from")
        return demos
    tasks = ws.train_tasks(cfg.sft.num_demos, cfg.seed)
    demos = ws.rollout.demonstrations(ws.env_entry.make_expert(), tasks)
    if not demos:
        raise RuntimeError("the scripted expert produced no verified demonstrations")
    return demos


@register_stage("sft", config="sft", title="SFT on expert demonstrations", label="SFT")
def sft_stage(ws: Workspace, model, resume: bool = False) -> Path:
    """``sft.steps`` steps of the SFT loss on batches drawn (seeded by step) from the demonstrations."""
    cfg = ws.cfg
    demos = sft_demonstrations(ws)
    learner = Learner(model, cfg.sft.optim, ws.contract.pad_token_id, ws.contract.sampling.temperature, dp=ws.dp)

    def step_fn(step: int) -> dict[str, float]:
        rng = random.Random(cfg.seed * 1_000_003 + step)
        batch = [demos[i] for i in rng.sample(range(len(demos)), min(cfg.sft.batch_size, len(demos)))]
        return learner.sft_step(batch, agg=cfg.sft.loss_agg)

    return run_stage(ws, "sft", model, learner, cfg.sft.steps, step_fn, checkpoint_every=cfg.sft.checkpoint_every,
                     resume=resume)
