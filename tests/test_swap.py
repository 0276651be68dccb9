"""The NVMe offload I/O layer: swap files round-trip every dtype and size, fail loudly."""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from zerotrain.zero import swap
from zerotrain.zero.swap import (
    ALIGNMENT,
    AioOptions,
    SwapFile,
    SwapIOError,
    aligned_empty,
    measure_disk_bandwidth,
)

NUMELS = [1, 1023, 4097, 300_001]  # below, around and across 4096-byte blocks
DTYPES = [torch.float32, torch.bfloat16, torch.int8]


def _direct_io_works(directory: Path) -> bool:
    """Whether the filesystem under ``directory`` takes an aligned O_DIRECT write."""
    if not hasattr(os, "O_DIRECT"):
        return False
    path = directory / "probe"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        os.pwrite(fd, memoryview(aligned_empty(ALIGNMENT, torch.uint8).numpy()), 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        path.unlink()


def _random(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=generator).to(dtype)
    return torch.randint(-128, 128, (numel,), generator=generator, dtype=dtype)


@pytest.mark.parametrize("thread_count", [1, 3])
def test_round_trip_many_slots_in_flight(tmp_path: Path, thread_count: int):
    grid = itertools.product(DTYPES, NUMELS)
    tensors = [_random(n, d, seed=i) for i, (d, n) in enumerate(grid)]
    # Every other source tensor starts off a 4096-byte boundary: the bounce path.
    tensors = [t if i % 2 else torch.cat([t[:1], t])[1:] for i, t in enumerate(tensors)]
    assert any(t.data_ptr() % ALIGNMENT for t in tensors)
    slots = [t.nbytes + 13 * i for i, t in enumerate(tensors)]  # some slots bigger than needed
    options = AioOptions(block_size=8192, thread_count=thread_count, queue_depth=2)
    with SwapFile(tmp_path / "rank0.swap", slots, options) as swap_file:
        if _direct_io_works(tmp_path):
            assert swap_file.direct
        writes = [swap_file.write(i, t) for i, t in enumerate(tensors)]
        # reads are submitted while writes are in flight: the slot's order keeps them after
        outs = [
            torch.empty_like(t) if i % 3 else aligned_empty(t.numel(), t.dtype)
            for i, t in enumerate(tensors)
        ]
        reads = [swap_file.read(i, out) for i, out in enumerate(outs)]
        for future in writes + reads:
            future.result()
    for tensor, out in zip(tensors, outs, strict=True):
        assert torch.equal(tensor, out)


def test_overwrite_then_read(tmp_path: Path):
    first, second = _random(5000, torch.float32, 0), _random(5000, torch.float32, 1)
    with SwapFile(tmp_path / "s", [first.nbytes, first.nbytes]) as swap_file:
        swap_file.write(0, first).result()
        swap_file.write(1, first).result()
        swap_file.write(0, second).result()
        out = torch.empty(5000)
        swap_file.read(0, out).result()
        assert torch.equal(out, second)
        swap_file.read(1, out).result()
        assert torch.equal(out, first)
        short = torch.empty(17)  # a read shorter than the slot fills from its start
        swap_file.read(0, short).result()
        assert torch.equal(short, second[:17])


def test_requests_to_one_slot_keep_their_order(tmp_path: Path, monkeypatch):
    real_pwrite = os.pwrite

    def slow_pwrite(fd, data, offset):  # a slow disk: the read is queued long before this ends
        time.sleep(0.05)
        return real_pwrite(fd, data, offset)

    old, new = torch.zeros(4096), torch.arange(4096.0)
    options = AioOptions(block_size=8192, thread_count=3)
    with SwapFile(tmp_path / "s", [old.nbytes, old.nbytes], options) as swap_file:
        swap_file.write(0, old).result()
        monkeypatch.setattr(swap.os, "pwrite", slow_pwrite)
        write = swap_file.write(0, new)
        out = torch.empty(4096)
        read = swap_file.read(0, out)
        other = swap_file.read(1, torch.empty(1024))  # another slot (one chunk) does not wait
        other.result()
        assert not write.done()
        read.result()
        assert write.done() and torch.equal(out, new)


def test_tmpfs_round_trips_direct_or_buffered(tmp_path: Path):
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    tensor = _random(4097, torch.bfloat16, 0)
    path = Path("/dev/shm") / f"zerotrain-test-{os.getpid()}" / "rank0.swap"
    with SwapFile(path, [tensor.nbytes]) as swap_file:
        # Linux >= 6.6 tmpfs accepts O_DIRECT; older kernels get buffered I/O.
        assert swap_file.direct == _direct_io_works(path.parent)
        swap_file.write(0, tensor).result()
        out = torch.empty_like(tensor)
        swap_file.read(0, out).result()
    path.parent.rmdir()
    assert torch.equal(out, tensor)


@pytest.mark.parametrize("fails_at", ["open", "first_write"])
def test_falls_back_to_buffered_on_einval(tmp_path: Path, monkeypatch, fails_at: str):
    if not swap._O_DIRECT:
        pytest.skip("no O_DIRECT on this platform")
    real_open, real_pwrite = os.open, os.pwrite

    def open_(path, flags, mode=0o777):
        if fails_at == "open" and flags & swap._O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode)

    def pwrite(fd, data, offset):  # a filesystem that opens with O_DIRECT, then refuses it
        if fails_at == "first_write" and fcntl.fcntl(fd, fcntl.F_GETFL) & swap._O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(swap.os, "open", open_)
    monkeypatch.setattr(swap.os, "pwrite", pwrite)
    tensor = _random(3000, torch.float32, 0)
    with SwapFile(tmp_path / "s", [tensor.nbytes], AioOptions(block_size=4096)) as swap_file:
        assert not swap_file.direct
        swap_file.write(0, tensor).result()
        out = torch.empty_like(tensor)
        swap_file.read(0, out).result()
    assert torch.equal(out, tensor)


def test_write_error_surfaces_with_path(tmp_path: Path, monkeypatch):
    with SwapFile(tmp_path / "rank3.swap", [1 << 16], AioOptions(block_size=8192)) as swap_file:

        def full(fd, data, offset):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(swap.os, "pwrite", full)
        future = swap_file.write(0, torch.zeros(1 << 14))
        with pytest.raises(SwapIOError) as raised:
            future.result()
        monkeypatch.undo()
        message = str(raised.value)
        assert str(tmp_path / "rank3.swap") in message and "slot 0" in message
        assert "No space left on device" in message and "bytes [" in message
        assert raised.value.errno == errno.ENOSPC
        # the file still works after a failed request
        tensor = torch.arange(10.0)
        swap_file.write(0, tensor).result()
        out = torch.empty(10)
        swap_file.read(0, out).result()
        assert torch.equal(out, tensor)


def test_full_disk_fails_at_construction(tmp_path: Path):
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a 1 MiB tmpfs needs root")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True
    )
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        path = mount / "rank0.swap"
        with pytest.raises(SwapIOError) as raised:
            SwapFile(path, [4 << 20])
        message = str(raised.value)
        assert str(path) in message and f"needs {4 << 20} bytes" in message
        assert "bytes free" in message and raised.value.errno == errno.ENOSPC
        assert not path.exists()  # nothing half-made left behind
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_filesystem_without_fallocate(tmp_path: Path, monkeypatch):
    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(swap.os, "posix_fallocate", unsupported)
    tensor = _random(1023, torch.int8, 0)
    with SwapFile(tmp_path / "s", [tensor.nbytes]) as swap_file:
        assert swap_file.path.stat().st_size == ALIGNMENT  # extended instead
        swap_file.write(0, tensor).result()
        out = torch.empty_like(tensor)
        swap_file.read(0, out).result()
    assert torch.equal(out, tensor)
    with pytest.raises(SwapIOError, match=r"needs \d+ bytes, \d+ bytes free"):
        SwapFile(tmp_path / "huge", [1 << 62])  # more than any disk: the free-space check
    assert not (tmp_path / "huge").exists()


def test_close_removes_file_and_is_idempotent(tmp_path: Path):
    path = tmp_path / "deep" / "dir" / "rank0.swap"  # parents are created
    swap_file = SwapFile(path, [100, 5000])
    assert path.stat().st_size == 4096 + 8192  # slots padded to 4096 bytes
    pending = swap_file.write(1, torch.ones(1250))
    swap_file.close()
    assert pending.done() and not path.exists()
    swap_file.close()
    with pytest.raises(ValueError, match="is closed"):
        swap_file.write(0, torch.ones(1))
    kept = SwapFile(path, [100])
    kept.close(remove=False)
    assert path.exists()


def test_rejects_bad_requests(tmp_path: Path):
    with SwapFile(tmp_path / "s", [400]) as swap_file:
        with pytest.raises(
            ValueError, match="tensor of 404 bytes does not fit slot 0 of 400 bytes"
        ):
            swap_file.write(0, torch.zeros(101))
        with pytest.raises(ValueError, match="slot 1 out of range"):
            swap_file.read(1, torch.zeros(1))
        with pytest.raises(ValueError, match="contiguous CPU tensor"):
            swap_file.write(0, torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="aio.block_size: must be a positive multiple of 4096"):
        AioOptions(block_size=1000)


@pytest.mark.parametrize("dtype", DTYPES)
def test_aligned_empty(dtype: torch.dtype):
    for numel in (0, 1, 4097):
        tensor = aligned_empty(numel, dtype, pin=True)  # pin is ignored without CUDA
        assert tensor.shape == (numel,) and tensor.dtype == dtype
        assert tensor.data_ptr() % ALIGNMENT == 0 or numel == 0


def test_measure_disk_bandwidth(tmp_path: Path):
    write_gbps, read_gbps = measure_disk_bandwidth(tmp_path, nbytes=4 << 20)
    assert write_gbps > 0 and read_gbps > 0
    assert not list(tmp_path.iterdir())
