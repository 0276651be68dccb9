"""The I/O layer of NVMe offload (ZeRO-Infinity, arXiv:2104.07857): per-rank swap files.

A :class:`SwapFile` is one rank's working file, cut into a fixed list of slots in which the
offloaded fp32 master weights and optimizer states live between steps. Reads and writes run on
a thread pool (the syscalls release the GIL, so I/O overlaps compute) and return futures.

[Note: direct I/O alignment]
O_DIRECT bypasses the page cache, so host memory is not spent twice on the same bytes, but the
kernel wants the buffer address, the file offset and the length aligned (4096 bytes is safe on
every device). Slots start at 4096-byte offsets and are padded to a multiple of 4096, and a
request is cut into ``block_size`` chunks (a multiple of 4096), so file offsets are always
aligned. What may not be aligned is the caller's tensor: chunks whose address is off, and the
last partial block of any tensor, go through a per-thread aligned bounce buffer, written
padded up to 4096 bytes; the padding lands inside the slot's own padding, so there is no
read-modify-write and one (direct) file descriptor serves everything. Filesystems that refuse
O_DIRECT (EINVAL at open or at a first aligned write) get buffered I/O: ``SwapFile.direct``.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass
from pathlib import Path

import torch

from zerotrain.errors import ZeroTrainError

ALIGNMENT = 4096  # bytes; O_DIRECT's buffer, offset and length granularity

_O_DIRECT = getattr(os, "O_DIRECT", 0)  # absent on macOS: buffered I/O there
_pin_warned = False


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class AioOptions:
    """DeepSpeed's `aio` config section, as this module reads it."""

    block_size: int = 1_048_576  # bytes per read/write call
    queue_depth: int = 8  # I/O calls in flight per file at once (across threads)
    thread_count: int = 1  # worker threads of the pool
    single_submit: bool = False  # accepted; submit blocks one by one (no effect beyond that)
    overlap_events: bool = True  # accepted; no effect

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size % ALIGNMENT:
            raise ValueError(
                f"aio.block_size: must be a positive multiple of {ALIGNMENT}, got {self.block_size}"
            )
        for key in ("queue_depth", "thread_count"):
            if getattr(self, key) < 1:
                raise ValueError(f"aio.{key}: must be >= 1, got {getattr(self, key)}")


class SwapIOError(ZeroTrainError, OSError):
    """A swap file read or write failed; the message names the file, slot, bytes and cause."""


def aligned_empty(numel: int, dtype: torch.dtype, *, pin: bool = False) -> torch.Tensor:
    """A 1-D CPU tensor whose data starts at a 4096-byte boundary (what O_DIRECT wants).

    ``pin=True`` page-locks it when CUDA is available (so device copies can be asynchronous),
    else it is ignored; when pinning fails, warn once and return pageable memory."""
    global _pin_warned
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    raw: torch.Tensor | None = None
    if pin and torch.cuda.is_available():
        try:
            raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as error:
            if not _pin_warned:
                _pin_warned = True
                warnings.warn(
                    f"could not pin {nbytes} bytes of host memory ({error}); using pageable "
                    "memory, so device copies of offloaded tensors are synchronous",
                    stacklevel=2,
                )
    if raw is None:
        raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8)
    start = (-raw.data_ptr()) % ALIGNMENT
    return raw[start : start + nbytes].view(dtype)


def _byte_view(tensor: torch.Tensor, what: str) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, writable, whatever its dtype (bf16 has no
    numpy dtype, hence the uint8 view first)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(
            f"{what}: needs a contiguous CPU tensor, got device {tensor.device}, "
            f"contiguous={tensor.is_contiguous()}"
        )
    return _raw_bytes(tensor)


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    return tensor.detach().reshape(-1).view(torch.uint8).numpy().data


class SwapFile:
    """One rank's working file: a fixed list of slots (byte sizes), each at an aligned offset.

    Requests to the same slot run in the order they were submitted, so a read submitted after
    a write sees it; requests to different slots overlap. The caller must not touch a tensor
    until the future of its request is done.
    """

    def __init__(self, path: Path, slot_bytes: list[int], options: AioOptions = AioOptions()):
        if any(n < 0 for n in slot_bytes):
            raise ValueError(f"swap file {path}: slot sizes must be >= 0, got {slot_bytes}")
        self.path = Path(path)
        self.slot_bytes = list(slot_bytes)
        self.options = options
        self._slot_offsets: list[int] = []
        nbytes = 0
        for size in self.slot_bytes:
            self._slot_offsets.append(nbytes)
            nbytes += _round_up(size, ALIGNMENT)
        self.nbytes = nbytes  # the file's size: slots padded to ALIGNMENT
        self._closed = True  # until the file exists, close() has nothing to do
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.direct = bool(_O_DIRECT)
        try:
            self._fd = self._open(create=True)
        except OSError as error:
            if not self.direct or error.errno != errno.EINVAL:
                raise
            self.direct = False
            self._fd = self._open(create=True)
        self._closed = False
        try:
            self._preallocate()
            if self.direct and not self._probe_direct():
                os.close(self._fd)
                self.direct = False
                self._fd = self._open(create=False)
        except BaseException:
            self.close()
            raise
        self._pool = ThreadPoolExecutor(options.thread_count, thread_name_prefix="zerotrain-swap")
        self._in_flight = threading.BoundedSemaphore(options.queue_depth)
        self._lock = threading.Lock()
        self._last: dict[int, Future[None]] = {}  # per slot, the latest request
        self._pending: set[Future[None]] = set()
        self._bounce = threading.local()  # per worker thread, one aligned block

    def _open(self, create: bool) -> int:
        flags = os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0)
        return os.open(self.path, flags | (_O_DIRECT if self.direct else 0), 0o600)

    def _preallocate(self) -> None:
        """Reserve the whole file now, so that a full disk fails here and not mid-training."""
        if self.nbytes == 0:
            return
        try:
            os.posix_fallocate(self._fd, 0, self.nbytes)
            return
        except OSError as error:
            # No fallocate on this filesystem (glibc's emulation writes single bytes, which an
            # O_DIRECT file refuses with EINVAL): check the free space and extend instead.
            if error.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise self._cannot_preallocate(error.errno or errno.EIO) from error
        if shutil.disk_usage(self.path.parent).free < self.nbytes:
            raise self._cannot_preallocate(errno.ENOSPC)
        os.ftruncate(self._fd, self.nbytes)

    def _cannot_preallocate(self, errno_: int) -> SwapIOError:
        free = shutil.disk_usage(self.path.parent).free
        return SwapIOError(
            errno_,
            f"cannot preallocate swap file {self.path}: needs {self.nbytes} bytes, {free} bytes "
            f"free on its filesystem ({os.strerror(errno_)})",
        )

    def _probe_direct(self) -> bool:
        """Some filesystems accept O_DIRECT at open and refuse the I/O: try one aligned block
        (the file is fresh, so its bytes do not matter yet)."""
        if self.nbytes == 0:
            return True
        try:
            os.pwrite(self._fd, _raw_bytes(aligned_empty(ALIGNMENT, torch.uint8)), 0)
        except OSError as error:
            if error.errno == errno.EINVAL:
                return False
            raise
        return True

    # -- requests --------------------------------------------------------------------------------
    def write(self, slot: int, tensor: torch.Tensor) -> Future[None]:
        """Write ``tensor`` (contiguous CPU, at most the slot's size) at the start of ``slot``."""
        return self._submit(slot, tensor, True)

    def read(self, slot: int, out: torch.Tensor) -> Future[None]:
        """Fill ``out`` (contiguous CPU, at most the slot's size) from the start of ``slot``."""
        return self._submit(slot, out, False)

    def _submit(self, slot: int, tensor: torch.Tensor, is_write: bool) -> Future[None]:
        what = f"SwapFile.{'write to' if is_write else 'read from'} {self.path}"
        buffer = _byte_view(tensor, what)
        aligned = tensor.data_ptr() % ALIGNMENT == 0
        if not 0 <= slot < len(self.slot_bytes):
            raise ValueError(
                f"swap file {self.path}: slot {slot} out of range, it has {len(self.slot_bytes)}"
            )
        if buffer.nbytes > self.slot_bytes[slot]:
            raise ValueError(
                f"swap file {self.path}: tensor of {buffer.nbytes} bytes does not fit slot {slot} "
                f"of {self.slot_bytes[slot]} bytes"
            )
        request: Future[None] = Future()
        with self._lock:
            if self._closed:
                raise ValueError(f"swap file {self.path} is closed")
            previous = self._last.get(slot)
            self._last[slot] = request
            self._pending.add(request)
        request.add_done_callback(self._forget)

        def start(_: object = None) -> None:
            try:
                self._start(request, slot, buffer, aligned, is_write)
            except BaseException as error:  # never lost: the caller sees it from result()
                if not request.done():
                    request.set_exception(error)

        if previous is None:
            start()
        else:  # same slot: after the previous request, on whichever thread finishes it
            previous.add_done_callback(start)
        return request

    def _forget(self, request: Future[None]) -> None:
        with self._lock:
            self._pending.discard(request)

    def _start(
        self, request: Future[None], slot: int, buffer: memoryview, aligned: bool, is_write: bool
    ) -> None:
        """Split the request into ``block_size`` chunks, shared among up to ``thread_count``
        parts, and complete ``request`` when every part is done (with the first error)."""
        block = self.options.block_size
        chunks = [(lo, min(lo + block, buffer.nbytes)) for lo in range(0, buffer.nbytes, block)]
        if not chunks:
            request.set_result(None)
            return
        parts = min(self.options.thread_count, len(chunks))
        per_part = -(-len(chunks) // parts)
        groups = [chunks[i : i + per_part] for i in range(0, len(chunks), per_part)]
        left = [len(groups)]
        errors: list[BaseException] = []
        lock = threading.Lock()

        def part_done(part: Future[None]) -> None:
            with lock:
                left[0] -= 1
                error = part.exception()
                if error is not None:
                    errors.append(error)
                last = left[0] == 0
            if last:
                if errors:
                    request.set_exception(errors[0])
                else:
                    request.set_result(None)

        for group in groups:
            part = self._pool.submit(self._run_chunks, slot, buffer, aligned, group, is_write)
            part.add_done_callback(part_done)

    def _run_chunks(
        self,
        slot: int,
        buffer: memoryview,
        aligned: bool,
        chunks: list[tuple[int, int]],
        is_write: bool,
    ) -> None:
        base = self._slot_offsets[slot]
        for lo, hi in chunks:
            # [Note: direct I/O alignment]: aligned bytes go straight, the rest bounces
            straight = hi
            if self.direct:
                straight = lo + ((hi - lo) // ALIGNMENT * ALIGNMENT if aligned else 0)
            try:
                if straight > lo:
                    self._transfer(buffer[lo:straight], base + lo, is_write)
                if straight < hi:
                    self._bounce_transfer(buffer[straight:hi], base + straight, is_write)
            except OSError as error:
                raise SwapIOError(
                    error.errno,
                    f"swap file {self.path}: {'write' if is_write else 'read'} of slot {slot} "
                    f"bytes [{lo}, {hi}) (file offset {base + lo}) failed: "
                    f"{os.strerror(error.errno) if error.errno else error}",
                ) from error

    def _bounce_transfer(self, view: memoryview, offset: int, is_write: bool) -> None:
        bounce = getattr(self._bounce, "buffer", None)
        if bounce is None:
            bounce = _raw_bytes(aligned_empty(self.options.block_size, torch.uint8))
            self._bounce.buffer = bounce
        padded = bounce[: _round_up(view.nbytes, ALIGNMENT)]  # into the slot's padding
        if is_write:
            bounce[: view.nbytes] = view
            self._transfer(padded, offset, True)
        else:
            self._transfer(padded, offset, False)
            view[:] = bounce[: view.nbytes]

    def _transfer(self, view: memoryview, offset: int, is_write: bool) -> None:
        """All of ``view`` at ``offset``: syscalls may move fewer bytes than asked."""
        done = 0
        while done < view.nbytes:
            with self._in_flight:  # aio.queue_depth calls at once on this file
                if is_write:
                    moved = os.pwrite(self._fd, view[done:], offset + done)
                else:
                    moved = os.preadv(self._fd, [view[done:]], offset + done)
            if moved == 0:
                raise OSError(errno.EIO, "unexpected end of file")
            done += moved

    # -- lifetime --------------------------------------------------------------------------------
    def _sync(self, drop_cache: bool) -> None:
        """Flush written bytes to the device; optionally evict the file from the page cache."""
        os.fsync(self._fd)
        if drop_cache and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self, remove: bool = True) -> None:
        """Wait for I/O in flight, close the file and (``remove``) delete it. Idempotent."""
        if self._closed:
            return
        if hasattr(self, "_pool"):
            with self._lock:
                self._closed = True  # under the lock: no request slips in after the wait
                pending = list(self._pending)
            wait_all(pending)
            self._pool.shutdown(wait=True)
        self._closed = True
        os.close(self._fd)
        if remove:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> SwapFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def measure_disk_bandwidth(
    directory: Path, nbytes: int = 256 << 20, options: AioOptions = AioOptions()
) -> tuple[float, float]:
    """Sequential (write GB/s, read GB/s) through a :class:`SwapFile` in ``directory``: what
    offload can hope for there. Writes are timed up to fsync. With O_DIRECT reads come from
    the device; without it the file is dropped from the page cache first (POSIX_FADV_DONTNEED),
    which the kernel may not fully honour, so buffered reads may be cache hits."""
    path = Path(directory) / f"zerotrain-bandwidth-{os.getpid()}.swap"
    data = aligned_empty(nbytes, torch.uint8)
    pattern = torch.randint(0, 256, (min(nbytes, 1 << 20),), dtype=torch.uint8)
    for lo in range(0, nbytes, pattern.numel()):  # incompressible, without 256 MiB of RNG
        data[lo : lo + pattern.numel()] = pattern[: nbytes - lo]
    with SwapFile(path, [nbytes], options) as swap:
        start = time.perf_counter()
        swap.write(0, data).result()
        swap._sync(drop_cache=not swap.direct)
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        swap.read(0, data).result()
        read_s = time.perf_counter() - start
    return nbytes / write_s / 1e9, nbytes / read_s / 1e9
