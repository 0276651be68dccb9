"""Process-group start-up: torchrun, SLURM and MPI environments, one backend choice."""

from __future__ import annotations

import atexit
import gc
import os
import socket
import threading
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from zerotrain.accelerator import get_accelerator, usable_cpus
from zerotrain.comm import progress

DEFAULT_TIMEOUT = timedelta(minutes=10)
"""How long a collective waits for a silent peer before it fails, naming itself. Torch's NCCL
default; DeepSpeed and Lightning wait 30 minutes, which a stalled rank costs every other rank.
``ZEROTRAIN_TIMEOUT`` (minutes; else DeepSpeed's ``DEEPSPEED_TIMEOUT``) overrides it."""

# Where each launcher leaves rank, world size and local rank. torchrun first: it is what
# `zerotrain run` uses; SLURM's srun and MPI launchers (Open MPI, MPICH/Intel MPI) follow.
_LAUNCHER_ENV = (
    ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
)


_timeout: timedelta | None = None  # what init_distributed was given (None: group made elsewhere)
# The default group init_distributed made, weakly: see [Note: who ends the process group].
_made_group: weakref.ref | None = None
_exit_hook_registered = False

# [Note: who ends the process group]
# Whoever starts the default process group ends it. When init_distributed made it (directly or
# through zerotrain.initialize), an atexit hook destroys it while the interpreter is whole: torch
# wants destroy_process_group() before exit (NCCL's ProcessGroupNCCL destructor otherwise warns
# "destroy_process_group() was not called before program exit, which can leak resources"), and
# gloo can abort the process (see _tear_down_at_exit). The hook checks that the default group is
# still the one zerotrain made: a group the user made, even after destroying ours, is theirs.
# engine.destroy() leaves the group alone, as DeepSpeed's does: scripts keep using the engine or
# the group after destroy() (examples/train_gpt.py evaluates after it, tests build one engine
# after another in one process), and "no other live engine uses it" is a rank-local judgement
# (garbage collection differs between ranks) while ending a group concerns every rank: one rank
# closing early would leave its peers waiting out the collective timeout. A script that wants it
# gone sooner calls zerotrain.comm.destroy_process_group() on every rank.


def default_timeout() -> timedelta:
    """:data:`DEFAULT_TIMEOUT`, or the minutes ``ZEROTRAIN_TIMEOUT`` / ``DEEPSPEED_TIMEOUT`` set."""
    for name in ("ZEROTRAIN_TIMEOUT", "DEEPSPEED_TIMEOUT"):
        value = os.environ.get(name)
        if value is None:
            continue
        try:
            minutes = float(value)
        except ValueError:
            minutes = -1.0
        if not minutes > 0:
            raise ValueError(f"{name}={value!r}: expected a positive number of minutes")
        return timedelta(minutes=minutes)
    return DEFAULT_TIMEOUT


def collective_timeout() -> timedelta | None:
    """The timeout :func:`init_distributed` applied to the default group, if it made it."""
    return _timeout


def _launcher_ranks() -> tuple[int, int, int] | None:
    for rank_key, world_key, local_key in _LAUNCHER_ENV:
        if rank_key in os.environ and world_key in os.environ:
            return (
                int(os.environ[rank_key]),
                int(os.environ[world_key]),
                int(os.environ.get(local_key, "0")),
            )
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_initialized() -> bool:
    """Whether the default process group exists."""
    return dist.is_available() and dist.is_initialized()


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Create the default process group (DeepSpeed's signature); a second call does nothing.

    The backend is the accelerator's (NCCL on CUDA, gloo on the CPU) unless ``dist_backend``
    names one. Rank and world size come from the arguments, else from the launcher's
    environment (torchrun, SLURM, MPI), else a single process on this machine; under SLURM or
    MPI with ``MASTER_ADDR`` set and no ``MASTER_PORT``, ``distributed_port`` is the port.
    ``timeout`` bounds every collective (default :func:`default_timeout`): a rank that dies or
    stalls makes the others raise an error naming the operation instead of hanging. ``dist_init_required=False`` only checks
    that a group exists. ``auto_mpi_discovery`` is accepted: MPI variables are always read.
    ``config`` is accepted for DeepSpeed's signature: zerotrain applies a config's
    `comms_logger` section per engine, in ``initialize``. ``verbose``: rank 0 prints a line.
    """
    if not isinstance(auto_mpi_discovery, bool):  # e.g. a timeout passed second, by position
        raise TypeError(
            f"init_distributed(): auto_mpi_discovery takes a bool, got "
            f"{type(auto_mpi_discovery).__name__}; pass a collective timeout as timeout=..."
        )
    del auto_mpi_discovery, config  # see the docstring
    if dist_init_required is False:
        if not is_initialized():
            raise RuntimeError(
                "init_distributed(dist_init_required=False): no process group is initialized; "
                "call it with dist_init_required left out, or initialize torch.distributed first"
            )
        return
    if is_initialized():
        return
    backend = dist_backend or get_accelerator().communication_backend_name()
    found = _launcher_ranks()
    local_rank = 0
    if rank < 0 or world_size < 0:
        if found is not None:
            rank, world_size, local_rank = found
        else:
            rank, world_size = 0, 1
    if init_method is None:
        if "MASTER_ADDR" in os.environ:  # torchrun sets both; SLURM/MPI users often one
            os.environ.setdefault("MASTER_PORT", str(distributed_port))
        if world_size == 1 and "MASTER_ADDR" not in os.environ:
            init_method = f"tcp://127.0.0.1:{_free_port()}"
        elif "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            raise RuntimeError(
                f"init_distributed: rank {rank} of {world_size} found no MASTER_ADDR/MASTER_PORT. "
                "Launch with `zerotrain run` (torchrun), or export MASTER_ADDR and MASTER_PORT "
                "(under SLURM: the first host of $SLURM_JOB_NODELIST and a free port)."
            )
        else:
            init_method = "env://"
    os.environ.setdefault("LOCAL_RANK", str(local_rank))
    os.environ.setdefault("RANK", str(rank))  # for what reads it later (progress.py)
    if backend == "nccl":  # CUDA only: bind this process to its GPU before NCCL starts
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    global _timeout, _made_group, _exit_hook_registered
    timeout = timeout or default_timeout()
    dist.init_process_group(
        backend=backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
    )
    _timeout = timeout
    _made_group = weakref.ref(dist.group.WORLD)
    progress.watch(timeout.total_seconds() / 4)  # a rank stalled before its first collective
    if not _exit_hook_registered:  # once per process, however often a group is made
        atexit.register(_tear_down_at_exit)
        _exit_hook_registered = True
    threads = _share_cpu_cores() if backend == "gloo" else None
    if verbose and rank == 0:
        per_rank = f", {threads} CPU threads per rank" if threads is not None else ""
        print(
            f"zerotrain: initialized {backend} with {world_size} ranks (timeout {timeout}"
            f"{per_rank})"
        )


def _share_cpu_cores() -> int | None:
    """CPU ranks on one node share its cores: each takes (usable cores / ranks on the node)
    intra-op threads, as `zerotrain run` sets OMP_NUM_THREADS for the ranks it starts, so ranks
    started some other way (plain python, mp.spawn, mpirun) do not oversubscribe the cores:
    two processes of two threads each on 2 busy cores took 3.2 s per step of the demo's tiny
    GPT, against 0.11 s with one thread each (OpenMP's waiting threads spin). A thread count
    the user chose (OMP_NUM_THREADS, torch.set_num_threads below the share) is kept. Returns
    the threads set, or None when left alone."""
    if "OMP_NUM_THREADS" in os.environ:
        return None
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is None:  # not torchrun: the ranks on this host whose cores overlap ours (srun
        # and mpirun may pin each rank to its own cores: those share nothing)
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        mine = (socket.gethostname(), cpus)
        everyone: list[tuple[str, list[int]] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        ranks_here = sum(
            1
            for other in everyone
            if other is not None
            and other[0] == mine[0]
            and (not other[1] or not cpus or set(other[1]) & set(cpus))
        )
    else:
        ranks_here = int(local)
    threads = max(1, usable_cpus() // max(1, ranks_here))
    if threads >= torch.get_num_threads():
        return None
    torch.set_num_threads(threads)
    return threads


def made_default_group() -> bool:
    """Whether the default process group exists and :func:`init_distributed` made it (zerotrain
    then destroys it at exit; see [Note: who ends the process group])."""
    return is_initialized() and _made_group is not None and _made_group() is dist.group.WORLD


def _tear_down_at_exit() -> None:
    """Scripts rarely destroy their process group. Gloo's worker threads then live until the
    interpreter's final garbage collection frees the group (engines keep it in reference
    cycles), and a thread releasing a finished collective's tensors at that moment aborts the
    process ("terminate called without an active exception"); NCCL's destructor warns. Destroy
    the group zerotrain made and collect the cycles while the interpreter is whole: the group's
    destructor joins its threads. A group the user made is left to them."""
    if made_default_group():
        destroy_distributed()
    gc.collect()


def destroy_distributed() -> None:
    """Tear down the default process group and every other, if any, whoever made them
    (``zerotrain.comm.destroy_process_group()`` calls this); every rank must call it."""
    global _timeout, _made_group
    if is_initialized():
        dist.destroy_process_group()
    _timeout = None
    _made_group = None


def local_rank() -> int:
    """This process's rank on its node (0 without a launcher)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def store_answers(host: str, port: int, seconds: float) -> bool:
    """Whether the program listening at ``host:port`` answers as a c10d store (torchrun's
    rendezvous) within ``seconds``. torch's store client can wait past its own timeout on a
    program that accepts the connection and never replies (an HTTP server), so the probe runs
    on a daemon thread that is abandoned, not joined, when it does not finish."""
    answered = threading.Event()

    def probe() -> None:
        try:
            store = dist.TCPStore(
                host, port, is_master=False, timeout=timedelta(seconds=max(1.0, seconds - 5))
            )
            store.check(["zerotrain/endpoint-probe"])
        except Exception:
            return  # refused or reset: not a store either
        answered.set()

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(seconds)
    return answered.is_set()
