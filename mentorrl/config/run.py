"""The run config: the run-wide fields, one section per stage of the stage table
(:mod:`mentorrl.config.stages`), and the audit, evaluation, rollout, distributed and logging sections.

:data:`RunConfig` holds the built-in stages' sections; :func:`run_config_model` is the model of the
current stage table: :data:`RunConfig` itself, or a subclass of it with a section for every stage
registered later (a plugin's), so a plugin's section validates like a built-in one.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationError, create_model, field_validator, model_validator

from mentorrl.config.base import Section
from mentorrl.config.env import EnvConfig
from mentorrl.config.model import ModelConfig
from mentorrl.config.names import assert_trainable_splits
from mentorrl.config.plugins import MODULE_PATH, load_plugins
from mentorrl.config.prompt import ContractLimits, PromptFormat, SamplingParams
from mentorrl.config.reward import RewardWeights
from mentorrl.config.sections import AuditConfig, DistributedConfig, EvalConfig, LoggingConfig, RolloutConfig
from mentorrl.config.stages import BUILTIN_STAGES, STAGE_NAMES, STAGES, StageSpec, stage_specs

MAX_PLUGINS = 32


class RunSettings(Section):
    """The run-wide fields (every field but the sections of :data:`RunConfig`)."""

    run_dir: str = Field("runs/demo", description="where everything is written")
    seed: int = Field(0, description="seeds task sampling, batches and rollouts")
    recipe: list[str] = Field(
        default_factory=lambda: ["sft", "grpo"],
        min_length=1,
        description="stages run in order: " + ", ".join(STAGE_NAMES) + ", or a stage registered with "
        "mentorrl.train.registry.register_stage (e.g. by a plugin)",
    )
    plugins: list[str] = Field(
        default_factory=list,
        max_length=MAX_PLUGINS,
        description="modules imported before the rest of the config is validated, e.g. [my_pkg.stages]: each may "
        "register stages (with their own config sections) and environments; installed packages' "
        "`mentorrl.stages` / `mentorrl.envs` entry points load without being listed",
    )
    train_split: str = Field("train", description="task split every training stage draws from (never 'hidden')")
    threads: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        0,
        description="torch CPU threads; 0 keeps torch's default; auto: chosen for the machine and the recipe "
        "(cores, device, grpo.overlap, torchrun ranks; with distributed.backend: ray also the rollout "
        "workers), printed at start and written to RUN_DIR/parallelism.json (docs/scaling.md)",
    )
    malloc_mmap_threshold: Annotated[int, Field(ge=1 << 12, le=1 << 30)] | Literal["auto"] | None = Field(
        "auto",
        description="bytes (glibc only): every CPU block at least this large gets a mapping of its own, returned to "
        "the OS when freed (low: a lean peak, e.g. 1 MiB kept 1.5 GiB off a 0.5B LoRA step, docs/scaling.md#memory; "
        "each large tensor then costs page faults, 1.8x a SmolLM2 LoRA SFT step); auto: 1 MiB when a stage sets "
        "gradient_checkpointing, micro_batch_tokens or offload_optimizer, else 1 GiB; null keeps glibc's default; "
        "MALLOC_MMAP_THRESHOLD_ or GLIBC_TUNABLES in the environment win",
    )
    stage_processes: bool = Field(
        False,
        description="run each stage, each held-out evaluation and each final-split evaluation in a fresh process "
        "that resumes the run from RUN_DIR: no allocator state carries from one to the next (one long SmolLM2 "
        "process rolled out 1.32x slower than fresh ones, docs/results.md); costs a model load per unit; "
        "one process at a time (under torchrun ranks, one a rank; not with distributed.backend ray)",
    )
    huge_pages: bool = Field(
        False,
        description="with stage_processes: start them with THP_MEM_ALLOC_ENABLE=1, so torch asks for transparent "
        "huge pages for CPU buffers of 2 MB and more (Linux, THP madvise; SmolLM2 rollouts ~12% faster here, "
        "docs/scaling.md); torch reads it once at start (in one process, export THP_MEM_ALLOC_ENABLE=1 instead)",
    )
    env: EnvConfig = Field(default_factory=EnvConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    limits: ContractLimits = Field(default_factory=ContractLimits)
    prompt: PromptFormat = Field(default_factory=PromptFormat)
    reward: RewardWeights = Field(default_factory=RewardWeights)

    @field_validator("recipe")
    @classmethod
    def _registered_stages(cls, v: list[str]) -> list[str]:
        known = stage_specs()
        unknown = [name for name in v if name not in known]
        if unknown:
            raise ValueError(f"unknown stage(s) {unknown}; registered: {', '.join(known)}")
        return v

    @field_validator("plugins")
    @classmethod
    def _module_paths(cls, v: list[str]) -> list[str]:
        bad = [m for m in v if not MODULE_PATH.fullmatch(m)]
        if bad:
            raise ValueError(f"not a module path (package.module): {bad}")
        return v

    @field_validator("train_split")
    @classmethod
    def _hidden_is_never_trained_on(cls, v: str) -> str:
        assert_trainable_splits([v])  # HiddenSetError is a ValueError: reported with the field name
        return v

    @model_validator(mode="after")
    def _stage_processes(self) -> "RunSettings":
        dist = getattr(self, "distributed", None)
        if self.huge_pages and not self.stage_processes:
            raise ValueError(
                "huge_pages needs stage_processes: true (torch reads THP_MEM_ALLOC_ENABLE once, when it starts; "
                "in one process, export THP_MEM_ALLOC_ENABLE=1 before mentorrl starts)"
            )
        if self.stage_processes and dist is not None and dist.backend == "ray":
            raise ValueError("stage_processes runs one process at a time; not with distributed.backend ray")
        return self

    @model_validator(mode="after")
    def _reward_range(self) -> "RunSettings":
        audit = getattr(self, "audit", None)
        if audit is not None and not audit.reward_low < audit.reward_high:
            raise ValueError(
                f"audit.reward_low ({audit.reward_low}) must be below audit.reward_high ({audit.reward_high})"
            )
        return self

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # by value through the current stage table: a plugin's run config is a class made at run time
        return restore_run_config, (self.model_dump(mode="json"),)


TAIL_SECTIONS: dict[str, type[BaseModel]] = {
    "audit": AuditConfig,
    "eval": EvalConfig,
    "rollout": RolloutConfig,
    "distributed": DistributedConfig,
    "logging": LoggingConfig,
}


def _section_field(section: type[BaseModel], description: str | None = None) -> tuple[Any, Any]:
    try:
        section()
    except ValidationError:  # a section with required fields: the config must give it
        return section, Field(..., description=description)
    return section, Field(default_factory=section, description=description)


def _stage_fields(specs: list[StageSpec]) -> dict[str, Any]:
    return {s.name: _section_field(s.section, f"the {s.name} stage's settings") for s in specs if s.section is not None}


RunConfig = create_model(  # the run config of the built-in stages
    "RunConfig",
    __base__=RunSettings,
    __module__=__name__,
    __doc__="The whole run config: run-wide fields, one section per built-in stage, then the run's other sections.",
    **_stage_fields(list(BUILTIN_STAGES)),
    **{k: (v, Field(default_factory=v)) for k, v in TAIL_SECTIONS.items()},
)
for _field in RunConfig.model_fields:  # no stage may take the name of a run-config section that is not one
    if _field not in STAGE_NAMES:
        STAGES.reserve(_field, "a run-config section that is not a stage; pick another")


def run_config_model() -> type[BaseModel]:
    """The run-config model of the current stage table: :data:`RunConfig`, or (once a stage with a
    section of another name or class is registered) a subclass of it with that stage's section."""
    extra = [
        s for s in stage_specs().values() if s.section is not None and RunConfig.model_fields.get(s.name, None) is None
    ]
    changed = [
        s
        for s in stage_specs().values()
        if s.section is not None
        and s.name in RunConfig.model_fields
        and RunConfig.model_fields[s.name].annotation is not s.section
    ]
    if not extra and not changed:
        return RunConfig
    return _run_config_subclass(tuple((s.name, s.section) for s in extra + changed))


@functools.cache  # one class per set of sections: a config restored twice is of one class
def _run_config_subclass(sections: tuple[tuple[str, type[BaseModel]], ...]) -> type[BaseModel]:
    fields = {name: _section_field(section, f"the {name} stage's settings") for name, section in sections}
    return create_model("RunConfig", __base__=RunConfig, __module__=__name__, **fields)


def restore_run_config(data: dict[str, Any]) -> BaseModel:
    """A pickled run config back: its plugins loaded first, then validated by :func:`run_config_model`."""
    load_plugins(data.get("plugins") or [])
    return run_config_model().model_validate(data)


__all__ = ["RunConfig", "RunSettings", "restore_run_config", "run_config_model"]
