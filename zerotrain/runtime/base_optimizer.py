"""``deepspeed.runtime.base_optimizer``: the optimizer class under DeepSpeed's name, and the
classes of DeepSpeed's per-stage ZeRO wrappers, which zerotrain's one ZeroOptimizer answers by
its stage (``deepspeed.runtime.zero.stage_1_and_2``, ``deepspeed.runtime.zero.stage3``)."""

from __future__ import annotations

from typing import Any

from zerotrain.zero import ZeroOptimizer

DeepSpeedOptimizer = ZeroOptimizer
"""``isinstance(x, DeepSpeedOptimizer)`` is true for the ZeRO optimizer (``engine.optimizer``;
what ``initialize`` returns where DeepSpeed returns a wrapper)."""

ZeROOptimizer = ZeroOptimizer


class ServedByStage(type):
    """The metaclass of a DeepSpeed ZeRO wrapper class that zerotrain serves by name only:
    DeepSpeed has a class per stage, zerotrain one :class:`ZeroOptimizer` whose policy is the
    stage, so ``isinstance`` asks the policy (client code tells stages apart this way).
    Building one directly is refused: ``initialize`` builds the ZeRO optimizer."""

    stages: tuple[int, ...]

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, ZeroOptimizer) and instance.policy.stage in cls.stages

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"{cls.__name__}: zerotrain builds its ZeRO optimizer in initialize(); call "
            "zerotrain.initialize(model=..., optimizer=..., config=...) (deepspeed.initialize) "
            "and use the optimizer it returns, or engine.optimizer"
        )


__all__ = ["DeepSpeedOptimizer", "ServedByStage", "ZeROOptimizer"]
