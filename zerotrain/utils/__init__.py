"""DeepSpeed's ``deepspeed.utils``: the logger, ``RepeatingLoader``, partitioned state read and
set by hand (``tensor_fragment``), and (in ``zerotrain.utils.zero_to_fp32``) checkpoint conversion."""

from __future__ import annotations

from torch import nn

from zerotrain.data import RepeatingLoader
from zerotrain.utils import logging, tensor_fragment, zero_to_fp32
from zerotrain.utils.logging import (
    log_dist,
    log_dist_once,
    logger,
    print_dist,
    set_log_level_from_string,
)
from zerotrain.utils.tensor_fragment import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
    safe_update_full_grad_vectorized,
)

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
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
    "set_log_level_from_string",
    "set_z3_leaf_modules",
    "tensor_fragment",
    "zero_to_fp32",
]


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
