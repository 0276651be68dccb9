"""The typed, validated config: DeepSpeed's ``ds_config.json`` keys, as far as zerotrain
implements them. ``load_config(config, world_size=...)`` is the entry point; errors are
``ConfigError`` lines naming the key path and the fix. ``python -m zerotrain.config`` renders
docs/config.md.

One idea per module, each importing only those above it:
- ``deepspeed_keys``: DeepSpeed keys accepted without a field ([Note: lenient where nothing is
  asked, strict where something is]);
- ``errors``: ``ConfigError`` and how problems are worded;
- ``section``: the base of every section and the value types of its fields;
- ``batch``: DeepSpeed's train_batch_size / micro batch / accumulation arithmetic;
- ``params``: the `optimizer` and `scheduler` sections and their `params` keys per type;
- ``schema``: every other section, and ``ZeroTrainConfig``;
- ``files``: reading a JSON/YAML file;
- ``load``: ``load_config`` / ``check_config`` ([Note: how a config is checked]);
- ``docs``: the generated Markdown reference.
"""

from zerotrain.config.docs import config_reference_markdown
from zerotrain.config.errors import ConfigError
from zerotrain.config.files import read_config_file
from zerotrain.config.load import check_config, load_config
from zerotrain.config.params import OptimizerConfig, SchedulerConfig
from zerotrain.config.schema import (
    ZERO_DEFAULTS,
    ActivationCheckpointingConfig,
    BF16Config,
    CheckpointConfig,
    CommsLoggerConfig,
    CSVMonitorConfig,
    FlopsProfilerConfig,
    FP16Config,
    OffloadDeviceEnum,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OffloadStateTypeEnum,
    TensorBoardConfig,
    WandbConfig,
    ZeroOptimizationConfig,
    ZeroTrainConfig,
)
from zerotrain.config.zero import DEFAULT_LEAF_MODULE_CLASSES, LeafModuleConfig

__all__ = [
    "DEFAULT_LEAF_MODULE_CLASSES",
    "ZERO_DEFAULTS",
    "ActivationCheckpointingConfig",
    "BF16Config",
    "CheckpointConfig",
    "CSVMonitorConfig",
    "CommsLoggerConfig",
    "ConfigError",
    "FP16Config",
    "FlopsProfilerConfig",
    "LeafModuleConfig",
    "OffloadDeviceEnum",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OffloadStateTypeEnum",
    "OptimizerConfig",
    "SchedulerConfig",
    "TensorBoardConfig",
    "WandbConfig",
    "ZeroOptimizationConfig",
    "ZeroTrainConfig",
    "check_config",
    "config_reference_markdown",
    "load_config",
    "read_config_file",
]
