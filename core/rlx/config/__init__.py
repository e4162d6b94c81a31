"""rlx's config: the typed tree (`rlx.config.schema`) and reading it from YAML with located errors
(`rlx.config.loading`). The checks that need the installed plugins or the files named are `rlx.preflight`'s.
"""

from rlx.config.loading import Check, apply_override, describe_error, format_path, load_config, parse_config
from rlx.config.modes import check_modes
from rlx.config.schema import (
    COMPONENT_FIELDS, PATH_FIELDS, AsyncConfig, BufferConfig, CheckpointConfig, ComponentSpec, Config, CriticConfig,
    DataConfig, DataSource, DistillConfig, EngineGroupConfig, EvalConfig, EvalDatasetConfig, FaultToleranceConfig, LoRAAdapterConfig, LoRAConfig, ModelConfig,
    ObjectiveConfig, OptimConfig, ParallelConfig, RayConfig, RewardSpec, RolloutConfig, RouterConfig, RunConfig,
    SamplingConfig, Section, TeacherConfig, TrainConfig, WeightSyncConfig, CpuConfig, ScoringConfig, RequestsConfig,
    DynamicSamplingConfig, PartialRolloutConfig, adapter_pushes, component_config, engines_offload, launched_groups, records_routing,
    trainer_offloads)

__all__ = [
    "Check", "apply_override", "describe_error", "format_path", "load_config", "parse_config",
    "COMPONENT_FIELDS", "PATH_FIELDS", "AsyncConfig", "BufferConfig", "CheckpointConfig", "ComponentSpec", "Config",
    "CriticConfig", "DataConfig", "DataSource", "DistillConfig", "EngineGroupConfig", "EvalConfig", "EvalDatasetConfig",
    "FaultToleranceConfig", "LoRAAdapterConfig", "LoRAConfig",
    "ModelConfig", "ObjectiveConfig", "OptimConfig", "ParallelConfig", "RayConfig", "RewardSpec", "RolloutConfig",
    "RouterConfig", "RunConfig", "SamplingConfig", "Section", "TeacherConfig", "TrainConfig", "WeightSyncConfig", "CpuConfig", "ScoringConfig", "RequestsConfig", "DynamicSamplingConfig", "PartialRolloutConfig", "check_modes", "component_config",
    "adapter_pushes", "engines_offload", "launched_groups", "records_routing", "trainer_offloads",
]
