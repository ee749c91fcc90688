"""The distillation stages' sections: on-policy distillation from white-box teachers (MOPD, ShortOPD,
RLSD, reward-weighted) and the self-evolving loop."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union, get_args

from pydantic import Field, field_validator, model_validator

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
from mentorrl.config.model import DEVICE_PATTERN, DType, ModelSpec
from mentorrl.config.sft import distinct_families


class TeacherBuildConfig(Section):
    init: Literal["scratch", "student"] = Field(
        "scratch",
        description="scratch: a fresh tiny model; student: a copy of the student as it enters the stage, "
        "trained on (keeps the student's tokenizer and size; the cache key includes a hash "
        "of the student's weights)",
    )
    vocab_size: int | None = Field(
        None,
        ge=300,
        description="null: the student's tokenizer (same corpus and size give the same tokenizer); "
        "a number: the teacher's own tokenizer with this vocabulary (cross-tokenizer OPD)",
    )
    spec: ModelSpec | None = Field(None, description="teacher model size; null: the student's model.spec")
    num_demos: int = Field(4000, ge=1, description="expert demonstrations the teacher's SFT draws from")
    families: list[str] | None = Field(
        None,
        min_length=1,
        description="the teacher's SFT draws its demonstrations only from these task families (its sft.families: "
        "a specialist teacher; part of the build's cache key); null: every family",
    )
    sft_steps: int = Field(1500, ge=1, description="SFT steps (the demo's student takes 600)")
    batch_size: int = Field(32, ge=1, description="demonstrations per SFT step")
    lr: float = Field(3e-3, gt=0, description="SFT learning rate")

    @field_validator("families")
    @classmethod
    def _distinct_families(cls, v: list[str] | None) -> list[str] | None:
        return distinct_families(v)

    @model_validator(mode="after")
    def _student_init_keeps_the_student(self) -> "TeacherBuildConfig":
        if self.init == "student" and (self.vocab_size is not None or self.spec is not None):
            raise ValueError(
                "build.init student continues the student's own weights: it keeps the student's "
                "tokenizer and size, so leave build.vocab_size and build.spec unset"
            )
        return self


class TeacherConfig(Section):
    name: str = Field("teacher", min_length=1, description="name in logs, samples and MOPD routes")
    kind: Literal["hf", "self"] = Field(
        "hf",
        description="hf: a local Hugging Face checkpoint; self: a frozen snapshot of the student taken at the "
        "start of each step (RLSD)",
    )
    path: str | None = Field(
        None,
        description="hf: checkpoint directory or GGUF source (a .gguf file, `smollm2`); null: built by `build` "
        "(once, cached under opd.teachers_dir)",
    )
    build: TeacherBuildConfig = Field(
        default_factory=TeacherBuildConfig,
        description="how the stronger local teacher is built when path is null (the "
        "demo's SFT stage, longer, on more demonstrations)",
    )
    temperature: float = Field(1.0, gt=0, description="softmax temperature of the teacher's log-probs")
    special_tokens: dict[str, str] = Field(
        default_factory=dict,
        description="cross-tokenizer: the student's special tokens spelled the teacher's way, "
        "e.g. {'<|im_end|>': '<|eot_id|>'}",
    )
    device: str | None = Field(
        None,
        pattern=DEVICE_PATTERN,
        description="hf: the device the teacher scores on (auto, cpu, cuda, cuda:N); null: the learner's "
        "(model.device). Its scores come back to the learner on the CPU",
    )
    dtype: DType | None = Field(None, description="hf: the teacher's weights' dtype; null: model.dtype")


# ------------------------------------------------------------------------------ OPD terms -----
# The OPD stage's advantage and loss terms, one schema per term (``opd.terms``, a list selected by
# ``name``). The runtime functions are registered under the same names: token and advantage terms
# in mentorrl.algos.opd_terms (pure, with the inputs each one reads), loss terms in the OPD stage.


class _OPDTerm(Section):
    pass


class SampledKLTerm(_OPDTerm):
    name: Literal["sampled_kl"] = "sampled_kl"
    coef: float = Field(
        1.0,
        ge=0,
        description="weight of the sampled-token (chunk) reverse-KL estimate "
        "log p_teacher - log p_student as a per-token advantage in the "
        "clipped policy loss",
    )


class TopKTerm(_OPDTerm):
    name: Literal["topk"] = "topk"
    coef: float = Field(1.0, ge=0, description="weight of the top-k divergence to the most-weighted teacher")
    divergence: Literal["reverse", "forward", "jsd"] = Field("reverse", description="the divergence")
    beta: float = Field(0.5, ge=0, le=1, description="divergence jsd: its beta")
    top_k: int = Field(16, ge=1, description="teacher tokens kept per position")
    tail: bool = Field(
        True,
        description="compare the top-k plus one bin for the rest of the mass (false: "
        "renormalise over the k tokens, which ignores mass the student moves "
        "outside them)",
    )


class UntilFirstErrorTerm(_OPDTerm):
    name: Literal["until_first_error"] = "until_first_error"


class StepWeightsTerm(_OPDTerm):
    name: Literal["step_weights"] = "step_weights"
    tool_error_boost: float = Field(2.0, ge=1, description="distillation weight of a turn whose tool call failed")
    low_reward_boost: float = Field(1.5, ge=1, description="weight of every turn of a trajectory below low_reward")
    low_reward: float = Field(0.5, description="the reward bar of low_reward_boost")
    entropy_threshold: float = Field(1.0, ge=0, description="student entropy (nats) above which a token is unsure")
    entropy_boost: float = Field(1.5, ge=1, description="weight of an unsure token")


class CenterTerm(_OPDTerm):
    name: Literal["center"] = "center"


class ShortTerm(_OPDTerm):
    name: Literal["short"] = "short"
    threshold: float | None = Field(
        None,
        ge=0,
        description="distil tokens whose |teacher - student| log-prob gap exceeds this (give this or top_frac)",
    )
    top_frac: float | None = Field(
        None, gt=0, le=1, description="distil this share of policy tokens, largest gap first"
    )
    min_share: float = Field(
        0.25,
        gt=0,
        le=1,
        description="share of a task family's drawn tasks rolled out when its gap is 0 (1 at gap >= full_gap and "
        "for families not measured yet); whole episodes are left out, none is cut short",
    )
    full_gap: float = Field(0.5, gt=0, description="mean per-token gap (nats) at which every drawn task is rolled out")
    ema: float = Field(0.5, gt=0, le=1, description="weight of the newest step in each family's gap average")

    @model_validator(mode="before")
    @classmethod
    def _no_token_budgets(cls, v: Any) -> Any:
        if isinstance(v, dict) and ({"min_budget", "max_budget"} & set(v)):
            raise ValueError(
                "min_budget / max_budget were removed: ShortOPD no longer cuts a family's episodes to a token budget "
                "(a cut episode never reaches its final answer); it rolls out a share of the family's tasks, "
                "min_share at no gap"
            )
        return v

    @model_validator(mode="after")
    def _one_rule(self) -> "ShortTerm":
        if (self.threshold is None) == (self.top_frac is None):
            raise ValueError("give exactly one of threshold and top_frac")
        return self


class RewardWeightedTerm(_OPDTerm):
    name: Literal["reward_weighted"] = "reward_weighted"
    coef: float = Field(1.0, ge=0, description="weight of the weighted-MLE term")
    temperature: float = Field(0.5, gt=0, description="weights softmax(R / T) over each task's group")


class EnvAdvantageTerm(_OPDTerm):
    name: Literal["env_advantage"] = "env_advantage"
    coef: float = Field(1.0, gt=0, description="weight of the group-relative environment advantage (RL + beta*KL)")


class _RLSDTerm(_OPDTerm):
    name: str  # first in a dump; each subclass fixes it
    coef: float = Field(0.5, ge=0, description="lambda of L_RL + lambda * L_SD")
    reward_temperature: float = Field(1.0, gt=0, description="trajectory weight exp(R / T) among verified ones")
    length_power: float = Field(0.5, ge=0, description="trajectory weight (length / mean) ** -p: shorter wins")
    exploration_share: float = Field(0.25, ge=0, le=1, description="share of each batch trained by RL only")


class RLSDSelectedTerm(_RLSDTerm):
    name: Literal["rlsd_selected"] = "rlsd_selected"


class RLSDTopKTerm(_RLSDTerm):
    name: Literal["rlsd_topk"] = "rlsd_topk"
    top_k: int = Field(8, ge=1, description="tokens of the stored snapshot distribution")
    teacher_temperature: float = Field(
        0.7, gt=0, description="temperature of the stored snapshot distribution (< 1 sharpens it)"
    )
    tail: bool = Field(True, description="compare the top-k plus one bin for the rest of the mass")


class SequenceFallbackTerm(_OPDTerm):
    name: Literal["sequence_fallback"] = "sequence_fallback"


OPDTerm = Annotated[
    Union[
        SampledKLTerm,
        TopKTerm,
        UntilFirstErrorTerm,
        StepWeightsTerm,
        CenterTerm,
        ShortTerm,
        RewardWeightedTerm,
        RLSDSelectedTerm,
        EnvAdvantageTerm,
        RLSDTopKTerm,
        SequenceFallbackTerm,
    ],
    Field(discriminator="name"),
]
OPD_TERM_SCHEMAS: dict[str, type[_OPDTerm]] = {
    get_args(c.model_fields["name"].annotation)[0]: c for c in get_args(get_args(OPDTerm)[0])
}
RLSD_TERMS = ("rlsd_selected", "rlsd_topk")
REWARD_TERMS = ("env_advantage", "reward_weighted", *RLSD_TERMS)  # compare a task's samples

# the legacy spellings of some terms' settings (still accepted as opd.short, opd.reward_weighted, ...)
StepWeightConfig = StepWeightsTerm
ShortOPDConfig = ShortTerm
RewardWeightedConfig = RewardWeightedTerm


class CompetenceConfig(Section):
    tasks_per_family: int = Field(
        8, ge=1, description="train-split tasks of each trained family that every teacher rolls out (the same tasks)"
    )
    mode: Literal["soft", "hard"] = Field(
        "soft",
        description="soft: route each family by the teachers' Beta(1,1) posterior mean success, normalised; "
        "hard: all of it to the best teacher (ties split evenly)",
    )
    seed: int = Field(0, ge=0, description="mixed with the run seed into the seed of the tasks and rollouts")


class MOPDConfig(Section):
    routes: dict[str, dict[str, float]] = Field(
        default_factory=dict,
        description="static routing: task family -> {teacher: weight}; unrouted families spread evenly",
    )
    confidence_temperature: float | None = Field(
        None, gt=0, description="weight teachers by softmax(mean token log-prob on the trajectory / T); null: off"
    )
    success_history: bool = Field(
        False,
        description="weight teachers by their verified success so far (Beta(1,1) posterior mean); each "
        "trajectory's outcome counts for the teacher that weighed most on it",
    )
    competence: CompetenceConfig | None = Field(
        None,
        description="{tasks_per_family, mode: soft|hard, seed}: routes measured by the verifier before the first "
        "step: every teacher rolls out the same train tasks of each family, and its verified success there "
        "routes that family (RUN_DIR/mopd_competence.json, kept on resume; not with routes); null: off",
    )
    step_weights: StepWeightConfig | None = Field(
        None, description="legacy: the step_weights term (failure-aware per-token weights); null: off"
    )


class RLSDConfig(Section):
    coef: float = Field(0.5, ge=0, description="lambda of L_RL + lambda * L_SD")
    target: Literal["selected", "topk"] = Field(
        "selected",
        description="selected: the sampled tokens of verified trajectories; topk: the snapshot's top-k "
        "distribution stored at rollout (forward KL)",
    )
    top_k: int = Field(8, ge=1, description="target: topk")
    teacher_temperature: float = Field(
        0.7, gt=0, description="target: topk: temperature of the stored snapshot distribution (< 1 sharpens it)"
    )
    reward_temperature: float = Field(1.0, gt=0, description="trajectory weight exp(R / T) among verified ones")
    length_power: float = Field(0.5, ge=0, description="trajectory weight (length / mean) ** -p: shorter wins")
    exploration_share: float = Field(0.25, ge=0, le=1, description="share of each batch trained by RL only")


LEGACY = "legacy, translated into opd.terms (not with it): "
# the legacy flat settings of OPDConfig that stand for terms (all null unless given)
LEGACY_OPD_FLAGS = (
    "loss",
    "center",
    "divergence",
    "beta",
    "top_k",
    "topk_tail",
    "kl_coef",
    "distill_until",
    "reward_coef",
    "cross_tokenizer",
    "short",
    "rlsd",
    "reward_weighted",
)


def legacy_opd_terms(o: "OPDConfig") -> list[_OPDTerm]:
    """The terms list that the legacy flat settings of ``o`` stand for, in the order the stage has
    always applied them (the distillation objective, the token terms, the advantage terms, the
    remaining loss terms). Terms that read a white-box teacher's signal are left out without one
    (they would do nothing)."""
    hf = any(t.kind == "hf" for t in o.teachers)
    loss, kl_coef = o.loss or "sampled", 1.0 if o.kl_coef is None else o.kl_coef
    out: list[_OPDTerm] = []
    if loss == "sampled" and hf:
        out.append(SampledKLTerm(coef=kl_coef))
    if loss == "topk":  # kept without a teacher: it also makes the policy gradient one pass
        out.append(
            TopKTerm(
                coef=kl_coef,
                divergence=o.divergence or "reverse",
                beta=_or(o.beta, 0.5),
                top_k=_or(o.top_k, 16),
                tail=_or(o.topk_tail, True),
            )
        )
    if o.distill_until == "first_error" and hf:
        out.append(UntilFirstErrorTerm())
    if o.mopd.step_weights is not None and hf:
        out.append(o.mopd.step_weights)
    if loss == "sampled" and _or(o.center, True) and hf:
        out.append(CenterTerm())
    out += [x for x in (o.short, o.reward_weighted) if x is not None]
    rlsd = o.rlsd.model_dump(exclude={"target"}) if o.rlsd is not None else {}
    if o.rlsd is not None and o.rlsd.target == "selected":
        out.append(RLSDSelectedTerm(**{k: v for k, v in rlsd.items() if k in RLSDSelectedTerm.model_fields}))
    if (o.reward_coef or 0.0) > 0:
        out.append(EnvAdvantageTerm(coef=o.reward_coef))
    if o.rlsd is not None and o.rlsd.target == "topk":
        out.append(RLSDTopKTerm(**rlsd, tail=_or(o.topk_tail, True)))
    if o.cross_tokenizer == "sequence":
        out.append(SequenceFallbackTerm())
    return out


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


class OPDConfig(RolloutStageConfig):
    defaults: ClassVar[dict[str, Any]] = {
        "steps": 10,
        "tasks_per_step": 16,
        "samples_per_task": 2,
        "optim": {"lr": 2e-4, "warmup_steps": 2},
    }

    updates_per_step: int = updates_per_step_field(2, "optimizer steps (minibatches) per pass over a rollout batch")
    epochs: int = Field(
        1,
        ge=1,
        description="passes of the distillation loss over each rollout batch (the teacher "
        "scores it once; the policy gradient, or the topk term's divergence "
        "when there is one); more passes learn more per student rollout token",
    )
    teachers: list[TeacherConfig] = Field(
        default_factory=lambda: [TeacherConfig()], description="white-box teachers (several: MOPD)"
    )
    teachers_dir: str | None = Field(
        "runs/teachers",
        description="built teachers are cached here, one directory per build recipe, shared by "
        "runs; null: RUN_DIR/teachers",
    )
    terms: list[OPDTerm] | None = Field(
        None,
        description="the advantage and loss terms, in order, each {name: ..., its settings} (docs/opd.md): "
        "sampled_kl, topk, until_first_error, step_weights, center, short, reward_weighted, "
        "rlsd_selected, env_advantage, rlsd_topk, sequence_fallback; a bare name takes the "
        "defaults; null: the terms the legacy settings below stand for",
    )
    mopd: MOPDConfig = Field(default_factory=MOPDConfig, description="multi-teacher weighting")
    loss: Literal["sampled", "topk"] | None = Field(
        None, description=LEGACY + "sampled: the sampled_kl term (null: sampled); topk: the topk term"
    )
    center: bool | None = Field(None, description=LEGACY + "loss sampled: the center term (null: true)")
    divergence: Literal["reverse", "forward", "jsd"] | None = Field(None, description=LEGACY + "topk.divergence")
    beta: float | None = Field(None, ge=0, le=1, description=LEGACY + "topk.beta")
    top_k: int | None = Field(None, ge=1, description=LEGACY + "topk.top_k")
    topk_tail: bool | None = Field(None, description=LEGACY + "topk.tail")
    kl_coef: float | None = Field(None, ge=0, description=LEGACY + "sampled_kl.coef or topk.coef (null: 1)")
    distill_until: Literal["end", "first_error"] | None = Field(
        None, description=LEGACY + "first_error: the until_first_error term"
    )
    reward_coef: float | None = Field(None, ge=0, description=LEGACY + "> 0: the env_advantage term with this coef")
    cross_tokenizer: Literal["chunk", "sequence"] | None = Field(
        None, description=LEGACY + "sequence: the sequence_fallback term"
    )
    short: ShortOPDConfig | None = Field(None, description=LEGACY + "the short term (ShortOPD)")
    rlsd: RLSDConfig | None = Field(None, description=LEGACY + "the rlsd_selected or rlsd_topk term (by target)")
    reward_weighted: RewardWeightedConfig | None = Field(None, description=LEGACY + "the reward_weighted term")
    eps_low: float = eps_low_field()
    eps_high: float = eps_high_field()
    loss_agg: LossAgg = loss_agg_field()
    eval_every: int = Field(
        0, ge=0, description="held-out check every N steps, logged with the rollout tokens so far (0: off)"
    )
    eval_tasks: int = Field(200, ge=1, description="tasks per held-out check")
    sample_trajectories: int = Field(
        8,
        ge=0,
        description="trajectories per step written to samples/, with each "
        "teacher's signal and weight in opd/signals-step-N.jsonl",
    )

    @field_validator("terms", mode="before")
    @classmethod
    def _bare_names(cls, v: Any) -> Any:
        return [{"name": x} if isinstance(x, str) else x for x in v] if isinstance(v, list) else v

    @model_validator(mode="after")
    def _coherent(self) -> "OPDConfig":
        given = [k for k in LEGACY_OPD_FLAGS if getattr(self, k) is not None]
        given += ["mopd.step_weights"] if self.mopd.step_weights is not None else []
        if self.terms is not None and given:
            raise ValueError(
                f"opd.terms and the legacy settings {', '.join('opd.' + k for k in given)} are both "
                "given: spell them as terms in opd.terms (docs/opd.md)"
            )
        if self.terms is None:  # the legacy settings become the terms list, and only it is kept
            self.terms = legacy_opd_terms(self)
            for k in LEGACY_OPD_FLAGS:
                setattr(self, k, None)
            self.mopd.step_weights = None
        _check_opd(self, [t.name for t in self.terms])
        return self


def _check_opd(o: OPDConfig, names: list[str]) -> None:
    """The OPD settings that only make sense together."""
    teachers = [t.name for t in o.teachers]
    if len(set(teachers)) != len(teachers):
        raise ValueError(f"teacher names must be unique, got {teachers}")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"opd.terms lists {', '.join(twice)} more than once")
    selfs = [t for t in o.teachers if t.kind == "self"]
    rlsd = [n for n in names if n in RLSD_TERMS]
    if rlsd and (len(o.teachers) != 1 or not selfs):
        raise ValueError("rlsd needs exactly one teacher, of kind self")
    if rlsd and "env_advantage" not in names:
        raise ValueError("rlsd is L_RL + lambda * L_SD: set reward_coef > 0 (the env_advantage term, the RL term)")
    if selfs and not rlsd:
        raise ValueError("a teacher of kind self is the RLSD recipe: set opd.rlsd (an rlsd_selected or rlsd_topk term)")
    for fam, route in o.mopd.routes.items():
        unknown = set(route) - set(teachers)
        if unknown:
            raise ValueError(f"mopd.routes[{fam!r}] names unknown teachers {sorted(unknown)}")
    _check_competence(o)
    if not o.teachers and not {"reward_weighted", "env_advantage"} & set(names):
        raise ValueError("no teachers, no reward_weighted and reward_coef 0: nothing to learn from")
    if not set(names) - {"until_first_error", "step_weights", "center", "short"}:
        raise ValueError(
            "opd.terms has no advantage or loss term (sampled_kl, topk, reward_weighted, env_advantage, "
            "rlsd_selected, rlsd_topk, sequence_fallback): nothing would train"
        )
    if set(REWARD_TERMS) & set(names) and o.samples_per_task < 2:
        raise ValueError(
            "reward terms (reward_coef, reward_weighted, rlsd) compare a task's samples: samples_per_task must be >= 2"
        )


def _check_competence(o: OPDConfig) -> None:
    """``opd.mopd.competence`` measures the routes by rolling out the in-process (``hf``) teachers."""
    if o.mopd.competence is None:
        return
    if o.mopd.routes:
        raise ValueError(
            "opd.mopd.competence measures the routes: give it or opd.mopd.routes (static routes), not both"
        )
    if not any(t.kind == "hf" for t in o.teachers):
        raise ValueError("opd.mopd.competence rolls out the teachers: it needs at least one teacher of kind hf")


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
    accept_margin: float = Field(
        0.0,
        ge=0,
        description="accept a version unless its held-out success drops by more than this below the best accepted",
    )
    eval_tasks: int = Field(200, ge=1, description="held-out tasks per version")
    eps_low: float = eps_low_field()
    eps_high: float = eps_high_field()

    @model_validator(mode="after")
    def _curriculum_band(self) -> "EvolveConfig":
        if not self.lower_below < self.raise_above:
            raise ValueError(f"lower_below ({self.lower_below}) must be below raise_above ({self.raise_above})")
        return self


__all__ = [
    "CompetenceConfig",
    "EvolveConfig",
    "MOPDConfig",
    "OPDConfig",
    "RLSDConfig",
    "RewardWeightedConfig",
    "ShortOPDConfig",
    "StepWeightConfig",
    "TeacherBuildConfig",
    "TeacherConfig",
    "OPD_TERM_SCHEMAS",
    "OPDTerm",
    "RLSD_TERMS",
    "REWARD_TERMS",
    "SampledKLTerm",
    "TopKTerm",
    "UntilFirstErrorTerm",
    "StepWeightsTerm",
    "CenterTerm",
    "ShortTerm",
    "RewardWeightedTerm",
    "EnvAdvantageTerm",
    "RLSDSelectedTerm",
    "RLSDTopKTerm",
    "SequenceFallbackTerm",
    "legacy_opd_terms",
    "LEGACY_OPD_FLAGS",
]
