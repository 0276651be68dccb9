"""DeepSpeed's ``deepspeed.utils``: the logger, ``RepeatingLoader``, full views of partitioned
state, and (in ``zerotrain.utils.zero_to_fp32``) checkpoint conversion."""

from __future__ import annotations

import torch
from torch import nn

from zerotrain.data import RepeatingLoader
from zerotrain.utils import logging, zero_to_fp32
from zerotrain.utils.logging import (
    log_dist,
    log_dist_once,
    logger,
    print_dist,
    set_log_level_from_string,
)
from zerotrain.zero.init import owner_of

__all__ = [
    "RepeatingLoader",
    "log_dist",
    "log_dist_once",
    "logger",
    "logging",
    "print_dist",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "set_log_level_from_string",
    "set_z3_leaf_modules",
    "zero_to_fp32",
]


def _full(param: nn.Parameter, kind: str) -> torch.Tensor | None:
    owner = owner_of(param)
    return owner.full_value(param, kind) if owner is not None else None


def safe_get_full_fp32_param(param: nn.Parameter) -> torch.Tensor | None:
    """The full fp32 master weight of ``param`` (collective: every rank calls it); None for a
    parameter no engine trains."""
    return _full(param, "master")


def safe_get_full_grad(param: nn.Parameter) -> torch.Tensor | None:
    """The full fp32 gradient of ``param`` reduced so far, without the fp16 loss scale: the
    average over ranks between the accumulation boundary's backward and ``step()`` (collective)."""
    return _full(param, "grad")


def safe_get_full_optimizer_state(param: nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """The full fp32 optimizer state ``optim_state_key`` (``"exp_avg"``, ``"exp_avg_sq"``) of
    ``param``; None before the optimizer made it (collective)."""
    return _full(param, optim_state_key)


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes, raise_if_not_found: bool = True):
    """Mark the modules of ``model`` whose class is (or is named) one of
    ``leaf_module_classes`` as ZeRO-3 leaves and return them (DeepSpeed's name). zerotrain
    gathers whole blocks, so a leaf module is always gathered whole: the mark has no further
    effect (see `zero_optimization.leaf_module` in docs/config.md)."""
    wanted = tuple(leaf_module_classes)
    found = [
        m for m in model.modules() if any(type(m) is c or type(m).__name__ == c for c in wanted)
    ]
    if not found and raise_if_not_found:
        raise ValueError(f"set_z3_leaf_modules: no module of {list(wanted)} in the model")
    for module in found:
        # torch annotates Module.__setattr__ for tensors and modules; other values are plain
        module._z3_leaf = True  # pyrefly: ignore[bad-argument-type]
    return found
