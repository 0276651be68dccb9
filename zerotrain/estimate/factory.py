"""A model from a factory named on a command line: ``module.path:factory`` or
``path/to/file.py:factory`` (``zerotrain estimate --model``, ``zerotrain plan --model``)."""

from __future__ import annotations

import os
import sys

from zerotrain.errors import ZeroTrainError

__all__ = ["ModelFactoryError", "build_on_meta", "load_factory"]


class ModelFactoryError(ZeroTrainError, ValueError):
    """A ``--model`` that names no factory, or whose factory fails (the message says which)."""


def _import_target(target: str):
    import importlib
    import importlib.util

    if target.endswith(".py") or os.sep in target or "/" in target:
        if not os.path.isfile(target):
            raise ModelFactoryError(f"--model: no file {target!r}")
        name = os.path.splitext(os.path.basename(target))[0]
        spec = importlib.util.spec_from_file_location(f"_zerotrain_estimate_{name}", target)
        if spec is None or spec.loader is None:  # not a file Python can import
            raise ModelFactoryError(f"--model: {target!r} is not a Python file (path/to/file.py)")
        module = importlib.util.module_from_spec(spec)
        # registered before it runs, as an import would: dataclasses and pickling look a
        # module up by name while it executes
        sys.modules[spec.name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[spec.name]
            raise
        return module
    if os.getcwd() not in sys.path and "" not in sys.path:  # console scripts leave it out
        sys.path.insert(0, os.getcwd())
    return importlib.import_module(target)


def load_factory(spec: str):
    """The model factory ``spec`` names: ``module.path:factory`` or
    ``path/to/file.py:factory`` (ModelFactoryError, naming ``--model``, if it cannot be found)."""
    from torch import nn

    target, _, name = spec.rpartition(":")
    if not target or not name:
        raise ModelFactoryError(
            f"--model: expected module.path:factory or path/to/file.py:factory, got {spec!r}"
        )
    try:
        module = _import_target(target)
    except ModelFactoryError:
        raise
    except Exception as error:  # whatever the user's module raises: report it, no traceback
        raise ModelFactoryError(
            f"--model: cannot import {target!r}: {type(error).__name__}: {error}"
        ) from error
    factory = getattr(module, name, None)
    if not callable(factory) or isinstance(factory, nn.Module):
        raise ModelFactoryError(
            f"--model: {target!r} has no function or class {name!r} that builds the model"
        )
    return factory


def build_on_meta(spec: str):
    """``module.path:factory`` or ``path/to/file.py:factory`` called on the meta device: the
    parameters have shapes and no storage, so a 70B model costs nothing to build."""
    import torch
    from torch import nn

    factory = load_factory(spec)
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as error:
        raise ModelFactoryError(
            f"--model: {spec}() failed on the meta device: {type(error).__name__}: {error}"
        ) from error
    if not isinstance(model, nn.Module):
        raise ModelFactoryError(
            f"--model: {spec}() returned {type(model).__name__}, not an nn.Module"
        )
    return model
