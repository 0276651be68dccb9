"""``deepspeed.runtime.zero.offload_config``."""

from zerotrain.config import OffloadDeviceEnum, OffloadStateTypeEnum

__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum"]
