"""Run configuration: YAML in, validated pydantic models out. A package of schema modules that import
only pydantic, yaml, the standard library and each other (an import contract), so every layer may
import it:

* :mod:`~mentorrl.config.base` -- the section base, :class:`OptimConfig`, the shared field helpers and
  :class:`StageConfig`, the base of every stage's section (``steps``, ``optim``, ``samples_per_task``,
  ``tasks_per_step``, ``checkpoint_every``, ``updates_per_step``, named one way);
* :mod:`~mentorrl.config.sft`, :mod:`~mentorrl.config.rl`, :mod:`~mentorrl.config.opd`,
  :mod:`~mentorrl.config.blackbox` -- the stages' sections;
* :mod:`~mentorrl.config.env`, :mod:`~mentorrl.config.model`, :mod:`~mentorrl.config.prompt`,
  :mod:`~mentorrl.config.reward`, :mod:`~mentorrl.config.replay`, :mod:`~mentorrl.config.client`,
  :mod:`~mentorrl.config.sections` -- the other sections (the runtime modules import them from here);
* :mod:`~mentorrl.config.names` -- registered names checked at load time (environments, advantage
  estimators) and the training-split guard;
* :mod:`~mentorrl.config.stages` -- the stage table (:class:`StageSpec`);
* :mod:`~mentorrl.config.run` -- :data:`RunConfig` and :func:`run_config_model`;
* :mod:`~mentorrl.config.plugins` -- plugin modules and entry points;
* :mod:`~mentorrl.config.loading` -- YAML reading, bounds, overrides, dotted errors;
* :mod:`~mentorrl.config.reference` -- the configuration reference.
"""

from mentorrl.config.base import (
    CLIP_HIGH,
    CLIP_LOW,
    ConfigError,
    LossAgg,
    OptimConfig,
    RolloutStageConfig,
    Section,
    StageConfig,
    StepStageConfig,
    UpdateStageConfig,
    checkpoint_every_field,
    eps_high_field,
    eps_low_field,
    loss_agg_field,
    optim_field,
    updates_per_step_field,
)
from mentorrl.config.blackbox import (
    BLACKBOX_RECIPES,
    ActionRankConfig,
    BlackBoxConfig,
    BlackBoxTeacherConfig,
    CorrectionConfig,
    CritiqueConfig,
    PreferenceConfig,
    ScoreRewardConfig,
    SoftLabelConfig,
)
from mentorrl.config.client import ClientConfig
from mentorrl.config.env import EnvConfig, LatencyModel
from mentorrl.config.loading import (
    MAX_CONFIG_BYTES,
    MAX_CONFIG_DEPTH,
    MAX_CONFIG_INT,
    MAX_CONFIG_NODES,
    MAX_EXTENDS,
    PACKAGED_CONFIG_DIR,
    check_bounded,
    dump_config,
    load_config,
    number_problems,
    parse_yaml,
    raw_number_problems,
    validate_config,
)
from mentorrl.config.model import ModelConfig, ModelSpec, PretrainSpec
from mentorrl.config.opd import (
    OPD_TERM_SCHEMAS,
    OPDTerm,
    RLSD_TERMS,
    REWARD_TERMS,
    SampledKLTerm,
    TopKTerm,
    UntilFirstErrorTerm,
    StepWeightsTerm,
    CenterTerm,
    ShortTerm,
    RewardWeightedTerm,
    EnvAdvantageTerm,
    RLSDSelectedTerm,
    RLSDTopKTerm,
    SequenceFallbackTerm,
    legacy_opd_terms,
    LEGACY_OPD_FLAGS,
    EvolveConfig,
    MOPDConfig,
    OPDConfig,
    RewardWeightedConfig,
    RLSDConfig,
    ShortOPDConfig,
    StepWeightConfig,
    TeacherBuildConfig,
    TeacherConfig,
)
from mentorrl.config.plugins import load_plugins
from mentorrl.config.prompt import ContractLimits, PromptFormat, SamplingParams
from mentorrl.config.reference import config_reference, config_reference_markdown
from mentorrl.config.replay import ReplayConfig
from mentorrl.config.reward import RewardWeights
from mentorrl.config.rl import (
    AsyncConfig,
    CriticConfig,
    GAEConfig,
    GRPOConfig,
    HardPoolConfig,
    PPOConfig,
    SAOConfig,
    SegmentReplayConfig,
)
from mentorrl.config.run import RunConfig, RunSettings, run_config_model
from mentorrl.config.sections import AuditConfig, DistributedConfig, EvalConfig, LoggingConfig, RolloutConfig
from mentorrl.config.sft import RFTConfig, SFTConfig
from mentorrl.config.stages import (
    BUILTIN_STAGES,
    DISTRIBUTED_STAGES,
    STAGE_NAMES,
    StageSpec,
    get_stage_spec,
    register_stage_spec,
    stage_specs,
    unregister_stage_spec,
)

__all__ = [
    "BLACKBOX_RECIPES", "BUILTIN_STAGES", "CLIP_HIGH", "CLIP_LOW", "DISTRIBUTED_STAGES", "MAX_CONFIG_BYTES",
    "MAX_CONFIG_DEPTH", "MAX_CONFIG_INT", "MAX_CONFIG_NODES", "MAX_EXTENDS", "PACKAGED_CONFIG_DIR", "STAGE_NAMES",
    "ActionRankConfig", "AsyncConfig", "AuditConfig", "BlackBoxConfig", "BlackBoxTeacherConfig", "ClientConfig",
    "ConfigError", "ContractLimits", "CorrectionConfig", "CriticConfig", "CritiqueConfig", "DistributedConfig",
    "EnvConfig", "EvalConfig", "EvolveConfig", "GAEConfig", "GRPOConfig", "HardPoolConfig", "LatencyModel",
    "LoggingConfig", "LossAgg", "MOPDConfig", "ModelConfig", "ModelSpec", "OPDConfig", "OptimConfig", "PPOConfig",
    "PreferenceConfig", "PretrainSpec", "PromptFormat", "RFTConfig", "RLSDConfig", "ReplayConfig",
    "RewardWeightedConfig", "RewardWeights", "RolloutConfig", "RolloutStageConfig", "RunConfig", "RunSettings",
    "SAOConfig", "SFTConfig", "SamplingParams", "ScoreRewardConfig", "Section", "SegmentReplayConfig",
    "ShortOPDConfig", "SoftLabelConfig", "StageConfig", "StageSpec", "StepStageConfig", "StepWeightConfig",
    "TeacherBuildConfig", "TeacherConfig", "UpdateStageConfig", "check_bounded", "checkpoint_every_field",
    "config_reference", "config_reference_markdown", "dump_config", "eps_high_field", "eps_low_field",
    "get_stage_spec", "load_config", "load_plugins", "loss_agg_field", "number_problems", "optim_field",
    "parse_yaml", "raw_number_problems", "register_stage_spec", "run_config_model", "stage_specs",
    "unregister_stage_spec", "updates_per_step_field", "validate_config",
    "OPD_TERM_SCHEMAS", "OPDTerm", "RLSD_TERMS", "REWARD_TERMS", "SampledKLTerm", "TopKTerm", "UntilFirstErrorTerm", "StepWeightsTerm", "CenterTerm", "ShortTerm", "RewardWeightedTerm", "EnvAdvantageTerm", "RLSDSelectedTerm", "RLSDTopKTerm", "SequenceFallbackTerm", "legacy_opd_terms", "LEGACY_OPD_FLAGS",
]
