"""The building blocks of every config section: the strict section base, the optimiser settings, the
field helpers and :class:`StageConfig`, the base of every training stage's section.

Schema only: this package imports pydantic, yaml, the standard library and itself, nothing else.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticUndefined


class ConfigError(ValueError):
    """A config that cannot be used; the message names the file or the dotted field."""


class Section(BaseModel):
    """A config section: unknown fields fail (with their dotted path, see :mod:`mentorrl.config.loading`)."""

    model_config = ConfigDict(extra="forbid")


class OptimConfig(Section):
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping")
    warmup_steps: int = Field(0, ge=0, description="linear learning-rate warm-up")
    micro_batch_size: int = Field(32, ge=1, description="sequences per forward/backward; gradients accumulate")
    micro_batch_tokens: int | None = Field(
        None,
        ge=1,
        description="size micro-batches by tokens instead (replaces micro_batch_size): rows are taken in order "
        "while rows x the longest row stays within this many tokens (a longer row alone is one "
        "micro-batch); the update is the same, only the memory peak changes",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="recompute each decoder layer's activations in the backward pass instead of keeping them "
        "(the model's own checkpointing, and the learner's prefix-tree forward layer by layer): less "
        "activation memory for about one more forward; the same gradients",
    )
    offload_optimizer: bool = Field(
        False,
        description="keep AdamW's state (and the fp32 copy it steps) in CPU memory while the model is on a GPU; "
        "each step brings the gradients over and writes the weights back. No effect on a CPU learner",
    )
    pack_prefixes: bool = Field(
        True,
        description="run each token prefix a micro-batch's sequences share once "
        "(prefix-tree packing with a tree attention mask): the same loss and gradient "
        "as the padded forward, with fewer tokens; the padded forward where the model "
        "cannot take a tree mask",
    )
    tree_attention: bool = Field(
        True,
        description="with pack_prefixes: pack a micro-batch as one prefix trie whose "
        "attention is block-sparse (each query block attends to its nodes' ancestors only) "
        "for the decoders that support it (Qwen2, Llama); false: a dense tree mask over "
        "packed rows of bounded length",
    )


# ---- fields every policy-update stage shares, declared once (each stage keeps its own defaults) ----
LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
CLIP_LOW, CLIP_HIGH = "clip range below 1 of the importance ratio", "clip range above 1 of the importance ratio"


def eps_low_field(description: str = CLIP_LOW) -> Any:
    return Field(0.2, ge=0, description=description)


def eps_high_field(description: str = CLIP_HIGH) -> Any:
    return Field(0.28, ge=0, description=description)


def loss_agg_field(description: str = "loss aggregation, as for SFT") -> Any:
    return Field("token-mean", description=description)


def updates_per_step_field(default: int, description: str) -> Any:
    return Field(default, ge=1, description=description)


def checkpoint_every_field(default: int = 5, description: str = "steps between checkpoints") -> Any:
    return Field(default, ge=1, description=description)


def optim_field(**defaults: Any) -> Any:
    """The stage's AdamW settings; ``defaults`` are this stage's defaults (lr, warmup_steps, ...)."""
    return Field(default_factory=lambda: OptimConfig(**defaults))


def _with_default(info: Any, value: Any) -> Any:
    """A copy of field ``info`` whose default is ``value`` (a dict for a section field: its field defaults)."""
    info = copy.copy(info)
    if isinstance(value, dict) and isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
        section = info.annotation
        info.default, info.default_factory = PydanticUndefined, (lambda: section(**value))
    else:
        info.default, info.default_factory = value, None
    return info


class StageConfig(Section):
    """The base of every training stage's section: the fields all stages share, named one way.

    A subclass changes a shared field's default with ``defaults`` (a section field such as ``optim``
    takes a dict of its own fields), and names keys it renamed in ``renamed`` (old -> new), which then
    fail with a message naming the new key::

        class MyStageConfig(RolloutStageConfig):
            defaults: ClassVar[dict[str, Any]] = {"steps": 5, "optim": {"lr": 1e-4}}
            renamed: ClassVar[dict[str, str]] = {"group_size": "samples_per_task"}
    """

    defaults: ClassVar[dict[str, Any]] = {}
    renamed: ClassVar[dict[str, str]] = {}

    optim: OptimConfig = Field(default_factory=OptimConfig, description="the stage's AdamW settings")

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        own = cls.__dict__.get("defaults") or {}
        unknown = set(own) - set(cls.model_fields)
        if unknown:
            raise TypeError(f"{cls.__name__}.defaults names no field: {sorted(unknown)}")
        if own:
            for name, value in own.items():
                cls.model_fields[name] = _with_default(cls.model_fields[name], value)
            cls.model_rebuild(force=True)

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        old = [k for k in cls.renamed if isinstance(data, dict) and k in data]
        if old:
            raise ValueError("; ".join(f"{k} was renamed: write {cls.renamed[k]} instead" for k in old))
        return data


class StepStageConfig(StageConfig):
    """A stage of optimizer steps, checkpointed every few."""

    steps: int = Field(20, ge=0, description="optimizer steps")
    checkpoint_every: int = checkpoint_every_field()


class UpdateStageConfig(StepStageConfig):
    """A stage whose steps each make one or more policy updates."""

    updates_per_step: int = updates_per_step_field(2, "optimizer steps (minibatches) per rollout batch")


class RolloutStageConfig(UpdateStageConfig):
    """A stage whose steps each roll out groups of samples on a few tasks."""

    steps: int = Field(20, ge=0, description="steps (one rollout batch each)")
    tasks_per_step: int = Field(16, ge=1, description="distinct tasks per step")
    samples_per_task: int = Field(1, ge=1, description="rollouts per task (a group)")


__all__ = [
    "CLIP_HIGH",
    "CLIP_LOW",
    "ConfigError",
    "LossAgg",
    "OptimConfig",
    "RolloutStageConfig",
    "Section",
    "StageConfig",
    "StepStageConfig",
    "UpdateStageConfig",
    "checkpoint_every_field",
    "eps_high_field",
    "eps_low_field",
    "loss_agg_field",
    "optim_field",
    "updates_per_step_field",
]
