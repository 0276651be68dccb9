"""DeepSpeed's ``deepspeed.utils``: the logger, ``RepeatingLoader``, partitioned state read and
set by hand (``tensor_fragment``), and (in ``zerotrain.utils.zero_to_fp32``) checkpoint conversion."""

from __future__ import annotations

from zerotrain.data import RepeatingLoader
from zerotrain.utils import groups, init_on_device, logging, tensor_fragment, zero_to_fp32
from zerotrain.utils.init_on_device import OnDevice
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
from zerotrain.utils.z3_leaf_module import (
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)

__all__ = [
    "OnDevice",
    "RepeatingLoader",
    "get_z3_leaf_modules",
    "groups",
    "init_on_device",
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
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "tensor_fragment",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
    "zero_to_fp32",
]
