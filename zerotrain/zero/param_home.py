"""Where stage 3 keeps this rank's parameter shards between uses (``offload_param``): on the
training device, in host memory, or in a working file on NVMe (ZeRO-Infinity, arXiv:2104.07857).

[Note: lending a shard]
A stage-3 gather (zerotrain/zero/in_flight.py) borrows the shard it sends from the home and gives
it back once its copy to the device is issued: :meth:`ShardHome.lend` / :meth:`give_back`. On
the device the shard is simply there; in host memory it is a pinned tensor; on NVMe it is read
into one of ``buffer_count`` host buffers, which goes back to the pool at ``give_back`` (on CUDA
once the asynchronous copy out of it has completed: an event). The gatherer's prefetch order
asks for the next unit's reads ahead of time (:meth:`read_ahead`), so the disk works while the
device computes. The optimizer writes the new shards bucket by bucket through
:meth:`targets` (zerotrain/zero/store.py's ``ParamShards``): on NVMe each is written into a
pool buffer and from there to its slot of the file, behind the step. A slot's reads are ordered
after its writes by the swap file (zerotrain/zero/swap.py), so a gather after a step reads the
new values. Host memory holds the pool, never the shards: ``buffer_count`` times the largest
shard.
"""

from __future__ import annotations

import atexit
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zerotrain.config import ConfigError
from zerotrain.zero.host import (
    check_disk,
    host_tensor,
    local_ranks,
    remove_stale_files,
    working_file,
)
from zerotrain.zero.layout import FlatBucket
from zerotrain.zero.store import ParamShards
from zerotrain.zero.swap import AioOptions, SwapFile, aligned_empty


@dataclass(frozen=True, kw_only=True)
class ParamOffload:
    """``zero_optimization.offload_param`` (with ``aio``), as stage 3 reads it."""

    device: str = "none"  # "none", "cpu" or "nvme"
    pin_memory: bool = True
    nvme_path: str | None = None
    buffer_count: int = 5
    buffer_size: int = 100_000_000  # elements per NVMe buffer
    aio: AioOptions = field(default_factory=AioOptions)


class ShardHome:
    """Stage 3's parameter shards on the training device (no ``offload_param``)."""

    on_host = False
    """Whether lent shards are host memory (copied to the device before their gather)."""

    def check(self, buckets: list[FlatBucket]) -> None:
        """Prepare for keeping ``buckets``' shards here, before any is allocated (their host
        memory was checked at initialize: zerotrain/estimate/preflight.py)."""

    def keep(self, bucket: FlatBucket, values: torch.Tensor) -> None:
        """Keep ``values`` (the bucket's shard in the training dtype, on the device)."""
        bucket.param_shard = values

    def lend(self, bucket: FlatBucket) -> torch.Tensor:
        """The bucket's shard, for a gather; :meth:`give_back` when its copy is issued."""
        return bucket.require_param_shard()

    def give_back(self, bucket: FlatBucket) -> None:
        """The gather of a lent shard no longer reads it (see [Note: lending a shard])."""

    def read_ahead(self, bucket: FlatBucket) -> None:
        """The bucket will be gathered soon: start bringing its shard in."""

    def targets(self, buckets: list[FlatBucket]) -> ParamShards:
        """Where the optimizer writes each bucket's new shard."""
        return ParamShards([b.require_param_shard() for b in buckets])

    def host_tensors(self) -> list[torch.Tensor]:
        """The host memory holding shards (for memory accounting)."""
        return []

    def disk_bytes(self) -> int:
        """Bytes of working file holding shards."""
        return 0


class HostShardHome(ShardHome):
    """``offload_param: cpu``: the shards in (pinned) host memory."""

    on_host = True

    def __init__(self, pin: bool):
        self.pin = pin
        self._kept: list[torch.Tensor] = []

    def keep(self, bucket: FlatBucket, values: torch.Tensor) -> None:
        bucket.param_shard = host_tensor(values.numel(), values.dtype, pin=self.pin).copy_(values)
        self._kept.append(bucket.param_shard)

    def host_tensors(self) -> list[torch.Tensor]:
        return self._kept


@dataclass(eq=False)
class _Buffer:
    """One host buffer of the NVMe pool, and what must finish before it is reused."""

    data: torch.Tensor  # uint8, aligned for direct I/O
    write: Future[None] | None = None  # its last write to the file
    copied: torch.cuda.Event | None = None  # CUDA-only: its last copy to the device

    def wait(self) -> None:
        """Until nothing reads or writes it any more."""
        if self.write is not None:
            self.write.result()  # raises SwapIOError naming the file
            self.write = None
        if self.copied is not None:
            self.copied.synchronize()
            self.copied = None

    def holding(self, bucket: FlatBucket) -> torch.Tensor:
        return self.data[: bucket.shard_numel * bucket.dtype.itemsize].view(bucket.dtype)


class NvmeShardHome(ShardHome):
    """``offload_param: nvme``: the shards in a per-rank working file under ``nvme_path``,
    staged through ``buffer_count`` host buffers (see [Note: lending a shard])."""

    on_host = True

    def __init__(self, options: ParamOffload):
        self.options = options
        self.directory = Path(options.nvme_path or ".")
        self.swap: SwapFile | None = None
        self._slots: dict[int, int] = {}  # id(bucket) -> its slot in the file
        self._free: deque[_Buffer] = deque()
        self._lent: dict[int, _Buffer] = {}  # id(bucket) -> the buffer its gather reads
        self._ahead: dict[int, tuple[_Buffer, Future[None]]] = {}  # reads started early
        self.bytes_read = self.bytes_written = 0
        self.reads_ahead = 0  # reads started before their gather (the prefetch order's next)

    def check(self, buckets: list[FlatBucket]) -> None:
        options = self.options
        if not buckets:
            return
        largest = max(b.shard_numel for b in buckets)
        if largest > options.buffer_size:
            raise ConfigError(
                f"zero_optimization.offload_param.buffer_size: {options.buffer_size} elements, "
                f"but this rank's largest stage-3 parameter shard (one gather unit's share) has "
                f"{largest}; set buffer_size to at least {largest}"
            )
        itemsize = max(b.dtype.itemsize for b in buckets)
        count = max(1, options.buffer_count)  # their host memory: checked at initialize
        sizes = [b.shard_numel * b.dtype.itemsize for b in buckets]
        remove_stale_files(self.directory)
        check_disk(self.directory, sum(sizes), local_ranks(), key="offload_param")
        self._slots = {id(b): slot for slot, b in enumerate(buckets)}
        self.swap = swap = SwapFile(working_file(self.directory, "params"), sizes, options.aio)
        finalizer = weakref.finalize(self, swap.close)
        atexit.register(finalizer)
        for _ in range(count):
            self._free.append(
                _Buffer(aligned_empty(largest * itemsize, torch.uint8, pin=options.pin_memory))
            )

    def _file(self) -> SwapFile:
        if self.swap is None:
            raise RuntimeError("offload_param nvme: check() opens the working file, not called")
        return self.swap

    def _take(self) -> _Buffer:
        if not self._free:  # every buffer lent: more gathers in flight than buffers
            raise RuntimeError(
                f"offload_param nvme: all {self.options.buffer_count} buffers are in use "
                "(raise offload_param.buffer_count)"
            )
        buffer = self._free.popleft()
        buffer.wait()
        return buffer

    def _drop_ahead(self, bucket: FlatBucket) -> None:
        """Forget an early read of ``bucket``: its values are about to change."""
        early = self._ahead.pop(id(bucket), None)
        if early is not None:
            early[1].result()
            self._free.append(early[0])

    def keep(self, bucket: FlatBucket, values: torch.Tensor) -> None:
        self.open(bucket).copy_(values)
        self.close(bucket)  # to the file: the host keeps no copy
        bucket.param_shard = None

    def open(self, bucket: FlatBucket) -> torch.Tensor:
        """A pool buffer to fill with the bucket's new shard; :meth:`close` writes it."""
        self._drop_ahead(bucket)
        buffer = self._take()
        self._lent[id(bucket)] = buffer
        return buffer.holding(bucket)

    def close(self, bucket: FlatBucket) -> None:
        buffer = self._lent.pop(id(bucket))
        staged = buffer.holding(bucket)
        buffer.write = self._file().write(self._slots[id(bucket)], staged)
        self.bytes_written += staged.numel() * staged.element_size()
        self._free.append(buffer)

    def lend(self, bucket: FlatBucket) -> torch.Tensor:
        if id(bucket) not in self._slots:  # a persistent unit's shard: on the device
            return bucket.require_param_shard()
        early = self._ahead.pop(id(bucket), None)
        if early is None:
            buffer = self._take()
            staged = buffer.holding(bucket)
            self._read(bucket, staged).result()
        else:
            buffer, read = early
            read.result()
            staged = buffer.holding(bucket)
        self._lent[id(bucket)] = buffer
        return staged

    def _read(self, bucket: FlatBucket, staged: torch.Tensor) -> Future[None]:
        self.bytes_read += staged.numel() * staged.element_size()
        return self._file().read(self._slots[id(bucket)], staged)

    def give_back(self, bucket: FlatBucket) -> None:
        buffer = self._lent.pop(id(bucket), None)
        if buffer is None:
            return
        if torch.cuda.is_available() and buffer.data.is_pinned():  # CUDA-only
            buffer.copied = torch.cuda.Event()
            buffer.copied.record()  # after the asynchronous copy out of it
        self._free.append(buffer)

    def read_ahead(self, bucket: FlatBucket) -> None:
        key = id(bucket)
        # one buffer stays free for the gather in progress, or the step
        if key not in self._slots or key in self._ahead or key in self._lent or len(self._free) < 2:
            return
        buffer = self._take()
        self._ahead[key] = (buffer, self._read(bucket, buffer.holding(bucket)))
        self.reads_ahead += 1

    def targets(self, buckets: list[FlatBucket]) -> ParamShards:
        return _NvmeTargets(self, buckets)

    def host_tensors(self) -> list[torch.Tensor]:
        buffers = [*self._free, *self._lent.values(), *(b for b, _ in self._ahead.values())]
        return [b.data for b in buffers]

    def disk_bytes(self) -> int:
        return 0 if self.swap is None else self.swap.nbytes


class _NvmeTargets(ParamShards):
    """The optimizer's targets when the shards are on NVMe: each bucket is staged in a pool
    buffer from ``open`` to ``close`` (persistent units' shards are on the device)."""

    def __init__(self, home: NvmeShardHome, buckets: list[FlatBucket]):
        super().__init__([])
        self.home = home
        self.buckets = buckets

    def __len__(self) -> int:
        return len(self.buckets)

    def _offloaded(self, index: int) -> bool:
        return id(self.buckets[index]) in self.home._slots

    def open(self, index: int) -> torch.Tensor:
        bucket = self.buckets[index]
        return self.home.open(bucket) if self._offloaded(index) else bucket.require_param_shard()

    def close(self, index: int) -> None:
        if self._offloaded(index):
            self.home.close(self.buckets[index])

    @property
    def resident(self) -> bool:
        return False


def shard_home(options: ParamOffload | None) -> ShardHome:
    """The home ``offload_param`` asks for."""
    if options is None or options.device == "none":
        return ShardHome()
    if options.device == "nvme":
        return NvmeShardHome(options)
    return HostShardHome(options.pin_memory)
