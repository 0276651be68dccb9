"""DeepSpeed's ``deepspeed.runtime`` module paths, for scripts that import from them.

Each module here re-exports zerotrain's own implementation under DeepSpeed's path
(``deepspeed.runtime.utils.set_random_seed`` -> ``zerotrain.runtime.utils.set_random_seed``).
zerotrain's own modules do not import them; only the top-level package re-exports
``DeepSpeedConfig`` as DeepSpeed does.
"""

from zerotrain.runtime import (
    base_optimizer,
    compiler,
    config,
    data_pipeline,
    dataloader,
    engine,
    lr_schedules,
    sequence_parallel,
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
    "sequence_parallel",
    "utils",
    "zero",
]
