"""From the folder a user has to the checkpoint in it: one resolver for every checkpoint tool.

[Note: the folders a checkpoint tool accepts]
``engine.load_checkpoint``, ``zerotrain checkpoint inspect|consolidate``, ``consolidate``,
``read_state_dict``, ``load_consolidated`` and the ``zero_to_fp32`` functions all read a path
through :func:`find_checkpoints` and :func:`resolve`, so they accept the same folders:

- a checkpoint (tag) directory: ``manifest.json`` beside the files of a save;
- a save directory: tag directories (``global_step100/``), usually beside a ``latest`` file;
  with ``tag=None`` the tag ``latest`` names, as DeepSpeed reads it (an older one when the
  last save passed ``save_latest=False``, or when a user pointed ``latest`` back); without a
  ``latest``, or one naming no complete checkpoint, the newest complete one by commit time
  (incomplete ones are skipped);
- the HuggingFace Trainer's ``checkpoint-N`` folder: a save directory (``latest``,
  ``global_stepN/``) that also holds the Trainer's files (``model.safetensors``,
  ``trainer_state.json``, ``rng_state_*.pth``); the checkpoint is read, not the export.

DeepSpeed's ``zero_to_fp32`` and ``load_checkpoint`` read ``checkpoint_dir/latest`` and accept
nothing else; these are a superset. DeepSpeed accepts no folder of several save directories
(the Trainer's output directory with its ``checkpoint-N`` folders), and neither do we: which one
is meant (the newest, the best) is the user's choice, so the error names them. When a folder holds no complete
checkpoint, :class:`NoCheckpoint` says why, in one of five kinds the engine treats apart
(see ``load.py``): the path does not exist beside a similar name (a typo, most likely: that name
is offered), it does not exist or holds nothing of a checkpoint (a first run: scripts pass a
folder their first save creates), only incomplete saves, or something
else that is not a loadable checkpoint (a consolidated export, DeepSpeed's files, save
directories one level down, a ``latest`` naming a tag that is not there).
"""

from __future__ import annotations

import difflib
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from zerotrain.checkpoint.manifest import (
    LATEST,
    MANIFEST,
    CheckpointError,
    CheckpointStatus,
    Manifest,
    holds_save,
    read_latest,
    scan,
    status_of,
)

__all__ = ["Found", "NoCheckpoint", "find_checkpoints", "resolve"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
EXPECTED = (
    "expected a checkpoint directory (manifest.json beside a save's files) or a save directory "
    "of them (global_step100/ beside a latest file, as save_checkpoint writes and the "
    "HuggingFace Trainer's checkpoint-N folder holds)"
)
# DeepSpeed's own checkpoint files (mp_rank_00_model_states.pt, zero_pp_rank_0_..._optim_states.pt)
_DEEPSPEED_FILE = re.compile(r"(model|optim)_states\.pt$")

NoCheckpointKind = Literal["absent", "missing", "empty", "incomplete", "unusable"]


class NoCheckpoint(CheckpointError):
    """A folder holds no complete checkpoint to load; ``kind`` says why: ``absent`` (no such
    path, and nothing of a similar name beside it: a first run), ``missing`` (no such path, but
    a similar name: a typo), ``empty`` (nothing of a checkpoint: a first run), ``incomplete``
    (only saves that did not finish) or ``unusable`` (something else: see [Note: the folders a
    checkpoint tool accepts])."""

    def __init__(self, message: str, kind: NoCheckpointKind):
        super().__init__(message)
        self.kind: NoCheckpointKind = kind


@dataclass(frozen=True)
class Found:
    """What a folder holds, as the checkpoint tools read it."""

    path: Path
    save_dir: Path  # where `latest` and the tag directories are: path, or its parent (single)
    checkpoints: list[CheckpointStatus]  # oldest commit first, incomplete last
    single: bool  # path is one checkpoint directory itself
    latest: str | None  # the tag save_dir's `latest` file names

    @property
    def export(self) -> str | None:
        """The consolidated export in ``path`` (``model.safetensors`` or its index), if any."""
        for name in (SINGLE_FILE, INDEX_FILE):
            if (self.path / name).is_file():
                return name
        return None

    @property
    def named_by_latest(self) -> Manifest | None:
        """The complete checkpoint ``latest`` names in a save directory (DeepSpeed's choice
        with ``tag=None``), or None."""
        if self.single or self.latest is None:
            return None
        for status in self.checkpoints:
            if status.tag == self.latest and status.manifest is not None:
                return status.manifest
        return None

    @property
    def newest(self) -> Manifest | None:
        """The newest complete checkpoint (by commit time), or None."""
        complete = [s.manifest for s in self.checkpoints if s.manifest is not None]
        return complete[-1] if complete else None

    def nothing_to_load(self) -> NoCheckpoint:
        """Why there is no complete checkpoint here, naming what was found."""
        if self.checkpoints:
            if self.single:
                return NoCheckpoint(self.checkpoints[0].problem or str(self.path), "incomplete")
            saves = ", ".join(f"{s.tag} ({_why_incomplete(s)})" for s in self.checkpoints)
            return NoCheckpoint(
                f"{self.path}: holds only incomplete checkpoints, saves that did not finish: "
                f"{saves}",
                "incomplete",
            )
        found = self._not_loadable()
        if not found:
            return NoCheckpoint(f"{self.path}: holds no checkpoint; {EXPECTED}", "empty")
        return NoCheckpoint(
            f"{self.path}: holds no zerotrain checkpoint but " + "; and ".join(found), "unusable"
        )

    def _not_loadable(self) -> list[str]:
        """What in ``path`` looks like a checkpoint but is not one to load, and what to do."""
        found = []
        if self.export:
            found.append(
                f"a consolidated export ({self.export}): load it into a model with "
                "zerotrain.checkpoint.load_consolidated"
            )
        subdirs = _subdirs(self.path)
        nested = [d for d in subdirs if _is_save_dir(d)]
        if nested:
            names = ", ".join(d.name for d in nested)
            found.append(
                f"save directories one level down ({names}), as the HuggingFace Trainer's "
                f"output directory holds checkpoint-N folders: pass one of them, e.g. "
                f"{nested[-1]}"
            )
        deepspeed = [
            str(p.relative_to(self.path))
            for d in (self.path, *subdirs)
            for p in sorted(d.iterdir())
            if p.is_file() and _DEEPSPEED_FILE.search(p.name)
        ]
        if deepspeed:
            found.append(
                f"DeepSpeed checkpoint files ({', '.join(deepspeed[:3])}), which zerotrain "
                "does not read: convert them with DeepSpeed's zero_to_fp32 and load the result "
                "with zerotrain.checkpoint.load_consolidated"
            )
        if self.latest is not None and not nested:
            found.append(f"a latest file naming {self.latest}, which is not there")
        return found


def find_checkpoints(path: str | os.PathLike[str]) -> Found:
    """What ``path`` holds (see [Note: the folders a checkpoint tool accepts]). Raises
    :class:`NoCheckpoint` (``missing``) when it does not exist, ``CheckpointError`` when it is a
    file."""
    path = Path(path)
    if not path.exists():
        near = _closest(path)
        if not near and path.parent.is_dir():  # a first run: its first save makes the folder
            raise NoCheckpoint(f"{path}: no such checkpoint directory", "absent")
        # a near name (a typo), or a missing parent too (an unmounted disk, a wrong root)
        raise NoCheckpoint(f"{path}: no such checkpoint directory{near}", "missing")
    if not path.is_dir():
        raise CheckpointError(f"{path}: a file, not a checkpoint directory; {EXPECTED}")
    if holds_save(path):
        return Found(path, path.parent, [status_of(path)], True, read_latest(path.parent))
    return Found(path, path, scan(path), False, read_latest(path))


def resolve(path: str | os.PathLike[str], tag: str | None = None) -> Manifest:
    """The manifest of the checkpoint in the folder a user has: ``tag`` in the save directory
    ``path``, or with ``tag=None`` ``path`` itself if it is a checkpoint directory, else the
    complete checkpoint its ``latest`` names, else the newest complete one in it. Raises
    :class:`NoCheckpoint` (``tag=None``) or ``CheckpointError`` saying what was found where,
    and what was expected."""
    found = find_checkpoints(path)
    if tag is not None:
        if found.single:
            raise CheckpointError(
                f"{found.path} is a checkpoint directory itself; pass its parent with "
                f"tag={tag!r}, or leave out the tag"
            )
        return Manifest.read(found.path / tag)
    if found.single and (found.path / MANIFEST).exists():
        return Manifest.read(found.path)  # its own error: a malformed manifest is no first run
    named = found.named_by_latest
    if named is not None:
        return named
    newest = found.newest
    if newest is None:
        raise found.nothing_to_load()
    if found.latest is not None and not found.single:
        # DeepSpeed raises here; the newest complete save is loaded, but never silently (a
        # latest pointed back to roll back, at a save since pruned, would resume the other run)
        warnings.warn(
            f"{found.path}: latest names {found.latest!r}, which is not a complete checkpoint "
            f"here; loading the newest complete one, {newest.directory.name!r}",
            stacklevel=2,
        )
    return newest


def _why_incomplete(status: CheckpointStatus) -> str:
    if not (status.path / MANIFEST).exists():
        return f"no {MANIFEST}"
    return status.problem or "unreadable"


def _subdirs(path: Path) -> list[Path]:
    """The visible subdirectories, in natural order (checkpoint-2 before checkpoint-10)."""
    dirs = [p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return sorted(
        dirs, key=lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]
    )


def _is_save_dir(path: Path) -> bool:
    return (path / LATEST).is_file() or any(holds_save(d) for d in _subdirs(path))


def _closest(path: Path) -> str:
    """``" (did you mean X?)"``: a save or checkpoint folder beside the first missing component
    of ``path`` whose name is a near spelling of it (a mistyped directory), or ``""``. Folders
    that hold no checkpoint, and names that differ only in their numbers (``runs/exp2`` beside
    ``runs/exp1``: a new run, not a typo), are no suggestion."""
    missing, parent = path, path.parent
    while not parent.is_dir() and parent != parent.parent:
        missing, parent = parent, parent.parent
    if not parent.is_dir():
        return ""
    numbered = re.sub(r"\d+", "#", missing.name)
    names = [
        d.name
        for d in _subdirs(parent)
        if (holds_save(d) or _is_save_dir(d)) and re.sub(r"\d+", "#", d.name) != numbered
    ]
    # a near spelling, else a name the missing one starts with (rck_typo -> rck)
    prefixed = [n for n in names if missing.name.startswith(n)]
    match = difflib.get_close_matches(missing.name, names, n=1, cutoff=0.6) or sorted(
        prefixed, key=len, reverse=True
    )
    if not match:
        return ""
    guess = parent / match[0] / path.relative_to(missing)
    return f" (did you mean {guess if guess.exists() else parent / match[0]}?)"
