"""A batch cut along its sequence for the sequence-parallel ranks, and DeepSpeed's
``UlyssesSPDataLoaderAdapter``.

[Note: cutting a batch along the sequence]
The labels are shifted before the cut (``shift_labels[t] = labels[t + 1]``, -100 at the end),
so the target of a rank's last token, which is the next rank's first, is not lost at the edge.
A length that sp does not divide is padded at the end (input ids with ``pad_token_id``,
shift_labels with -100, position ids continuing), which changes no loss: the padding comes
after every real token, so causal attention keeps real tokens from seeing it, and its labels
are ignored. ``position_ids`` are required after the cut (a rank cannot know where its share
starts otherwise): made as 0..s-1 when the batch has none. An ``attention_mask`` is dropped
when it only masks a padded tail (the same reason), and refused otherwise: masks are
quadratic and are not cut.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from zerotrain.comm import Communicator
from zerotrain.sequence.groups import communicator_of

IGNORE_INDEX = -100


def shard_batch(
    batch: dict[str, Any], rank: int, world: int, *, pad_token_id: int = 0
) -> dict[str, Any]:
    """Rank ``rank`` of ``world``'s share of ``batch`` (a dict with ``input_ids`` and
    ``labels`` of shape ``[batch, sequence]``; see [Note: cutting a batch along the
    sequence]): every tensor whose first two dimensions are the input's is cut along dimension
    1, ``labels`` becomes ``shift_labels``, the rest is kept whole."""
    batch = dict(batch)
    ids = batch.get("input_ids")
    if not torch.is_tensor(ids) or ids.dim() != 2:
        raise ValueError(
            "sequence parallelism: a batch must be a dict with `input_ids` of shape [batch, "
            f"sequence], got {_describe(batch)}"
        )
    labels = batch.pop("labels", None)
    if labels is None and "shift_labels" not in batch:
        raise ValueError(
            "sequence parallelism: the batch has no `labels` (nor `shift_labels`): each rank "
            "computes the loss of its share of the tokens, so the labels are cut with them"
        )
    shape = tuple(ids.shape)
    _check_mask(batch.pop("attention_mask", None), shape)
    if batch.get("position_ids") is None:
        batch["position_ids"] = torch.arange(shape[1], device=ids.device).expand(shape).clone()
    if labels is not None:
        batch["shift_labels"] = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    length = math.ceil(shape[1] / world) * world
    per_rank = length // world
    out = {}
    for key, value in batch.items():
        if torch.is_tensor(value) and value.dim() >= 2 and tuple(value.shape[:2]) == shape:
            value = _pad(key, value, length, pad_token_id)
            value = value[:, rank * per_rank : (rank + 1) * per_rank]
        out[key] = value
    return out


def _pad(key: str, value: torch.Tensor, length: int, pad_token_id: int) -> torch.Tensor:
    missing = length - value.shape[1]
    if missing == 0:
        return value
    if key == "position_ids":
        steps = torch.arange(1, missing + 1, device=value.device, dtype=value.dtype)
        return torch.cat([value, value[:, -1:] + steps], dim=1)
    fill = {"shift_labels": IGNORE_INDEX, "input_ids": pad_token_id}.get(key, 0)
    tail = value.new_full((value.shape[0], missing, *value.shape[2:]), fill)
    return torch.cat([value, tail], dim=1)


def _check_mask(mask: Any, shape: tuple[int, ...]) -> None:
    if mask is None:
        return
    if not torch.is_tensor(mask) or tuple(mask.shape) != shape:
        raise ValueError(
            "sequence parallelism: `attention_mask` must be a [batch, sequence] padding mask; "
            "Ulysses attention is causal over position ids (ALST requires position_ids), so "
            "pass position_ids and leave 4-D masks out"
        )
    kept = mask.bool()
    # a padded tail: once a row's mask is 0 it stays 0
    if bool((kept[:, 1:] & ~kept[:, :-1]).any()):
        raise ValueError(
            "sequence parallelism: `attention_mask` masks tokens before real ones (left padding "
            "or holes), which cannot be cut along the sequence; pad on the right with labels "
            "-100 (ALST requires position_ids: masks are not sharded)"
        )


def _describe(batch: dict[str, Any]) -> str:
    return (
        "{"
        + ", ".join(
            f"{k}: {tuple(v.shape) if torch.is_tensor(v) else type(v).__name__}"
            for k, v in batch.items()
        )
        + "}"
    )


class SequenceShards:
    """A loader whose batches every sequence-parallel rank already shares (zerotrain's own
    loader splits the data over the data-parallel ranks only), each cut to this rank's share."""

    def __init__(self, loader: Iterable, comm: Communicator, *, pad_token_id: int = 0):
        self.loader, self.comm, self.pad_token_id = loader, comm, pad_token_id

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.loader:
            yield shard_batch(
                batch, self.comm.rank, self.comm.world_size, pad_token_id=self.pad_token_id
            )

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:  # the loader's state_dict, sampler, ...
        if name == "loader":  # not set yet (copy, unpickling): no recursion through it
            raise AttributeError(name)
        return getattr(self.loader, name)


class UlyssesSPDataLoaderAdapter:
    """DeepSpeed's adapter, for loaders that give each rank its own samples (a sampler over the
    whole world): it gathers one batch from each rank of the sequence-parallel group and yields
    them in turn, each cut to this rank's share, so the group trains on every rank's samples
    one after the other (``len`` is the loader's times sp). ``sp_group`` is a torch process
    group or a Communicator; ``device`` where the yielded tensors go."""

    def __init__(
        self,
        dl: Iterable,
        sp_rank: int,
        sp_group: Any,
        sp_world_size: int,
        device: Any,
        pad_to_sp_multiple: bool = True,
        pad_token_id: int = 0,
    ):
        self.dl = dl
        self.comm = communicator_of(sp_group)
        if (self.comm.rank, self.comm.world_size) != (sp_rank, sp_world_size):
            raise ValueError(
                f"UlyssesSPDataLoaderAdapter: sp_rank {sp_rank} of sp_world_size "
                f"{sp_world_size}, but this rank is {self.comm.rank} of {self.comm.world_size} "
                "in sp_group"
            )
        self.device = device
        self.pad_to_sp_multiple = pad_to_sp_multiple
        self.pad_token_id = pad_token_id
        self.iter: Iterator = iter(dl)
        self.micro_batches: deque[dict[str, Any]] = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.comm.world_size  # type: ignore[arg-type]

    def __iter__(self) -> UlyssesSPDataLoaderAdapter:
        return self

    def __next__(self) -> dict[str, Any]:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        """Gather the next batch of every rank of the group and queue this rank's shares."""
        try:
            batch = next(self.iter)
        except StopIteration:
            batch = None
        batches = self.comm.all_gather_object(_to_cpu(batch))
        if any(b is None for b in batches):
            # one loader ran out: the group ends the epoch together, and every rank starts
            # the next one from the beginning (the others' last batches are dropped)
            self.iter = iter(self.dl)
            raise StopIteration
        world, rank = self.comm.world_size, self.comm.rank
        for theirs in batches:
            if not self.pad_to_sp_multiple and theirs["input_ids"].shape[1] % world:
                raise ValueError(
                    f"UlyssesSPDataLoaderAdapter: a batch of {theirs['input_ids'].shape[1]} "
                    f"tokens does not divide into {world} ranks; pass pad_to_sp_multiple=True"
                )
            mine = shard_batch(theirs, rank, world, pad_token_id=self.pad_token_id)
            self.micro_batches.append(_to(mine, self.device))


def _to_cpu(batch: Any) -> Any:
    if isinstance(batch, Mapping):  # a dict, or transformers' BatchEncoding
        return {k: v.cpu() if torch.is_tensor(v) else v for k, v in batch.items()}
    return batch


def _to(batch: dict[str, Any], device: Any) -> dict[str, Any]:
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
