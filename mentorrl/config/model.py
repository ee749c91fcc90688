"""The model sections: the tiny local model's size and pretraining (:class:`ModelSpec`,
:class:`PretrainSpec`, built by :mod:`mentorrl.models.build` and :mod:`mentorrl.models.pretrain`) and
the run's ``model:`` section."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from mentorrl.config.base import Section

# A device name: auto (CUDA when available, else the CPU), cpu, cuda or cuda:N (resolved by mentorrl.models.device).
DEVICE_PATTERN = r"^(auto|cpu|cuda(:[0-9]+)?)$"
DType = Literal["float32", "bfloat16", "float16"]
ModelDType = Literal["auto", "float32", "bfloat16", "float16"]


class ModelSpec(BaseModel):
    """Size of the tiny default model (a Qwen2-architecture causal LM)."""

    model_config = ConfigDict(extra="forbid")

    vocab_size: int = Field(1024, ge=300, description="BPE vocabulary size including special tokens")
    hidden_size: int = Field(128, ge=16, description="model width")
    intermediate_size: int = Field(384, ge=16, description="MLP width")
    num_layers: int = Field(4, ge=1, description="decoder layers")
    num_heads: int = Field(4, ge=1, description="attention heads")
    num_kv_heads: int = Field(2, ge=1, description="key/value heads (GQA)")
    max_positions: int = Field(2048, ge=64, description="context length")
    seed: int = Field(0, description="weight initialisation seed")


# The corpus generators' versions (``PretrainSpec.corpus_version``): a generator that changes what it
# writes adds a version and keeps the older ones reproducible. The version is part of the build config,
# so a shipped base built by one version is never served for another.
CORPUS_VERSIONS = (2, 3, 4, 5)


class PretrainSpec(BaseModel):
    """Next-token pretraining of the tiny model on a generated corpus of the environment's language."""

    model_config = ConfigDict(extra="forbid")

    steps: int = Field(0, ge=0, description="optimizer steps of pretraining; 0 builds the model without it")
    batch_size: int = Field(8, ge=1, description="packed blocks per step")
    block_size: int = Field(512, ge=16, description="tokens per packed block")
    lr: float = Field(1e-3, gt=0, description="peak AdamW learning rate (cosine decay after warm-up)")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="final learning rate as a fraction of lr")
    warmup_steps: int = Field(20, ge=0, description="linear learning-rate warm-up")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping")
    transcripts: int = Field(2000, ge=0, description="expert episodes on train tasks in the corpus")
    worlds: int = Field(400, ge=0, description="train-range seeded worlds described in free text and tool sessions")
    seed: int = Field(0, description="corpus sampling and block order")
    eval_transcripts: int = Field(
        64, ge=0, description="held-out-split expert transcripts scored before and after (never trained on)"
    )
    corpus_version: int = Field(
        2,
        ge=CORPUS_VERSIONS[0],
        le=CORPUS_VERSIONS[-1],
        description="generated corpus: 2: support-log notes naming an e-mail and "
        "an order that the tool calls copy; 3: the notes may also "
        "name an amount and a new address that the writes copy; "
        "4: 3 plus echo documents (a run of the domain's values "
        "written again: copying any token back); 5: 4 plus copy "
        "drills (a named value beside an on-file one of the same "
        "kind, then the call that uses the named one) and 14 more "
        "echo documents a world",
    )


class LoraSpec(BaseModel):
    """LoRA adapters on the policy (through ``peft``): only the adapters train, the base stays frozen."""

    model_config = ConfigDict(extra="forbid")

    r: int = Field(16, ge=1, description="adapter rank")
    alpha: float = Field(32.0, gt=0, description="scaling numerator: each adapter's update is scaled by alpha / r")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on each adapter's input while training")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        description="names (last component of the module path, or a full dotted path) of the Linear "
        "modules that get adapters; each must match a module of the model (checked before the first step)",
    )


class ModelConfig(Section):
    path: str | None = Field(
        None,
        description="Hugging Face checkpoint directory, hub id in the local cache, or GGUF source (a .gguf file, or "
        "`smollm2`: an installed package's file), imported once into a cached checkpoint; null builds the tiny "
        "local model into RUN_DIR/base_model",
    )
    spec: ModelSpec = Field(default_factory=ModelSpec, description="size of the tiny model (used when path is null)")
    tokenizer_corpus_tasks: int = Field(400, ge=10, description="expert episodes rendered to train the tiny tokenizer")
    pretrain: PretrainSpec = Field(
        default_factory=PretrainSpec,
        description="next-token pretraining of the tiny model on the environment's language when it is built "
        "(by a recipe with model.path null, or by `mentorrl init-model`); steps 0: none",
    )
    device: str = Field(
        "auto",
        pattern=DEVICE_PATTERN,
        description="the learner's device: auto (the first CUDA device when there is one, else the CPU), cpu, "
        "cuda or cuda:N; checked before the first step",
    )
    dtype: ModelDType = Field(
        "float32",
        description="the learner's compute dtype. auto: bfloat16 where a start-up probe finds it faster (a GPU with "
        "bf16; a CPU whose bf16 matmul measures >= 1.5x fp32, e.g. with AMX), else float32; the choice and the "
        "measured ratio are printed at start and written to RUN_DIR/precision.json. float32: plain fp32. bfloat16 / float16: mixed precision "
        "(weights and optimizer state stay fp32, forward and backward run under torch.autocast in "
        "this dtype; float16 adds a gradient scaler and needs a GPU). Also the rollout's and the "
        "teachers' dtype unless they set their own",
    )
    lora: LoraSpec | None = Field(
        None,
        description="LoRA adapters through peft: {r: rank (16), alpha: the update is scaled by alpha / r (32), "
        "dropout: on the adapters' input while training (0), target_modules: the Linear modules that get "
        "adapters (default: q/k/v/o_proj, gate/up/down_proj), each checked against the model}; only the "
        "adapters train and the optimizer holds only their state; checkpoints and each stage's final dir "
        "hold the adapter (docs/scaling.md); null: full fine-tuning",
    )


__all__ = [
    "CORPUS_VERSIONS",
    "DEVICE_PATTERN",
    "DType",
    "ModelDType",
    "LoraSpec",
    "ModelConfig",
    "ModelSpec",
    "PretrainSpec",
]
