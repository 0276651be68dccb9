"""zerotrain: ZeRO data-parallel training for PyTorch with a DeepSpeed-compatible API.

A DeepSpeed script runs with its imports pointed at zerotrain: ``import zerotrain as
deepspeed``, ``import zerotrain.comm as dist``, ``from zerotrain.accelerator import
get_accelerator``. As in DeepSpeed, a bare ``import zerotrain`` makes the submodules reachable
as attributes (``zerotrain.zero.Init``, ``zerotrain.runtime.utils.set_random_seed``).
"""

from zerotrain import (
    accelerator,
    checkpoint,
    checkpointing,  # deepspeed.checkpointing
    comm,
    moe,
    ops,
    pipe,
    runtime,
    utils,
    zero,
)
from zerotrain.accelerator import get_accelerator
from zerotrain.api import add_config_arguments, initialize
from zerotrain.comm import CollectiveError, init_distributed
from zerotrain.config import ConfigError, ZeroTrainConfig
from zerotrain.engine import ZeroTrainEngine
from zerotrain.pipe import PipelineModule
from zerotrain.runtime.base_optimizer import DeepSpeedOptimizer
from zerotrain.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
from zerotrain.runtime.engine import DeepSpeedEngine
from zerotrain.utils import log_dist, logger

__version__ = "0.1.0"

__all__ = [
    "CollectiveError",
    "ConfigError",
    "DeepSpeedConfig",
    "DeepSpeedConfigError",
    "DeepSpeedEngine",
    "DeepSpeedOptimizer",
    "PipelineModule",
    "ZeroTrainConfig",
    "ZeroTrainEngine",
    "__version__",
    "accelerator",
    "add_config_arguments",
    "checkpoint",
    "checkpointing",
    "comm",
    "get_accelerator",
    "init_distributed",
    "initialize",
    "log_dist",
    "logger",
    "moe",
    "ops",
    "pipe",
    "runtime",
    "utils",
    "zero",
]
