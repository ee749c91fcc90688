"""SFT on the scripted expert's verified demonstrations (of the task families ``sft.families`` only, when
set: a specialist), or on a dataset of conversations (``sft.demos``: TRL's conversational format, e.g. from
``mentorrl export``) (``recipe: [sft, ...]``)."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from mentorrl.config import ConfigError
from mentorrl.envs.base import UnknownFamilyError
from mentorrl.train.loop import Stage, StepBatch, run_on_loop
from mentorrl.train.workspace import Workspace
from mentorrl.trajectory import Trajectory


def sft_demonstrations(ws: Workspace, section=None, where: str = "sft") -> list:
    """The SFT set of ``section`` (an :class:`~mentorrl.config.SFTConfig` at field ``where``; default
    ``ws.cfg.sft``): its ``demos`` tokenised with this run's tokenizer, else the scripted expert's verified
    demonstrations on ``num_demos`` train tasks, of its ``families`` only when set."""
    cfg = ws.cfg.sft if section is None else section
    if cfg.demos:
        from mentorrl.datasets_io import import_demos, load_rows

        demos = import_demos(load_rows(Path(cfg.demos)), ws.tokenizer)
        if not demos:
            raise RuntimeError(f"{where}.demos {cfg.demos}: no train-split conversation to learn from")
        return demos
    try:
        tasks = ws.train_tasks(cfg.num_demos, ws.cfg.seed, families=cfg.families)
    except UnknownFamilyError as e:
        raise ConfigError(f"{where}.families {cfg.families}: {e}") from None
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
        if not (ws.run_dir / self.name / "final" / "DONE").exists():
            self.demos  # noqa: B018 -- built now, before the step loop allocates anything (as always)

    @cached_property
    def demos(self) -> list[Trajectory]:
        """The verified demonstrations. A stage whose final weights are already there (each later stage process of
        ``stage_processes: true`` opens the run again) builds them only if a step needs them, so a resumed
        complete stage builds none (800 sandboxed code solutions took four minutes a process)."""
        return sft_demonstrations(self.ws, self.cfg, self.section or self.name)

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
