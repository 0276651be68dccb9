"""How trainable parameters are laid out to be partitioned: flat, evenly sharded buckets.

[Note: buckets are sharded evenly]
Trainable parameters of one optimizer group are packed, in reverse registration order (roughly
the order backward produces their gradients), into flat buckets of about ``reduce_bucket_size``
elements. Each bucket is padded to a multiple of the world size and split into ``world_size``
equal, contiguous shards; rank r owns shard r of *every* bucket. Equal shards let every
gradient reduction be one ``reduce_scatter`` and every parameter refresh one ``all_gather``
per bucket, with no per-parameter messages, whatever the parameter sizes. Model parameters
become views into their bucket's ``flat_param`` so the gathered result is in place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from itertools import pairwise

import torch
from torch import nn

from zerotrain.comm import Communicator
from zerotrain.ranges import intersect
from zerotrain.zero.init import full_shape

NamedParams = list[tuple[str, nn.Parameter]]


@dataclass(eq=False)  # identity: slots hold tensors
class ParamSlot:
    """Where one model parameter sits inside its bucket's flat buffer."""

    param: nn.Parameter
    name: str
    index: int  # position among all trainable parameters (e.g. for Lamb's per-param norms)
    offset: int
    numel: int
    shape: torch.Size

    def overlap(self, start: int, end: int) -> tuple[int, int]:
        """Flat positions of ``[start, end)`` this parameter occupies, as ``(lo, hi)``; empty when
        ``lo >= hi``."""
        return intersect(self.offset, self.offset + self.numel, start, end)


@dataclass(eq=False)  # identity: buckets hold tensors
class FlatBucket:
    """Trainable parameters of one optimizer group stored in one flat, evenly sharded buffer."""

    group_index: int
    slots: list[ParamSlot]
    numel: int  # sum of parameter sizes
    numel_padded: int  # numel rounded up to a multiple of world_size
    world_size: int
    rank: int
    # 1D, numel_padded elements that the parameters view. Stages 0-2: always there. Stage 3:
    # only while the bucket's unit is gathered (None otherwise).
    flat_param: torch.Tensor | None = field(repr=False)
    # Stage 3: this rank's shard of the parameters (1D, shard_numel), kept between gathers.
    param_shard: torch.Tensor | None = field(default=None, repr=False)
    # Stages 0-1: full gradient buffer (1D, numel_padded) that every param.grad views.
    flat_grad: torch.Tensor | None = field(default=None, repr=False)
    # Stages 2-3: this rank's reduced gradient shard (1D, shard_numel), accumulated.
    grad_shard: torch.Tensor | None = field(default=None, repr=False)
    unit: int = 0  # stage 3: the gather unit (a module subtree) the bucket belongs to
    dtype: torch.dtype = torch.float32  # training dtype of parameters and gradients
    comm_dtype: torch.dtype | None = None  # its gradients' on the wire, where not the group's

    @property
    def device(self) -> torch.device:
        return self.slots[0].param.device

    @property
    def shard_numel(self) -> int:
        return self.numel_padded // self.world_size

    @property
    def frozen(self) -> bool:
        """Whether it holds frozen parameters (stage 3 partitions them too), of no optimizer
        group."""
        return self.group_index < 0

    # The buffers by what the stage and the moment guarantee; each raises naming the bucket
    # where a caller asks for one that does not exist now (a bug in the caller's stage logic).
    def require_flat_param(self) -> torch.Tensor:
        """``flat_param``: at stages 0-2, and at stage 3 while the bucket's unit is gathered."""
        return self._present(self.flat_param, "flat_param", "stage 3: its unit is not gathered")

    def require_param_shard(self) -> torch.Tensor:
        """``param_shard`` (stage 3)."""
        return self._present(self.param_shard, "param_shard", "it exists at stage 3 only")

    def require_flat_grad(self) -> torch.Tensor:
        """``flat_grad`` (stages 0-1)."""
        return self._present(self.flat_grad, "flat_grad", "it exists at stages 0-1 only")

    def require_grad_shard(self) -> torch.Tensor:
        """``grad_shard`` (stages 2-3)."""
        return self._present(self.grad_shard, "grad_shard", "it exists at stages 2-3 only")

    def _present(self, tensor: torch.Tensor | None, name: str, why: str) -> torch.Tensor:
        if tensor is None:
            raise RuntimeError(
                f"the bucket of {self.slots[0].name!r} ({self._kind()}) has no {name} now ({why})"
            )
        return tensor

    def _kind(self) -> str:
        if self.group_index < 0:  # see GatheredForUse.take_frozen
            return "frozen parameters"
        return f"optimizer group {self.group_index}"

    def shard_range(self, rank: int | None = None) -> tuple[int, int]:
        """Flat positions ``[start, end)`` of rank ``rank``'s (default: this rank's) shard."""
        r = self.rank if rank is None else rank
        return r * self.shard_numel, (r + 1) * self.shard_numel

    @cached_property
    def shard_pieces(self) -> tuple[tuple[int, ...], ...]:
        """Per rank, the lengths of the pieces its shard holds of each parameter (and of the
        padding), in order: where a quantized gather's blocks end (see [Note: quantized
        parameter all-gather] in zerotrain/compression/gather.py)."""
        bounds = {slot.offset for slot in self.slots} | {self.numel}
        out = []
        for rank in range(self.world_size):
            start, end = self.shard_range(rank)
            edges = [start, *sorted(b for b in bounds if start < b < end), end]
            out.append(tuple(b - a for a, b in pairwise(edges)))
        return tuple(out)

    def shard(self, flat: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """Rank ``rank``'s (default: this rank's) piece of a bucket-sized flat tensor."""
        start, end = self.shard_range(rank)
        return flat[start:end]

    def view(self, flat: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
        """``slot``'s parameter-shaped view into a bucket-sized flat tensor."""
        return flat[slot.offset : slot.offset + slot.numel].view(slot.shape)

    def slot_ranges(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """The parameters in flat positions ``[start, end)``: ``(lo, hi, index)`` per parameter
        there, in order, positions relative to ``start``; positions in none are padding."""
        ranges = []
        for slot in self.slots:
            lo, hi = slot.overlap(start, end)
            if lo < hi:
                ranges.append((lo - start, hi - start, slot.index))
        return ranges


def build_buckets(
    runs: list[tuple[int, int, NamedParams]],
    *,
    index_of: dict[int, int],
    bucket_numel: int | None,
    world_size: int,
    rank: int,
    full_value: Callable[[nn.Parameter], torch.Tensor],
    shard_only: bool = False,
) -> list[FlatBucket]:
    """Pack runs of parameters into buckets (see [Note: buckets are sharded evenly]).

    A run is ``(group_index, unit, named_params)``: parameters that may share a bucket. Each run
    is packed in reverse order and split at ``bucket_numel`` elements (``None``: one bucket per
    run). ``index_of`` maps ``id(param)`` to its stable index over all trainable parameters;
    ``full_value(param)`` returns a parameter's whole value (it may be a collective, and is
    called for every parameter, in order, on every rank). The values are copied in fp32: into
    ``flat_param`` or, with ``shard_only``, into this rank's ``param_shard`` alone, so no more
    than one parameter is ever whole beyond what the caller holds.
    """
    buckets: list[FlatBucket] = []
    for group_index, unit, named in runs:
        current: list[ParamSlot] = []
        size = 0
        for slot in reversed([_slot_of(name, p, index_of[id(p)]) for name, p in named]):
            if current and bucket_numel is not None and size + slot.numel > bucket_numel:
                buckets.append(_make_bucket(group_index, unit, current, world_size, rank))
                current, size = [], 0
            slot.offset = size
            current.append(slot)
            size += slot.numel
        if current:
            buckets.append(_make_bucket(group_index, unit, current, world_size, rank))
    for bucket in buckets:
        _fill(bucket, full_value, shard_only)
    return buckets


def _slot_of(name: str, param: nn.Parameter, index: int) -> ParamSlot:
    shape = full_shape(param)
    return ParamSlot(param, name, index, 0, shape.numel(), shape)


def _make_bucket(group_index: int, unit: int, slots: list[ParamSlot], world_size: int, rank: int):
    numel = sum(s.numel for s in slots)
    numel_padded = -(-numel // world_size) * world_size
    return FlatBucket(group_index, slots, numel, numel_padded, world_size, rank, None, unit=unit)


def _fill(bucket: FlatBucket, full_value, shard_only: bool) -> None:
    start, end = bucket.shard_range()
    size = bucket.shard_numel if shard_only else bucket.numel_padded
    target = torch.zeros(size, dtype=torch.float32, device=bucket.device)
    for slot in bucket.slots:
        value = full_value(slot.param).reshape(-1)
        if not shard_only:
            target[slot.offset : slot.offset + slot.numel].copy_(value)
            continue
        lo, hi = slot.overlap(start, end)
        if lo < hi:
            target[lo - start : hi - start].copy_(value[lo - slot.offset : hi - slot.offset])
    if shard_only:
        bucket.param_shard = target
    else:
        bucket.flat_param = target


def point_params_at(bucket: FlatBucket) -> None:
    """Make every parameter of ``bucket`` a view into ``bucket.flat_param`` (keeps identity)."""
    flat_param = bucket.require_flat_param()
    for slot in bucket.slots:
        slot.param.data = bucket.view(flat_param, slot)


def point_grads_at(bucket: FlatBucket) -> None:
    """Make every ``param.grad`` a view into ``bucket.flat_grad`` so autograd accumulates there."""
    flat_grad = bucket.require_flat_grad()
    for slot in bucket.slots:
        slot.param.grad = bucket.view(flat_grad, slot)


class OptimizerPartition:
    """Which part of every bucket this rank's optimizer steps: the whole bucket (optimizer
    states replicated, stage 0) or this rank's shard (stages 1-3), and how a value over that
    part becomes the global one."""

    def __init__(self, comm: Communicator, sharded: bool):
        self.comm = comm
        self.sharded = sharded

    def range(self, bucket: FlatBucket) -> tuple[int, int]:
        """Flat positions ``[start, end)`` of ``bucket`` that this rank's optimizer steps."""
        if self.sharded:
            return bucket.shard_range()
        return 0, bucket.numel_padded

    def part(self, bucket: FlatBucket, flat: torch.Tensor) -> torch.Tensor:
        """This rank's part of a bucket-sized flat tensor."""
        start, end = self.range(bucket)
        return flat[start:end]

    def sum_over_ranks(self, tensor: torch.Tensor) -> None:
        """Sum a per-rank partial (a gradient norm, Lamb's per-parameter norms) in place: each
        element is owned by one rank when sharded, by every rank otherwise."""
        if self.sharded:
            on_wire = tensor.to(self.comm.device)  # offloaded: on the host, which NCCL cannot send
            self.comm.all_reduce(on_wire)
            if on_wire is not tensor:
                tensor.copy_(on_wire)

    def full(self, bucket: FlatBucket, local: torch.Tensor) -> torch.Tensor:
        """The whole bucket from every rank's part ``local`` (collective when sharded)."""
        if not self.sharded:
            return local
        on_wire = local.to(self.comm.device).contiguous()  # offloaded: from the host
        full = torch.empty(bucket.numel_padded, dtype=local.dtype, device=on_wire.device)
        self.comm.all_gather(full, on_wire)
        return full.to(local.device)  # and back there: offload keeps the whole off the GPU
