"""``deepspeed.runtime.config``: the config class and the optimizer names scripts compare
``optimizer_name()`` with."""

from __future__ import annotations

import os
from typing import Any

from zerotrain.config import ConfigError, ZeroTrainConfig, load_config

DeepSpeedConfigError = ConfigError

ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
SGD_OPTIMIZER = "sgd"


def DeepSpeedConfig(  # noqa: N802 - DeepSpeed's class name, called the same way
    config: dict[str, Any] | str | os.PathLike[str], mpu: Any = None, mesh_device: Any = None
) -> ZeroTrainConfig:
    """DeepSpeed's ``DeepSpeedConfig(config, mpu)``: the config (a dict, or a JSON or YAML
    path) validated, with its batch sizes resolved for the data-parallel world (the process
    group's size, 1 without one). The result is a :class:`zerotrain.ZeroTrainConfig`, whose
    fields carry the config's own key names (``cfg.train_batch_size``,
    ``cfg.zero_optimization.stage``), not the flat attributes DeepSpeed derives from them
    (``zero_optimization_stage``)."""
    from zerotrain.api import check_mpu
    from zerotrain.comm import get_world_size

    if mpu is not None:
        check_mpu(mpu, caller="DeepSpeedConfig")
    if mesh_device is not None:
        raise ConfigError(
            "DeepSpeedConfig(mesh_device=...): device meshes (sequence parallelism) are not "
            "supported yet; pass None"
        )
    return load_config(config, world_size=get_world_size())


__all__ = [
    "ADAMW_OPTIMIZER",
    "ADAM_OPTIMIZER",
    "LAMB_OPTIMIZER",
    "SGD_OPTIMIZER",
    "DeepSpeedConfig",
    "DeepSpeedConfigError",
    "load_config",
]
