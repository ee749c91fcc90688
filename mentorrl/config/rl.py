"""The reinforcement-learning stages' sections: GRPO (with its hard-task pool), PPO (critic, GAE) and
SAO (asynchronous rollouts, replay)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from mentorrl.config.base import (
    LossAgg,
    OptimConfig,
    RolloutStageConfig,
    Section,
    UpdateStageConfig,
    eps_high_field,
    eps_low_field,
    loss_agg_field,
    optim_field,
)
from mentorrl.config.model import ModelSpec
from mentorrl.config.names import ADVANTAGE, POLICY_LOSS, check_registered
from mentorrl.config.replay import ReplayConfig


class HardPoolConfig(Section):
    """The hard-task pool of :mod:`mentorrl.flywheel.hard_pool` (declared here: the config imports no runtime module)."""

    boost: float = Field(4.0, ge=0.0, description="sampling weight of a pooled task is 1 + boost * score")
    max_share: float = Field(0.5, ge=0.0, le=1.0, description="at most this share of a draw comes from the pool")
    decay: float = Field(0.9, gt=0.0, le=1.0, description="scores are multiplied by this at every update")
    success_relief: float = Field(0.5, ge=0.0, le=1.0, description="a success multiplies its task's score by 1 - this")
    min_score: float = Field(0.05, ge=0.0, description="entries below this score are dropped")
    max_score: float = Field(5.0, gt=0.0, description="cap on one task's score (a task failing forever stays bounded)")


class DynamicSamplingConfig(Section):
    """DAPO's dynamic sampling (Yu et al. 2025): a step keeps drawing tasks until it holds ``tasks_per_step`` groups
    whose rewards differ, and trains on those alone (declared here; built in :mod:`mentorrl.train.dynamic_sampling`)."""

    max_rounds: int = Field(
        4,
        ge=1,
        le=16,
        description="rollout rounds a step may take, each of tasks_per_step fresh tasks from the stage's pool; when "
        "they run out the step trains on the informative groups it has (none: the step makes no update)",
    )


class GRPOConfig(RolloutStageConfig):
    defaults: ClassVar[dict[str, Any]] = {
        "steps": 20,
        "tasks_per_step": 16,
        "updates_per_step": 2,
        "optim": {"lr": 5e-4},
    }
    renamed: ClassVar[dict[str, str]] = {"group_size": "samples_per_task"}

    samples_per_task: int = Field(8, ge=2, description="rollouts per task: the group its advantages are relative to")
    normalize_std: bool = Field(True, description="divide group-centred rewards by the group std")
    eps_low: float = eps_low_field()
    eps_high: float = eps_high_field()
    kl_coef: float = Field(0.0, ge=0, description="k3 KL penalty to the frozen reference (the SFT model)")
    loss_agg: LossAgg = loss_agg_field()
    advantage: str = Field(
        "grpo", description="a registered advantage estimator (mentorrl.algos.advantages.register_advantage)"
    )
    loss: str = Field(
        "grpo",
        description="a registered policy loss (mentorrl.algos.losses.register_policy_loss): grpo (clipped surrogate "
        "+ k3 KL to the reference when kl_coef > 0), clipped, masked_is, or a user's; it gets each trajectory's "
        "advantage, eps_low / eps_high and loss_agg (and the reference's log-probs and kl_coef when kl_coef > 0)",
    )
    sample_trajectories: int = Field(
        8, ge=0, description="trajectories per step written to RUN_DIR/samples/grpo-step-N.jsonl"
    )
    hard_pool: HardPoolConfig | None = Field(
        None, description="hard-task pool: failed tasks are drawn again at a raised rate (null: uniform task draws)"
    )
    hard_pool_state: str | None = Field(
        None, description="start the pool from a saved state, e.g. the hard_pool.json written by `mentorrl flywheel`"
    )
    dynamic_sampling: DynamicSamplingConfig | None = Field(
        None,
        description="keep only groups whose rewards differ, drawing more tasks until a step has tasks_per_step of "
        "them (DAPO); null: every drawn group is trained on, all-equal ones with zero advantage",
    )
    guide: Literal["none", "expert"] = Field(
        "none",
        description="expert: a group where no rollout succeeded gets the scripted expert's verified "
        "demonstration as one more member (off-policy guidance; needs an environment with "
        "an expert)",
    )
    guide_sft: float = Field(
        0.0,
        ge=0,
        description="with guide: expert, weight of an SFT term on the step's expert demonstrations "
        "(their token-mean negative log-likelihood, added to each update's loss besides "
        "their place in the group; single-stage SFT + RL); 0: none",
    )
    pool: Literal["all", "expert_verified"] = Field(
        "all",
        description="the stage's training tasks: all (drawn from train_split), or expert_verified: only those the "
        "scripted expert solves within the run's limits, its demonstration verified (checked once as the stage "
        "starts); with guide: expert every group whose rollouts all fail then gets a demonstration (e.g. tau2 "
        "tasks whose gold replay does not fit the model's context are left out); needs an environment with an expert",
    )
    overlap: Literal["off", "one_step"] = Field(
        "off",
        description="one_step: one-step-off-policy GRPO -- batch k+1 is rolled out (by the weights after step k-1, "
        "in a thread of its own, or by the Ray rollout actors) while the learner trains on batch k; the "
        "clipped ratio to the recorded behaviour log-probs corrects for the lag. The batch rolled ahead is "
        "checkpointed with the step, so a resumed run continues bit for bit (docs/scaling.md#overlap)",
    )

    @field_validator("advantage")
    @classmethod
    def _registered(cls, v: str) -> str:
        return check_registered(ADVANTAGE, v)  # a ValueError naming the registered estimators

    @field_validator("loss")
    @classmethod
    def _registered_loss(cls, v: str) -> str:
        return check_registered(POLICY_LOSS, v)  # a ValueError naming the registered losses

    @field_validator("overlap", mode="before")
    @classmethod
    def _yaml_off(cls, v: Any) -> Any:
        """YAML reads ``off`` / ``on`` as booleans: false is ``off``, true ``one_step``."""
        return {False: "off", True: "one_step"}.get(v, v) if isinstance(v, bool) else v

    @model_validator(mode="after")
    def _state_needs_a_pool(self) -> "GRPOConfig":
        if self.hard_pool_state and self.hard_pool is None:
            raise ValueError("grpo.hard_pool_state is set but grpo.hard_pool is null; enable the pool to use it")
        if self.guide_sft > 0 and self.guide != "expert":
            raise ValueError("grpo.guide_sft > 0 needs grpo.guide: expert (the demonstrations it trains on)")
        return self


class CriticConfig(Section):
    backbone: Literal["policy", "separate"] = Field(
        "policy",
        description="policy: a value head on a copy of the policy's backbone (its weights to start); "
        "separate: a separate small model (path, or built from spec)",
    )
    path: str | None = Field(None, description="separate: a Hugging Face checkpoint whose decoder becomes the critic")
    spec: ModelSpec = Field(
        default_factory=lambda: ModelSpec(
            hidden_size=64, intermediate_size=192, num_layers=2, num_heads=2, num_kv_heads=1
        ),
        description="separate, no path: size of the freshly built critic (the policy's vocabulary)",
    )
    steps: int = Field(2, ge=1, description="critic optimizer steps (minibatches) per actor step")
    warmup_steps: int = Field(2, ge=0, description="first steps train only the critic")
    value_clip: float | None = Field(0.2, gt=0, description="clip of the value update around the old value; null: off")
    optim: OptimConfig = optim_field(lr=5e-4)


class GAEConfig(Section):
    gamma: float = Field(1.0, ge=0, le=1, description="discount per policy token")
    lam: float = Field(
        1.0,
        ge=0,
        le=1,
        description="GAE lambda (ignored when lambda_alpha is set); 1: R - V, which keeps the outcome "
        "reward from fading over long turns",
    )
    lambda_alpha: float | None = Field(
        None, gt=0, description="length-adaptive GAE lambda = 1 - 1/(alpha * policy tokens); null: fixed lam"
    )
    value_lam: float | None = Field(
        None,
        ge=0,
        le=1,
        description="lambda of the critic's returns (decoupled GAE; VAPO uses 1); null: the advantages' lambda",
    )
    normalize_advantages: bool = Field(True, description="whiten advantages over the batch's policy tokens")


class PPOConfig(RolloutStageConfig):
    """PPO: one rollout per task by default (no group is needed: the critic is the baseline)."""

    defaults: ClassVar[dict[str, Any]] = {
        "steps": 20,
        "tasks_per_step": 32,
        "samples_per_task": 1,
        "updates_per_step": 2,
        "optim": {"lr": 1e-4},
    }
    gae: GAEConfig = Field(default_factory=GAEConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    eps_low: float = eps_low_field()
    eps_high: float = eps_high_field()
    loss_agg: LossAgg = loss_agg_field()


class AsyncConfig(Section):
    workers: int = Field(1, ge=1, description="rollout worker threads, each with its own policy copy and engine")
    slots: int = Field(32, ge=1, description="episodes each rollout worker keeps in flight (continuous batching)")
    sync_every: int = Field(
        1, ge=1, description="learner steps between weight syncs to the worker (each sync: policy version + 1)"
    )
    max_staleness: int = Field(
        2, ge=0, description="policy versions a trajectory may lag the learner before the staleness rule applies"
    )
    stale: Literal["drop", "downweight"] = Field(
        "drop",
        description="over max_staleness: drop the trajectory, or scale its advantages by "
        "staleness_decay ** (lag - max_staleness)",
    )
    staleness_decay: float = Field(0.5, gt=0, le=1, description="downweight factor per version over max_staleness")
    queue_size: int | None = Field(
        None,
        ge=1,
        description="finished trajectories waiting for the learner, at most (the worker blocks when it is "
        "full, which bounds how stale its data gets); null: one learner batch",
    )
    recompute_kv: bool = Field(
        False,
        description="after a weight sync, prefill every live episode again under the new weights (each token "
        "then comes from one policy version; costs a prefill of every live row per sync)",
    )
    get_timeout_s: float = Field(600.0, gt=0, description="the learner fails when no trajectory arrives this long")


class SegmentReplayConfig(Section):
    turns_per_segment: int = Field(1, ge=1, description="policy turns trained on per replayed window")
    min_tokens: int = Field(512, ge=0, description="only trajectories longer than this are cut into windows")


class SAOConfig(UpdateStageConfig):
    defaults: ClassVar[dict[str, Any]] = {"steps": 20, "updates_per_step": 1, "optim": {"lr": 1e-4}}

    batch_size: int = Field(32, ge=1, description="online trajectories per learner step, taken as they finish")
    eps_low: float = eps_low_field("tokens with ratio below 1 - eps_low are masked out")
    eps_high: float = eps_high_field("tokens with ratio above 1 + eps_high are masked out")
    loss_agg: LossAgg = loss_agg_field()
    gae: GAEConfig = Field(default_factory=GAEConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    rollout: AsyncConfig = Field(default_factory=AsyncConfig)
    replay: ReplayConfig | None = Field(
        None, description="persistent replay buffer in RUN_DIR/sao/replay.sqlite (null: none; mix.replay must be 0)"
    )
    mix: dict[str, float] = Field(
        default_factory=lambda: {"online": 1.0, "expert": 0.0, "replay": 0.0},
        description="hybrid batch ratios of online, expert-demonstration and replayed trajectories",
    )
    segment_replay: SegmentReplayConfig | None = Field(
        None, description="replay long trajectories as one random window of turns (null: whole trajectories)"
    )
    expert_advantage: float = Field(
        1.0, description="advantage of every policy token of an expert demonstration (behaviour = current policy)"
    )
    num_demos: int = Field(256, ge=0, description="expert demonstrations on train tasks (used when mix.expert > 0)")
    sample_trajectories: int = Field(
        8, ge=0, description="trajectories per step written to RUN_DIR/samples/sao-step-N.jsonl"
    )

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


__all__ = [
    "AsyncConfig",
    "CriticConfig",
    "GAEConfig",
    "GRPOConfig",
    "HardPoolConfig",
    "PPOConfig",
    "SAOConfig",
    "SegmentReplayConfig",
]
