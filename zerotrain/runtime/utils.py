"""``deepspeed.runtime.utils``: seeding and a memory report."""

from __future__ import annotations

import gc

from zerotrain.accelerator import get_accelerator
from zerotrain.api import seed_everything as set_random_seed
from zerotrain.comm import get_rank

__all__ = ["see_memory_usage", "set_random_seed"]


def see_memory_usage(message: str, force: bool = False) -> None:
    """With ``force``, rank 0 prints ``message`` and the accelerator's memory (allocated, peak,
    reserved), then resets the peak. Without it, nothing (as in DeepSpeed)."""
    if not force or get_rank() != 0:
        return
    gc.collect()
    accelerator = get_accelerator()
    gb = 2**30
    print(
        f"{message} | MA {accelerator.memory_allocated() / gb:.2f} GB "
        f"Max_MA {accelerator.max_memory_allocated() / gb:.2f} GB "
        f"CA {accelerator.memory_reserved() / gb:.2f} GB "
        f"Max_CA {accelerator.max_memory_reserved() / gb:.2f} GB",
        flush=True,
    )
    accelerator.reset_peak_memory_stats()
