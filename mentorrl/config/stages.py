"""The stage table: every training stage a recipe can name, what the rest of the package needs to know
about it, and its config section. The built-in stages are written once, in :data:`BUILTIN_STAGES`;
the recipe check, the run config's stage sections, the stage titles and labels, the RL stages of the
report, the data-parallel stages and the stages that write samples all derive from this table.

A stage's code is found through ``runner``: an import path ``"module:function"`` resolved on first use
by :mod:`mentorrl.train.registry` (so the schema layer imports no training code), or the function
itself (a test's or a plugin's stage). A user's stage joins the table with
:func:`mentorrl.train.registry.register_stage` (which calls :func:`register_stage_spec`); a stage with
a ``section`` (a pydantic model) gets a run-config section of its name, validated like the built-in
ones (see :func:`mentorrl.config.run.run_config_model`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

from pydantic import BaseModel

from mentorrl.config.blackbox import BlackBoxConfig
from mentorrl.config.external import ExternalConfig
from mentorrl.config.opd import EvolveConfig, OPDConfig
from mentorrl.config.registry import Registry
from mentorrl.config.rl import GRPOConfig, PPOConfig, SAOConfig
from mentorrl.config.sft import RFTConfig, SFTConfig

Needs = Callable[[Any], list[tuple[str, str]]]
STAGE_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")


@dataclass(frozen=True)
class StageSpec:
    """A training stage.

    ``section``: the pydantic model of its run-config section (the field is the stage's name), or None;
    ``runner``: ``"module:function"`` or the function ``run(ws, model, resume=False) -> final weights dir``;
    ``title``: the rule printed before it runs; ``label``: its short name in the evaluation table;
    ``rl``: a reinforcement-learning stage (the report compares the last one with the stage before it);
    ``parallel``: the learner parallelism it supports under torchrun (``"ddp"``: data-parallel, every rank
    holding the whole model; ``"fsdp2"``: data-parallel with the learner sharded; ``distributed.strategy``);
    ``writes_samples``: it writes ``samples/<name>-step-N.jsonl`` (read by ``mentorrl export``);
    ``needs``: from its section, the ``(field, path)`` of every Hugging Face checkpoint it loads (the
    field relative to the section), checked before the run starts."""

    name: str
    section: type[BaseModel] | None
    runner: str | Callable[..., Any]
    title: str = ""
    label: str = ""
    rl: bool = False
    parallel: frozenset[str] = field(default_factory=frozenset)
    writes_samples: bool = False
    needs: Needs | None = None

    def __post_init__(self) -> None:
        if not STAGE_NAME.fullmatch(self.name):
            raise ValueError(f"stage name {self.name!r}: lower-case letters, digits and _, starting with a letter")
        if isinstance(self.runner, str) and not re.fullmatch(r"[\w.]+:\w+", self.runner):
            raise ValueError(f"stage {self.name}: runner {self.runner!r} must look like 'package.module:function'")
        if self.section is not None and not (isinstance(self.section, type) and issubclass(self.section, BaseModel)):
            raise TypeError(f"stage {self.name}: section must be a pydantic model class, got {self.section!r}")
        object.__setattr__(self, "title", self.title or self.name)
        object.__setattr__(self, "label", self.label or self.name.upper())
        object.__setattr__(self, "parallel", frozenset(self.parallel))

    def checkpoints(self, section: Any) -> list[tuple[str, str]]:
        """(dotted field, path) of the checkpoints this stage loads, given its section's values."""
        if self.needs is None or section is None:
            return []
        return [(f"{self.name}.{f}", p) for f, p in self.needs(section)]


def _critic_checkpoint(s: Any) -> list[tuple[str, str]]:
    separate = s.critic.backbone == "separate" and s.critic.path is not None
    return [("critic.path", s.critic.path)] if separate else []


def _teacher_checkpoints(s: Any) -> list[tuple[str, str]]:
    return [(f"teachers.{i}.path", t.path) for i, t in enumerate(s.teachers) if t.kind == "hf" and t.path is not None]


def _served_teacher(s: Any) -> list[tuple[str, str]]:
    serve = s.teacher.serve
    return [("teacher.serve.path", serve.path)] if serve is not None and serve.path is not None else []


_RECIPES = "mentorrl.train.recipes"
DDP = frozenset({"ddp", "fsdp2"})  # data-parallel under torchrun, the learner replicated (ddp) or sharded (fsdp2)

BUILTIN_STAGES: tuple[StageSpec, ...] = (  # in recipe order
    StageSpec("sft", SFTConfig, f"{_RECIPES}.sft:sft_stage", "SFT on expert demonstrations", "SFT", parallel=DDP),
    StageSpec("rft", RFTConfig, f"{_RECIPES}.rft:rft_stage", "RFT: sample, verify, fine-tune", "RFT"),
    StageSpec(
        "grpo", GRPOConfig, f"{_RECIPES}.grpo:run_grpo", "GRPO", "GRPO", rl=True, parallel=DDP, writes_samples=True
    ),
    StageSpec(
        "ppo", PPOConfig, f"{_RECIPES}.ppo:ppo_stage", "PPO with a critic", "PPO", rl=True, needs=_critic_checkpoint
    ),
    StageSpec(
        "sao",
        SAOConfig,
        f"{_RECIPES}.sao:sao_stage",
        "SAO: asynchronous single-rollout optimisation",
        "SAO",
        rl=True,
        writes_samples=True,
        needs=_critic_checkpoint,
    ),
    StageSpec(
        "opd",
        OPDConfig,
        f"{_RECIPES}.opd:opd_stage",
        "On-policy distillation",
        "OPD",
        rl=True,
        needs=_teacher_checkpoints,
    ),
    StageSpec(
        "blackbox",
        BlackBoxConfig,
        f"{_RECIPES}.blackbox:blackbox_stage",
        "Black-box on-policy distillation",
        "BB-OPD",
        rl=True,
        needs=_served_teacher,
    ),
    StageSpec("evolve", EvolveConfig, f"{_RECIPES}.evolve:evolve_stage", "Self-evolving loop", "Evolve", rl=True),
    StageSpec(
        "external",
        ExternalConfig,
        f"{_RECIPES}.external:run_external",
        "GRPO on an external agent (recorded over HTTP)",
        "External",
        rl=True,
        writes_samples=True,
    ),
)

STAGE_NAMES = tuple(s.name for s in BUILTIN_STAGES)  # the built-in stages
DISTRIBUTED_STAGES = tuple(s.name for s in BUILTIN_STAGES if "ddp" in s.parallel)  # data-parallel under ddp

STAGES: Registry[StageSpec] = Registry("stage")  # run-config fields that are not stages are reserved (config.run)
for _spec in BUILTIN_STAGES:
    STAGES.register(_spec.name, _spec)


def register_stage_spec(spec: StageSpec, replace: bool = False) -> StageSpec:
    """Add ``spec`` to the table; a taken name is an error unless ``replace`` (a built-in stage replaced by a
    test's own comes back with :func:`unregister_stage_spec`)."""
    return STAGES.register(spec.name, spec, replace=replace)


def unregister_stage_spec(name: str) -> None:
    """Forget stage ``name``; a built-in stage goes back to its built-in entry."""
    STAGES.unregister(name)
    builtin = {s.name: s for s in BUILTIN_STAGES}
    if name in builtin:
        STAGES.register(name, builtin[name])


def stage_specs() -> dict[str, StageSpec]:
    """Every stage by name, the built-in ones first in recipe order."""
    return dict(STAGES.items())


def get_stage_spec(name: str) -> StageSpec:
    """Stage ``name``; a ValueError naming the known stages otherwise."""
    return STAGES.get(name)


def stages_supporting(parallel: str) -> tuple[str, ...]:
    """The stages whose learner supports ``parallel`` (``"ddp"`` or ``"fsdp2"``)."""
    return tuple(n for n, s in STAGES.items() if parallel in s.parallel)


def sample_writing_stages() -> tuple[str, ...]:
    """The stages that write ``samples/<name>-step-N.jsonl``."""
    return tuple(n for n, s in STAGES.items() if s.writes_samples)


__all__ = [
    "BUILTIN_STAGES",
    "DISTRIBUTED_STAGES",
    "STAGES",
    "STAGE_NAMES",
    "StageSpec",
    "get_stage_spec",
    "register_stage_spec",
    "sample_writing_stages",
    "stage_specs",
    "stages_supporting",
    "unregister_stage_spec",
]
