"""DeepSpeed's ``deepspeed.utils.z3_leaf_module``: marking modules as ZeRO-3 leaves
(zerotrain.zero.leaf_modules, where stage 3 reads the marks)."""

from __future__ import annotations

from zerotrain.zero.leaf_modules import (
    apply_leaf_module_config as apply_zero_leaf_module_config,
)
from zerotrain.zero.leaf_modules import (
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
    "apply_zero_leaf_module_config",
    "get_z3_leaf_modules",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
]
