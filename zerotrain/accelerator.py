"""``get_accelerator()``: the device this process trains on, behind DeepSpeed's accelerator API.

DeepSpeed scripts ask ``deepspeed.accelerator.get_accelerator()`` for device names, the
communication backend, seeds, memory counters and pinned memory, so that one script runs on
any device. zerotrain knows two: CUDA when it is available (one GPU per local rank), else the
CPU. The method names, arguments and return values are DeepSpeed's; on the CPU the
device-only operations (synchronize, streams, events, the cache) do nothing, and the memory
counters report the process's resident set, as DeepSpeed's CPU accelerator does.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
from dataclasses import dataclass

import torch

__all__ = [
    "Accelerator",
    "HostMemoryLimit",
    "available_host_memory",
    "current_rss",
    "file_backed_rss",
    "get_accelerator",
    "host_memory_limits",
    "peak_rss",
    "map_large_host_blocks",
    "release_free_host_memory",
    "set_accelerator",
    "settle_host_math",
    "usable_cpus",
]


def current_rss() -> int | None:
    """This process's resident set size in bytes (None where the platform does not say)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def file_backed_rss() -> int:
    """The resident bytes of this process that files back (its libraries' pages, and shared
    memory), which the kernel can drop and read again under pressure; 0 where the platform does
    not say (Linux's ``RssFile`` and ``RssShmem``)."""
    total = 0
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(("RssFile:", "RssShmem:")):
                    total += int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return 0
    return total


def peak_rss() -> int | None:
    """The largest resident set size this process has had, in bytes (None: unknown).

    On Linux: ``VmHWM``, the high-water mark of this process's own address space. Not
    ``ru_maxrss``: Linux carries it across ``execve``, so a process started by a larger one
    (torchrun's agent, ``subprocess``, multiprocessing's spawn: fork or vfork, then exec) would
    report its parent's peak whenever that is the higher."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def usable_cpus() -> int:
    """The CPU cores this process may run on: its affinity mask (taskset, cpusets, SLURM's
    --cpus-per-task), lowered to its cgroup's CPU quota where one is set, at any level up to
    the root (a container limited to 2 CPUs on a 64-core host sees 64 cores otherwise)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    quota = _cgroup_cpu_quota()
    return max(1, min(cores or 1, quota) if quota is not None else cores or 1)


def _cgroup_levels(
    v1_controller: str, *, proc: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup"
) -> list[tuple[str, bool]]:
    """The directories of this process's cgroup and of each ancestor up to the root, as
    ``(directory, is_v2)``: in the cgroup v2 hierarchy, and in the v1 hierarchy that holds
    ``v1_controller``. A limit set at any of them applies to the process (a container's or a
    SLURM job's limit usually sits above the process's own cgroup, which has none)."""
    try:
        with open(proc, encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    levels = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2
            base, v2 = root, True
        elif v1_controller in controllers.split(","):
            base, v2 = f"{root}/{controllers}", False
        else:
            continue
        level = path
        while True:
            levels.append((f"{base}{level.rstrip('/')}", v2))
            if level in ("/", ""):
                break
            level = level.rsplit("/", 1)[0] or "/"
    return levels


def _cgroup_cpu_quota() -> int | None:
    """The smallest CPU quota (in whole CPUs, rounded up) of this process's cgroup and its
    ancestors; None where none is set or the platform does not say."""
    quotas = [_cpu_quota_at(d, "cpu.max" if v2 else "") for d, v2 in _cgroup_levels("cpu")]
    found = [q for q in quotas if q is not None]
    return min(found) if found else None


def _cpu_quota_at(directory: str, v2_name: str) -> int | None:
    try:
        if v2_name:
            with open(f"{directory}/{v2_name}", encoding="ascii") as f:
                quota, period = f.read().split()
        else:
            with open(f"{directory}/cpu.cfs_quota_us", encoding="ascii") as f:
                quota = f.read().strip()
            with open(f"{directory}/cpu.cfs_period_us", encoding="ascii") as f:
                period = f.read().strip()
        if quota in ("max", "-1"):
            return None
        return -(-int(quota) // int(period))
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class HostMemoryLimit:
    """One bound on the host memory this process can still allocate."""

    nbytes: int
    what: str
    """Where it comes from, for messages: ``MemAvailable``, ``cgroup <dir>``, ``RLIMIT_AS``."""
    scope: str
    """What shares it: ``node`` (every process of the host), ``cgroup`` (the processes of that
    cgroup) or ``process`` (this process alone)."""


def host_memory_limits(
    *, proc: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup"
) -> list[HostMemoryLimit]:
    """Every bound on the host memory this process can still allocate without swapping or
    being killed: the kernel's ``MemAvailable`` (the node's), the headroom of each memory
    cgroup from the process's own up to the root (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``; limit minus usage, the usage without reclaimable page cache),
    and ``RLIMIT_AS`` (``ulimit -v``) less the process's current virtual size. Empty where
    the platform says nothing."""
    limits = []
    available = _proc_field("/proc/meminfo", "MemAvailable:")
    if available is not None:
        limits.append(HostMemoryLimit(available, "MemAvailable", "node"))
    for directory, v2 in _cgroup_levels("memory", proc=proc, root=root):
        headroom = _memory_headroom_at(directory, v2)
        if headroom is not None:
            limits.append(HostMemoryLimit(headroom, f"cgroup {directory}", "cgroup"))
    address_space = _address_space_headroom()
    if address_space is not None:
        limits.append(HostMemoryLimit(address_space, "RLIMIT_AS", "process"))
    return limits


def available_host_memory() -> int | None:
    """Bytes of host memory this process can still allocate: the smallest of
    :func:`host_memory_limits` (None where the platform does not say)."""
    limits = host_memory_limits()
    return min(limit.nbytes for limit in limits) if limits else None


def _proc_field(path: str, key: str) -> int | None:
    """A ``key: N kB`` line of a /proc file, in bytes."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _memory_headroom_at(directory: str, v2: bool) -> int | None:
    """A memory cgroup's limit minus its usage (None: no limit there, or unreadable). Usage
    leaves out the inactive page cache, which the kernel reclaims before it kills (what
    ``docker stats`` and the kubelet call the working set)."""
    names = (
        ("memory.max", "memory.current")
        if v2
        else ("memory.limit_in_bytes", "memory.usage_in_bytes")
    )
    try:
        with open(f"{directory}/{names[0]}", encoding="ascii") as f:
            limit = f.read().strip()
        with open(f"{directory}/{names[1]}", encoding="ascii") as f:
            usage = int(f.read().strip())
    except (OSError, ValueError):
        return None
    if limit == "max" or int(limit) >= 1 << 60:  # v1 writes a huge number for "none"
        return None
    stat = _cgroup_stat(f"{directory}/memory.stat")
    cache = stat.get("inactive_file" if v2 else "total_inactive_file", 0)
    return max(0, int(limit) - max(0, usage - cache))


def _cgroup_stat(path: str) -> dict[str, int]:
    try:
        with open(path, encoding="ascii") as f:
            pairs = [line.split() for line in f]
        return {pair[0]: int(pair[1]) for pair in pairs if len(pair) == 2}
    except (OSError, ValueError):
        return {}


def _address_space_headroom() -> int | None:
    """``RLIMIT_AS`` (soft) less this process's virtual size (None: unlimited, or unknown)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    size = _proc_field("/proc/self/status", "VmSize:")
    return None if size is None else max(0, soft - size)


def release_free_host_memory() -> None:
    """Give the host memory that freed allocations still hold back to the kernel (glibc's
    ``malloc_trim``; a no-op where the C library has none).

    glibc serves blocks below its mmap threshold from heaps, and raises that threshold (up to
    32 MiB) the first time a larger block is freed; a heap returns memory only from its top,
    so a small block that outlives large ones there keeps every page below it resident.
    ``malloc_trim`` also returns the free pages inside the heaps. See [Note: NVMe offload
    and freed host memory] in zerotrain/zero/nvme.py."""
    trim = _glibc("malloc_trim")
    if trim is not None:
        trim(0)


@functools.cache
def _glibc(name: str):
    """The C library's function ``name``, None where it has none (musl, macOS)."""
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def map_large_host_blocks(threshold: int = 4 << 20) -> bool:
    """Have glibc serve every block of ``threshold`` bytes or more from its own mapping,
    unmapped when freed, instead of from a heap (``mallopt(M_MMAP_THRESHOLD)``, which also
    stops glibc raising the threshold by itself). False where the C library has no mallopt,
    or where the user chose a threshold with ``MALLOC_MMAP_THRESHOLD_``, which is kept.

    A heap reuses a freed block only for a request that fits in it, so blocks of changing
    sizes freed between live ones grow it step after step while the bytes in use stay the
    same. See [Note: NVMe offload and freed host memory] in zerotrain/zero/nvme.py."""
    mallopt = _glibc("mallopt")
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))


# The float unary ops ATen hands to MKL's vector math library (aten/src/ATen/cpu/vml.h).
_VML_OPS = (
    "abs", "acos", "asin", "atan", "cos", "erf", "erfc", "exp", "expm1", "log", "log10",
    "log1p", "log2", "sin", "sqrt", "tan", "tanh", "trunc",
)  # fmt: skip


@functools.cache
def settle_host_math() -> None:
    """Call each of MKL's vector math functions once, from this thread alone, before training.

    MKL picks its kernels on the first call of the process. When several intra-op threads
    make that first call together (a CPU op over more than 2048 elements with two or more
    threads), one of them can run a low-accuracy kernel over its whole chunk, for that call
    only (pytorch/pytorch#188792; oneMKL 2024.2, fixed in 2025.0). A training step's first
    ``tanh`` (GPT-2's GELU) or ``sqrt`` (Adam) then differs from every later one, and the
    run from a single-process reference. One single-element call per function and dtype
    settles the choice first: about 3 ms, once a process."""
    if not torch.backends.mkl.is_available():
        return
    for dtype in (torch.float32, torch.float64):
        one = torch.full((1,), 0.5, dtype=dtype)
        for name in _VML_OPS:
            getattr(torch, name)(one)


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


class Accelerator:
    """One device type, ``"cuda"`` or ``"cpu"``, with DeepSpeed's ``DeepSpeedAccelerator``
    methods. Build it through :func:`get_accelerator`."""

    def __init__(self, name: str):
        if name not in ("cuda", "cpu"):
            raise ValueError(f"Accelerator: zerotrain runs on 'cuda' or 'cpu', got {name!r}")
        self._name = name
        self._cuda = name == "cuda"
        self._peak_rss = 0  # CPU: our own peak, so that it can be reset

    def __repr__(self) -> str:
        return f"Accelerator({self._name!r})"

    # -- devices -------------------------------------------------------------------------------
    def device_name(self, device_index: int | None = None) -> str:
        """``"cuda"`` or ``"cuda:<index>"``; ``"cpu"`` whatever the index."""
        if self._cuda and device_index is not None:
            return f"cuda:{device_index}"
        return self._name

    def current_device(self) -> int:
        """The index of this process's device (on the CPU: the local rank, as in DeepSpeed)."""
        return torch.cuda.current_device() if self._cuda else _local_rank()

    def current_device_name(self) -> str:
        """``"cuda:<current device>"``, or ``"cpu"``."""
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device(self, device_index: int | None = None):
        """CUDA: ``torch.cuda.device(index)``, a context that selects it; CPU: None."""
        return torch.cuda.device(device_index) if self._cuda else None

    def set_device(self, device_index: int) -> None:
        """Make ``device_index`` this process's device (nothing to do on the CPU)."""
        if self._cuda:
            torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        """GPUs on this node; on the CPU, the processes per node the launcher started (one
        "device" per process), else 1."""
        if self._cuda:
            return torch.cuda.device_count()
        return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self._cuda else True

    def synchronize(self, device_index: int | None = None) -> None:
        """Wait for the device's queued work (CPU work is synchronous: nothing to wait for)."""
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def communication_backend_name(self) -> str:
        """The ``torch.distributed`` backend zerotrain uses on this device."""
        return "nccl" if self._cuda else "gloo"

    def is_synchronized_device(self) -> bool:
        """True on the CPU: operations complete before they return."""
        return not self._cuda

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on this device type."""
        return tensor.device.type == self._name

    # -- random numbers ------------------------------------------------------------------------
    def random(self):
        return torch.random

    def manual_seed(self, seed: int):
        return torch.cuda.manual_seed(seed) if self._cuda else torch.manual_seed(seed)

    def manual_seed_all(self, seed: int):
        return torch.cuda.manual_seed_all(seed) if self._cuda else torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if self._cuda:
            return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)
        else:
            torch.set_rng_state(new_state)

    def default_generator(self, device_index: int):
        return (
            torch.cuda.default_generators[device_index] if self._cuda else torch.default_generator
        )

    # -- streams and events (CUDA only; None or no-ops on the CPU, as in DeepSpeed) ------------
    @property
    def Stream(self):  # noqa: N802 (DeepSpeed's name)
        return torch.cuda.Stream if self._cuda else None

    @property
    def Event(self):  # noqa: N802 (DeepSpeed's name)
        return torch.cuda.Event if self._cuda else None

    def stream(self, stream):
        return torch.cuda.stream(stream) if self._cuda else contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None):
        return torch.cuda.current_stream(device_index) if self._cuda else None

    def default_stream(self, device_index: int | None = None):
        return torch.cuda.default_stream(device_index) if self._cuda else None

    def range_push(self, msg: str, domain=None, category=None) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain=None) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback) -> None:
        if self._cuda:
            torch.cuda._lazy_call(callback)
        else:
            callback()

    # -- memory --------------------------------------------------------------------------------
    def _rss(self) -> int:
        rss = current_rss() or 0
        self._peak_rss = max(self._peak_rss, rss)
        return rss

    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        """CUDA: bytes held by tensors; CPU: the process's resident set."""
        return torch.cuda.memory_allocated(device_index) if self._cuda else self._rss()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """The peak of :meth:`memory_allocated` since the last reset (CPU: as far as this
        accelerator has seen it, at least the current resident set)."""
        if self._cuda:
            return torch.cuda.max_memory_allocated(device_index)
        self._rss()
        return self._peak_rss

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)
        else:
            self._peak_rss = 0
            self._rss()

    reset_max_memory_allocated = reset_peak_memory_stats
    reset_max_memory_cached = reset_peak_memory_stats

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._cuda else self._rss()

    memory_cached = memory_reserved

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.max_memory_reserved(device_index)
        return self.max_memory_allocated()

    max_memory_cached = max_memory_reserved

    def memory_stats(self, device_index: int | None = None) -> dict:
        if self._cuda:
            return torch.cuda.memory_stats(device_index)
        return {
            "allocated_bytes.all.current": self._rss(),
            "allocated_bytes.all.peak": self._peak_rss,
        }

    def total_memory(self, device_index: int | None = None) -> int:
        """Bytes of device memory (CPU: of physical memory)."""
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: int | None = None) -> int:
        """Bytes free for new allocations (CPU: the kernel's MemAvailable)."""
        if self._cuda:
            free, _ = torch.cuda.mem_get_info(device_index)
            return free
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        return self.total_memory()

    # -- data types ----------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return True

    def is_fp64_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32, torch.float16]
        return dtypes + [torch.bfloat16] if self.is_bf16_supported() else dtypes

    # -- pinned host memory --------------------------------------------------------------------
    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """``tensor`` in page-locked host memory (CUDA: fast copies to the GPU); on a CPU-only
        machine there is no device to copy to, and ``tensor`` is returned as it is."""
        return tensor.pin_memory() if self._cuda else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self._cuda else False

    # -- compile -------------------------------------------------------------------------------
    def get_compile_backend(self) -> str:
        return "inductor"


_accelerator: Accelerator | None = None


def get_accelerator() -> Accelerator:
    """This process's accelerator: CUDA when available, else the CPU (the same choice
    ``zerotrain.initialize`` makes for the training device)."""
    global _accelerator
    if _accelerator is None:
        _accelerator = Accelerator("cuda" if torch.cuda.is_available() else "cpu")
    return _accelerator


def set_accelerator(accelerator: Accelerator) -> None:
    """Use ``accelerator`` from now on (DeepSpeed's name; e.g. the CPU on a GPU machine)."""
    global _accelerator
    _accelerator = accelerator


def process_start_time(pid: int) -> str | None:
    """When process ``pid`` started, in clock ticks since boot (None: no such process, or no
    /proc): with the pid it names one process, even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]  # field 22; the name before may hold spaces
