"""The distillation stages' sections: on-policy distillation from white-box teachers (MOPD, ShortOPD,
RLSD, reward-weighted) and the self-evolving loop."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from mentorrl.config.base import (
    LossAgg,
    RolloutStageConfig,
    Section,
    StageConfig,
    eps_high_field,
    eps_low_field,
    loss_agg_field,
    updates_per_step_field,
)
from mentorrl.config.model import ModelSpec


class TeacherBuildConfig(Section):
    init: Literal["scratch", "student"] = Field(
        "scratch", description="scratch: a fresh tiny model; student: a copy of the student as it enters the stage, "
                               "trained on (keeps the student's tokenizer and size; the cache key includes a hash "
                               "of the student's weights)")
    vocab_size: int | None = Field(
        None, ge=300, description="null: the student's tokenizer (same corpus and size give the same tokenizer); "
                                  "a number: the teacher's own tokenizer with this vocabulary (cross-tokenizer OPD)")
    spec: ModelSpec | None = Field(None, description="teacher model size; null: the student's model.spec")
    num_demos: int = Field(4000, ge=1, description="expert demonstrations the teacher's SFT draws from")
    sft_steps: int = Field(1500, ge=1, description="SFT steps (the demo's student takes 600)")
    batch_size: int = Field(32, ge=1, description="demonstrations per SFT step")
    lr: float = Field(3e-3, gt=0, description="SFT learning rate")

    @model_validator(mode="after")
    def _student_init_keeps_the_student(self) -> "TeacherBuildConfig":
        if self.init == "student" and (self.vocab_size is not None or self.spec is not None):
            raise ValueError("build.init student continues the student's own weights: it keeps the student's "
                             "tokenizer and size, so leave build.vocab_size and build.spec unset")
        return self


class TeacherConfig(Section):
    name: str = Field("teacher", min_length=1, description="name in logs, samples and MOPD routes")
    kind: Literal["hf", "self"] = Field(
        "hf", description="hf: a local Hugging Face checkpoint; self: a frozen snapshot of the student taken at the "
                          "start of each step (RLSD)")
    path: str | None = Field(
        None, description="hf: checkpoint directory; null: built by `build` (once, cached under opd.teachers_dir)")
    build: TeacherBuildConfig = Field(default_factory=TeacherBuildConfig,
                                      description="how the stronger local teacher is built when path is null (the "
                                                  "demo's SFT stage, longer, on more demonstrations)")
    temperature: float = Field(1.0, gt=0, description="softmax temperature of the teacher's log-probs")
    special_tokens: dict[str, str] = Field(
        default_factory=dict, description="cross-tokenizer: the student's special tokens spelled the teacher's way, "
                                          "e.g. {'<|im_end|>': '<|eot_id|>'}")


class StepWeightConfig(Section):
    tool_error_boost: float = Field(2.0, ge=1, description="distillation weight of a turn whose tool call failed")
    low_reward_boost: float = Field(1.5, ge=1, description="weight of every turn of a trajectory below low_reward")
    low_reward: float = Field(0.5, description="the reward bar of low_reward_boost")
    entropy_threshold: float = Field(1.0, ge=0, description="student entropy (nats) above which a token is unsure")
    entropy_boost: float = Field(1.5, ge=1, description="weight of an unsure token")


class MOPDConfig(Section):
    routes: dict[str, dict[str, float]] = Field(
        default_factory=dict, description="static routing: task family -> {teacher: weight}; unrouted families "
                                          "spread evenly")
    confidence_temperature: float | None = Field(
        None, gt=0, description="weight teachers by softmax(mean token log-prob on the trajectory / T); null: off")
    success_history: bool = Field(
        False, description="weight teachers by their verified success so far (Beta(1,1) posterior mean); each "
                           "trajectory's outcome counts for the teacher that weighed most on it")
    step_weights: StepWeightConfig | None = Field(
        None, description="failure-aware per-token weights (tool errors, low reward, unsure student); null: off")


class ShortOPDConfig(Section):
    threshold: float | None = Field(None, ge=0, description="distil tokens whose |teacher - student| log-prob gap "
                                                             "exceeds this (give this or top_frac)")
    top_frac: float | None = Field(None, gt=0, le=1, description="distil this share of policy tokens, largest gap "
                                                                 "first")
    min_budget: int = Field(128, ge=16, description="rollout token budget (tokens after the prompt) of a task "
                                                     "family whose gap is 0")
    max_budget: int | None = Field(None, ge=16, description="budget at gap >= full_gap, and of families not measured "
                                                            "yet; null: limits.max_total_tokens")
    full_gap: float = Field(0.5, gt=0, description="mean per-token gap (nats) that earns the whole budget")
    ema: float = Field(0.5, gt=0, le=1, description="weight of the newest step in each family's gap average")

    @model_validator(mode="after")
    def _one_rule(self) -> "ShortOPDConfig":
        if (self.threshold is None) == (self.top_frac is None):
            raise ValueError("give exactly one of threshold and top_frac")
        return self


class RLSDConfig(Section):
    coef: float = Field(0.5, ge=0, description="lambda of L_RL + lambda * L_SD")
    target: Literal["selected", "topk"] = Field(
        "selected", description="selected: the sampled tokens of verified trajectories; topk: the snapshot's top-k "
                                "distribution stored at rollout (forward KL)")
    top_k: int = Field(8, ge=1, description="target: topk")
    teacher_temperature: float = Field(0.7, gt=0, description="target: topk: temperature of the stored snapshot "
                                                              "distribution (< 1 sharpens it)")
    reward_temperature: float = Field(1.0, gt=0, description="trajectory weight exp(R / T) among verified ones")
    length_power: float = Field(0.5, ge=0, description="trajectory weight (length / mean) ** -p: shorter wins")
    exploration_share: float = Field(0.25, ge=0, le=1, description="share of each batch trained by RL only")


class RewardWeightedConfig(Section):
    coef: float = Field(1.0, ge=0, description="weight of the weighted-MLE term")
    temperature: float = Field(0.5, gt=0, description="weights softmax(R / T) over each task's group")


class OPDConfig(RolloutStageConfig):
    defaults: ClassVar[dict[str, Any]] = {"steps": 10, "tasks_per_step": 16, "samples_per_task": 2,
                                          "optim": {"lr": 2e-4, "warmup_steps": 2}}

    updates_per_step: int = updates_per_step_field(2, "optimizer steps (minibatches) per pass over a rollout batch")
    epochs: int = Field(1, ge=1, description="passes over each rollout batch (the teacher scores it once); more "
                                             "passes learn more per student rollout token")
    teachers: list[TeacherConfig] = Field(default_factory=lambda: [TeacherConfig()],
                                          description="white-box teachers (several: MOPD)")
    teachers_dir: str | None = Field(
        "runs/teachers", description="built teachers are cached here, one directory per build recipe, shared by "
                                     "runs; null: RUN_DIR/teachers")
    loss: Literal["sampled", "topk"] = Field(
        "sampled", description="sampled: the sampled-token (chunk) reverse-KL estimate as a per-token advantage in "
                               "the clipped policy loss; topk: a divergence over the teacher's top-k (same tokenizer)")
    center: bool = Field(True, description="loss sampled: subtract the batch mean of the distillation advantage "
                                           "(a baseline; the raw advantages average to minus the reverse KL)")
    divergence: Literal["reverse", "forward", "jsd"] = Field("reverse", description="loss topk: the divergence")
    beta: float = Field(0.5, ge=0, le=1, description="loss topk, divergence jsd: its beta")
    top_k: int = Field(16, ge=1, description="loss topk: teacher tokens kept per position")
    topk_tail: bool = Field(True, description="loss topk: compare the top-k plus one bin for the rest of the mass "
                                              "(false: renormalise over the k tokens, which ignores mass the student "
                                              "moves outside them)")
    kl_coef: float = Field(1.0, ge=0, description="weight of the distillation advantage / loss")
    distill_until: Literal["end", "first_error"] = Field(
        "end", description="first_error: distil a trajectory only up to its first failed tool call (the states after "
                           "it are off the teacher's support)")
    reward_coef: float = Field(0.0, ge=0, description="RL + beta*KL: weight of the group-relative environment "
                                                      "advantage (0: pure distillation)")
    cross_tokenizer: Literal["chunk", "sequence"] = Field(
        "chunk", description="teachers with another tokenizer: chunk-level OPD, or the sequence-level fallback "
                             "(the teacher's own verified episodes, re-tokenised, as SFT targets)")
    mopd: MOPDConfig = Field(default_factory=MOPDConfig, description="multi-teacher weighting")
    short: ShortOPDConfig | None = Field(None, description="ShortOPD: distil large-gap tokens, adapt rollout budgets")
    rlsd: RLSDConfig | None = Field(None, description="RLSD: self-distillation of verified trajectories (teacher kind self)")
    reward_weighted: RewardWeightedConfig | None = Field(
        None, description="reward-weighted distillation: weighted MLE on the group, weights softmax(R / T)")
    eps_low: float = eps_low_field()
    eps_high: float = eps_high_field()
    loss_agg: LossAgg = loss_agg_field()
    eval_every: int = Field(0, ge=0, description="held-out check every N steps, logged with the rollout tokens so "
                                                 "far (0: off)")
    eval_tasks: int = Field(200, ge=1, description="tasks per held-out check")
    sample_trajectories: int = Field(8, ge=0, description="trajectories per step written to samples/, with each "
                                                          "teacher's signal and weight in opd/signals-step-N.jsonl")

    @model_validator(mode="after")
    def _coherent(self) -> "OPDConfig":
        names = [t.name for t in self.teachers]
        if len(set(names)) != len(names):
            raise ValueError(f"teacher names must be unique, got {names}")
        selfs = [t for t in self.teachers if t.kind == "self"]
        if self.rlsd is not None and (len(self.teachers) != 1 or not selfs):
            raise ValueError("rlsd needs exactly one teacher, of kind self")
        if self.rlsd is not None and self.reward_coef <= 0:
            raise ValueError("rlsd is L_RL + lambda * L_SD: set reward_coef > 0 (the RL term)")
        if selfs and self.rlsd is None:
            raise ValueError("a teacher of kind self is the RLSD recipe: set opd.rlsd")
        for fam, route in self.mopd.routes.items():
            unknown = set(route) - set(names)
            if unknown:
                raise ValueError(f"mopd.routes[{fam!r}] names unknown teachers {sorted(unknown)}")
        if not self.teachers and self.reward_weighted is None and self.reward_coef == 0:
            raise ValueError("no teachers, no reward_weighted and reward_coef 0: nothing to learn from")
        if (self.reward_weighted is not None or self.reward_coef > 0 or self.rlsd is not None) and self.samples_per_task < 2:
            raise ValueError("reward terms (reward_coef, reward_weighted, rlsd) compare a task's samples: "
                             "samples_per_task must be >= 2")
        return self


class EvolveConfig(StageConfig):
    defaults: ClassVar[dict[str, Any]] = {"optim": {"lr": 1e-4, "warmup_steps": 2}}

    iterations: int = Field(3, ge=1, description="self-evolving iterations (each: OPD steps, held-out check, gate)")
    steps_per_iteration: int = Field(5, ge=1, description="learning steps per iteration")
    tasks_per_step: int = Field(16, ge=1, description="curriculum tasks per step")
    samples_per_task: int = Field(4, ge=2, description="student rollouts per task")
    kl_coef: float = Field(0.5, ge=0, description="weight of the distillation advantage towards the current teacher")
    reward_coef: float = Field(1.0, ge=0, description="weight of the group-relative environment advantage")
    replay_coef: float = Field(0.5, ge=0, description="weight of the SFT term on replayed verified trajectories")
    replay_batch: int = Field(16, ge=0, description="verified trajectories replayed per step")
    raise_above: float = Field(0.6, ge=0, le=1, description="curriculum: raise the level above this success")
    lower_below: float = Field(0.2, ge=0, le=1, description="curriculum: lower the level below this success")
    window: int = Field(64, ge=1, description="curriculum: outcomes per success estimate")
    accept_margin: float = Field(0.0, ge=0, description="accept a version unless its held-out success drops by more "
                                                        "than this below the best accepted")
    eval_tasks: int = Field(200, ge=1, description="held-out tasks per version")
    eps_low: float = eps_low_field()
    eps_high: float = eps_high_field()

    @model_validator(mode="after")
    def _curriculum_band(self) -> "EvolveConfig":
        if not self.lower_below < self.raise_above:
            raise ValueError(f"lower_below ({self.lower_below}) must be below raise_above ({self.raise_above})")
        return self


__all__ = [
    "EvolveConfig", "MOPDConfig", "OPDConfig", "RLSDConfig", "RewardWeightedConfig", "ShortOPDConfig",
    "StepWeightConfig", "TeacherBuildConfig", "TeacherConfig",
]
