"""zerotrain: ZeRO data-parallel training for PyTorch with a DeepSpeed-compatible API.

A DeepSpeed script runs unchanged with ``import zerotrain as deepspeed``.
"""

from zerotrain import checkpointing  # deepspeed.checkpointing
from zerotrain.api import add_config_arguments, initialize
from zerotrain.comm import CollectiveError, init_distributed
from zerotrain.config import ConfigError, ZeroTrainConfig
from zerotrain.engine import ZeroTrainEngine

__version__ = "0.1.0"

__all__ = [
    "CollectiveError",
    "ConfigError",
    "ZeroTrainConfig",
    "ZeroTrainEngine",
    "__version__",
    "add_config_arguments",
    "checkpointing",
    "init_distributed",
    "initialize",
]
