"""``deepspeed.runtime.utils``: seeding and a memory report."""

from __future__ import annotations

import functools
import gc

from zerotrain.accelerator import get_accelerator
from zerotrain.api import seed_everything as set_random_seed
from zerotrain.comm import get_rank
from zerotrain.fmt import quantity

__all__ = ["see_memory_usage", "set_random_seed"]


def see_memory_usage(message: str, force: bool = False) -> None:
    """With ``force``, rank 0 prints ``message`` and the accelerator's memory (allocated, peak,
    reserved), then resets the peak. Without it, nothing (as in DeepSpeed)."""
    if not force or get_rank() != 0:
        return
    gc.collect()
    accelerator = get_accelerator()
    gib = functools.partial(quantity, unit="B", prefix="Gi")  # DeepSpeed's values (2^30 bytes)
    print(
        f"{message} | MA {gib(accelerator.memory_allocated())} "
        f"Max_MA {gib(accelerator.max_memory_allocated())} "
        f"CA {gib(accelerator.memory_reserved())} "
        f"Max_CA {gib(accelerator.max_memory_reserved())}",
        flush=True,
    )
    accelerator.reset_peak_memory_stats()
