"""``deepspeed.runtime.config``: the config class and the optimizer names scripts compare
``optimizer_name()`` with."""

from zerotrain.config import ConfigError, ZeroTrainConfig, load_config

DeepSpeedConfig = ZeroTrainConfig
DeepSpeedConfigError = ConfigError

ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
SGD_OPTIMIZER = "sgd"

__all__ = [
    "ADAMW_OPTIMIZER",
    "ADAM_OPTIMIZER",
    "LAMB_OPTIMIZER",
    "SGD_OPTIMIZER",
    "DeepSpeedConfig",
    "DeepSpeedConfigError",
    "load_config",
]
