"""Marking modules as ZeRO-3 leaves: by hand (DeepSpeed's ``deepspeed.utils.z3_leaf_module``
functions) or from the config's ``zero_optimization.leaf_module`` section.

A leaf module's parameters are gathered together, on entry to its forward, and stay gathered
through its forward and its backward: stage 3 makes the leaf one gather unit ([Note: choosing
gather units] in zerotrain/zero/units.py). A Mixture-of-Experts block needs it where its experts
would otherwise be units of their own: ranks that route their tokens to different experts would
gather different units, and the gathers, collectives, would not match. Mark modules before
``initialize``, which chooses the units (and first marks what the config's section names:
:func:`apply_leaf_module_config`); at stages 0-2 parameters are whole anyway.
"""

from __future__ import annotations

import warnings

from torch import nn

from zerotrain.config import DEFAULT_LEAF_MODULE_CLASSES, LeafModuleConfig
from zerotrain.zero.units import LEAF_FLAG, is_leaf_module

__all__ = [
    "apply_leaf_module_config",
    "get_z3_leaf_modules",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
]

_PARAM_FLAG = "ds_z3_leaf_module"  # DeepSpeed's mark on a leaf module's parameters


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether ``model`` is marked as a leaf."""
    return is_leaf_module(model)


def z3_leaf_parameter(param: nn.Parameter) -> bool:
    """Whether ``param`` belongs to a module marked as a leaf (when it was marked)."""
    return hasattr(param, _PARAM_FLAG)


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` (itself included) marked as leaves."""
    return [module for module in model.modules() if is_leaf_module(module)]


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    """Mark ``model`` itself as a leaf (``flag`` True) or not."""
    _mark([model], flag)


def _class_matches(module: nn.Module, wanted: type | str) -> bool:
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    cls = type(module)
    return wanted in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _set_by_class(model: nn.Module, classes, flag: bool, raise_if_not_found: bool):
    classes = list(classes)
    bad = [c for c in classes if not isinstance(c, (type, str))]
    if bad:
        raise TypeError(f"leaf_module_classes must be module classes or class names, got {bad!r}")
    found = [m for m in model.modules() if any(_class_matches(m, c) for c in classes)]
    if not found and raise_if_not_found:
        raise ValueError(
            f"no module of {[getattr(c, '__name__', c) for c in classes]} in the model "
            "(pass raise_if_not_found=False to allow it)"
        )
    _mark(found, flag)
    return found


def set_z3_leaf_modules(
    model: nn.Module, leaf_module_classes, raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Mark every module of ``model`` that is an instance of one of ``leaf_module_classes``
    (classes, or class names plain or qualified with the module) as a leaf, and return them;
    ValueError where none matches, unless ``raise_if_not_found`` is False."""
    return _set_by_class(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(
    model: nn.Module, leaf_module_classes, raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Undo :func:`set_z3_leaf_modules` for those classes; returns the modules matched."""
    return _set_by_class(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(
    model: nn.Module, module_names: list[str], flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[nn.Module], list[str]]:
    """Mark the modules named ``module_names`` (as ``named_modules()`` names them); returns
    them and the names that matched none (ValueError for those, unless
    ``raise_if_not_found`` is False)."""
    by_name = dict(model.named_modules())
    missing = [name for name in module_names if name not in by_name]
    if missing and raise_if_not_found:
        raise ValueError(f"no module named {missing} in the model")
    found = [by_name[name] for name in module_names if name in by_name]
    _mark(found, flag)
    return found, missing


def set_z3_leaf_modules_by_suffix(
    model: nn.Module,
    module_name_suffixes: list[str],
    flag: bool = True,
    raise_if_not_found: bool = True,
) -> tuple[list[nn.Module], list[str]]:
    """Mark the modules whose ``named_modules()`` name ends with one of
    ``module_name_suffixes``; returns them and the suffixes that matched none."""
    named = list(model.named_modules())
    found: dict[int, nn.Module] = {}
    missing = []
    for suffix in module_name_suffixes:
        matched = [module for name, module in named if name.endswith(suffix)]
        if not matched:
            missing.append(suffix)
        found.update((id(module), module) for module in matched)
    if missing and raise_if_not_found:
        raise ValueError(f"no module name ends with {missing} in the model")
    _mark(list(found.values()), flag)
    return list(found.values()), missing


def apply_leaf_module_config(
    model: nn.Module, config: LeafModuleConfig, *, warn: bool = True
) -> list[nn.Module]:
    """Mark the modules of ``model`` that ``config`` names (by class, by name, by name suffix)
    as leaves, as DeepSpeed's engine does at stage 3, and return them. A list changed from its
    default that matches nothing is warned about (a misspelled name would otherwise be
    silently gathered block by block); the default classes are HF's MoE blocks, absent from
    most models. ``warn`` False leaves the warning to another rank."""
    by_class = _set_by_class(model, config.classes, True, False)
    found = {id(m): m for m in by_class}
    unmatched = []
    if list(config.classes) != list(DEFAULT_LEAF_MODULE_CLASSES):  # customised: each must match
        unmatched += [c for c in config.classes if not any(_class_matches(m, c) for m in by_class)]
    for names, mark in (
        (config.names, set_z3_leaf_modules_by_name),
        (config.name_suffixes, set_z3_leaf_modules_by_suffix),
    ):
        modules, missing = mark(model, names, raise_if_not_found=False)
        found.update((id(m), m) for m in modules)
        unmatched += missing
    if unmatched and warn:
        warnings.warn(
            f"zero_optimization.leaf_module: {unmatched} match no module of the model; those "
            "leaves are not marked (names are named_modules() names, classes a class name "
            "plain or with its module)",
            stacklevel=3,
        )
    return list(found.values())


def _mark(modules: list[nn.Module], flag: bool) -> None:
    for module in modules:
        # torch annotates Module.__setattr__ for tensors and modules; other values are plain
        setattr(module, LEAF_FLAG, flag)
        for param in module.parameters():
            if flag:
                setattr(param, _PARAM_FLAG, True)
            elif hasattr(param, _PARAM_FLAG):
                delattr(param, _PARAM_FLAG)
