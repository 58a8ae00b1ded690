"""Typed configuration: one source of truth for every key, its type, default and meaning.

Loaded from YAML, then dotted ``key=value`` overrides (values parse as YAML). Any unknown
key or wrong type raises ``ConfigError`` naming the key (and the closest valid one); the
CLI turns that into exit status 2.

One module per concern: ``base``, ``model``, ``rollout``, ``learning``, ``services``, ``engines``,
``frozen``, ``schedule``, ``root`` (the whole ``Config``), ``hints`` (errors that teach) and
``loading`` (YAML and overrides in, a ``Config`` out); every name is importable from
``asyncrl.config`` as it was when this was one module.
"""

from asyncrl.config.base import ConfigError, Section
from asyncrl.config.engines import EngineServerConfig, RemoteConfig, VLLMConfig
from asyncrl.config.frozen import FrozenModelConfig, JudgeConfig, TeacherConfig
from asyncrl.config.hints import _NOTES, COMMON_NAMES, CommonName
from asyncrl.config.learning import AlgorithmConfig, CriticConfig, LearnerConfig, OptimConfig
from asyncrl.config.loading import (
    CONFIG_CHANGES_FILE,
    CONFIG_FILE,
    NOT_SETTINGS,
    SHORTHANDS,
    SWITCHES,
    M,
    all_keys,
    apply_overrides,
    changed_settings,
    describe_changes,
    load_config,
    read_config_file,
    record_config_changes,
    run_settings,
    save_config,
    settings,
    validate,
)
from asyncrl.config.model import LoraConfig, ModelConfig
from asyncrl.config.rollout import (
    EvalConfig,
    RolloutConfig,
    SamplingConfig,
    TaskConfig,
    TaskSamplerConfig,
    WorkflowConfig,
)
from asyncrl.config.root import Config
from asyncrl.config.tinker import TinkerConfig
from asyncrl.config.schedule import (
    SCHEDULE_KEYS,
    ScheduleConfig,
    flatten_schedule_keys,
    hoist_schedule_keys,
)
from asyncrl.config.services import (
    GatewayConfig,
    HooksConfig,
    LoggingConfig,
    RayConfig,
    WatchdogConfig,
    WeightSyncConfig,
)

__all__ = [
    'Section',
    'ConfigError',
    'ModelConfig',
    'LoraConfig',
    'TaskSamplerConfig',
    'WorkflowConfig',
    'SamplingConfig',
    'EvalConfig',
    'TaskConfig',
    'RolloutConfig',
    'OptimConfig',
    'LearnerConfig',
    'AlgorithmConfig',
    'CriticConfig',
    'WatchdogConfig',
    'LoggingConfig',
    'GatewayConfig',
    'WeightSyncConfig',
    'HooksConfig',
    'RayConfig',
    'EngineServerConfig',
    'TinkerConfig',
    'VLLMConfig',
    'RemoteConfig',
    'JudgeConfig',
    'FrozenModelConfig',
    'TeacherConfig',
    'SCHEDULE_KEYS',
    'flatten_schedule_keys',
    'hoist_schedule_keys',
    'ScheduleConfig',
    'Config',
    'COMMON_NAMES',
    'CommonName',
    '_NOTES',
    'all_keys',
    'record_config_changes',
    'CONFIG_FILE',
    'SHORTHANDS',
    'NOT_SETTINGS',
    'save_config',
    'M',
    'validate',
    'apply_overrides',
    'run_settings',
    'CONFIG_CHANGES_FILE',
    'read_config_file',
    'settings',
    'load_config',
    'describe_changes',
    'changed_settings',
    'SWITCHES',
]
