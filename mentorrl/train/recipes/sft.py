"""SFT on the scripted expert's verified demonstrations, or on a dataset of conversations
(``sft.demos``: TRL's conversational format, e.g. from ``mentorrl export``) (``recipe: [sft, ...]``)."""

from __future__ import annotations

from pathlib import Path

from mentorrl.train.loop import Stage, StepBatch, run_on_loop
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


class SFTStage(Stage):
    """``sft.steps`` steps of the SFT loss on batches drawn (seeded by step) from the demonstrations."""

    name = "sft"
    data_parallel = True
    update_metrics = ()

    def __init__(self, ws: Workspace, model):
        super().__init__(ws, model)
        self.demos = sft_demonstrations(ws)

    def rollout(self, b: StepBatch) -> None:
        """No rollout: the step's batch is drawn from the demonstrations."""
        rng = b.seeds.rng("batch")
        b.trajs = [self.demos[i] for i in rng.sample(range(len(self.demos)), min(self.cfg.batch_size, len(self.demos)))]

    def score(self, b: StepBatch) -> None:
        """Demonstrations need no reward."""

    def update(self, b: StepBatch) -> None:
        b.metrics.update(self.learner.sft_step(b.trajs, agg=self.cfg.loss_agg))
        b.metrics["train_tokens"] = float(sum(t.num_policy_tokens for t in b.trajs))  # for tokens/s


sft_stage = run_on_loop(SFTStage)
