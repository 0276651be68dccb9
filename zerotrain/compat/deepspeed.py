"""``activate()``: for the rest of this process, ``import deepspeed`` is zerotrain.

[Note: an opt-in alias, not a package]
The HuggingFace Trainer and Accelerate have no extension point for another ZeRO backend: they
ask importlib for a distribution named ``deepspeed`` (its version) and then ``import
deepspeed`` by name. :func:`activate` answers both for the current process only. It puts two
finders at the front of ``sys.meta_path``:
* modules: ``deepspeed`` and ``deepspeed.X`` resolve to ``zerotrain`` and ``zerotrain.X``, the
  same module objects (``deepspeed.comm is zerotrain.comm``); a DeepSpeed module zerotrain does
  not have is not found, as it would be without DeepSpeed;
* metadata: ``importlib.metadata`` finds a distribution ``deepspeed`` of version
  :data:`VERSION` (``0.19.8+zerotrain``: the DeepSpeed API zerotrain follows, and what it is).
Nothing is installed or written: a new process starts without the alias, and
``pip list`` never shows a ``deepspeed``. When a real DeepSpeed is installed, ``activate``
refuses unless told to shadow it, and it refuses once a ``deepspeed`` module has been imported
(that process would run two libraries under one name). Rank 0 says in one line that the alias
is on. Frameworks read the ``deepspeed`` distribution when they are imported
(``transformers.integrations.deepspeed`` decides at import time), so activate first:
``zerotrain run --deepspeed-compat`` does it before the script starts.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from zerotrain.errors import ZeroTrainError

VERSION = "0.19.8+zerotrain"
"""The version of the ``deepspeed`` distribution the alias presents."""

_NAME = "deepspeed"


class DeepSpeedInstalled(ZeroTrainError, RuntimeError):
    """A real DeepSpeed is installed or imported where the alias would shadow it, or
    accelerate was imported without DeepSpeed before the alias could take effect."""


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)  # the zerotrain module itself

    def exec_module(self, module: ModuleType) -> None:
        """Executed already, as its zerotrain name."""


class _ModuleAlias(importlib.abc.MetaPathFinder):
    """``deepspeed[.X]`` -> ``zerotrain[.X]``."""

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != _NAME and not fullname.startswith(_NAME + "."):
            return None
        zerotrain_name = "zerotrain" + fullname[len(_NAME) :]
        try:
            found = importlib.util.find_spec(zerotrain_name)
        except ModuleNotFoundError:  # a parent that zerotrain lacks
            return None
        if found is None:
            return None
        return importlib.machinery.ModuleSpec(
            fullname,
            _AliasLoader(zerotrain_name),
            is_package=found.submodule_search_locations is not None,
        )


class _Distribution(importlib.metadata.Distribution):
    """The runtime-only ``deepspeed`` distribution: metadata, no files."""

    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            return (
                "Metadata-Version: 2.1\n"
                f"Name: {_NAME}\n"
                f"Version: {VERSION}\n"
                "Summary: zerotrain presented as deepspeed in this process "
                "(zerotrain.compat.deepspeed.activate)\n"
            )
        return None

    def locate_file(self, path) -> Path:
        return Path(__file__).parent / str(path)


class _MetadataAlias(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path=None, target=None):
        return None

    def find_distributions(self, context=None):
        if getattr(context, "name", None) in (None, _NAME):
            return iter([_Distribution()])
        return iter([])


_finders: list[importlib.abc.MetaPathFinder] = []


def active() -> bool:
    """Whether :func:`activate` is in effect in this process."""
    return bool(_finders)


def installed_deepspeed() -> str | None:
    """Where a real DeepSpeed is (a distribution or an importable module), or None."""
    if active():
        return None
    try:
        distribution = importlib.metadata.distribution(_NAME)
    except importlib.metadata.PackageNotFoundError:
        spec = importlib.util.find_spec(_NAME)
        return None if spec is None else str(spec.origin or spec.submodule_search_locations)
    return f"{_NAME} {distribution.version} ({distribution.locate_file('')})"


def activate(*, shadow: bool = False, announce: bool = True) -> None:
    """Make ``import deepspeed`` resolve to zerotrain in this process (see the note above).

    ``shadow``: go ahead although a real DeepSpeed is installed (it stays installed, and other
    processes keep using it). Idempotent.
    """
    if active():
        return
    if _NAME in sys.modules:
        raise DeepSpeedInstalled(
            f"zerotrain.compat.deepspeed.activate(): a module named {_NAME} is imported already "
            f"({sys.modules[_NAME]!r}); call activate() before anything imports {_NAME}"
        )
    accelerate_utils = sys.modules.get("accelerate.utils")
    if accelerate_utils is not None and not hasattr(accelerate_utils, "DeepSpeedEngineWrapper"):
        # accelerate decides once, as it is imported, whether it supports DeepSpeed
        raise DeepSpeedInstalled(
            "zerotrain.compat.deepspeed.activate(): accelerate was imported before it, when "
            f"`import {_NAME}` failed, and keeps no DeepSpeed support in this process; call "
            "activate() before importing accelerate or transformers (as `zerotrain run "
            "--deepspeed-compat` does)"
        )
    real = installed_deepspeed()
    if real is not None and not shadow:
        raise DeepSpeedInstalled(
            f"zerotrain.compat.deepspeed.activate(): DeepSpeed is installed here ({real}); "
            f"`import {_NAME}` would be ambiguous. Pass shadow=True (zerotrain run "
            "--deepspeed-compat=shadow) to use zerotrain in its place in this process, or "
            "uninstall it"
        )
    _finders.extend([_ModuleAlias(), _MetadataAlias()])
    sys.meta_path[:0] = _finders
    if announce and os.environ.get("RANK", "0") == "0":
        from zerotrain import __version__

        shadowed = f", shadowing {real}" if real else ""
        print(
            f"zerotrain: `import {_NAME}` is zerotrain {__version__} in this process "
            f"(distribution {_NAME} {VERSION}{shadowed}); DeepSpeed itself is not used",
            flush=True,
        )


def deactivate() -> None:
    """Undo :func:`activate` (the alias modules imported so far are dropped)."""
    for finder in _finders:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
    _finders.clear()
    for name in [n for n in sys.modules if n == _NAME or n.startswith(_NAME + ".")]:
        del sys.modules[name]
