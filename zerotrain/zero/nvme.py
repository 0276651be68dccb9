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
here. The store therefore fixes the threshold at 1 MiB when it is built
(:func:`zerotrain.accelerator.map_large_host_blocks`; a user's ``MALLOC_MMAP_THRESHOLD_`` is
kept): larger blocks are mapped and unmapped, and peak RSS held at 556-567 MiB in five runs,
the in-memory run's less its state. Its cost, a page fault per 4 KiB of such blocks, did not
show in NVMe step times (1.33-1.45 s against 1.41-1.59 s at the default); it is not applied
without NVMe offload, where an fp32 CPU step of the same MLP took 10% longer with it.

The working file is not a checkpoint: it is removed at exit, and a file left by a process that
was killed is removed by the next run on the same node (its name carries the dead pid).
Checkpoints read and write the state through :meth:`NvmeShardStore.state_tensor` /
:meth:`NvmeShardStore.write_state`, a bucket at a time.
"""

from __future__ import annotations

import atexit
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zerotrain.accelerator import map_large_host_blocks, release_free_host_memory
from zerotrain.config import ConfigError
from zerotrain.precision import PrecisionPolicy
from zerotrain.progress import progress
from zerotrain.zero.host import check_disk, local_ranks, remove_stale_files, working_file
from zerotrain.zero.low_precision import LowPrecisionSteps
from zerotrain.zero.offload import (
    BucketNorms,
    HostBytes,
    HostPlacement,
    OffloadOptions,
    Ring,
    host_bytes,
    quiesce_device,
    ring_numel,
)
from zerotrain.zero.store import (
    OptimizerOver,
    ParamShards,
    Placement,
    ShardStore,
    copy_into,
    masters_alias_params,
    needs_whole_parameters,
    write_device_params,
    zero_element_state,
)
from zerotrain.zero.swap import SwapFile, aligned_empty

_EMPTY = torch.empty(0)  # the data of a sub-group that is not in a staging set


@dataclass(eq=False)
class SubGroup:
    """``[start, end)`` of bucket ``bucket``'s optimizer part, stepped as one tensor."""

    bucket: int
    start: int
    end: int
    slot: int  # its master's slot in the file; its element state keys follow, in key order
    param: torch.Tensor = field(default_factory=lambda: torch.empty(0))

    @property
    def numel(self) -> int:
        return self.end - self.start


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


class _StagingSet:
    """Host buffers for one sub-group in flight: master, element state, gradient."""

    def __init__(self, numel: int, layout: StateLayout, pin: bool):
        self.master = aligned_empty(numel, layout.master_dtype, pin=pin)
        self.state = [aligned_empty(numel, d, pin=pin) for d in layout.dtypes]
        self.grad = aligned_empty(numel, layout.master_dtype, pin=pin)
        self.io: list[Future[None]] = []  # reads or writes using these buffers

    def wait(self) -> None:
        for future in self.io:
            future.result()  # raises SwapIOError naming the file
        self.io = []

    def nbytes(self) -> int:
        tensors = [self.master, self.grad, *self.state]
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


def split_sub_groups(numels: list[int], on_host: list[bool], size: int, keys: int):
    """The sub-groups of the offloaded buckets, each with ``1 + keys`` file slots: at most
    :func:`sub_group_numel` of ``size`` elements."""
    size = sub_group_numel(size)
    groups, slot = [], 0
    for bucket, (numel, host) in enumerate(zip(numels, on_host, strict=True)):
        if not host:
            continue
        for start in range(0, numel, size):
            groups.append(SubGroup(bucket, start, min(numel, start + size), slot))
            slot += 1 + keys
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


class NvmeShardStore(ShardStore):
    """Offloaded buckets' masters and state in a working file, stepped sub-group by sub-group;
    the other buckets' on the device (see [Note: the sub-group pipeline])."""

    def __init__(
        self,
        device_masters: list[torch.Tensor | None],
        numels: list[int],
        sub_groups: list[SubGroup],
        layout: StateLayout,
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
        self.layout = layout
        self.optimizer = optimizer
        self.swap = swap
        self.masters_alias_params = masters_alias_params
        self.on_host = [m is None for m in device_masters]
        map_large_host_blocks()  # see [Note: NVMe offload and freed host memory]
        largest = max(g.numel for g in sub_groups)
        count = max(1, options.buffer_count)
        self._sets = [_StagingSet(largest, layout, options.pin_memory) for _ in range(count)]
        self._ring = Ring(count, ring_numel(largest), param_dtype, pin=options.pin_memory)
        self._norms = BucketNorms(len(numels))
        self._grads: list[torch.Tensor | None] = [None] * len(numels)  # the reduced, on device
        self._factor = 1.0
        self._has_state = False
        self.bytes_read = self.bytes_written = 0  # for the benchmark's GB/s
        self._finalizer = weakref.finalize(self, swap.close)
        atexit.register(self._finalizer)

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
        if self._resident_masters():
            # only they have gradients now
            buckets = [i for i, m in enumerate(self._device_masters) if m is not None]
            self.step_optimizer(self._resident_masters(), buckets)
            self._write_device_params(param_shards)
            for master in self._resident_masters():  # out of the sub-groups' steps
                master.grad = None
        self._walk(self._step_order(), param_shards, step=True)
        self._has_state = True

    def _step_order(self) -> list[SubGroup]:
        # the first buckets' parameters are needed last in forward: the last ones first
        return sorted(self.sub_groups, key=lambda g: (-g.bucket, g.start))

    def _walk(self, order: list[SubGroup], param_shards: ParamShards, *, step: bool) -> None:
        """Stage each sub-group of ``order`` in turn (reads ahead, writes behind), step it if
        ``step``, and send its master to its parameter shard."""
        quiesce_device()
        count = len(self._sets)
        # read k + ahead while k is stepped: into the set of k - 2 (its writes are then done)
        # where there are sets enough, else of k - 1, else (one set) no overlap at all
        ahead = min(count - 1, max(1, count - 2))
        for k in range(min(ahead, len(order))):
            self._read(order[k], self._sets[k % count], with_state=step and self._has_state)
        target = _EMPTY  # the open parameter shard: a bucket's sub-groups are walked in a row
        creating = step and not self._has_state  # the first step makes the state
        created = 0  # bytes of state made since memory was last handed back
        for k, group in enumerate(order):
            if k + ahead < len(order):
                upcoming = self._sets[(k + ahead) % count]
                self._read(order[k + ahead], upcoming, with_state=step and self._has_state)
            staged = self._sets[k % count]
            staged.wait()
            master = staged.master[: group.numel]
            if step:
                self._step_one(group, staged)
            if group.start == 0:
                target = param_shards.open(group.bucket)
            self._ring.send(master, target[group.start : group.end])
            if group.end == self._numels[group.bucket]:
                param_shards.close(group.bucket)
            if step:
                self._write(group, staged)
            if creating:  # see [Note: NVMe offload and freed host memory]
                created += group.numel * self.layout.bytes_per_element
                if created >= RELEASE_EVERY:
                    release_free_host_memory()
                    created = 0
        for staged in self._sets:
            staged.wait()
        if creating:
            release_free_host_memory()

    def _read(self, group: SubGroup, staged: _StagingSet, *, with_state: bool) -> None:
        staged.wait()  # its previous sub-group's writes are done
        n = group.numel
        buffers = [staged.master, *(staged.state if with_state else [])]
        for offset, buffer in enumerate(buffers):
            staged.io.append(self.swap.read(group.slot + offset, buffer[:n]))
            self.bytes_read += n * buffer.element_size()

    def _write(self, group: SubGroup, staged: _StagingSet) -> None:
        n = group.numel
        for offset, buffer in enumerate([staged.master, *staged.state]):
            staged.io.append(self.swap.write(group.slot + offset, buffer[:n]))
            self.bytes_written += n * buffer.element_size()

    def _step_one(self, group: SubGroup, staged: _StagingSet) -> None:
        n = group.numel
        grad = self._grads[group.bucket]
        assert grad is not None, "the step found no gradient of an offloaded bucket"
        staged.grad[:n].copy_(grad[group.start : group.end])
        if self._factor != 1.0:
            staged.grad[:n].mul_(self._factor)
        param = group.param
        param.data = staged.master[:n]
        param.grad = staged.grad[:n]
        state = self.optimizer.state[param]
        if self._has_state:
            for key, buffer in zip(self.layout.keys, staged.state, strict=True):
                state[key] = buffer[:n]
        self.step_optimizer([param], [group.bucket])
        for key, buffer in zip(self.layout.keys, staged.state, strict=True):
            if state[key].data_ptr() != buffer.data_ptr():  # created by this first step
                buffer[:n].copy_(state[key])
            state[key] = _EMPTY
        param.grad = None
        param.data = _EMPTY

    def _write_device_params(self, param_shards: ParamShards) -> None:
        write_device_params(self._device_masters, param_shards, alias=self.masters_alias_params)

    def write_params(self, param_shards: ParamShards) -> None:
        self._write_device_params(param_shards)
        self._walk(self._step_order(), param_shards, step=False)

    # -- state, a bucket at a time ------------------------------------------------------------
    def master_numels(self) -> list[int]:
        return self._numels

    def _resident_masters(self) -> list[torch.Tensor]:
        return [m for m in self._device_masters if m is not None]

    def element_state_keys(self, master: int | None = None) -> list[str]:
        # one layout for every bucket (an optimizer with states per group is refused here)
        if self._has_state:
            return sorted(self.layout.keys)
        for tensor in self._resident_masters():
            if self.optimizer.state.get(tensor):
                return sorted(self.layout.keys)
        return []

    def _slot_offset(self, key: str) -> int:
        if key == "master":
            return 0
        if key not in self.layout.keys:
            raise KeyError(f"NVMe offload: the optimizer keeps no per-element {key!r}")
        return 1 + self.layout.keys.index(key)

    def state_tensor(self, master: int, key: str) -> torch.Tensor:
        device_master = self._device_masters[master]
        if device_master is not None:
            return device_master if key == "master" else self.optimizer.state[device_master][key]
        offset = self._slot_offset(key)
        dtype = self.layout.master_dtype if key == "master" else self.layout.dtypes[offset - 1]
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
        offset = self._slot_offset(key)
        value = value.detach().reshape(-1).cpu().contiguous()
        writes = [
            self.swap.write(g.slot + offset, value[g.start : g.end])
            for g in self.sub_groups
            if g.bucket == master
        ]
        for write in writes:
            write.result()

    def reset_element_state(self, keys: list[str]) -> None:
        dtype = self.low_precision.precision.state_dtype
        zero_element_state(self.optimizer, self._resident_masters(), keys, dtype)
        for group in self.sub_groups:
            self.optimizer.state.pop(group.param, None)
            self.optimizer.state[group.param].update({key: _EMPTY for key in self.layout.keys})
        unknown = set(keys) - set(self.layout.keys)
        if unknown:
            raise KeyError(f"NVMe offload: the optimizer keeps no per-element {sorted(unknown)}")
        largest = max(g.numel for g in self.sub_groups)
        zeros = torch.zeros(
            largest * max(d.itemsize for d in self.layout.dtypes), dtype=torch.uint8
        )
        for group in self.sub_groups:  # the padding of every key starts at zero
            for key, dtype in zip(self.layout.keys, self.layout.dtypes, strict=True):
                size = group.numel * dtype.itemsize
                self.swap.write(group.slot + self._slot_offset(key), zeros[:size]).result()
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
        probe = self._probe(masters_fp32, optimizer_over)
        if needs_whole_parameters(probe):
            raise ConfigError(
                f'zero_optimization.offload_optimizer.device: "nvme" steps the optimizer '
                f"sub-group by sub-group, and {type(probe).__name__} needs whole parameters (Lamb's "
                'trust ratios, Muon\'s matrices); use device "cpu", or an element-wise optimizer '
                "(Adam, AdamW, SGD, Lion, Adagrad)"
            )
        layout = _state_layout(probe, precision)
        numels = [m.numel() for m in masters_fp32]
        on_host = self.on_host(numels, layout.bytes_per_element, precision)
        if not any(on_host):  # nothing to swap: the device store
            return Placement().build_store(masters_fp32, param_parts, precision, optimizer_over)
        groups = split_sub_groups(numels, on_host, options.sub_group_size, len(layout.keys))
        largest = max(g.numel for g in groups)
        host_numels = [n for n, host in zip(numels, on_host, strict=True) if host]
        # the staging sets' host memory was checked at initialize (estimate/preflight.py)
        directory = Path(options.nvme_path or ".")
        remove_stale_files(directory)
        needed = disk_bytes_needed(
            sum(host_numels), layout.bytes_per_element, precision.master_dtype.itemsize
        )
        check_disk(directory, needed, local_ranks())
        slot_bytes = []
        master_bytes = precision.master_dtype.itemsize
        for group in groups:
            slot_bytes += [master_bytes * group.numel]
            slot_bytes += [d.itemsize * group.numel for d in layout.dtypes]
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
            layout,
            optimizer_over(tensors),
            swap,
            masters_alias_params=alias,
            precision=precision,
            options=options,
        )


def _state_layout(probe: torch.optim.Optimizer, precision: PrecisionPolicy) -> StateLayout:
    """The per-element state keys of a stepped probe optimizer, in the policy's dtypes (the
    probe stepped fp32 stand-ins: a state it keeps in fp32 is stored in ``state_dtype``)."""
    for group in probe.param_groups:
        for param in group["params"]:
            state = probe.state.get(param)
            if state:
                items = sorted(
                    (k, v.dtype)
                    for k, v in state.items()
                    if torch.is_tensor(v) and v.shape == param.shape
                )
                dtypes = (precision.state_dtype if d == torch.float32 else d for _, d in items)
                keys = tuple(k for k, _ in items)
                return StateLayout(keys, tuple(dtypes), precision.master_dtype)
    return StateLayout((), (), precision.master_dtype)
