"""``deepspeed.runtime.lr_schedules``: DeepSpeed's schedules (zerotrain.optim.schedulers)."""

from zerotrain.optim.schedulers import OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

VALID_LR_SCHEDULES = ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
"""DeepSpeed's schedule names (Accelerate recognises DeepSpeed schedulers by them)."""


class LRRangeTest:
    """DeepSpeed's learning-rate range test, which zerotrain does not implement yet."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            "LRRangeTest: zerotrain does not implement DeepSpeed's learning-rate range test "
            "yet; use WarmupLR, WarmupDecayLR, WarmupCosineLR or OneCycle"
        )


__all__ = [
    "VALID_LR_SCHEDULES",
    "LRRangeTest",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
]
