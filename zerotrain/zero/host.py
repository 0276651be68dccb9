"""The host and the local disk, for what leaves the device: host tensors (page-locked where
that helps), the ranks sharing a node, the cores the host step runs on, and a directory of
working files under ``nvme_path`` (checked, preflighted, its files named per process and
cleaned after a killed one). Offloaded optimizer state (offload.py, nvme.py) and stage 3's
parameter homes (param_home.py) both use them.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import warnings
from pathlib import Path

import torch

from zerotrain.accelerator import process_start_time
from zerotrain.config import ConfigError
from zerotrain.fmt import quantity


def gib(nbytes: float) -> str:
    return quantity(nbytes, "B", binary=True)


def host_tensor(numel: int, dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
    """A 1-D host tensor; page-locked when ``pin`` and CUDA is there (pageable, with a warning,
    when the host refuses: pinned memory is a speed-up, not a requirement)."""
    if pin and torch.cuda.is_available():
        try:
            return torch.empty(numel, dtype=dtype, pin_memory=True)
        except RuntimeError as error:
            size = gib(numel * dtype.itemsize)
            warnings.warn(
                f"zerotrain offload: could not pin {size} of host memory ({error}); using "
                "pageable memory (slower copies). Set "
                "offload_optimizer.pin_memory: false to silence this.",
                stacklevel=2,
            )
    return torch.empty(numel, dtype=dtype)


def local_ranks() -> int:
    """Ranks sharing this node's host memory (torchrun's LOCAL_WORLD_SIZE)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def host_cores_for_rank(cores: list[int], local_rank: int, ranks: int) -> list[int]:
    """The cores a rank's host optimizer step runs on: its equal share of ``cores`` (all of
    them when there are fewer than two per rank: pinning would then only hurt)."""
    share = len(cores) // max(1, ranks)
    if ranks <= 1 or share < 2:
        return cores
    return cores[local_rank * share : (local_rank + 1) * share]


def configure_host_threads() -> int:
    """CUDA-only: give the host step this rank's share of the cores (torchrun sets
    OMP_NUM_THREADS=1 per rank, which would run the step on one core) and pin the rank to
    them when there are enough. ``ZEROTRAIN_HOST_THREADS`` overrides the count. Returns it."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    mine = host_cores_for_rank(cores, int(os.environ.get("LOCAL_RANK", "0")), local_ranks())
    if mine and mine != cores:
        os.sched_setaffinity(0, mine)
    threads = int(os.environ.get("ZEROTRAIN_HOST_THREADS", "0")) or max(1, len(mine))
    torch.set_num_threads(threads)
    return threads


def prepare_directory(directory: Path, *, key: str = "offload_optimizer") -> None:
    """Make ``directory`` (the ``key`` section's nvme_path) ready for working files, or refuse
    it with a ConfigError naming the key: a path that is a file, or where this process cannot
    create and write a file, fails here rather than as a raw OSError in the middle of a build."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".zerotrain-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise ConfigError(
            f"zero_optimization.{key}.nvme_path: cannot write working files in {directory} "
            f"({error.strerror or error}); give a writable directory on a local disk"
        ) from None


def check_disk(
    directory: Path, needed: int, local_ranks: int, *, key: str = "offload_optimizer"
) -> None:
    """Preflight: refuse, before writing, what the disk under ``directory`` cannot hold (for
    the working file of the ``key`` section)."""
    prepare_directory(directory, key=key)
    free = shutil.disk_usage(directory).free
    total = needed * local_ranks
    if total > free:
        what, lower = (
            ("stage-3 parameter shards", 'offload_param.device: "cpu"')
            if key == "offload_param"
            else (
                "fp32 masters and optimizer state",
                "a lower ratio (keeps more of the optimizer state on the device)",
            )
        )
        held = others_files(directory)
        others = (
            f" Working files of other running processes are there: {'; '.join(held)}."
            if held
            else ""
        )
        raise ConfigError(
            f"zero_optimization.{key}.nvme_path: {directory} has {gib(free)} free, but each "
            f"rank's working file needs {gib(needed)} ({what}), x {local_ranks} rank(s) on this "
            f"node = {gib(total)}.{others} Options: a path on a larger disk, {lower}, or more "
            "nodes"
        )


_files = 0  # working files this process created (their names must differ)
_working: set[Path] = set()  # their paths, removed on SIGTERM (see _remove_on_sigterm)


def working_file(directory: Path, kind: str) -> Path:
    """A new working file's path: its name carries the pid and the process's start time, which
    together name this process even after its pid is reused (see :func:`remove_stale_files`).
    The file is removed if the process is ended by SIGTERM (a scheduler's cancel)."""
    global _files
    _files += 1
    pid = os.getpid()
    path = directory / f"zerotrain-{pid}-{process_start_time(pid) or 0}-{kind}-{_files}.swap"
    _working.add(path)
    _remove_on_sigterm()
    return path


def _remove_on_sigterm() -> None:
    """SIGTERM's default ends the process without exit hooks, leaving the working files to
    fill the disk for the next job: remove them first. A handler the program installed itself
    is left alone (it decides how the process ends, and its exit runs the hooks)."""
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may install handlers
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminate)


def _terminate(signum: int, frame: object) -> None:
    for path in _working:
        path.unlink(missing_ok=True)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # ended by the signal, as it would have been


def remove_stale_files(directory: Path) -> None:
    """Remove working files left by processes of this node that no longer run (a kill -9): a
    name's pid with another start time is another process."""
    for path in directory.glob("zerotrain-*.swap"):
        owner = _owner_of(path)
        if owner is not None and owner[0] != os.getpid() and not _running(*owner):
            path.unlink(missing_ok=True)


def _owner_of(path: Path) -> tuple[int, str | None] | None:
    """The pid and start time a working file's name carries (start time None: a name from
    before 2026-12, the pid alone); None: not a working file's name."""
    parts = path.name.split("-")
    try:
        pid = int(parts[1])
    except (IndexError, ValueError):
        return None
    start = parts[2] if len(parts) > 4 and parts[2].isdigit() else None
    return pid, start


def _running(pid: int, start: str | None) -> bool:
    """Whether the process a working file names still runs (without /proc: assumed so)."""
    if not os.path.isdir("/proc/self"):
        return True
    started = process_start_time(pid)
    if started is None:
        return False
    return start in (None, "0") or started == start  # "0": its start time was unknown


def others_files(directory: Path) -> list[str]:
    """The working files under ``directory`` that other running processes hold, each as
    "path (size, pid N)": what a refusal for lack of space names."""
    found = []
    for path in sorted(directory.glob("zerotrain-*.swap")):
        owner = _owner_of(path)
        if owner is None or owner[0] == os.getpid():
            continue
        try:
            size = path.stat().st_size
        except OSError:
            continue
        found.append(f"{path} ({gib(size)}, pid {owner[0]})")
    return found
