"""DeepSpeed's ``zero_to_fp32`` functions, over zerotrain checkpoints.

A zerotrain checkpoint already holds fp32 master weights with their logical shapes, so these
are thin wrappers of :mod:`zerotrain.checkpoint.export`. ``checkpoint_dir`` is the save
directory (the checkpoint named by ``tag``, else the one ``latest`` names), a checkpoint
directory itself, or the HuggingFace Trainer's ``checkpoint-N`` folder (HF's documented
recovery: ``load_state_dict_from_zero_checkpoint(model, "out/checkpoint-N")``); see [Note: the
folders a checkpoint tool accepts] in zerotrain/checkpoint/locate.py. Nothing needs a process
group.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from zerotrain.checkpoint.export import consolidate, read_state_dict
from zerotrain.checkpoint.files import commit_text, write_state_dict
from zerotrain.fmt import parse_size
from zerotrain.precision import DTYPES

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "convert_zero_checkpoint_to_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
]


def _size_in_bytes(size: int | str) -> int:
    """``5 * 10**9``, ``"5GB"`` or ``"500MiB"`` (HuggingFace's spellings) in bytes."""
    if isinstance(size, int):
        return size
    try:
        return parse_size(size)
    except ValueError as error:
        raise ValueError(f"max_shard_size: {error}") from None


def _dtype(dtype: torch.dtype | str) -> torch.dtype:
    names = {**DTYPES, **{str(d).removeprefix("torch."): d for d in DTYPES.values()}}
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in names:
        raise ValueError(f"dtype: one of {', '.join(names)} or a torch dtype, got {dtype!r}")
    return names[dtype]


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> dict[str, torch.Tensor]:
    """The full model state dict in fp32 on the CPU (buffers included), ready for
    ``model.load_state_dict``; tied keys share one tensor, as DeepSpeed's ``shared_params``
    recovery gives them. ``tag=None`` reads the tag ``latest`` names, as DeepSpeed does (see
    [Note: the folders a checkpoint tool accepts] for folders without one).
    ``lazy_mode`` is accepted; the values are read at once (a tensor has the ``.contiguous()``
    DeepSpeed's lazy values offer)."""
    del lazy_mode
    return read_state_dict(
        checkpoint_dir, tag=tag, exclude_frozen_parameters=exclude_frozen_parameters
    )


def convert_zero_checkpoint_to_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    dtype: torch.dtype | str = torch.float32,
    max_shard_size: int | str | None = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> None:
    """Write the state dict to ``output_dir``: ``model.safetensors`` with
    ``safe_serialization``, else ``pytorch_model.bin``; split into ``...-0000i-of-0000N``
    shards plus an index when larger than ``max_shard_size``, as HuggingFace names them. Tied
    keys (an embedding and its head) are one tensor in the ``torch.save`` files, in the same
    shard, and a copy each in safetensors, which cannot share (see [Note: tied parameters in
    exports] in zerotrain/checkpoint/export.py), as DeepSpeed writes them (since #8376)."""
    dtype, limit = _dtype(dtype), _size_in_bytes(max_shard_size or 2**63 - 1)
    if safe_serialization:
        consolidate(
            checkpoint_dir,
            output_dir,
            tag=tag,
            dtype=dtype,
            max_shard_size=limit,
            exclude_frozen_parameters=exclude_frozen_parameters,
        )
        return
    state = read_state_dict(
        checkpoint_dir, tag=tag, dtype=dtype, exclude_frozen_parameters=exclude_frozen_parameters
    )
    shards: list[dict[str, torch.Tensor]] = [{}]
    split_of: dict[int, int] = {}  # id(tensor) -> its shard: tied keys go with their tensor
    shard_bytes = 0
    for key, tensor in state.items():  # greedy in key order, as HuggingFace splits
        if id(tensor) in split_of:  # a tied key: torch.save writes the shared data once
            shards[split_of[id(tensor)]][key] = tensor
            continue
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > limit:
            shards.append({})
            shard_bytes = 0
        shards[-1][key] = tensor
        split_of[id(tensor)] = len(shards) - 1
        shard_bytes += size
    out = Path(output_dir)
    if len(shards) == 1:
        write_state_dict(out / "pytorch_model.bin", shards[0])
        return
    names = [f"pytorch_model-{i + 1:05d}-of-{len(shards):05d}.bin" for i in range(len(shards))]
    for name, shard in zip(names, shards, strict=True):
        write_state_dict(out / name, shard)
    unique = {id(t): t for t in state.values()}.values()
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in unique)},
        "weight_map": {key: n for n, shard in zip(names, shards, strict=True) for key in shard},
    }
    commit_text(out / "pytorch_model.bin.index.json", json.dumps(index, indent=2) + "\n")


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    max_shard_size: int | str | None = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> None:
    """:func:`convert_zero_checkpoint_to_state_dict` in fp32."""
    convert_zero_checkpoint_to_state_dict(
        checkpoint_dir,
        output_dir,
        dtype=torch.float32,
        max_shard_size=max_shard_size,
        safe_serialization=safe_serialization,
        tag=tag,
        exclude_frozen_parameters=exclude_frozen_parameters,
    )


def load_state_dict_from_zero_checkpoint(
    model: nn.Module, checkpoint_dir: str | os.PathLike[str], tag: str | None = None
) -> nn.Module:
    """Move ``model`` to the CPU and load the checkpoint's fp32 weights into it
    (``strict=False``, as DeepSpeed); returns the model."""
    model = model.cpu()
    model.load_state_dict(
        get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag), strict=False
    )
    return model
