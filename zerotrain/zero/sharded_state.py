"""What a checkpoint saves and loads of the shard groups: the pieces of the fp32 masters and of
the optimizer's per-element state this rank holds, by parameter name and element range (the
manifest's terms, see [Note: checkpoint layout] in checkpoint/manifest.py); the optimizer's
groups and scalar state; each group's own state (its codec's and step extensions'). The
checkpoint reads and writes the groups only through these, never a store or a bucket.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch

from zerotrain.comm.split import Split, split_of
from zerotrain.zero.extension import Resume
from zerotrain.zero.optimizer import ZeroOptimizer

# Optimizer param-group entries that describe the layout of this rank's shards, not training.
LAYOUT_GROUP_KEYS = frozenset({"params", "segment_ranges", "num_segments"})

PieceReader = Callable[[str, str, int, int], list[tuple[int, torch.Tensor]]]
"""``read(name, kind, start, end)``: pieces ``(offset, values)`` covering elements
``[start, end)`` of parameter ``name``'s flattened ``kind`` (``"master"`` or a state key)."""


def split_params(zero: ZeroOptimizer) -> dict[str, Split]:
    """The trained parameters, by name, that a model-parallel split cut, with their split."""
    return {s.name: split for s in zero.slots() if (split := split_of(s.param)) is not None}


def trained_shapes(zero: ZeroOptimizer, split: dict[str, Split]) -> dict[str, tuple[int, ...]]:
    """Every trained parameter's whole shape, by name (a parameter of ``split``, from
    :func:`split_params`: before the split)."""
    return {
        s.name: tuple(split[s.name].whole_shape(s.shape) if s.name in split else s.shape)
        for s in zero.slots()
    }


def state_keys(zero: ZeroOptimizer) -> list[str]:
    """The optimizer's per-element state keys (Adam's moments) over every group, once any
    group has stepped."""
    return list(dict.fromkeys(k for g in zero.groups for k in g.store.element_state_keys()))


def optimizer_name(zero: ZeroOptimizer) -> str:
    """The kind of optimizer the groups step (one for all)."""
    return type(zero.group.store.optimizer).__name__


def parameter_records(zero: ZeroOptimizer, split_rank: int) -> dict[str, dict]:
    """The manifest records of the parameters this rank writes: each parameter is written by
    one copy (a whole one by split rank 0; a tied layer's by its first stage), split ones by
    every split rank (their pieces)."""
    split = split_params(zero)
    records = {}
    first_group = 0  # the index of the shard group's first optimizer group among all
    for group in zero.groups:
        tied = {group.buckets[index].slots[0].name: comm for index, comm in group.summed}
        for bucket in group.buckets:
            for slot in bucket.slots:
                if slot.name in tied and tied[slot.name].rank != 0:
                    continue
                if split_rank != 0 and slot.name not in split:
                    continue
                shard = split.get(slot.name)
                record = {
                    "name": slot.name,
                    "shape": list(shard.whole_shape(slot.shape) if shard else slot.shape),
                    "group": first_group + bucket.group_index,
                }
                if shard is not None:
                    record["split"] = shard.to_list()
                records[slot.name] = record
        first_group += len(group.store.param_groups)
    return records


def saved_tensors(
    zero: ZeroOptimizer, names: Collection[str]
) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, int, int]]]:
    """This rank's pieces of the parameters ``names``: ``("<name>/<kind>", values)`` for the
    master (as every rank holds it alike) and each per-element state, and the segments
    ``(name, start, end)`` of the flattened parameter they hold."""
    tensors: list[tuple[str, torch.Tensor]] = []
    segments = []
    for group in zero.groups:
        pieces = [p for p in group.master_pieces(own_shard_only=True) if p.name in names]
        read: dict[tuple[int, str], torch.Tensor] = {}  # each read once: a store may swap

        def tensor(master: int, key: str, group=group, read=read) -> torch.Tensor:
            if (master, key) not in read:
                read[master, key] = (
                    group.shared_master(master)
                    if key == "master"
                    else group.store.state_tensor(master, key)
                )
            return read[master, key]

        for piece in pieces:
            for key in ["master", *group.store.element_state_keys(piece.master)]:
                values = tensor(piece.master, key).view(-1)
                part = values[piece.master_start : piece.master_start + piece.numel]
                tensors.append((f"{piece.name}/{key}", part))
        segments += [(p.name, p.param_start, p.param_start + p.numel) for p in pieces]
    return tensors, segments


def held_ranges(zero: ZeroOptimizer) -> list[tuple[str, int, int]]:
    """The element ranges ``(name, start, end)`` of the flattened parameters this rank's
    masters hold (what a load reads)."""
    return [
        (piece.name, piece.param_start, piece.param_start + piece.numel)
        for group in zero.groups
        for piece in group.master_pieces(own_shard_only=False)
    ]


def load_tensors(zero: ZeroOptimizer, read: PieceReader, state_keys: list[str] | None) -> None:
    """Every master (and, with ``state_keys``, the optimizer's per-element state, which
    replaces the engine's) from ``read``, for the elements this rank's groups hold."""
    kinds = ["master", *(state_keys or [])]
    for group in zero.groups:
        store = group.store
        if state_keys is not None:
            store.reset_element_state(state_keys)
        by_master: dict[int, list] = {}
        for piece in group.master_pieces(own_shard_only=False):
            by_master.setdefault(piece.master, []).append(piece)
        for master, pieces in by_master.items():
            # the keys this bucket's optimizer group keeps (Muon: other ones than AdamW's)
            held = store.element_state_keys(master) if state_keys is not None else []
            for kind in [k for k in kinds if k == "master" or k in held]:
                # read and written once per master: a store that swaps to disk copies it
                flat = store.state_tensor(master, kind).view(-1)
                for piece in pieces:
                    end = piece.param_start + piece.numel
                    for offset, values in read(piece.name, kind, piece.param_start, end):
                        start = piece.master_start + offset - piece.param_start
                        flat[start : start + values.numel()].copy_(values)
                store.write_state(master, kind, flat)


def optimizer_groups(zero: ZeroOptimizer) -> list[dict]:
    """Every shard group's optimizer groups, in order (see ``ZeroOptimizer.param_groups``),
    without the entries that describe this rank's layout."""
    return [
        {k: v for k, v in g.items() if k not in LAYOUT_GROUP_KEYS}
        for group in zero.groups
        for g in group.store.param_groups
    ]


def scalar_states(zero: ZeroOptimizer) -> list[dict]:
    """The optimizer's scalar state (a step count) per optimizer group, in order."""
    return [state for group in zero.groups for state in group.store.scalar_state()]


def load_optimizer_groups(zero: ZeroOptimizer, hyper: list[dict], scalars: list[dict]) -> None:
    """Each shard group's optimizer groups take their hyperparameters and scalar state, in
    the order :func:`optimizer_groups` gave them."""
    hyper = [{k: v for k, v in g.items() if k not in LAYOUT_GROUP_KEYS} for g in hyper]
    for group in zero.groups:
        count = len(group.store.param_groups)
        group.store.load_scalar_state(hyper[:count], scalars[:count])
        hyper, scalars = hyper[count:], scalars[count:]


def group_states(zero: ZeroOptimizer) -> list[dict]:
    """Each shard group's own state (``ShardGroup.state_dict``)."""
    return [group.state_dict() for group in zero.groups]


def load_group_states(zero: ZeroOptimizer, states: list[dict | None], resume: Resume) -> list[str]:
    """Each shard group's own state from ``states`` (one per group); the warnings of what
    started afresh."""
    return [
        warning
        for group, state in zip(zero.groups, states, strict=True)
        for warning in group.load_state_dict(state, resume)
    ]
