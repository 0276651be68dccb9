"""What a parameter's ``ParamOwner`` (zero/init.py) offers: its values reached wherever the
shard groups keep them. DeepSpeed's ``safe_get_full_fp32_param`` family
(zerotrain/utils/tensor_fragment.py) reads and writes one parameter's master, gradient or
optimizer state, whole (collective) or this rank's elements; ``GatheredParameters``
(zero/gathered_parameters.py) makes parameters whole outside a forward and takes a modifier's
values back. A ZeroOptimizer records one :class:`ParamAccess` on each parameter it trains.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from zerotrain.comm import Communicator
from zerotrain.zero.group import ShardGroup
from zerotrain.zero.layout import FlatBucket, ParamSlot


class ParamAccess:
    """The ``ParamOwner`` of the parameters of ``groups`` (filled once they are built): the
    data-parallel group ``comm`` and the loss scale gradients are held times."""

    def __init__(self, comm: Communicator, loss_scale: Callable[[], float]):
        self.comm = comm
        self.loss_scale = loss_scale
        self.groups: list[ShardGroup] = []

    def holds_whole_during_step(self, param: nn.Parameter) -> bool:
        """Whether ``param`` is whole throughout forward and backward (at stage 3 only the
        root unit's and persistent units'; always below)."""
        return all(g.residency.holds_whole(param) for g in self.groups)

    # -- whole outside a forward (GatheredParameters) -----------------------------------------
    def begin_access(self, params: list[nn.Parameter]) -> list[tuple[list[FlatBucket], list]]:
        """Make ``params`` whole (collective); returns what :meth:`end_access` needs."""
        wanted = {id(p) for p in params}
        out = []
        for group in self.groups:
            residency = group.residency
            buckets = [
                b
                for b in group.buckets + residency.frozen_buckets
                if any(id(s.param) in wanted for s in b.slots)
            ]
            out.append((buckets, residency.begin_access(buckets)))
        return out

    def end_access(self, access, modifier_rank: int | None) -> None:
        """Finish :meth:`begin_access`; with ``modifier_rank``, that rank's (possibly changed)
        values become every rank's parameters, master weights included. ``modifier_rank`` is a
        rank of the data-parallel group (the world's, without model parallelism); a group over
        fewer ranks (experts') takes them from its rank at the same data-parallel position."""
        for group, (buckets, gathered_here) in zip(self.groups, access, strict=True):
            if modifier_rank is not None:
                source = group.comm.global_rank_of(
                    modifier_rank * group.comm.world_size // self.comm.world_size
                )
                for bucket in buckets:
                    group.comm.broadcast(bucket.flat_param, src=source)
                    group.residency.take_values(bucket)
                # the masters too (a no-op where they are the model's own fp32 shards)
                for index, bucket in enumerate(group.buckets):
                    if bucket in buckets:
                        part = group.partition.part(bucket, bucket.require_flat_param())
                        group.store.write_state(index, "master", part)
                group.masters_set()  # every rank holds the modifier's values
            group.residency.end_access(gathered_here)

    # -- one parameter's values (DeepSpeed's safe_get/set functions) -------------------------
    def _locate(self, param: nn.Parameter, kind: str) -> tuple[ShardGroup, int, ParamSlot] | None:
        """The group, bucket index and slot of a parameter this optimizer trains (None for
        another); ``kind`` checked: ``"grad"``, ``"master"`` or an optimizer state key."""
        for group in self.groups:
            found = group.locate(param)
            if found is None:
                continue
            keys = [] if kind in ("grad", "master") else group.store.element_state_keys()
            if kind not in ("grad", "master", *keys):
                raise ValueError(
                    f"{kind!r} is not an optimizer state of {found[1].name!r}: its states are "
                    f"{keys or 'none yet (the optimizer makes them at its first step)'}"
                )
            index, slot = found
            return group, index, slot
        return None

    def full_value(self, param: nn.Parameter, kind: str) -> torch.Tensor | None:
        """One parameter's full fp32 value of ``kind`` (collective where it is partitioned:
        every rank calls it for the same parameter): ``"master"`` (the fp32 master weight),
        ``"grad"`` (the gradient reduced so far, unscaled: the average after the boundary's
        backward), or an optimizer state key such as ``"exp_avg"`` (None before the optimizer
        created it). None for a parameter this optimizer does not train."""
        try:
            found = self._locate(param, kind)
        except ValueError:
            if any(group.store.element_state_keys() for group in self.groups):
                raise  # a key the optimizer does not have (a typo), not one still to come
            return None
        if found is None:
            return None
        group, index, slot = found
        bucket = group.buckets[index]
        local = group.part_of(index, kind).float()
        if kind == "grad":
            local = local / self.loss_scale()
        return bucket.view(group.partition.full(bucket, local), slot).float().clone()

    def set_full_value(self, param: nn.Parameter, kind: str, value: torch.Tensor) -> bool:
        """Set one parameter's ``kind`` (see :meth:`full_value`) from its whole ``value``; every
        rank calls it with the same value. A master is set in the model's parameter too (in its
        dtype), so the next forward and step go on from it. False for a parameter this
        optimizer does not train."""
        found = self._locate(param, kind)
        if found is None:
            return False
        group, index, slot = found
        flat = _checked(value, slot.numel, f"the value for {slot.name!r}", tuple(slot.shape))
        if kind == "master":
            group.set_param(index, slot, flat)
        else:
            _, piece = group.local_piece(index, slot)
            group.set_local_value(index, slot, kind, self._scaled(flat[piece], kind))
        return True

    def local_value(self, param: nn.Parameter, kind: str) -> torch.Tensor | None:
        """This rank's elements of one parameter's ``kind`` (see :meth:`full_value`): the run of
        the flattened parameter in this rank's partition, 1-D fp32 (the whole parameter at
        stage 0; empty where this rank holds none of it). Not a collective."""
        found = self._locate(param, kind)
        if found is None:
            return None
        group, index, slot = found
        local = group.local_value(index, slot, kind)
        return local / self.loss_scale() if kind == "grad" else local

    def set_local_value(self, param: nn.Parameter, kind: str, value: torch.Tensor) -> bool:
        """Set what :meth:`local_value` returns (a master takes effect at the next step, which
        trains from it). Not a collective. False for a parameter this optimizer does not
        train."""
        found = self._locate(param, kind)
        if found is None:
            return False
        group, index, slot = found
        part, _ = group.local_piece(index, slot)
        numel = part.stop - part.start
        flat = _checked(value, numel, f"the local value for {slot.name!r} on this rank", (numel,))
        group.set_local_value(index, slot, kind, self._scaled(flat, kind))
        return True

    def _scaled(self, values: torch.Tensor, kind: str) -> torch.Tensor:
        """Gradients are held times the loss scale (fp16)."""
        return values * self.loss_scale() if kind == "grad" else values


def _checked(value: torch.Tensor, numel: int, what: str, shape: tuple[int, ...]) -> torch.Tensor:
    """``value`` flattened, in fp32, checked to hold ``numel`` elements."""
    if not torch.is_tensor(value):
        raise TypeError(f"{what} must be a tensor, got {type(value).__name__}")
    if value.numel() != numel:
        raise ValueError(
            f"{what} has {value.numel()} elements (shape {tuple(value.shape)}); it needs "
            f"{numel} (shape {shape})"
        )
    return value.detach().reshape(-1).float()
