"""Durable files: streamed safetensors writing, checksums, fsync, commit by rename.

[Note: why our own safetensors writer]
The ``safetensors`` library serializes a dict of whole tensors held in memory. A rank's shard
is made of views into its flat master buffers, and a consolidated export is assembled from
pieces in other ranks' files; both would need a full copy first. The format is simple (an
8-byte little-endian header length, a JSON header with each tensor's dtype, shape and byte
range, then the raw bytes), so we write it ourselves from a plan of (name, dtype, shape, chunk
source) entries, one chunk at a time, hashing as we write. Reading stays with the library
(``safetensors.safe_open``), whose lazy slices let a loader read only the bytes it needs, and
which is also the check that the files we write are standard.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

DTYPE_CODES = {  # torch dtype -> safetensors dtype code
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_HASH_CHUNK = 1 << 22


@dataclass(frozen=True)
class FileRecord:
    """What the manifest records about one file: its size and SHA-256."""

    bytes: int
    sha256: str


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file to be written: ``chunks()`` yields tensors whose
    elements, concatenated, are the entry's (in ``dtype``, ``shape.numel()`` elements)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: Callable[[], Iterable[torch.Tensor]]

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * torch.tensor([], dtype=self.dtype).element_size()


def tensor_entry(name: str, tensor: torch.Tensor) -> TensorEntry:
    """An entry for a tensor already in memory (written without a copy on CPU)."""
    return TensorEntry(name, tensor.dtype, tuple(tensor.shape), lambda: (tensor,))


def write_safetensors(
    path: Path, entries: list[TensorEntry], metadata: dict[str, str] | None = None
) -> FileRecord:
    """Write ``entries`` as a safetensors file, streaming chunk by chunk; fsync; return its
    record. Raises ValueError when a chunk source yields the wrong number of bytes."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for entry in entries:
        if entry.dtype not in DTYPE_CODES:
            raise ValueError(f"{entry.name}: dtype {entry.dtype} cannot be stored in safetensors")
        header[entry.name] = {
            "dtype": DTYPE_CODES[entry.dtype],
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # keeps tensor data 8-byte aligned
    digest = hashlib.sha256()
    with open(path, "wb") as out:

        def emit(data) -> None:
            out.write(data)
            digest.update(data)

        emit(struct.pack("<Q", len(text)))
        emit(text)
        for entry in entries:
            written = 0
            for chunk in entry.chunks():
                data = _raw_bytes(chunk.to(entry.dtype))
                emit(data)
                written += len(data)
            if written != entry.nbytes:
                raise ValueError(f"{entry.name}: wrote {written} bytes, expected {entry.nbytes}")
        out.flush()
        os.fsync(out.fileno())
        size = out.tell()
    return FileRecord(size, digest.hexdigest())


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data.cast("B")  # the array's buffer, no copy


def write_torch(path: Path, obj: object) -> FileRecord:
    """``torch.save`` ``obj`` and fsync; return the file's record."""
    with open(path, "wb") as out:
        torch.save(obj, out)
        out.flush()
        os.fsync(out.fileno())
    return record_of(path)


def write_bytes(path: Path, data: bytes) -> FileRecord:
    """``data`` to ``path``, fsynced; return the file's record."""
    with open(path, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    return FileRecord(len(data), hashlib.sha256(data).hexdigest())


def write_state_dict(path: Path, state: dict[str, torch.Tensor]) -> None:
    """A state dict to ``path`` (safetensors for a ``.safetensors`` name, else ``torch.save``),
    written under a temporary name, fsynced and renamed: never a half-written model file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        if path.suffix == ".safetensors":
            write_safetensors(tmp, [tensor_entry(k, v) for k, v in state.items()])
        else:
            write_torch(tmp, state)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def record_of(path: Path) -> FileRecord:
    """Size and SHA-256 of an existing file."""
    with open(path, "rb") as f:
        return record_of_open(f)


def record_of_open(f: BinaryIO) -> FileRecord:
    """Size and SHA-256 of an open file, read from its start."""
    f.seek(0)
    digest = hashlib.sha256()
    size = 0
    while chunk := f.read(_HASH_CHUNK):
        digest.update(chunk)
        size += len(chunk)
    return FileRecord(size, digest.hexdigest())


def commit_text(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` atomically: write a temporary file, fsync, rename, fsync
    the directory. Readers see the old content or the new, never a mix."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Persist a directory's entries (new or renamed files) where the platform allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
