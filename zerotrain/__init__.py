"""zerotrain: ZeRO data-parallel training for PyTorch with a DeepSpeed-compatible API.

A DeepSpeed script runs with its imports pointed at zerotrain: ``import zerotrain as
deepspeed``, ``import zerotrain.comm as dist``, ``from zerotrain.accelerator import
get_accelerator``. As in DeepSpeed, a bare ``import zerotrain`` makes the submodules reachable
as attributes (``zerotrain.zero.Init``, ``zerotrain.runtime.utils.set_random_seed``).

[Note: the package loads its parts on first use]
``import zerotrain`` imports neither torch nor any submodule: each name below is imported the
first time it is read (PEP 562's module ``__getattr__``), so that ``zerotrain --version`` and
``zerotrain --help`` answer at once (zerotrain/cli/__init__.py) and ``import zerotrain.fmt``
costs nothing. What a script sees is the same as with eager imports: ``zerotrain.initialize``,
``zerotrain.zero.Init``, ``from zerotrain import *`` and ``dir(zerotrain)`` all work.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from zerotrain.errors import ZeroTrainError, report_errors_to_launcher

__version__ = "0.1.0"

# a rank of `zerotrain run` hands its ZeroTrainError to the launcher, which prints it once
# (see [Note: one message per failure, not a traceback per rank] in errors.py)
report_errors_to_launcher()

# the names of DeepSpeed's top level -> the module that defines each; the submodules of __all__
# (deepspeed.checkpointing, deepspeed.zero, ...) and all others load through __getattr__ too
_NAMES = {
    "get_accelerator": "zerotrain.accelerator",
    "add_config_arguments": "zerotrain.api",
    "initialize": "zerotrain.api",
    "CollectiveError": "zerotrain.comm",
    "init_distributed": "zerotrain.comm",
    "ConfigError": "zerotrain.config",
    "ZeroTrainConfig": "zerotrain.config",
    "ZeroTrainEngine": "zerotrain.engine",
    "PipelineModule": "zerotrain.pipe",
    "DeepSpeedOptimizer": "zerotrain.runtime.base_optimizer",
    "DeepSpeedConfig": "zerotrain.runtime.config",
    "DeepSpeedConfigError": "zerotrain.runtime.config",
    "DeepSpeedEngine": "zerotrain.runtime.engine",
    "OnDevice": "zerotrain.utils.init_on_device",
    "log_dist": "zerotrain.utils",
    "logger": "zerotrain.utils",
}

__all__ = [
    "CollectiveError",
    "ConfigError",
    "DeepSpeedConfig",
    "DeepSpeedConfigError",
    "DeepSpeedEngine",
    "DeepSpeedOptimizer",
    "OnDevice",
    "PipelineModule",
    "ZeroTrainConfig",
    "ZeroTrainEngine",
    "ZeroTrainError",
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
    "sequence",
    "utils",
    "zero",
]

if TYPE_CHECKING:  # what the names are, for type checkers and editors
    from zerotrain import (
        accelerator,
        checkpoint,
        checkpointing,
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
    from zerotrain.utils.init_on_device import OnDevice


def __getattr__(name: str) -> Any:
    """Import ``name`` on first use (see [Note: the package loads its parts on first use]): one
    of the names above, or any submodule (``zerotrain.config``, as eager imports made them)."""
    if name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name]), name)
        globals()[name] = value
        return value
    if not name.startswith("__"):
        try:
            return importlib.import_module(f"zerotrain.{name}")  # the import sets the attribute
        except ModuleNotFoundError as error:
            if error.name != f"zerotrain.{name}":
                raise  # the submodule exists and failed to import something
    raise AttributeError(f"module 'zerotrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
