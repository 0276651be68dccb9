"""The model's state dict as the shard groups hold it: the trained parameters' fp32 masters,
gathered whole, and the entries no group trains (frozen parameters, buffers), which stage 3
partitions too where they are frozen parameters. The engine's full state dict and the
checkpoint read and write the model through these."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from zerotrain.comm import Communicator
from zerotrain.zero.group import ShardGroup


def full_masters(groups: list[ShardGroup]) -> dict[int, torch.Tensor]:
    """``id(param) -> full fp32 master value``, gathered from every rank's part."""
    return {k: v for g in groups for k, v in g.full_master_params().items()}


def trained_names(groups: list[ShardGroup]) -> dict[int, str]:
    """``id(param) -> name`` of every trained parameter (tied ones under one name)."""
    return {k: v for g in groups for k, v in g.trained_names().items()}


def untrained_comm(groups: list[ShardGroup]) -> Communicator:
    """The ranks holding the same frozen parameters and buffers as this one: the narrowest
    group's (the experts', whose ranks hold other experts' buffers)."""
    return min((g.comm for g in groups), key=lambda comm: comm.world_size)


def _untrained_entries(groups: list[ShardGroup], module: nn.Module) -> dict[str, torch.Tensor]:
    trained = trained_names(groups)
    return {
        key: value
        for key, value in module.state_dict(keep_vars=True).items()
        if id(value) not in trained
    }


def frozen_keys(groups: list[ShardGroup], module: nn.Module) -> set[str]:
    """State-dict keys of ``module``'s parameters no group trains."""
    entries = _untrained_entries(groups, module)
    return {key for key, value in entries.items() if isinstance(value, nn.Parameter)}


def untrained_keys(groups: list[ShardGroup], module: nn.Module) -> set[str]:
    """The keys of :func:`untrained_state` (nothing is gathered)."""
    return set(_untrained_entries(groups, module))


def untrained_state(
    groups: list[ShardGroup],
    module: nn.Module,
    exclude_frozen: bool = False,
    *,
    on_rank: int | None = None,
) -> dict[str, torch.Tensor]:
    """``module``'s state-dict entries that no group trains: frozen parameters (unless
    ``exclude_frozen``) and buffers. Frozen parameters that stage 3 partitions are gathered
    (collective: every rank calls it) and kept, as host copies, on rank ``on_rank`` of the
    first group (None: every rank); elsewhere they are placeholders."""
    entries = _untrained_entries(groups, module)
    if exclude_frozen:
        return {k: v.detach() for k, v in entries.items() if not isinstance(v, nn.Parameter)}
    keep = on_rank in (None, groups[0].comm.rank)
    frozen = {k: v for g in groups for k, v in g.residency.frozen_values(keep).items()}
    return {key: frozen.get(id(value), value.detach()) for key, value in entries.items()}


def load_untrained(
    groups: list[ShardGroup], module: nn.Module, read: Callable[[str], torch.Tensor | None]
) -> None:
    """Set the untrained entries of ``module``'s state dict to ``read(key)`` (None: keep the
    value); collective where stage 3 partitions frozen parameters."""
    partitioned = {id(s.param) for g in groups for b in g.residency.frozen_buckets for s in b.slots}
    key_of: dict[int, str] = {}
    for key, value in _untrained_entries(groups, module).items():
        key_of.setdefault(id(value), key)
        if id(value) not in partitioned:
            loaded = read(key)
            if loaded is not None:
                value.detach().copy_(loaded)
    for group in groups:
        group.residency.load_frozen(lambda param: read(key_of[id(param)]))
