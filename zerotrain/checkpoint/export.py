"""Checkpoints outside training: export to a plain state dict, load into a plain model, inspect.

[Note: consolidating one parameter at a time]
A consolidated export is the model's state dict as HuggingFace writes it: ``model.safetensors``,
or ``model-0000i-of-0000N.safetensors`` shards plus ``model.safetensors.index.json``. The shard
split is planned from the manifest's shapes alone, then each file is streamed by
``write_safetensors``: an entry's chunks are the parameter's segments, read from the rank files
when the writer reaches them. At most one segment of one parameter is in memory at a time, so a
model larger than this machine's memory consolidates as well as a small one.

[Note: tied parameters in exports]
A tied embedding and head (GPT-2's ``transformer.wte.weight`` and ``lm_head.weight``) is one
tensor under two state-dict keys. In memory (:func:`read_state_dict`, DeepSpeed's
``get_fp32_state_dict_from_zero_checkpoint``) and in ``torch.save`` files the keys share one
tensor, as the model and DeepSpeed's ``shared_params`` recovery hold it, so the file holds the
data once and ``load_state_dict`` keeps the tie. safetensors cannot store two names for one
tensor (it refuses shared tensors); there each key gets its own copy of the data, as DeepSpeed's
``safe_serialization`` writes it since deepspeedai/DeepSpeed#8376 (before, it stopped with
safetensors' error): ``load_state_dict(strict=True)`` then finds every key, and
HuggingFace's ``from_pretrained`` ties the loaded copy again. (HuggingFace's ``save_pretrained``
drops the tied key instead, which only a loader that knows the tie can read.) The checkpoint
names the ties: keys of one trained parameter, and the manifest's ``tied_keys``.

Files are written under temporary names and renamed at the end, the index last: a crash leaves
temporary files, never a truncated file under a final name.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch import nn

from zerotrain.checkpoint.files import (
    DTYPE_CODES,
    TensorEntry,
    commit_text,
    fsync_dir,
    write_safetensors,
)
from zerotrain.checkpoint.locate import INDEX_FILE, SINGLE_FILE, find_checkpoints, resolve
from zerotrain.checkpoint.manifest import CheckpointError, CheckpointStatus, Manifest, ShardReader
from zerotrain.fmt import KiB, quantity

__all__ = ["consolidate", "inspect_checkpoints", "load_consolidated", "read_state_dict"]

_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


# -- reading a checkpoint as state-dict entries --------------------------------------------------
class _Source:
    """A state dict on disk: ``specs`` maps each key, in order, to its shape and stored dtype;
    ``pieces(key)`` yields the entry's elements in order, a piece at a time."""

    where: Path
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]]

    def pieces(self, key: str) -> Iterator[torch.Tensor]:
        raise NotImplementedError

    def close(self) -> None:
        """Drop the open file handles (memory maps)."""

    def tensor(self, key: str) -> torch.Tensor:
        shape, dtype = self.specs[key]
        parts = [piece.reshape(-1) for piece in self.pieces(key)]
        if not parts:  # an empty tensor has no segments
            return torch.empty(shape, dtype=dtype)
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).view(shape)


class _CheckpointSource(_Source):
    """A zerotrain checkpoint: trained keys from the fp32 masters in the rank files, the rest
    from the module file. Checks the layout and the files it reads before anything is read."""

    def __init__(self, manifest: Manifest):
        from safetensors import safe_open

        self.manifest = manifest
        self.where = manifest.directory
        self.trained = manifest["trained_keys"]
        problems = manifest.layout_problems()
        ranks = sorted(
            {seg[0] for record in manifest.params.values() for seg in record.segments}
            | set(manifest.module_ranks.values())
        )
        files = [manifest.file("shard", rank) for rank in ranks]
        module = manifest.optional_file("module")
        if module:
            files.append(module)
        problems += manifest.verify(files)
        if problems:
            raise CheckpointError(
                f"cannot read checkpoint {self.where}:\n  " + "\n  ".join(problems)
            )
        self.tied = _tied_keys(manifest)
        self.reader = ShardReader(manifest)
        self.module = safe_open(str(self.where / module), framework="pt") if module else None
        stored = set(self.module.keys()) if self.module is not None else set()
        self.specs = {}
        for key in manifest["module_keys"]:
            if key in self.trained:
                self.specs[key] = (manifest.params[self.trained[key]].shape, torch.float32)
            elif key in manifest.module_ranks:  # a later pipeline stage's, in its shard file
                tensor = self.reader.module_tensor(key)
                self.specs[key] = (tuple(tensor.shape), tensor.dtype)
            elif self.module is not None and key in stored:
                piece = self.module.get_slice(key)
                self.specs[key] = (tuple(piece.get_shape()), _DTYPES[piece.get_dtype()])
            else:
                raise CheckpointError(
                    f"{self.where / str(module)}: state-dict entry {key} is missing (the manifest "
                    "lists it as a frozen parameter or buffer); the checkpoint is damaged"
                )

    def close(self) -> None:
        self.reader.close()
        self.module = None

    def pieces(self, key: str) -> Iterator[torch.Tensor]:
        name = self.trained.get(key)
        if name is None and key in self.manifest.module_ranks:
            yield self.reader.module_tensor(key)
            return
        if name is None:
            if self.module is None:  # closed, or a save that wrote no module file
                raise CheckpointError(f"{self.where}: no module file open to read {key} from")
            yield self.module.get_tensor(key)
            return
        record = self.manifest.params[name]
        if record.split is not None:  # tensor-parallel pieces: joined into the whole
            yield self.reader.full(name)
            return
        for _, start, end in record.segments:
            for _, values in self.reader.read(name, "master", start, end):
                yield values


def _tied_keys(manifest: Manifest) -> dict[str, str]:
    """State-dict key -> the earlier key whose tensor it is (see [Note: tied parameters in
    exports]): keys of one trained parameter, and what the manifest's ``tied_keys`` names
    (frozen parameters and buffers too; older checkpoints do not have it)."""
    tied = dict(manifest.data.get("tied_keys", {}))
    first_of: dict[str, str] = {}
    for key in manifest["module_keys"]:
        name = manifest["trained_keys"].get(key)
        if name is not None and first_of.setdefault(name, key) != key:
            tied.setdefault(key, first_of[name])
    return tied


class _SafetensorsSource(_Source):
    """A consolidated export: ``model.safetensors``, or the shards an index names."""

    def __init__(self, directory: Path):
        from safetensors import safe_open

        self.where = directory
        if (directory / SINGLE_FILE).exists():  # preferred when both exist, as HuggingFace does
            weight_map = None
            names = [SINGLE_FILE]
        else:
            index = directory / INDEX_FILE
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: unreadable index ({exc})") from None
            names = list(dict.fromkeys(weight_map.values()))
        self.handles = {}
        for name in names:
            try:
                self.handles[name] = safe_open(str(directory / name), framework="pt")
            except Exception as exc:  # safetensors raises its own error types
                raise CheckpointError(
                    f"{directory / name}: unreadable safetensors file ({exc})"
                ) from None
        if weight_map is None:
            weight_map = dict.fromkeys(self.handles[SINGLE_FILE].keys(), SINGLE_FILE)
        self.file_of = weight_map
        self.specs = {}
        for key, name in weight_map.items():
            if key not in self.handles[name].keys():
                raise CheckpointError(
                    f"{directory / name}: has no tensor {key} (the index says so)"
                )
            piece = self.handles[name].get_slice(key)
            dtype = _DTYPES.get(piece.get_dtype())
            if dtype is None:
                raise CheckpointError(
                    f"{directory / name}: tensor {key} has dtype {piece.get_dtype()}, which "
                    "zerotrain does not read"
                )
            self.specs[key] = (tuple(piece.get_shape()), dtype)

    def close(self) -> None:
        self.handles.clear()

    def pieces(self, key: str) -> Iterator[torch.Tensor]:
        yield self.handles[self.file_of[key]].get_tensor(key)


def _open_source(path: Path, tag: str | None) -> _Source:
    """The checkpoint in ``path`` (see [Note: the folders a checkpoint tool accepts]), else a
    consolidated export there: in the HuggingFace Trainer's checkpoint-N folder, which holds
    both, the fp32 masters rather than the exported copy."""
    found = find_checkpoints(path)
    if found.export and found.newest is None and not found.single:
        if tag is not None:
            raise CheckpointError(f"{path} is a consolidated export, it has no tag {tag!r}")
        return _SafetensorsSource(path)
    return _CheckpointSource(resolve(path, tag))


# -- consolidate ---------------------------------------------------------------------------------
def consolidate(
    ckpt_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    tag: str | None = None,
    dtype: torch.dtype = torch.float32,
    max_shard_size: int = 5 * 2**30,
    progress: bool = True,
    exclude_frozen_parameters: bool = False,
) -> list[Path]:
    """Write a checkpoint's full model state dict as HuggingFace-style safetensors.

    ``ckpt_dir`` is a save directory (the checkpoint ``tag``, or the one ``latest`` names), a
    checkpoint directory itself or the HuggingFace Trainer's ``checkpoint-N`` folder (see [Note:
    the folders a checkpoint tool accepts]). Every state-dict key is written, in the model's
    order: trained parameters from their fp32 master weights, frozen parameters and buffers as
    saved; floating-point entries are cast to ``dtype``; a tied key gets its own copy (see
    [Note: tied parameters in exports]). One ``model.safetensors`` when the
    model fits in ``max_shard_size`` bytes, else ``model-0000i-of-0000N.safetensors`` shards and
    ``model.safetensors.index.json``. Files are checked against the manifest first (raises
    ``CheckpointError`` naming the damaged file); see [Note: consolidating one parameter at a
    time]. ``exclude_frozen_parameters`` leaves the frozen parameters out. Returns the files
    written, the index last.
    """
    if max_shard_size <= 0:
        raise ValueError(
            f"consolidate: max_shard_size must be a positive number of bytes, got {max_shard_size}"
        )
    if not dtype.is_floating_point:
        raise ValueError(f"consolidate: dtype must be a floating-point dtype, got {dtype}")
    source = _CheckpointSource(resolve(ckpt_dir, tag))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    entries = [_entry(source, key, dtype) for key in _keys(source, exclude_frozen_parameters)]
    shards: list[list[TensorEntry]] = [[]]
    shard_bytes = 0
    for entry in entries:  # greedy in key order, as HuggingFace splits
        if shards[-1] and shard_bytes + entry.nbytes > max_shard_size:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(entry)
        shard_bytes += entry.nbytes
    if len(shards) == 1:
        names = [SINGLE_FILE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    total = sum(entry.nbytes for entry in entries)

    tmp_of = {name: out_dir / f".{name}.tmp-{os.getpid()}" for name in names}
    bar = _progress_bar(total, f"consolidate {source.where.name}") if progress else None
    try:
        for name, shard in zip(names, shards, strict=True):
            tracked = [_tracked(entry, bar) for entry in shard]
            try:
                write_safetensors(tmp_of[name], tracked, {"format": "pt"})
            except ValueError as exc:  # a chunk source gave the wrong size: damaged checkpoint
                raise CheckpointError(f"cannot consolidate {source.where}: {exc}") from None
        _remove_stale_exports(out_dir, keep=set(names))
        for name in names:
            os.replace(tmp_of[name], out_dir / name)
        fsync_dir(out_dir)
        if len(names) > 1:  # the index last: it is what makes a sharded export visible
            weight_map = {e.name: n for n, shard in zip(names, shards, strict=True) for e in shard}
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            commit_text(out_dir / INDEX_FILE, json.dumps(index, indent=2))
            names.append(INDEX_FILE)
    finally:
        if bar is not None:
            bar.close()
        for tmp in tmp_of.values():
            tmp.unlink(missing_ok=True)
        source.close()
    return [out_dir / name for name in names]


def _keys(source: _CheckpointSource, exclude_frozen_parameters: bool) -> list[str]:
    frozen = set(source.manifest.data.get("frozen_keys", ())) if exclude_frozen_parameters else ()
    return [key for key in source.specs if key not in frozen]


def read_state_dict(
    ckpt_dir: str | os.PathLike[str],
    *,
    tag: str | None = None,
    dtype: torch.dtype = torch.float32,
    exclude_frozen_parameters: bool = False,
) -> dict[str, torch.Tensor]:
    """A checkpoint's full model state dict in memory, on the CPU (trained parameters from
    their fp32 masters; floating-point entries cast to ``dtype``); tied keys share one tensor
    ([Note: tied parameters in exports]). For models that fit in memory; :func:`consolidate`
    streams to files instead. ``ckpt_dir`` as for :func:`consolidate`."""
    source = _CheckpointSource(resolve(ckpt_dir, tag))
    try:
        out = {}
        for key in _keys(source, exclude_frozen_parameters):
            if source.tied.get(key) in out:  # one tensor, as the model holds it
                out[key] = out[source.tied[key]]
                continue
            tensor = source.tensor(key)
            out[key] = tensor.to(dtype) if tensor.is_floating_point() else tensor
        return out
    finally:
        source.close()


def _entry(source: _CheckpointSource, key: str, dtype: torch.dtype) -> TensorEntry:
    shape, stored = source.specs[key]
    return TensorEntry(
        key, dtype if stored.is_floating_point else stored, shape, lambda: source.pieces(key)
    )


def _tracked(entry: TensorEntry, bar) -> TensorEntry:
    if bar is None:
        return entry
    itemsize = entry.dtype.itemsize

    def chunks() -> Iterator[torch.Tensor]:
        for chunk in entry.chunks():
            yield chunk
            bar.update(chunk.numel() * itemsize)  # after the writer took it

    return TensorEntry(entry.name, entry.dtype, entry.shape, chunks)


def _progress_bar(total: int, description: str):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional
        return None
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=description)


def _remove_stale_exports(out_dir: Path, keep: set[str]) -> None:
    """An earlier export to the same directory with another split would be read instead of
    (model.safetensors wins over an index) or mixed with this one."""
    for path in out_dir.iterdir():
        stale = path.name in (SINGLE_FILE, INDEX_FILE) or (
            path.name.startswith("model-") and path.name.endswith(".safetensors")
        )
        if stale and path.name not in keep:
            path.unlink(missing_ok=True)


# -- load into a plain model ---------------------------------------------------------------------
def load_consolidated(
    model: nn.Module, ckpt_dir: str | Path, *, tag: str | None = None, strict: bool = True
) -> nn.Module:
    """Load a checkpoint's weights into a plain ``model`` (no distributed setup needed).

    ``ckpt_dir`` is a zerotrain save directory (the checkpoint ``tag``, or the one ``latest``
    names), a checkpoint directory, the HuggingFace Trainer's ``checkpoint-N`` folder (its
    checkpoint's fp32 masters, not its exported copy), or a :func:`consolidate` output
    directory. Names and shapes
    are checked first: missing or unexpected keys (with ``strict``) and shape mismatches raise
    ``CheckpointError`` listing them, and leave the model unchanged; ``strict=False`` loads the
    keys both have. Values are copied into the model's tensors one entry at a time, cast to
    their dtypes. Returns ``model``.
    """
    source = _open_source(Path(ckpt_dir), tag)
    try:
        _load_into(model, source, strict)
    finally:
        source.close()
    return model


def _load_into(model: nn.Module, source: _Source, strict: bool) -> None:
    targets = model.state_dict(keep_vars=True)
    missing = [key for key in targets if key not in source.specs]
    unexpected = [key for key in source.specs if key not in targets]
    common = [key for key in targets if key in source.specs]
    problems = [
        f"{key}: shape {list(source.specs[key][0])} in the checkpoint, "
        f"{list(targets[key].shape)} in the model"
        for key in common
        if tuple(targets[key].shape) != source.specs[key][0]
    ]
    if strict and missing:
        problems.append(f"missing from the checkpoint: {', '.join(missing)}")
    if strict and unexpected:
        problems.append(f"in the checkpoint but not in the model: {', '.join(unexpected)}")
    if problems:
        hint = " (strict=False loads the keys both have)" if missing or unexpected else ""
        raise CheckpointError(
            f"cannot load {source.where} into {type(model).__name__}, nothing was changed"
            f"{hint}:\n  " + "\n  ".join(problems)
        )
    with torch.no_grad():
        for key in common:
            targets[key].copy_(source.tensor(key))


# -- inspect -------------------------------------------------------------------------------------
def inspect_checkpoints(path: str | Path, *, verify: bool = True) -> str:
    """A human-readable summary of a save directory (or of one checkpoint directory, or of the
    HuggingFace Trainer's ``checkpoint-N`` folder). Raises ``CheckpointError`` naming what the
    folder holds when it holds something other than checkpoints.

    The ``latest`` pointer, then each checkpoint, oldest first: complete, INCOMPLETE (and why)
    or CORRUPT (the files that fail the manifest's sizes and SHA-256, checked when ``verify``);
    its step, world size, ZeRO stage, precision, optimizer, trained parameters, dtypes, files
    and bytes on disk, and commit time; and the newest complete checkpoint.
    """
    found = find_checkpoints(path)
    if not found.checkpoints:
        nothing = found.nothing_to_load()
        if nothing.kind != "empty":  # a wrong folder, not an empty one: say what it holds
            raise nothing
    save_dir, statuses = found.save_dir, found.checkpoints
    names = {s.tag: s for s in statuses}
    latest = found.latest
    lines = [f"checkpoints in {path}"]
    if latest is None:
        lines.append("latest: none (no latest file)")
    elif latest in names and names[latest].complete:
        lines.append(f"latest: {latest}")
    else:
        lines.append(f"latest: {latest} (not a complete checkpoint in {save_dir})")
    if not statuses:
        lines.append("no checkpoint directories")

    corrupt = set()
    for status in statuses:
        problems = []
        if status.manifest is not None and verify:
            problems = status.manifest.verify(list(status.manifest["files"]))
        if problems:
            corrupt.add(status.tag)
        lines += _describe(status, problems)

    complete = [s.tag for s in statuses if s.complete]
    if not complete:
        lines.append("newest complete: none")
    else:
        line = f"newest complete: {complete[-1]}"
        if complete[-1] in corrupt:
            intact = [tag for tag in complete if tag not in corrupt]
            line += f" (CORRUPT; newest intact: {intact[-1] if intact else 'none'})"
        lines.append(line)
    return "\n".join(lines)


def _describe(status: CheckpointStatus, problems: list[str]) -> list[str]:
    files = [p for p in status.path.iterdir() if p.is_file()]
    on_disk = f"files: {len(files)}, {_human_bytes(sum(p.stat().st_size for p in files))} on disk"
    manifest = status.manifest
    if manifest is None:  # incomplete
        return [f"{status.tag}: INCOMPLETE", f"  reason: {status.problem}", f"  {on_disk}"]
    lines = [f"{status.tag}: {'CORRUPT' if problems else 'complete'}"]
    lines += [f"  problem: {problem}" for problem in problems]
    state_keys = ", ".join(manifest["optimizer_state_keys"])
    elements = sum(record.numel for record in manifest.params.values())
    committed = datetime.fromtimestamp(manifest["commit_time"], tz=timezone.utc)
    lines += [
        f"  global step {manifest['global_steps']} ({manifest['global_samples']} samples), "
        f"world size {manifest['world_size']}, ZeRO stage {manifest['stage']}, "
        f"precision {manifest['precision']}",
        f"  optimizer {manifest['optimizer']}" + (f" (state: {state_keys})" if state_keys else ""),
        f"  trained parameters: {len(manifest.params)} ({elements:,} elements); "
        f"dtypes: {', '.join(_dtypes_in(manifest)) or 'unknown'}",
        f"  {on_disk}",
        f"  committed: {committed.strftime('%Y-%m-%dT%H:%M:%SZ')}",
    ]
    return lines


def _dtypes_in(manifest: Manifest) -> list[str]:
    """The dtypes stored in the checkpoint's safetensors files (their headers only)."""
    from safetensors import safe_open

    found = set()
    for name in [*manifest["roles"]["shard"], manifest.optional_file("module")]:
        if not name:
            continue
        try:
            handle = safe_open(str(manifest.directory / name), framework="pt")
            found |= {handle.get_slice(key).get_dtype() for key in handle.keys()}
        except Exception:  # a missing or damaged file: verify reports it, when asked
            continue
    return sorted(
        str(_DTYPES[code]).removeprefix("torch.") if code in _DTYPES else code for code in found
    )


def _human_bytes(size: int) -> str:
    exact = f"{size:,} bytes"
    return exact if size < KiB else f"{exact} ({quantity(size, 'B', binary=True, digits=1)})"
