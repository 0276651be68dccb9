"""Optimizers and LR schedulers built from DeepSpeed ``optimizer`` / ``scheduler`` config sections.

registry.py names the optimizers (``OPTIMIZERS``) and builds them (``build_optimizer``). The
schedulers are DeepSpeed's, as ``torch.optim.lr_scheduler.LRScheduler`` subclasses.
"""

from __future__ import annotations

import torch

from zerotrain.optim.adam import DeepSpeedCPUAdam, FusedAdam
from zerotrain.optim.lamb import Lamb
from zerotrain.optim.onebit import OneBitAdam, ZeroOneAdam
from zerotrain.optim.registry import (
    DEEPSPEED_ONLY_OPTIMIZERS,
    OPTIMIZERS,
    OptimizerSpec,
    build_optimizer,
    find_optimizer,
)
from zerotrain.optim.schedulers import (
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
    repoint_scheduler,
)

__all__ = [
    "DEEPSPEED_ONLY_OPTIMIZERS",
    "OPTIMIZERS",
    "DeepSpeedCPUAdam",
    "FusedAdam",
    "Lamb",
    "NoOptimizer",
    "OneBitAdam",
    "OneCycle",
    "OptimizerSpec",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "ZeroOneAdam",
    "build_optimizer",
    "build_scheduler",
    "repoint_scheduler",
    "find_optimizer",
]


class NoOptimizer(torch.optim.Optimizer):
    """Stands in when ``initialize`` is given no optimizer (no `optimizer` section and no
    ``optimizer=``): an engine for evaluation, as DeepSpeed allows. Stepping raises."""

    MESSAGE = (
        "this engine was initialized without an optimizer (no `optimizer` config section and "
        "no initialize(optimizer=...)): it runs forward passes only; give it an optimizer to "
        "train"
    )

    def __init__(self, params):
        super().__init__(params, {})

    def step(self, closure=None):
        raise RuntimeError(self.MESSAGE)
