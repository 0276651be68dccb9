"""``deepspeed.runtime.dataloader``."""

from zerotrain.data import RepeatingLoader

__all__ = ["RepeatingLoader"]
