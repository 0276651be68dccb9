"""The checkpoint layout: the manifest that commits a checkpoint, and reading from it.

[Note: checkpoint layout]
``SAVE_DIR/TAG/`` holds, per save, files named ``{save_id}-...``:

- ``rank00000.safetensors`` (one per rank): the rank's slice of every trainable parameter's
  fp32 master value and per-element optimizer state (``{param name}/master``,
  ``{param name}/exp_avg``, ...), each a 1-D run of the flattened parameter;
- ``rank00000.pt`` (one per rank): that rank's RNG states;
- ``module.safetensors``: frozen parameters (unless saved with ``exclude_frozen_parameters``;
  the manifest's ``frozen_keys`` lists them either way) and buffers (state-dict keys); those
  of a pipeline stage after the first are in the shard file of the stage's first rank, as
  ``module/{key}`` (the manifest's ``module_ranks``);
- ``engine.pt``: counters, loss scaler, LR scheduler, data position, optimizer hyperparameters;
- ``client_state.pt``: the user's ``client_state`` (the only pickled file);
- ``manifest.json``: what the save wrote, written last and committed by rename. It lists every
  parameter by name with its logical shape and which rank's file holds which element range
  (``segments``), and every file with its size and SHA-256. ``tied_keys`` maps a state-dict
  key whose tensor is an earlier key's (a tied embedding and head) to that key, so that an
  export keeps them one tensor (checkpoints without it: the trained keys of one parameter).

A parameter that tensor parallelism split (see zerotrain/comm/split.py) is saved as
its pieces: its record's ``split`` is ``[dim, chunks, size]``, and each segment is a range of the
flattened piece of the tensor-parallel rank ``tp_ranks[rank]`` of the file's rank. Whole
parameters are written by tensor-parallel rank 0 alone (and a layer tied across pipeline
stages by its first stage). Each stage's ranks write their own layers, whose names (the layer
index in the whole model) do not depend on the stages. A load joins the pieces into the
logical tensor and cuts its own, so a checkpoint loads at any tensor-parallel degree, none
included.

A checkpoint exists once its manifest does; a directory holding a save's files without one is
a save that did not finish (other folders are not checkpoints: ``holds_save``). Saving the
same tag again writes new files under a new save id and switches the manifest by rename, so
the previous save stays loadable until the new one is committed.
Loading any world size or ZeRO stage is a pure function of the manifest: a rank reads, for each
parameter slice it owns, the segments that overlap it. The ``.pt`` files hold only tensors and
plain containers and are loaded with ``weights_only=True``; ``client_state.pt`` is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import torch

from zerotrain.checkpoint.files import FileRecord, record_of_open
from zerotrain.comm.split import Split
from zerotrain.errors import ZeroTrainError
from zerotrain.ranges import intersect

if TYPE_CHECKING:
    from safetensors import safe_open

FORMAT = "zerotrain-checkpoint"
VERSION = 2  # 2: tensor-parallel pieces and pipeline stages (split, tp_ranks, module_ranks)
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
LATEST = "latest"
_SAVE_FILE = re.compile(r"^[0-9a-f]{12}-\w+\.(safetensors|pt)$")  # {save_id}-{role}: save.py


class CheckpointError(ZeroTrainError, RuntimeError):
    """A checkpoint cannot be saved or loaded; the message names the file and the problem."""


@dataclass(frozen=True)
class ParamRecord:
    """One trainable parameter: its logical shape and where its elements are stored."""

    name: str
    shape: tuple[int, ...]
    group: int
    segments: tuple[tuple[int, int, int], ...]  # (rank, start, end) of the flattened parameter
    split: Split | None = None  # saved as tensor-parallel pieces (segments: of a piece)

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    @property
    def stored_numel(self) -> int:
        """Elements that the segments of one tensor-parallel rank tile (all of them if whole)."""
        return self.numel // (self.split.size if self.split else 1)


class Manifest:
    """The parsed ``manifest.json`` of a committed checkpoint."""

    def __init__(self, data: dict, path: Path):
        self.data = data
        self.path = path
        self.params = {
            p["name"]: ParamRecord(
                p["name"],
                tuple(p["shape"]),
                p["group"],
                tuple(tuple(s) for s in p["segments"]),
                Split(*p["split"]) if p.get("split") else None,
            )
            for p in data["params"]
        }
        # untrained keys a later pipeline stage saved in its shard file: key -> rank
        self.module_ranks: dict[str, int] = data.get("module_ranks", {})
        # the tensor-parallel rank of each saved rank (checkpoints without: all whole, rank 0)
        self.tp_ranks: list[int] = data.get("tp_ranks") or [0] * len(data["roles"]["shard"])

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        path = directory / MANIFEST
        if not directory.is_dir():
            here = ", ".join(s.tag for s in scan(directory.parent)) or "none"
            raise CheckpointError(
                f"{directory}: no such checkpoint (checkpoints in {directory.parent}: {here})"
            )
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise CheckpointError(
                f"{directory}: incomplete checkpoint, no {MANIFEST} (a save that did not "
                "finish); load another tag, or tag=None for the newest complete one"
            ) from None
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: unreadable manifest ({exc})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise CheckpointError(f"{path}: not a zerotrain checkpoint manifest")
        if data.get("version") not in READABLE_VERSIONS:
            raise CheckpointError(
                f"{path}: checkpoint format version {data.get('version')}, this zerotrain reads "
                f"versions {', '.join(map(str, READABLE_VERSIONS))}"
            )
        if "checksum" in data and data["checksum"] != manifest_checksum(data):
            raise CheckpointError(
                f"{path}: edited or corrupted, its checksum does not match its contents (a "
                "manifest is written once, by the save that commits it); load another tag, or "
                "restore the file"
            )
        try:
            return cls(data, path)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(
                f"{path}: malformed manifest ({type(exc).__name__}: {exc})"
            ) from None

    @property
    def directory(self) -> Path:
        return self.path.parent

    def __getitem__(self, key: str):
        return self.data[key]

    def file(self, role: str, rank: int | None = None) -> str:
        """The file name of a role (``shard``/``rank_state`` per rank; ``module``, ``engine``,
        ``client_state``); ``CheckpointError`` when the save wrote none."""
        name = self.optional_file(role, rank)
        if not name:
            of_rank = f" of rank {rank}" if rank is not None else ""
            raise CheckpointError(f"{self.path}: the manifest names no {role} file{of_rank}")
        return name

    def optional_file(self, role: str, rank: int | None = None) -> str | None:
        """:meth:`file`, or None when the save wrote none (``client_state`` without one)."""
        entry = self.data["roles"][role]
        return entry[rank] if rank is not None else entry

    def layout_problems(self) -> list[str]:
        """Parameters whose segments do not tile them exactly, from existing rank files."""
        problems = []
        ranks = len(self.data["roles"]["shard"])
        for name, record in self.params.items():
            for tp_rank in range(record.split.size if record.split else 1):
                covered = 0
                for rank, start, end in self.segments_of(record, tp_rank):
                    covered = end if start == covered and 0 <= rank < ranks else -1
                if covered != record.stored_numel:
                    problems.append(f"{self.path}: parameter {name}: its segments do not cover it")
        orphans = [k for k, n in self.data["trained_keys"].items() if n not in self.params]
        if orphans:
            problems.append(f"{self.path}: trained keys without a parameter record: {orphans[:5]}")
        return problems

    def segments_of(self, record: ParamRecord, tp_rank: int) -> list[tuple[int, int, int]]:
        """The segments of ``record`` holding tensor-parallel rank ``tp_rank``'s piece (all of
        them for a whole parameter), in order."""
        if record.split is None:
            return list(record.segments)
        mine = [seg for seg in record.segments if self.tp_ranks[seg[0]] == tp_rank]
        return sorted(mine, key=lambda seg: seg[1])

    def verify(self, names: list[str]) -> list[str]:
        """Check each named file's size and SHA-256 against the manifest; the problems found."""
        held = HeldFiles(self.directory)
        try:
            return self.hold(names, held)
        finally:
            held.close()

    def hold(self, names: list[str], held: HeldFiles) -> list[str]:
        """Open each named file into ``held`` and check its size and SHA-256 through that
        handle, so what is read later is what was checked; the problems found."""
        problems = []
        for name in names:
            path = self.directory / name
            expected = self.data["files"][name]
            try:
                record = held.open(name)
            except FileNotFoundError:
                problems.append(f"{path}: missing (the manifest lists it)")
                continue
            if record.bytes != expected["bytes"]:
                problems.append(
                    f"{path}: truncated or overwritten, {record.bytes} bytes where the manifest "
                    f"records {expected['bytes']}"
                )
            elif record.sha256 != expected["sha256"]:
                problems.append(f"{path}: corrupted, its SHA-256 differs from the manifest's")
        return problems


# Linux names an open file by its descriptor, and the name opens the same file after it was
# deleted or replaced (elsewhere a held file is reopened by its own name)
_PROC_FD = Path("/proc/self/fd")


def manifest_checksum(data: dict) -> str:
    """The SHA-256 of a manifest's contents besides its own ``checksum`` (canonical JSON):
    written with it, checked when it is read (manifests without one, before 2026-12, are
    read unchecked)."""
    body = {k: v for k, v in data.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


class HeldFiles:
    """A checkpoint's files, each opened once: a load verifies and reads through these handles,
    so another job deleting the checkpoint meanwhile (its ``keep_last`` retention) cannot take
    the bytes from under it, and a file replaced after the check is not read instead."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._files: dict[str, BinaryIO] = {}

    def open(self, name: str) -> FileRecord:
        """Open ``name`` (kept until :meth:`close`); its size and SHA-256."""
        if name not in self._files:
            self._files[name] = open(self.directory / name, "rb")  # noqa: SIM115 (held open)
        return record_of_open(self._files[name])

    def path(self, name: str) -> Path:
        """A path that opens ``name`` as held (by descriptor where the platform allows)."""
        held = self._files.get(name)
        if held is not None and _PROC_FD.is_dir():
            return _PROC_FD / str(held.fileno())
        return self.directory / name

    def close(self) -> None:
        for held in self._files.values():
            held.close()
        self._files.clear()


class ShardReader:
    """Reads element ranges of parameters from a checkpoint's rank files, lazily: only the
    bytes asked for are read (``safetensors`` slices over a memory map)."""

    def __init__(self, manifest: Manifest, held: HeldFiles | None = None):
        self.manifest = manifest
        self.held = held  # files opened (and verified) before: read through them
        self._open: dict[str, safe_open] = {}

    def _handle(self, name: str) -> safe_open:
        if name not in self._open:
            from safetensors import safe_open

            path = self.held.path(name) if self.held else self.manifest.directory / name
            self._open[name] = safe_open(str(path), framework="pt")
        return self._open[name]

    def read(
        self,
        param: str,
        kind: str,
        start: int,
        end: int,
        split: Split | None = None,
        tp_rank: int = 0,
    ) -> list[tuple[int, torch.Tensor]]:
        """Pieces ``(offset, values)`` covering elements ``[start, end)`` of the flattened
        ``param``'s ``kind`` (``master`` or an optimizer state key), in order; with ``split``,
        of tensor-parallel rank ``tp_rank``'s piece of it."""
        record = self.manifest.params[param]
        if split is None and record.split is None:
            return self._stored(record, kind, start, end, tp_rank=0)
        whole = self.full(param, kind)
        local = whole if split is None else split.local(whole, tp_rank)
        return [(start, local.reshape(-1)[start:end])]

    def _stored(
        self, record: ParamRecord, kind: str, start: int, end: int, tp_rank: int
    ) -> list[tuple[int, torch.Tensor]]:
        pieces = []
        for rank, seg_start, seg_end in self.manifest.segments_of(record, tp_rank):
            lo, hi = intersect(start, end, seg_start, seg_end)
            if lo < hi:
                handle = self._handle(self.manifest.file("shard", rank))
                values = handle.get_slice(f"{record.name}/{kind}")[lo - seg_start : hi - seg_start]
                pieces.append((lo, values))
        return pieces

    def full(self, param: str, kind: str = "master") -> torch.Tensor:
        """The whole parameter (its logical shape) from its segments; a split one's pieces
        joined."""
        record = self.manifest.params[param]
        split = record.split
        pieces = []
        for tp_rank in range(split.size if split else 1):
            parts = self._stored(record, kind, 0, record.stored_numel, tp_rank)
            pieces.append(torch.cat([values for _, values in parts]))
        if split is None:
            return pieces[0].view(record.shape)
        shape = list(record.shape)
        shape[split.dim] //= split.size
        return split.join([piece.view(shape) for piece in pieces])

    def module_tensor(self, key: str) -> torch.Tensor:
        """A buffer or frozen parameter: from module.safetensors, or (a later pipeline stage's)
        from its stage's shard file."""
        rank = self.manifest.module_ranks.get(key)
        if rank is None:
            return self._handle(self.manifest.file("module")).get_tensor(key)
        return self._handle(self.manifest.file("shard", rank)).get_tensor(f"module/{key}")

    def close(self) -> None:
        self._open.clear()


@dataclass(frozen=True)
class CheckpointStatus:
    """One tag directory under a save directory, as ``inspect`` and ``tag=None`` see it."""

    tag: str
    path: Path
    manifest: Manifest | None  # None: incomplete or unreadable
    problem: str | None = None

    @property
    def complete(self) -> bool:
        return self.manifest is not None


def status_of(directory: Path) -> CheckpointStatus:
    """Whether ``directory`` holds a complete checkpoint (and its manifest), or why not."""
    try:
        return CheckpointStatus(directory.name, directory, Manifest.read(directory))
    except CheckpointError as exc:
        return CheckpointStatus(directory.name, directory, None, str(exc))


def holds_save(directory: Path) -> bool:
    """Whether ``directory`` is a checkpoint (tag) directory, complete or not: its manifest, or
    a file that a save writes (``{save_id}-rank00000.safetensors``, ...). Other folders in a
    save directory (logs, the HuggingFace Trainer's files) are not checkpoints."""
    if (directory / MANIFEST).exists():
        return True
    return any(_SAVE_FILE.match(path.name) for path in directory.iterdir())


def scan(save_dir: Path) -> list[CheckpointStatus]:
    """Every tag directory in ``save_dir``, oldest commit first; incomplete ones last."""
    if not save_dir.is_dir():
        return []
    found = [
        status_of(path)
        for path in sorted(save_dir.iterdir())
        if path.is_dir() and not path.name.startswith(".") and holds_save(path)
    ]
    return sorted(
        found, key=lambda s: (not s.complete, s.manifest["commit_time"] if s.complete else 0)
    )


def read_latest(save_dir: Path) -> str | None:
    """The tag the ``latest`` file names (DeepSpeed's convention), if any."""
    try:
        return (save_dir / LATEST).read_text(encoding="utf-8").strip() or None
    except OSError:
        return None
