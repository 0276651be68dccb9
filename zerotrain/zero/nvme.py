"""NVMe offload (ZeRO-Infinity, arXiv:2104.07857): the offloaded masters and optimizer state
live in a per-rank working file and are stepped sub-group by sub-group.

[Note: the sub-group pipeline]
Each offloaded bucket's optimizer part is cut into sub-groups of at most ``sub_group_size``
elements; each sub-group is one tensor of the torch optimizer, whose data (and element state)
is a host staging buffer while it is stepped and an empty placeholder otherwise. The file holds,
per sub-group, a slot for the fp32 master and one per element state key (found by stepping the
optimizer once over one-element stand-ins at build time). A step walks the sub-groups with
``buffer_count`` staging sets: while sub-group k is stepped, the reads of the next ones and the
writes of the previous ones are in flight on the I/O threads (zerotrain/zero/swap.py), so host
memory holds ``buffer_count`` sub-groups, never the whole state. Each stepped sub-group's
parameters go back to the device right away, through the same ring as CPU offload.

Gradients are not copied to the host ahead of the step (that would be 4 bytes per element of
host memory): each sub-group's gradient is copied from the device's reduced gradient into its
staging set when it is stepped. The numerics are the in-memory path's (the optimizer's update
is per element; the gradient norm is taken per bucket on the device, as there).

[Note: NVMe offload and freed host memory]
What NVMe offload saves is host memory, so what it frees must go back to the kernel. The first
step creates the optimizer state sub-group by sub-group: the torch optimizer allocates it
(``zeros_like``), the store copies it into a staging set and drops it. With glibc those blocks
(a sub-group each, below its mmap threshold once that has risen) come from a heap, between
small blocks that live on (each sub-group's step counter, the optimizer's bookkeeping), and a
heap returns memory only from its top. On the 58.8M-parameter MLP of bench/nvme_rss.py the
heap grew by 0.78 MiB per sub-group (2 MiB of new Adam state) in three runs of five of the
same program: 174 MiB freed but resident, on which the next backward stacked its temporaries,
and NVMe saved 0.58-0.60 of the optimizer state's bytes in peak RSS instead of 0.97.
``MALLOC_MMAP_THRESHOLD_`` avoided it, but no user sets that. So while the first step creates
state, the store hands freed memory back (:func:`zerotrain.accelerator.release_free_host_memory`)
every :data:`RELEASE_EVERY` bytes of new state and at the end of the walk.

Later steps create no state, but on a CPU device the model's own gradients and temporaries
(16 MiB blocks on the 6 x Linear(2048, 2048) MLP of tests/test_offload_faults.py) come and go
every step, and a heap reuses a freed block only for a request that fits in it: with glibc's
threshold raised, that heap grew by 16-32 MiB on some steps and not others, the bytes in use
unchanged (119 MiB), and peak RSS fell by 0.53 of the optimizer state in one CI run, 0.5-1.0
here. The store therefore fixes the threshold at 4 MiB when it is built
(:func:`zerotrain.accelerator.map_large_host_blocks`; a user's ``MALLOC_MMAP_THRESHOLD_`` is
kept): larger blocks are mapped and unmapped, and peak RSS is the in-memory run's less its
state (tests/test_offload_faults.py's 0.8 held in each of 3 runs at 4 MiB, as at 1 MiB). Its cost falls on a CPU device only, where the activations and temporaries
are host blocks too: each mapped one's pages are faulted in anew every time it is allocated.
``python bench/host_allocator.py`` (a GPT of examples/gpt trained without offload, fp32, one
thread, 3 rounds) measured the forward and backward against glibc's default at 1.31x and
1.27x with a 1 MiB threshold (the demo GPT, width 256; the 30M GPT: 1.16x and 1.16x), and at
0.96x and 0.93x with 4 MiB (the 30M GPT, whose MLP blocks of 8 MiB are mapped: 1.12x and
1.02x). With 1 MiB, the planner's NVMe trials of the demo GPT ran 30-80% slower than the
same config in memory. It is not applied without NVMe offload.

The working file is not a checkpoint: it is removed at exit, and a file left by a process that
was killed is removed by the next run on the same node (its name carries the dead pid).
Checkpoints read and write the state through :meth:`NvmeShardStore.state_tensor` /
:meth:`NvmeShardStore.write_state`, a bucket at a time.
"""

from __future__ import annotations

import atexit
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch

from zerotrain.accelerator import map_large_host_blocks, release_free_host_memory
from zerotrain.config import ConfigError
from zerotrain.optim.muon import Muon
from zerotrain.precision import PrecisionPolicy
from zerotrain.progress import progress
from zerotrain.ranges import intersect
from zerotrain.zero.host import check_disk, local_ranks, remove_stale_files, working_file
from zerotrain.zero.low_precision import LowPrecisionSteps, copy_into
from zerotrain.zero.offload import (
    BucketNorms,
    HostBytes,
    HostPlacement,
    OffloadOptions,
    Ring,
    host_bytes,
    probe_stand_ins,
    quiesce_device,
    ring_numel,
)
from zerotrain.zero.store import (
    OptimizerOver,
    ParamShards,
    Placement,
    ShardStore,
    masters_alias_params,
    needs_whole_parameters,
    write_device_params,
    zero_element_state,
)
from zerotrain.zero.swap import SwapFile, aligned_empty
from zerotrain.zero.whole_matrices import ShardedMatrices

_EMPTY = torch.empty(0)  # the data of a sub-group that is not in a staging set


@dataclass(frozen=True)
class StateLayout:
    """What the optimizer keeps per element (from a probe step): key -> dtype; and the
    masters' dtype (the precision policy's)."""

    keys: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    master_dtype: torch.dtype = torch.float32

    @property
    def bytes_per_element(self) -> int:
        return sum(d.itemsize for d in self.dtypes)


@dataclass(eq=False)
class SubGroup:
    """``[start, end)`` of bucket ``bucket``'s optimizer part, stepped as one tensor."""

    bucket: int
    start: int
    end: int
    slot: int  # its master's slot in the file; its element state keys follow, in key order
    layout: StateLayout  # its bucket's: optimizer groups may keep different states (Muon)
    param: torch.Tensor = field(default_factory=lambda: torch.empty(0))

    @property
    def numel(self) -> int:
        return self.end - self.start


class _StagingSet:
    """Host buffers for one sub-group in flight: master, element state, gradient."""

    def __init__(self, numel: int, layouts: Sequence[StateLayout], pin: bool):
        master_dtype = layouts[0].master_dtype
        # sub-groups of different optimizer groups may keep different states (Muon's momentum,
        # AdamW's moments): a buffer per key position, as wide as its widest dtype
        keys = max(len(layout.dtypes) for layout in layouts)
        widths = [
            max(layout.dtypes[k].itemsize for layout in layouts if k < len(layout.dtypes))
            for k in range(keys)
        ]
        self.master = aligned_empty(numel, master_dtype, pin=pin)
        self._state = [aligned_empty(numel * width, torch.uint8, pin=pin) for width in widths]
        self.grad = aligned_empty(numel, master_dtype, pin=pin)
        self.io: list[Future[None]] = []  # reads or writes using these buffers

    def state(self, group: SubGroup) -> list[torch.Tensor]:
        """The buffers of ``group``'s element state, in its layout's key order."""
        dtypes = group.layout.dtypes
        buffers = self._state[: len(dtypes)]
        return [b[: group.numel * d.itemsize].view(d) for b, d in zip(buffers, dtypes, strict=True)]

    def wait(self) -> None:
        for future in self.io:
            future.result()  # raises SwapIOError naming the file
        self.io = []

    def nbytes(self) -> int:
        tensors = [self.master, self.grad, *self._state]
        return sum(t.untyped_storage().nbytes() for t in tensors)


RELEASE_EVERY = 64 << 20
"""Bytes of optimizer state the first step creates between two hand-backs of freed host memory
(see [Note: NVMe offload and freed host memory]): a trim costs about a millisecond."""


SUB_GROUP_ALIGNMENT = 1024
"""Sub-groups start at multiples of this many elements, so that each element meets the same
lane of the optimizer's vectorized CPU kernels as in one whole-bucket step: an element at a
sub-group's tail would otherwise take the scalar path, whose rounding differs."""


def sub_group_numel(sub_group_size: int) -> int:
    """Elements per sub-group: ``sub_group_size`` rounded down to a multiple of
    :data:`SUB_GROUP_ALIGNMENT` (at least one)."""
    aligned = sub_group_size // SUB_GROUP_ALIGNMENT * SUB_GROUP_ALIGNMENT
    return max(SUB_GROUP_ALIGNMENT, aligned)


def split_sub_groups(
    numels: list[int], on_host: list[bool], size: int, layouts: list[StateLayout]
) -> list[SubGroup]:
    """The sub-groups of the offloaded buckets (bucket i's state laid out as ``layouts[i]``),
    each with a file slot for its master and one per state key: at most
    :func:`sub_group_numel` of ``size`` elements."""
    size = sub_group_numel(size)
    groups, slot = [], 0
    for bucket, (numel, host) in enumerate(zip(numels, on_host, strict=True)):
        if not host:
            continue
        layout = layouts[bucket]
        for start in range(0, numel, size):
            groups.append(SubGroup(bucket, start, min(numel, start + size), slot, layout))
            slot += 1 + len(layout.keys)
    return groups


def staging_host_bytes(
    largest_bucket: int,
    *,
    sub_group_size: int,
    state_bytes: float,
    param_itemsize: int,
    buffer_count: int,
    master_itemsize: int = 4,
) -> HostBytes:
    """What :class:`NvmeShardStore` allocates in host memory when its largest offloaded bucket
    has ``largest_bucket`` elements: ``buffer_count`` staging sets of the largest sub-group
    (master, ``state_bytes`` of element state as stored, a gradient in the masters' dtype per
    element) and a ring of as many buffers of it in the training dtype. The memory preflight of ``initialize`` and
    ``zerotrain estimate --offload nvme`` count with it (zerotrain/estimate/stages.py)."""
    largest = min(sub_group_numel(sub_group_size), largest_bucket)
    count = max(1, buffer_count)
    return host_bytes(
        count * largest,
        largest,
        state_bytes=state_bytes,
        param_itemsize=param_itemsize,
        buffer_count=count,
        master_itemsize=master_itemsize,
    )


def disk_bytes_needed(numel: int, state_bytes: float, master_itemsize: int = 4) -> int:
    """Bytes of working file for ``numel`` offloaded elements with ``state_bytes`` of element
    state each (as stored), besides the master (before slot padding)."""
    return round(numel * (master_itemsize + state_bytes))


@dataclass(frozen=True)
class _Visit:
    """What a walk does with one sub-group: stage its master (and send it to the parameter
    shard after), stage its element state (once there is one), and run ``action`` on the
    staged buffers, after which what was staged is written back."""

    master: bool
    state: bool
    action: Callable[[SubGroup, _StagingSet], None] | None = None


@dataclass(frozen=True)
class _MuonBucket:
    """A bucket Muon steps: its optimizer group, that group's matrix layout, its position
    there."""

    group_index: int
    layout: ShardedMatrices
    position: int


class NvmeShardStore(ShardStore):
    """Offloaded buckets' masters and state in a working file, stepped sub-group by sub-group;
    the other buckets' on the device (see [Note: the sub-group pipeline])."""

    def __init__(
        self,
        device_masters: list[torch.Tensor | None],
        numels: list[int],
        sub_groups: list[SubGroup],
        layouts: list[StateLayout],
        optimizer: torch.optim.Optimizer,
        swap: SwapFile,
        *,
        masters_alias_params: bool,
        precision: PrecisionPolicy,
        options: OffloadOptions,
    ):
        self._device_masters = device_masters
        self.low_precision = LowPrecisionSteps(precision)
        param_dtype = precision.param_dtype
        self._numels = numels
        self.sub_groups = sub_groups
        self.layouts = layouts  # per bucket
        self.optimizer = optimizer
        self.swap = swap
        self.masters_alias_params = masters_alias_params
        self.on_host = [m is None for m in device_masters]
        map_large_host_blocks()  # see [Note: NVMe offload and freed host memory]
        largest = max(g.numel for g in sub_groups)
        count = max(1, options.buffer_count)
        hosted = [g.layout for g in sub_groups]
        self._sets = [_StagingSet(largest, hosted, options.pin_memory) for _ in range(count)]
        self._ring = Ring(count, ring_numel(largest), param_dtype, pin=options.pin_memory)
        self._norms = BucketNorms(len(numels))
        self._grads: list[torch.Tensor | None] = [None] * len(numels)  # the reduced, on device
        self._muon = self._muon_buckets()
        self._updates: dict[int, torch.Tensor] = {}  # Muon's, per bucket, during a step
        self._factor = 1.0
        self._has_state = False
        self.bytes_read = self.bytes_written = 0  # for the benchmark's GB/s
        self._finalizer = weakref.finalize(self, swap.close)
        atexit.register(self._finalizer)

    def _muon_buckets(self) -> dict[int, _MuonBucket]:
        """The buckets Muon steps (none for another optimizer)."""
        if not isinstance(self.optimizer, Muon):
            return {}
        bucket_of = {id(g.param): g.bucket for g in self.sub_groups}
        bucket_of.update((id(m), i) for i, m in enumerate(self._device_masters) if m is not None)
        out = {}
        for index, group in enumerate(self.optimizer.param_groups):
            if group["use_muon"]:
                layout = self.optimizer.layout(index)
                assert isinstance(layout, ShardedMatrices)
                for tensor in group["params"]:
                    out[bucket_of[id(tensor)]] = _MuonBucket(index, layout, layout.position(tensor))
        return out

    # -- gradients in ---------------------------------------------------------------------------
    def take_reduced(self, index: int, grad: torch.Tensor) -> None:
        self._norms.take(index, grad)
        self._grads[index] = grad

    def forget_taken(self) -> None:
        self._norms.forget()

    def attach_grads(self, reduced_grads: list[torch.Tensor]) -> None:
        for index, grad in enumerate(reduced_grads):
            if not self._norms.taken(index):
                self.take_reduced(index, grad)
            master = self._device_masters[index]
            if master is not None:
                master.grad = grad if grad.dtype == master.dtype else grad.to(master.dtype)

    def grad_sum_of_squares(self, weights: Sequence[float] | None = None) -> torch.Tensor:
        return self._norms.sum_of_squares(weights)

    def scale_grads(self, factor: float) -> None:
        self._factor = factor  # sub-groups: applied as each is staged
        grads = [m.grad for m in self._device_masters if m is not None and m.grad is not None]
        if grads and factor != 1.0:
            torch._foreach_mul_(grads, factor)

    def release_grads(self) -> None:
        for master in self._device_masters:
            if master is not None:
                master.grad = None
        self._grads = [None] * len(self._numels)
        self._norms.forget()
        self._factor = 1.0

    # -- the step ---------------------------------------------------------------------------------
    def step(self, param_shards: ParamShards) -> None:
        try:
            self._step(param_shards)
        finally:
            self._updates = {}  # Muon's: this step's only

    def _step(self, param_shards: ParamShards) -> None:
        if self._muon:  # see [Note: Muon on NVMe]
            self._muon_updates()
        resident = self._resident_masters()
        if resident:
            for index in self._muon:
                master = self._device_masters[index]
                if master is not None:
                    self._apply_muon(index, master, 0, self._updates[index])
                    master.grad = None  # stepped: out of the optimizer's step below
            buckets = [i for i, m in enumerate(self._device_masters) if m is not None]
            self.step_optimizer(resident, buckets)
            self._write_device_params(param_shards)
            for master in resident:  # out of the sub-groups' steps
                master.grad = None
        applied = _Visit(master=True, state=False, action=self._apply_muon_sub_group)
        stepped = _Visit(master=True, state=True, action=self._step_one)
        self._walk(
            self._step_order(),
            param_shards,
            lambda g: applied if g.bucket in self._muon else stepped,
        )
        self._has_state = True

    def _step_order(self) -> list[SubGroup]:
        # the first buckets' parameters are needed last in forward: the last ones first
        return sorted(self.sub_groups, key=lambda g: (-g.bucket, g.start))

    def _walk(
        self,
        order: list[SubGroup],
        param_shards: ParamShards,
        visit: Callable[[SubGroup], _Visit],
    ) -> None:
        """Stage each sub-group of ``order`` in turn (reads ahead, writes behind) and do with
        it what ``visit`` says; send its staged master to its parameter shard."""
        quiesce_device()
        count = len(self._sets)
        visits = [visit(g) for g in order]
        # read k + ahead while k is stepped: into the set of k - 2 (its writes are then done)
        # where there are sets enough, else of k - 1, else (one set) no overlap at all
        ahead = min(count - 1, max(1, count - 2))
        for k in range(min(ahead, len(order))):
            self._read(order[k], visits[k], self._sets[k % count])
        target = _EMPTY  # the open parameter shard: a bucket's sub-groups are walked in a row
        creating = not self._has_state  # the first step makes the state
        created = 0  # bytes of state made since memory was last handed back
        for k, (group, seen) in enumerate(zip(order, visits, strict=True)):
            if k + ahead < len(order):
                self._read(order[k + ahead], visits[k + ahead], self._sets[(k + ahead) % count])
            staged = self._sets[k % count]
            staged.wait()
            if seen.action is not None:
                seen.action(group, staged)
                self._write(group, seen, staged)
                created += group.numel * group.layout.bytes_per_element
            if seen.master:
                if group.start == 0:
                    target = param_shards.open(group.bucket)
                self._ring.send(staged.master[: group.numel], target[group.start : group.end])
                if group.end == self._numels[group.bucket]:
                    param_shards.close(group.bucket)
            if creating and created >= RELEASE_EVERY:  # [Note: NVMe offload and freed host memory]
                release_free_host_memory()
                created = 0
        for staged in self._sets:
            staged.wait()
        if creating and created:
            release_free_host_memory()

    def _staged(self, group: SubGroup, visit: _Visit, staged: _StagingSet, *, reading: bool):
        """(file slot, buffer) of what ``visit`` stages of ``group`` (reading: the state once
        there is one)."""
        pairs = [(group.slot, staged.master[: group.numel])] if visit.master else []
        if visit.state and (self._has_state or not reading):
            pairs += [(group.slot + 1 + k, b) for k, b in enumerate(staged.state(group))]
        return pairs

    def _read(self, group: SubGroup, visit: _Visit, staged: _StagingSet) -> None:
        staged.wait()  # its previous sub-group's writes are done
        for slot, buffer in self._staged(group, visit, staged, reading=True):
            staged.io.append(self.swap.read(slot, buffer))
            self.bytes_read += buffer.nbytes

    def _write(self, group: SubGroup, visit: _Visit, staged: _StagingSet) -> None:
        for slot, buffer in self._staged(group, visit, staged, reading=False):
            staged.io.append(self.swap.write(slot, buffer))
            self.bytes_written += buffer.nbytes

    def _stage_grad(self, group: SubGroup, staged: _StagingSet) -> torch.Tensor:
        """``group``'s part of its bucket's reduced gradient, scaled, in the staging set."""
        grad = self._grads[group.bucket]
        assert grad is not None, "the step found no gradient of an offloaded bucket"
        out = staged.grad[: group.numel]
        out.copy_(grad[group.start : group.end])
        if self._factor != 1.0:
            out.mul_(self._factor)
        return out

    def _step_one(self, group: SubGroup, staged: _StagingSet) -> None:
        n = group.numel
        param = group.param
        param.data = staged.master[:n]
        param.grad = self._stage_grad(group, staged)
        state = self.optimizer.state[param]
        buffers = staged.state(group)
        if self._has_state:
            for key, buffer in zip(group.layout.keys, buffers, strict=True):
                state[key] = buffer
        self.step_optimizer([param], [group.bucket])
        for key, buffer in zip(group.layout.keys, buffers, strict=True):
            if state[key].data_ptr() != buffer.data_ptr():  # created by this first step
                buffer.copy_(state[key])
            state[key] = _EMPTY
        param.grad = None
        param.data = _EMPTY

    # -- Muon -----------------------------------------------------------------------------------
    # [Note: Muon on NVMe]
    # Muon's step is element-wise but for Newton-Schulz, which needs each matrix whole
    # (zerotrain/zero/whole_matrices.py), while NVMe offload holds a few sub-groups in host
    # memory at a time. So the step is cut in Muon's three parts (optim/muon.py): a first walk
    # over Muon's sub-groups reads each one's momentum, updates it, and leaves the update
    # before orthogonalisation in the bucket's reduced gradient on the device (which this step
    # consumes; an fp32 buffer instead where the gradient is narrower); the layout then
    # orthogonalises those flat updates as in memory; and the usual walk applies each
    # sub-group's part of them to its master. The momentum is read and written once and the
    # master once, as for Adam; the updates cost no memory beyond the gradients in fp32 training.
    # Each part is element-wise over the same dtypes as the in-memory step, and sub-groups are
    # cut at vector-lane boundaries (SUB_GROUP_ALIGNMENT), so the result is that step's, bit for
    # bit (tests/test_optimizers_sharded.py).
    def _muon_updates(self) -> None:
        """Muon's first two parts: each bucket's momentum and update, then the update
        orthogonalised (collective)."""
        for index, master in enumerate(self._device_masters):
            if master is not None and index in self._muon:
                buf = self._muon_optimizer.momentum_buffer(master, self._state_dtype)
                assert master.grad is not None
                self._prepare_muon(index, master.grad, buf, self._update(index))
        prepared = _Visit(master=False, state=True, action=self._prepare_muon_sub_group)
        hosted = [g for g in self._step_order() if g.bucket in self._muon]
        self._walk(hosted, ParamShards([]), lambda g: prepared)
        by_group: dict[int, tuple[ShardedMatrices, dict[int, torch.Tensor]]] = {}
        for index, bucket in self._muon.items():
            _, flats = by_group.setdefault(bucket.group_index, (bucket.layout, {}))
            flats[bucket.position] = self._updates[index]
        for group_index, (layout, flats) in by_group.items():
            layout.orthogonalize_buckets(flats, self._muon_optimizer.orthogonalizer(group_index))

    @property
    def _muon_optimizer(self) -> Muon:
        return cast(Muon, self.optimizer)  # asked only where some bucket is Muon's

    @property
    def _state_dtype(self) -> torch.dtype:
        return self.low_precision.precision.state_dtype

    def _update(self, index: int) -> torch.Tensor:
        """Bucket ``index``'s Muon update (fp32, on the device): its gradient itself where
        that is fp32."""
        if index not in self._updates:
            master = self._device_masters[index]
            grad = master.grad if master is not None else self._grads[index]
            assert grad is not None, "the step found no gradient of a bucket"
            wide = grad.dtype == torch.float32
            self._updates[index] = grad if wide else torch.empty_like(grad, dtype=torch.float32)
        return self._updates[index]

    def _prepare_muon(
        self, index: int, grad: torch.Tensor, buf: torch.Tensor, out: torch.Tensor
    ) -> None:
        group_index = self._muon[index].group_index
        self.low_precision.prepare_muon(self._muon_optimizer, group_index, grad, buf, out)

    def _prepare_muon_sub_group(self, group: SubGroup, staged: _StagingSet) -> None:
        (buf,) = staged.state(group)
        if not self._has_state:
            buf.zero_()
        out = self._update(group.bucket)[group.start : group.end]
        self._prepare_muon(group.bucket, self._stage_grad(group, staged), buf, out)

    def _apply_muon(
        self, index: int, master: torch.Tensor, start: int, update: torch.Tensor
    ) -> None:
        """Muon's last part on ``master``, elements ``[start, start + numel)`` of bucket
        ``index``'s part, with their orthogonalised ``update`` (fp32, on ``master``'s device),
        in fp32, rounded back as the in-memory step rounds."""
        bucket = self._muon[index]
        end = start + master.numel()
        runs = [
            (lo - start, hi - start, shape)
            for first, last, shape in bucket.layout.bucket_runs(bucket.position)
            for lo, hi in [intersect(first, last, start, end)]
            if lo < hi
        ]
        muon = self._muon_optimizer
        self.low_precision.apply_muon(muon, bucket.group_index, master, update, runs, index)

    def _apply_muon_sub_group(self, group: SubGroup, staged: _StagingSet) -> None:
        update = self._updates[group.bucket][group.start : group.end]
        if update.device.type != "cpu":  # into host memory: the staging set's, where it fits
            host = staged.grad[: group.numel]
            update = host.copy_(update) if host.dtype == update.dtype else update.cpu()
        self._apply_muon(group.bucket, staged.master[: group.numel], group.start, update)

    def _write_device_params(self, param_shards: ParamShards) -> None:
        write_device_params(self._device_masters, param_shards, alias=self.masters_alias_params)

    def write_params(self, param_shards: ParamShards) -> None:
        self._write_device_params(param_shards)
        sent = _Visit(master=True, state=False)
        self._walk(self._step_order(), param_shards, lambda g: sent)

    # -- state, a bucket at a time ------------------------------------------------------------
    def master_numels(self) -> list[int]:
        return self._numels

    def _resident_masters(self) -> list[torch.Tensor]:
        return [m for m in self._device_masters if m is not None]

    def element_state_keys(self, master: int | None = None) -> list[str]:
        keys: set[str] = set()
        for index, tensor in enumerate(self._device_masters):
            if master in (None, index):
                if tensor is None:
                    keys.update(self.layouts[index].keys if self._has_state else ())
                else:
                    state = self.optimizer.state.get(tensor, {})
                    keys.update(k for k in self.layouts[index].keys if k in state)
        return sorted(keys)

    def _slot_offset(self, master: int, key: str) -> int:
        if key == "master":
            return 0
        layout = self.layouts[master]
        if key not in layout.keys:
            raise KeyError(f"NVMe offload: the optimizer keeps no per-element {key!r} here")
        return 1 + layout.keys.index(key)

    def state_tensor(self, master: int, key: str) -> torch.Tensor:
        device_master = self._device_masters[master]
        if device_master is not None:
            return device_master if key == "master" else self.optimizer.state[device_master][key]
        offset = self._slot_offset(master, key)
        layout = self.layouts[master]
        dtype = layout.master_dtype if key == "master" else layout.dtypes[offset - 1]
        out = torch.empty(self._numels[master], dtype=dtype)
        reads = [
            self.swap.read(g.slot + offset, out[g.start : g.end])
            for g in self.sub_groups
            if g.bucket == master
        ]
        for read in reads:
            read.result()
        return out

    def write_state(self, master: int, key: str, value: torch.Tensor) -> None:
        if self._device_masters[master] is not None:
            copy_into(self.state_tensor(master, key), value)
            return
        offset = self._slot_offset(master, key)
        value = value.detach().reshape(-1).cpu().contiguous()
        writes = [
            self.swap.write(g.slot + offset, value[g.start : g.end])
            for g in self.sub_groups
            if g.bucket == master
        ]
        for write in writes:
            write.result()

    def reset_element_state(self, keys: list[str]) -> None:
        unknown = set(keys) - {key for layout in self.layouts for key in layout.keys}
        if unknown:
            raise KeyError(f"NVMe offload: the optimizer keeps no per-element {sorted(unknown)}")
        zero_element_state(self.optimizer, self._resident_masters(), keys, self._state_dtype)
        for group in self.sub_groups:
            self.optimizer.state.pop(group.param, None)
            self.optimizer.state[group.param].update({key: _EMPTY for key in group.layout.keys})
        largest = max(g.numel for g in self.sub_groups)
        widest = max((d.itemsize for g in self.sub_groups for d in g.layout.dtypes), default=0)
        zeros = torch.zeros(largest * widest, dtype=torch.uint8)
        for group in self.sub_groups:  # the padding of every key starts at zero
            for offset, dtype in enumerate(group.layout.dtypes, start=1):
                size = group.numel * dtype.itemsize
                self.swap.write(group.slot + offset, zeros[:size]).result()
        self._has_state = True

    def optimizer_state_dict(self) -> dict:
        raise RuntimeError(
            "optimizer.state_dict(): with NVMe offload the optimizer state is in working files, "
            "not in the torch optimizer; save it with engine.save_checkpoint"
        )

    def load_optimizer_state_dict(self, state_dict: dict) -> None:
        self.optimizer_state_dict()  # the same refusal

    # -- what lives where -----------------------------------------------------------------------
    def offloaded_numel(self) -> int:
        return sum(n for n, host in zip(self._numels, self.on_host, strict=True) if host)

    def staging_bytes(self) -> int:
        return sum(s.nbytes() for s in self._sets) + self._ring.nbytes()

    def disk_bytes(self) -> int:
        return self.swap.nbytes


class NvmePlacement(HostPlacement):
    """The offloaded buckets' masters and state in a working file under ``nvme_path``."""

    def build_store(
        self,
        masters_fp32: list[torch.Tensor],
        param_parts: ParamShards,
        precision: PrecisionPolicy,
        optimizer_over: OptimizerOver,
    ) -> ShardStore:
        options = self.options
        stand_ins = probe_stand_ins(len(masters_fp32))
        probe = self._probe(masters_fp32, optimizer_over, stand_ins)
        if needs_whole_parameters(probe) and not isinstance(probe, Muon):
            raise ConfigError(
                f'zero_optimization.offload_optimizer.device: "nvme" steps the optimizer '
                f"sub-group by sub-group, and {type(probe).__name__} needs whole parameters (Lamb's "
                'trust ratios); use device "cpu", or an element-wise optimizer (Adam, AdamW, '
                "SGD, Lion, Adagrad) or Muon"
            )
        layouts = _state_layouts(probe, stand_ins, precision)
        numels = [m.numel() for m in masters_fp32]
        stored = sum(n * s.bytes_per_element for n, s in zip(numels, layouts, strict=True))
        on_host = self.on_host(numels, stored / max(1, sum(numels)), precision)
        if not any(on_host):  # nothing to swap: the device store
            return Placement().build_store(masters_fp32, param_parts, precision, optimizer_over)
        groups = split_sub_groups(numels, on_host, options.sub_group_size, layouts)
        largest = max(g.numel for g in groups)
        # the staging sets' host memory was checked at initialize (estimate/preflight.py)
        directory = Path(options.nvme_path or ".")
        remove_stale_files(directory)
        slot_bytes = []
        master_bytes = precision.master_dtype.itemsize
        for group in groups:
            slot_bytes += [master_bytes * group.numel]
            slot_bytes += [d.itemsize * group.numel for d in group.layout.dtypes]
        check_disk(directory, sum(slot_bytes), local_ranks())
        swap = SwapFile(working_file(directory, "optimizer"), slot_bytes, options.aio)
        staging = aligned_empty(largest, precision.master_dtype)
        written = master_bytes * sum(group.numel for group in groups)
        with progress("NVMe offload: initial masters written", total=written, unit="B") as advance:
            for group in groups:  # the initial masters, through one host buffer
                part = staging[: group.numel]
                part.copy_(masters_fp32[group.bucket][group.start : group.end])
                swap.write(group.slot, part).result()
                advance(master_bytes * group.numel)
        alias = masters_alias_params(precision, masters_fp32, param_parts)
        device_masters: list[torch.Tensor | None] = [
            None
            if host
            else (param_parts.tensors[index] if alias else master.to(precision.master_dtype))
            for index, (master, host) in enumerate(zip(masters_fp32, on_host, strict=True))
        ]
        tensors = [
            [g.param for g in groups if g.bucket == index] if master is None else [master]
            for index, master in enumerate(device_masters)
        ]
        return NvmeShardStore(
            device_masters,
            numels,
            groups,
            layouts,
            optimizer_over(tensors),
            swap,
            masters_alias_params=alias,
            precision=precision,
            options=options,
        )


def _state_layouts(
    probe: torch.optim.Optimizer, stand_ins: list[list[torch.Tensor]], precision: PrecisionPolicy
) -> list[StateLayout]:
    """Per bucket, the per-element state keys of the probe's stand-in for it (stepped; Muon's,
    not stepped, says its keys), in the policy's dtypes (the probe stepped fp32 stand-ins: a
    state it keeps in fp32 is stored in ``state_dtype``)."""
    keys_of = getattr(probe, "element_state_keys_of", None)
    layouts = []
    for (tensor,) in stand_ins:
        state = probe.state.get(tensor)
        if state:
            items = sorted(
                (k, v.dtype)
                for k, v in state.items()
                if torch.is_tensor(v) and v.shape == tensor.shape
            )
        else:
            items = [(k, torch.float32) for k in sorted(keys_of(tensor))] if keys_of else []
        dtypes = (precision.state_dtype if d == torch.float32 else d for _, d in items)
        keys = tuple(k for k, _ in items)
        layouts.append(StateLayout(keys, tuple(dtypes), precision.master_dtype))
    return layouts
