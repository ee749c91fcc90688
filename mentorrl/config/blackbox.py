"""The black-box on-policy distillation stage's section: a teacher reached through an OpenAI-compatible
endpoint (or a local checkpoint served for the stage), and one recipe of learning from it."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from mentorrl.config.base import (
    LossAgg,
    RolloutStageConfig,
    Section,
    eps_high_field,
    eps_low_field,
    loss_agg_field,
    updates_per_step_field,
)
from mentorrl.config.client import ClientConfig
from mentorrl.config.opd import TeacherConfig


class BlackBoxTeacherConfig(Section):
    client: ClientConfig = Field(
        default_factory=ClientConfig,
        description="the OpenAI-compatible endpoint (base URL, "
        "model, key variable, timeouts, retries, concurrency, response cache)",
    )
    serve: TeacherConfig | None = Field(
        None,
        description="a local checkpoint served by `mentorrl serve` on 127.0.0.1 for the stage, used only "
        "through HTTP (client.base_url is then ignored): {path: DIR}, or {build: ...} to build it "
        "once like an OPD teacher (cached under opd.teachers_dir); null: use client.base_url",
    )
    mode: Literal["acting", "prompted"] = Field(
        "acting",
        description="acting: every signal from the teacher's sampled next actions at the student's states "
        "(any chat policy); prompted: ask for rankings, scores and critiques as JSON "
        "(instruction-following API models)",
    )
    samples: int = Field(4, ge=1, description="acting: teacher actions sampled per state")
    temperature: float = Field(1.0, ge=0, description="acting: temperature of those samples")
    act_temperature: float = Field(0.0, ge=0, description="temperature of the teacher's corrections (0: greedy)")
    threshold: float = Field(0.5, ge=0, le=1, description="a student turn scored below this is wrong")
    max_tokens: int = Field(96, ge=1, description="per teacher answer")


class PreferenceConfig(Section):
    loss: Literal["dpo", "ipo", "orpo"] = Field("dpo", description="preference loss on (best, worst) pairs")
    beta: float = Field(0.1, gt=0, description="dpo: inverse temperature of the implicit reward")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="dpo: conservative-DPO label noise")
    tau: float = Field(0.1, gt=0, description="ipo: the margin target is 1 / (2 tau)")
    lam: float = Field(0.1, ge=0, description="orpo: weight of the odds-ratio term")
    min_margin: float = Field(0.1, ge=0, description="a pair needs the teacher's scores to differ by at least this")
    pairs: Literal["best_worst", "all"] = Field(
        "best_worst",
        description="per task: the best and worst candidate, or every pair whose scores differ by min_margin",
    )
    verifier_veto: bool = Field(
        True,
        description="drop a pair whose chosen side broke a hard constraint or failed "
        "where the rejected side succeeded (the verifier stays authoritative)",
    )
    average: bool = Field(
        False,
        description="dpo: compare mean token log-probs instead of sums (length-normalised, "
        "as SimPO; use a larger beta); ipo always does",
    )
    nll_coef: float = Field(
        0.0,
        ge=0,
        description="dpo: add this times the chosen trajectory's token-mean NLL (RPO); "
        "on-policy pairs otherwise let both sides' likelihood drift",
    )
    teacher_coef: float = Field(
        1.0,
        ge=0,
        le=1,
        description="candidates are ranked by (1 - c) * verifier reward + "
        "c * teacher score (as score.teacher_coef); 1: the "
        "teacher alone; 0: the verifier alone (an ablation: "
        "no teacher call)",
    )


class ScoreRewardConfig(Section):
    weights: dict[str, float] = Field(
        default_factory=lambda: {
            "task_success": 0.5,
            "tool_correctness": 0.2,
            "final_answer": 0.2,
            "efficiency": 0.1,
            "safety": 0.0,
        },
        description="rubric dimension -> weight of the teacher's score (dimensions it does not give are left out)",
    )
    teacher_coef: float = Field(
        0.5,
        ge=0,
        le=1,
        description="reward = (1 - c) * verifier + c * teacher score; a "
        "trajectory that breaks a hard constraint keeps the "
        "verifier's reward",
    )


class CritiqueConfig(Section):
    coef: float = Field(
        0.5,
        ge=0,
        description="weight of the standardised step score in each turn's advantage "
        "(added to the group-relative outcome advantage)",
    )


class SoftLabelConfig(Section):
    temperature: float = Field(0.1, gt=0, description="teacher weights softmax(score / T) over a task's candidates")
    average: bool = Field(True, description="the student's candidate score is its mean token log-prob (false: sum)")


class ActionRankConfig(Section):
    candidates: int = Field(4, ge=1, description="student samples of the next turn at each state")
    states_per_trajectory: int = Field(2, ge=1, description="states (student turns) per trajectory")
    include_teacher_action: bool = Field(True, description="add the teacher's own action to the candidates")
    temperature: float = Field(0.1, gt=0, description="teacher weights softmax(score / T) over the candidates")
    average: bool = Field(False, description="the student's action score is its mean token log-prob (false: sum)")
    loss: Literal["soft_labels", "preference"] = Field(
        "soft_labels",
        description="soft_labels: cross-entropy to softmax(score / T) over each state's candidates; "
        "preference: pairs of a state's candidate actions (best and worst, or all: "
        "preference.pairs) under the preference loss (DPO / IPO / ORPO), turn by turn",
    )


class CorrectionConfig(Section):
    only_failed: bool = Field(True, description="correct only trajectories the verifier failed")
    require_success: bool = Field(True, description="keep a correction only when the verifier passes it")


BLACKBOX_RECIPES = ("correction", "ranking", "score", "critique", "soft_labels", "actions")


class BlackBoxConfig(RolloutStageConfig):
    defaults: ClassVar[dict[str, Any]] = {
        "steps": 10,
        "tasks_per_step": 8,
        "samples_per_task": 4,
        "updates_per_step": 1,
        "optim": {"lr": 1e-4, "warmup_steps": 2},
    }

    recipe: Literal["correction", "ranking", "score", "critique", "soft_labels", "actions"] = Field(
        "ranking",
        description="correction: SFT on the teacher's continuation from the first wrong step; ranking: "
        "DPO-family pairs; score: teacher rubric fused with the verifier as a GRPO reward; "
        "critique: step scores as step advantages; soft_labels: candidate-level distillation; "
        "actions: action-level distillation over candidate tool calls",
    )
    teacher: BlackBoxTeacherConfig = Field(default_factory=BlackBoxTeacherConfig)
    updates_per_step: int = updates_per_step_field(
        1,
        "optimizer steps per rollout batch: minibatches for the "
        "policy-gradient recipes (score, critique), passes over the "
        "pairs / candidate groups for ranking, soft_labels, actions",
    )
    eps_low: float = eps_low_field()
    eps_high: float = eps_high_field()
    loss_agg: LossAgg = loss_agg_field("policy-gradient and SFT loss aggregation")
    preference: PreferenceConfig = Field(default_factory=PreferenceConfig)
    score: ScoreRewardConfig = Field(default_factory=ScoreRewardConfig)
    critique: CritiqueConfig = Field(default_factory=CritiqueConfig)
    soft_labels: SoftLabelConfig = Field(default_factory=SoftLabelConfig)
    actions: ActionRankConfig = Field(default_factory=ActionRankConfig)
    correction: CorrectionConfig = Field(default_factory=CorrectionConfig)
    eval_every: int = Field(0, ge=0, description="held-out check every N steps (0: off)")
    eval_tasks: int = Field(200, ge=1, description="tasks per held-out check")

    @model_validator(mode="after")
    def _groups(self) -> "BlackBoxConfig":
        if self.recipe in ("ranking", "score", "critique", "soft_labels") and self.samples_per_task < 2:
            raise ValueError(f"recipe {self.recipe} compares a task's candidates: samples_per_task must be >= 2")
        return self


__all__ = [
    "BLACKBOX_RECIPES",
    "ActionRankConfig",
    "BlackBoxConfig",
    "BlackBoxTeacherConfig",
    "CorrectionConfig",
    "CritiqueConfig",
    "PreferenceConfig",
    "ScoreRewardConfig",
    "SoftLabelConfig",
]
