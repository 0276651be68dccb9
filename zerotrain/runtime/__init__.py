"""DeepSpeed's ``deepspeed.runtime`` module paths, for scripts that import from them.

Each module here re-exports zerotrain's own implementation under DeepSpeed's path
(``deepspeed.runtime.utils.set_random_seed`` -> ``zerotrain.runtime.utils.set_random_seed``);
nothing below this package is imported by zerotrain itself.
"""

from zerotrain.runtime import (
    base_optimizer,
    compiler,
    config,
    data_pipeline,
    dataloader,
    engine,
    lr_schedules,
    utils,
    zero,
)

__all__ = [
    "base_optimizer",
    "compiler",
    "config",
    "data_pipeline",
    "dataloader",
    "engine",
    "lr_schedules",
    "utils",
    "zero",
]
