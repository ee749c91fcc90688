"""The supervised stages' sections: SFT on demonstrations and RFT (sample, verify, fine-tune)."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, field_validator, model_validator

from mentorrl.config.base import LossAgg, StageConfig, StepStageConfig, checkpoint_every_field, loss_agg_field


def distinct_families(v: list[str] | None) -> list[str] | None:
    """A ``families`` filter that names each family once (a ValueError, reported with the field, if not)."""
    if v is not None and len(set(v)) != len(v):
        raise ValueError(f"families lists a family more than once: {v}")
    return v


class SFTConfig(StepStageConfig):
    defaults: ClassVar[dict[str, Any]] = {"steps": 40, "optim": {"lr": 3e-3, "warmup_steps": 5}}

    num_demos: int = Field(1000, ge=1, description="expert demonstrations on train tasks")
    demos: str | None = Field(
        None,
        description="train on this dataset instead of the scripted expert: conversations in TRL's format (a "
        "Parquet file, save_to_disk folder or JSON lines, e.g. from `mentorrl export`), validated and "
        "tokenised with this run's tokenizer; train-split rows only",
    )
    families: list[str] | None = Field(
        None,
        min_length=1,
        description="draw the scripted expert's demonstrations only from train tasks of these task families "
        "(num_demos tasks of them, in the task source's own mix; e.g. one half of orders' families for a "
        "specialist teacher, docs/opd.md); each must be a family of the environment (checked before the first "
        "step); null: every family",
    )
    batch_size: int = Field(32, ge=1, description="demonstrations per step")
    loss_agg: LossAgg = loss_agg_field("token-mean, seq-mean-token-mean or seq-mean-token-sum")
    checkpoint_every: int = checkpoint_every_field(
        10, "steps between checkpoints (weights, optimizer and RNG state); --resume continues from the last"
    )

    @field_validator("families")
    @classmethod
    def _distinct_families(cls, v: list[str] | None) -> list[str] | None:
        return distinct_families(v)

    @model_validator(mode="after")
    def _families_filter_the_expert(self) -> "SFTConfig":
        if self.families is not None and self.demos is not None:
            raise ValueError("families filters the scripted expert's tasks: give it or demos (a dataset), not both")
        return self


class RFTConfig(StageConfig):
    defaults: ClassVar[dict[str, Any]] = {"optim": {"lr": 2e-4}}

    max_iterations: int = Field(3, ge=1, description="sample -> filter -> fine-tune rounds at most")
    num_tasks: int = Field(
        128, ge=1, description="train tasks sampled each round (coverage beats depth: see docs/rl.md)"
    )
    samples_per_task: int = Field(4, ge=1, description="N trajectories per task per round")
    top_k: int = Field(2, ge=1, description="successes kept per task (distinct tool-call sequences first)")
    band: tuple[float, float] = Field((0.05, 0.5), description="keep tasks whose estimated success lies in [lo, hi]")
    min_gain: float = Field(0.0, ge=0, description="stop when the positive-task rate rises by no more than this")
    sft_steps: int = Field(15, ge=1, description="fine-tuning steps on the RFT set per round")
    batch_size: int = Field(32, ge=1, description="trajectories per fine-tuning step")
    rollout_batch: int = Field(256, ge=1, description="trajectories decoded together")

    @field_validator("band")
    @classmethod
    def _band_is_an_interval(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not 0.0 <= v[0] <= v[1] <= 1.0:
            raise ValueError(f"band must satisfy 0 <= lo <= hi <= 1, got {list(v)}")
        return v


__all__ = ["RFTConfig", "SFTConfig", "distinct_families"]
