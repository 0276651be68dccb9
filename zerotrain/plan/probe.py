"""What this machine can do, measured once and cached: the constants of the planner's cost
model (zerotrain plan, docs/plan.md).

[Note: the machine probe]
The planner prices a candidate config from measured rates, not datasheets, so that a CPU with
AVX2 only, a throttled GPU or gloo's local copies are priced as they run:
- memory: the device's (CUDA: its total; a CPU-only machine trains in host memory) and the host
  memory this process may use (cgroup and RLIMIT_AS included, zerotrain.accelerator);
- compute: matmul FLOP/s in the training dtype (square products of the sizes below, the best of
  a few runs, with the threads one rank gets) and causal attention (torch's
  scaled_dot_product_attention) FLOP/s;
- the CPU optimizer step: torch's fused AdamW, elements per second, with one thread and with a
  rank's threads (what CPU and NVMe offload step with), over a working set the caches hold,
  and with a rank's threads over one far larger (``adam_streaming_elements_per_s``: a large
  model's step streams its state through memory; on the GPU machine of bench/README.md it ran
  at 0.57x the cached rate);
- host-device copies (CUDA only: pinned host to device and back);
- on a GPU, the device's own rates: fused AdamW over device tensors (elements per second) and
  a copy inside device memory (bytes read and written per second), what the step of what is
  not offloaded and the engine's own passes over the buckets run at (a CPU-only machine's
  device is the CPU: its optimizer rate is the one above, and the engine's cost a constant of
  the cost model, ``Corrections.engine_seconds_per_parameter``);
- disk: sequential write and read bytes per second of a working file under ``nvme_path``
  through zerotrain's own swap file (O_DIRECT where the filesystem takes it), as NVMe offload
  does I/O;
- links: for each collective kind (all_reduce, reduce_scatter, all_gather, all_to_all), the
  alpha-beta fit ([Note: the alpha-beta model] in zerotrain/comm/link.py) over a real process
  group of the launch's ranks on this node, through zerotrain's Communicator, so gloo's own and
  zerotrain's pairwise algorithms are priced as they run; and an all-reduce that follows each
  rank's compute, as tensor parallelism's do (``interleaved``): there the ranks' compute ends
  apart and the caches hold the compute's data, and a 4 MB all-reduce after a 40 ms segment of
  matmuls cost 7.7 ms over the segment on this CPU, 4.2 ms back to back (bench/README.md).
A probe took about 7 s on this project's 2-core CPU, 5 s on an H200. It is cached under
``$ZEROTRAIN_CACHE_DIR`` (default ``~/.cache/zerotrain``) per machine and per what it depends
on (host, device, torch version, dtype, threads per rank, ranks, nvme_path); ``refresh``
measures again. The memory figures are read again at each plan (:func:`with_current_memory`):
what is free changes, the rates do not.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from zerotrain.accelerator import available_host_memory, usable_cpus
from zerotrain.plan.jobs import job_arguments, run_local_job
from zerotrain.precision import DTYPES

__all__ = [
    "COLLECTIVES",
    "LinkFit",
    "Machine",
    "best_seconds",
    "cache_dir",
    "cached_machine",
    "memory_only_machine",
    "optimizer_step_seconds",
    "probe_machine",
    "timed_runs",
    "with_current_memory",
]

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")
MATMUL_SIZES = (512, 1024, 2048)
# batch, heads, sequence, head size; the best rate of those the device runs: a GPU needs larger
# shapes to be busy (one of 1 x 8 x 512 x 64 ran at 7.8 TFLOP/s on an H200)
ATTENTION_SHAPES = {
    "cpu": ((1, 8, 512, 64),),
    "cuda": ((1, 8, 512, 64), (8, 16, 1024, 64), (4, 16, 2048, 128)),
}
ADAM_ELEMENTS = 1 << 22
ADAM_STREAMING_ELEMENTS = 1 << 26  # 1 GiB of parameter, gradient and state: beyond the caches
DISK_BYTES = 64 << 20
LINK_BYTES = (1 << 10, 4 << 20)  # a small message for the latency, a large for the bandwidth
SEGMENT = (512, 12)  # the interleaved all-reduce's compute: products of this size, this many
SEGMENTS = 8  # of them, each followed by an all-reduce, per timed run
DEVICE_ADAM_ELEMENTS = 1 << 24
DEVICE_COPY_BYTES = 256 << 20
VERSION = 3  # of what a probe measures: a cache of another version is measured again


@dataclass(frozen=True)
class LinkFit:
    """One collective kind's cost on a group: ``hops * alpha + sent / beta`` seconds, with
    ``sent`` the bytes a rank transmits (zerotrain.comm.link)."""

    alpha: float
    beta: float

    def seconds(self, op: str, sent: int, world: int) -> float:
        from zerotrain.comm.link import hops

        return hops(op, world) * self.alpha + sent / self.beta


@dataclass(frozen=True)
class Machine:
    """The measured constants (see [Note: the machine probe])."""

    key: str
    device: str
    """``cpu``, or the CUDA device's name."""
    device_memory: int
    host_memory: int
    dtype: str
    threads: int
    """Threads one rank computes with."""
    matmul_flops: float
    attention_flops: float
    adam_elements_per_s: dict[str, float]
    """Threads (as a string: JSON keys) -> elements per second of fused AdamW on the CPU, over
    ``ADAM_ELEMENTS`` (a working set the caches hold)."""
    copy_bytes_per_s: float | None
    """Pinned host <-> device, CUDA only."""
    disk_write_bytes_per_s: float | None
    disk_read_bytes_per_s: float | None
    adam_streaming_elements_per_s: float | None = None
    """Fused AdamW on the CPU with a rank's threads over ``ADAM_STREAMING_ELEMENTS`` (none:
    probed before it was measured; the cached rate stands for it)."""
    device_adam_elements_per_s: float | None = None
    """Fused AdamW over device tensors, CUDA only (on a CPU: ``adam_elements_per_s``)."""
    device_copy_bytes_per_s: float | None = None
    """A copy inside device memory, bytes read plus written per second; CUDA only."""
    links: dict[str, LinkFit] = field(default_factory=dict)
    """Per collective kind, over ``world`` ranks of this node (none for one rank)."""
    interleaved: LinkFit | None = None
    """An all-reduce right after each rank's compute, over the same ranks (none for one)."""
    world: int = 1
    probed_at: str = ""
    probe_seconds: float = 0.0

    def cpu_adam_rate(self, elements: float) -> float:
        """Fused AdamW's rate on a rank's CPU threads over ``elements``: the cached working
        set's rate up to its size, the streaming one from the streaming probe's size on, and
        geometrically between the two rates in between."""
        cached = self.adam_elements_per_s.get(str(self.threads)) or max(
            self.adam_elements_per_s.values()
        )
        streaming = self.adam_streaming_elements_per_s
        if not streaming or elements <= ADAM_ELEMENTS:
            return cached
        if elements >= ADAM_STREAMING_ELEMENTS:
            return streaming
        between = math.log(elements / ADAM_ELEMENTS) / math.log(
            ADAM_STREAMING_ELEMENTS / ADAM_ELEMENTS
        )
        return cached * (streaming / cached) ** between

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Machine:
        links = {op: LinkFit(**fit) for op, fit in data.get("links", {}).items()}
        interleaved = data.get("interleaved")
        plain = {k: v for k, v in data.items() if k not in ("links", "interleaved")}
        return replace(
            cls(**plain), links=links, interleaved=LinkFit(**interleaved) if interleaved else None
        )


def cache_dir() -> Path:
    """Where probes are cached: ``$ZEROTRAIN_CACHE_DIR``, else ``~/.cache/zerotrain``."""
    configured = os.environ.get("ZEROTRAIN_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "zerotrain"


def _device_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def _key(dtype: str, threads: int, world: int, nvme_path: str | None) -> str:
    parts = [
        str(VERSION),
        platform.node(),
        _device_name(),
        torch.__version__,
        dtype,
        str(threads),
        str(world),
        str(Path(nvme_path).resolve()) if nvme_path else "",
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def probe_machine(
    *,
    dtype: str = "bf16",
    world: int = 1,
    nvme_path: str | None = None,
    threads: int | None = None,
    refresh: bool = False,
    progress=None,
) -> Machine:
    """This machine's constants for training in ``dtype`` with ``world`` ranks on this node,
    from the cache or measured now (``refresh``: always measured; ``progress(text)`` is told
    each phase). ``threads``: per rank (default: the usable CPUs shared by the ranks)."""
    threads = _threads(world, threads)
    key = _key(dtype, threads, world, nvme_path)
    path = _cache_path(key)
    cached = None if refresh else _read_cache(path)
    if cached is not None:
        return cached
    say = progress or (lambda text: None)
    started = time.perf_counter()
    machine = _measure(key, dtype, world, nvme_path, threads, say)
    machine = replace(
        machine,
        probed_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        probe_seconds=round(time.perf_counter() - started, 2),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(machine.to_json(), indent=1))
    partial.replace(path)  # a concurrent planner reads the old file or the new one, never half
    return machine


def cached_machine(
    *, dtype: str, world: int, nvme_path: str | None = None, threads: int | None = None
) -> Machine | None:
    """What :func:`probe_machine` would return from its cache, without measuring anything:
    None where this machine was not probed for these arguments."""
    return _read_cache(_cache_path(_key(dtype, _threads(world, threads), world, nvme_path)))


def memory_only_machine(*, dtype: str, world: int) -> Machine:
    """This machine with only its memory known (now), every rate NaN: what a prediction of
    memory alone needs where no probe is cached (its times are NaN)."""
    threads = _threads(world)
    nan = float("nan")
    blank = Machine(
        key=_key(dtype, threads, world, None),
        device=_device_name(),
        device_memory=0,
        host_memory=0,
        dtype=dtype,
        threads=threads,
        matmul_flops=nan,
        attention_flops=nan,
        adam_elements_per_s={str(threads): nan},
        copy_bytes_per_s=None,
        disk_write_bytes_per_s=None,
        disk_read_bytes_per_s=None,
        world=world,
    )
    return with_current_memory(blank)


def _threads(world: int, threads: int | None = None) -> int:
    """Threads a rank computes with: ``threads``, else the usable CPUs shared by the ranks."""
    return threads or max(1, usable_cpus() // max(1, world))


def _cache_path(key: str) -> Path:
    return cache_dir() / "machine" / f"{key}.json"


def _read_cache(path: Path) -> Machine | None:
    try:
        return Machine.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        return None  # none yet, or a cache of another version of this file: measure again


def with_current_memory(machine: Machine) -> Machine:
    """``machine`` with the memory this process may use now: a cached probe's figure is the
    memory free when it was probed."""
    host = available_host_memory()
    if not host:
        return machine
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_properties(0).total_memory if cuda else host
    return replace(machine, host_memory=int(host), device_memory=int(device))


def _measure(key, dtype, world, nvme_path, threads, say) -> Machine:
    torch_dtype = DTYPES[dtype]
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    host = available_host_memory() or 0
    device_memory = torch.cuda.get_device_properties(0).total_memory if cuda else host
    with torch_threads(threads):
        say("matmul and attention")
        matmul = _matmul_flops(device, torch_dtype)
        attention = _attention_flops(device, torch_dtype)
        say("the CPU optimizer step")
        adam = {str(n): _adam_rate(n) for n in sorted({1, threads})}
        streaming = _adam_rate(threads, ADAM_STREAMING_ELEMENTS)
    copy = _copy_rate() if cuda else None
    if cuda:
        say("the device's optimizer step and copies")
    device_adam = _device_adam_rate() if cuda else None
    device_copy = _device_copy_rate() if cuda else None
    write = read = None
    if nvme_path:
        say(f"disk under {nvme_path}")
        write, read = _disk_rates(Path(nvme_path))
    links, interleaved = {}, None
    if world > 1:
        say(f"links over {world} ranks")
        fits = run_local_job("zerotrain.plan.probe", world, {}, timeout=300, what="link probe")
        interleaved = LinkFit(**fits.pop("interleaved"))
        links = {op: LinkFit(**fit) for op, fit in fits.items()}
    return Machine(
        key=key,
        device=_device_name(),
        device_memory=int(device_memory),
        host_memory=int(host),
        dtype=dtype,
        threads=threads,
        matmul_flops=matmul,
        attention_flops=attention,
        adam_elements_per_s=adam,
        copy_bytes_per_s=copy,
        adam_streaming_elements_per_s=streaming,
        device_adam_elements_per_s=device_adam,
        device_copy_bytes_per_s=device_copy,
        disk_write_bytes_per_s=write,
        disk_read_bytes_per_s=read,
        links=links,
        interleaved=interleaved,
        world=world,
    )


def best_seconds(run, repeats: int = 3) -> float:
    """The fastest of ``repeats`` timed calls of ``run`` after an untimed one (a rate's best:
    what the machine can do)."""
    return min(timed_runs(run, repeats))


def timed_runs(run, repeats: int = 3) -> list[float]:
    """The seconds of ``repeats`` timed calls of ``run`` after an untimed one, the device's
    queued work included."""
    run()  # warm: kernels chosen, memory allocated
    times = []
    for _ in range(repeats):
        _settle()
        started = time.perf_counter()
        run()
        _settle()
        times.append(time.perf_counter() - started)
    return times


def _settle() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _matmul_flops(device: torch.device, dtype: torch.dtype) -> float:
    best = 0.0
    for n in MATMUL_SIZES:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        best = max(best, 2 * n**3 / best_seconds(lambda a=a, b=b: torch.mm(a, b)))
    return best


def _attention_flops(device: torch.device, dtype: torch.dtype) -> float:
    import torch.nn.functional as F

    best = 0.0
    for batch, heads, seq, dim in ATTENTION_SHAPES.get(device.type, ATTENTION_SHAPES["cpu"]):
        q, k, v = (torch.randn(batch, heads, seq, dim, device=device).to(dtype) for _ in range(3))
        # causal: half of the two products' 2 * 2 * b * h * s^2 * d
        flops = 2 * batch * heads * seq * seq * dim

        def run(q=q, k=k, v=v) -> None:
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

        best = max(best, flops / best_seconds(run))
    return best


def _adam_rate(threads: int, elements: int = ADAM_ELEMENTS) -> float:
    def adamw(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-3, fused=True)

    return elements / optimizer_step_seconds(adamw, elements, threads)


def optimizer_step_seconds(build, elements: int, threads: int) -> float:
    """The best time of one step of the optimizer ``build([param])`` makes over a stand-in of
    ``elements`` elements with a gradient, on ``threads`` threads (:func:`best_seconds`)."""
    with torch_threads(threads):
        param = torch.zeros(elements, requires_grad=True)
        param.grad = torch.randn(elements)
        return best_seconds(build([param]).step)


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch computing on ``threads`` threads inside, the caller's count restored after (what
    every probe of a rank's work runs under: a rank trains on its share of the cores)."""
    kept = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(kept)


def _copy_rate() -> float:  # CUDA only
    nbytes = 64 << 20
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def there_and_back() -> None:
        device.copy_(host, non_blocking=True)
        host.copy_(device, non_blocking=True)

    return 2 * nbytes / best_seconds(there_and_back)


def _device_adam_rate() -> float:  # CUDA only
    param = torch.zeros(DEVICE_ADAM_ELEMENTS, device="cuda", requires_grad=True)
    param.grad = torch.randn(DEVICE_ADAM_ELEMENTS, device="cuda")
    step = torch.optim.AdamW([param], lr=1e-3, fused=True).step
    return DEVICE_ADAM_ELEMENTS / best_seconds(step)


def _device_copy_rate() -> float:  # CUDA only
    source = torch.empty(DEVICE_COPY_BYTES, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    return 2 * DEVICE_COPY_BYTES / best_seconds(lambda: target.copy_(source))


def _disk_rates(directory: Path) -> tuple[float, float]:
    """Sequential write and read rates of a working file under ``directory``."""
    from zerotrain.zero.swap import SwapFile, aligned_empty

    directory.mkdir(parents=True, exist_ok=True)
    slots = 8
    size = DISK_BYTES // slots
    path = directory / f"zerotrain-{os.getpid()}-probe.swap"
    swap = SwapFile(path, [size] * slots)
    try:
        buffer = aligned_empty(size, torch.uint8)
        buffer.random_(0, 255)

        def write() -> None:
            for future in [swap.write(slot, buffer) for slot in range(slots)]:
                future.result()

        def read() -> None:
            for future in [swap.read(slot, buffer) for slot in range(slots)]:
                future.result()

        return DISK_BYTES / best_seconds(write, 2), DISK_BYTES / best_seconds(read, 2)
    finally:
        swap.close()


# -- the link probe's ranks ----------------------------------------------------------------------
def _link_fits(comm) -> dict[str, dict]:
    """Each collective kind's alpha and beta over ``comm``, and (as ``interleaved``) an
    all-reduce's after compute on every rank (the slowest rank's times)."""
    world = comm.world_size
    fits = {}
    for op in COLLECTIVES:
        times = []
        for nbytes in LINK_BYTES:
            numel = nbytes // 4 // world * world
            whole = torch.zeros(numel, device=comm.device)
            piece = torch.zeros(numel // world, device=comm.device)
            output = torch.zeros_like(whole)

            def run(op=op, whole=whole, piece=piece, output=output) -> None:
                if op == "all_reduce":
                    comm.all_reduce(whole, name="plan_probe")
                elif op == "reduce_scatter":
                    comm.reduce_scatter(piece, whole)
                elif op == "all_gather":
                    comm.all_gather(whole, piece, name="plan_probe")
                else:
                    comm.all_to_all(output, whole, name="plan_probe")

            times.append(statistics.median(timed_runs(run, 5)))
        fits[op] = _fit(comm, op, times)
    fits["interleaved"] = _fit(comm, "all_reduce", _interleaved_times(comm))
    return fits


def _interleaved_times(comm) -> list[float]:
    """Per message of ``LINK_BYTES``, what an all-reduce adds to a segment of compute that
    precedes it on every rank (the median of a few runs of ``SEGMENTS`` of them)."""
    size, count = SEGMENT
    a, b = (torch.randn(size, size, device=comm.device) for _ in range(2))

    def compute() -> None:
        for _ in range(count):
            torch.mm(a, b)

    def segments(reduced: torch.Tensor | None) -> None:
        for _ in range(SEGMENTS):
            compute()
            if reduced is not None:
                comm.all_reduce(reduced, name="plan_probe")

    comm.barrier()
    alone = statistics.median(timed_runs(lambda: segments(None)))
    times = []
    for nbytes in LINK_BYTES:
        reduced = torch.zeros(nbytes // 4 // comm.world_size * comm.world_size, device=comm.device)
        comm.barrier()
        run = statistics.median(timed_runs(lambda reduced=reduced: segments(reduced)))
        times.append(max(0.0, run - alone) / SEGMENTS)
    return times


def _fit(comm, op: str, times: list[float]) -> dict:
    """The alpha-beta fit of ``op`` from its seconds at each of ``LINK_BYTES`` on this rank:
    the slowest rank's."""
    from zerotrain.comm.communicator import ring_sent
    from zerotrain.comm.link import hops

    world = comm.world_size
    slowest = torch.tensor(times, dtype=torch.float64, device=comm.device)
    comm.all_reduce(slowest, op="max", name="plan_probe")
    small, large = slowest.tolist()
    sent_small, sent_large = (ring_sent(op, n // 4 // world * world * 4, world) for n in LINK_BYTES)
    beta = (sent_large - sent_small) / max(large - small, 1e-9)
    alpha = max(0.0, small - sent_small / beta) / max(hops(op, world), 1)
    return {"alpha": alpha, "beta": beta}


def main() -> None:
    _, out = job_arguments()
    from zerotrain.comm import Communicator
    from zerotrain.comm.setup import init_distributed

    init_distributed(verbose=False)
    comm = Communicator()
    fits = _link_fits(comm)
    if comm.rank == 0:
        out.write_text(json.dumps(fits))
    comm.barrier()


if __name__ == "__main__":
    main()
