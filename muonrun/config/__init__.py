"""Typed configuration: `schema` (the dataclasses; their field docstrings are the reference docs),
`load` (presets, `defaults:`, overrides, validation) and `docs` (`muonrun config docs`).

    from muonrun.config import load_config
    cfg = load_config("tiny", ["train.max_steps=10"])      # the typed Config, validated
"""

from muonrun.config.docs import field_docs, markdown_table
from muonrun.config.load import (
    DEFAULT_PRESET,
    PRESET_DIR,
    choices,
    differences,
    from_yaml,
    load_config,
    preset_names,
    resolve_preset,
    to_yaml,
    validate,
)
from muonrun.config.optimizer import MuonConfig, OptimizerConfig
from muonrun.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    LaunchConfig,
    LoggingConfig,
    LoraSettings,
    ModelConfig,
    ParallelConfig,
    ScheduleConfig,
    SourceConfig,
    TrainConfig,
)

__all__ = [
    "DEFAULT_PRESET",
    "PRESET_DIR",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "LaunchConfig",
    "LoggingConfig",
    "LoraSettings",
    "ModelConfig",
    "MuonConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "ScheduleConfig",
    "SourceConfig",
    "TrainConfig",
    "choices",
    "differences",
    "field_docs",
    "from_yaml",
    "load_config",
    "markdown_table",
    "preset_names",
    "resolve_preset",
    "to_yaml",
    "validate",
]
