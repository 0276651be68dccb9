"""``deepspeed.runtime.zero.leaf_module_config``: the ``zero_optimization.leaf_module`` section
and its defaults (zerotrain's validated section, zerotrain.config)."""

from __future__ import annotations

from zerotrain.config import DEFAULT_LEAF_MODULE_CLASSES as _CLASSES
from zerotrain.config import LeafModuleConfig as DeepSpeedZeroLeafModuleConfig

__all__ = [
    "DEFAULT_LEAF_MODULE_CLASSES",
    "DEFAULT_LEAF_MODULE_NAMES",
    "DEFAULT_LEAF_MODULE_NAME_SUFFIXES",
    "DeepSpeedZeroLeafModuleConfig",
]

DEFAULT_LEAF_MODULE_CLASSES: list[str] = list(_CLASSES)  # DeepSpeed's are lists
DEFAULT_LEAF_MODULE_NAMES: list[str] = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list[str] = []
