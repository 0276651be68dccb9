"""Run a function on N ranks over gloo, each a process of its own, and collect each rank's result.

The ranks fork from a server that imported torch once (a torch import costs 2-3 s a process
here). A call still costs process starts, a rendezvous and a teardown, so a test should run its
whole option grid inside one call rather than one call per option.
"""

from __future__ import annotations

import atexit
import os
import socket
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, args, out_dir, collective_timeout_s, environ):
    os.environ.clear()  # the parent's, as a spawned child would have it
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        import zerotrain

        zerotrain.init_distributed(timeout=timedelta(seconds=collective_timeout_s))
        result = fn(*args)
        torch.save({"ok": True, "result": result}, path)
    except BaseException:  # report everything, including assertion errors, to the parent
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
    finally:
        from zerotrain.comm import destroy_distributed

        destroy_distributed()
        # a forked rank ends by os._exit: run the exit hooks (NVMe files, monitors) as a
        # spawned one, ending by sys.exit, would
        atexit._run_exitfuncs()


def _context(fresh_interpreter: bool):
    """A fork server that imported torch, zerotrain and (where installed) transformers' GPT-2
    once: each rank forks from it instead of importing them again (3 s, 1 s and 3 s a rank on
    this machine; the ranks of several test files build GPT-2s). The fork server is one
    thread and has run no torch op, so its children start as clean as spawned ones, but for
    what a process reads only as it starts: glibc's ``MALLOC_*`` variables, and accelerate's
    view of whether ``deepspeed`` is importable, fixed when transformers imported it (tests
    of ``zerotrain.compat.deepspeed.activate()`` under accelerate need a process that has not
    imported it yet). ``fresh_interpreter`` spawns for those. (zerotrain reads its environment
    variables as it runs, not as it is imported, so each rank still sees the parent's.) What the
    server imported is frozen out of the garbage collector's reach (tests/frozen_heap.py)."""
    if fresh_interpreter:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # a module that fails to import is skipped (multiprocessing's forkserver)
    preload = ["torch", "zerotrain.api", "transformers.models.gpt2.modeling_gpt2"]
    # last: freezes what they made (a module the server finds from the repository root, its cwd)
    ctx.set_forkserver_preload([*preload, "tests.frozen_heap"])
    return ctx


def run_distributed(
    fn,
    world_size: int,
    *args,
    timeout: float = 240,
    collective_timeout_s: float = 60,
    may_die: tuple[int, ...] = (),
    fresh_interpreter: bool = False,
):
    """``fn(*args)`` on ``world_size`` ranks; returns the list of results in rank order.

    ``fn`` must be a module-level function. A rank's exception is re-raised here with its
    traceback; ranks still running after ``timeout`` seconds are killed and reported. Ranks in
    ``may_die`` may exit without a result (their entry is the exit code).
    ``fresh_interpreter``: each rank a new interpreter (see :func:`_context`).
    """
    ctx = _context(fresh_interpreter)
    port = _free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [
            ctx.Process(
                target=_worker,
                args=(
                    fn,
                    rank,
                    world_size,
                    port,
                    args,
                    out_dir,
                    collective_timeout_s,
                    dict(os.environ),
                ),
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results, errors = [], []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pt")
            if not os.path.exists(path) and rank in may_die:
                results.append(procs[rank].exitcode)
                continue
            if not os.path.exists(path):
                errors.append(f"rank {rank}: no result (exit code {procs[rank].exitcode})")
                continue
            record = torch.load(path, weights_only=False)
            if record["ok"]:
                results.append(record["result"])
            else:
                errors.append(f"rank {rank}:\n{record['error']}")
        if hung:
            errors.insert(0, f"ranks {hung} still running after {timeout} s (killed)")
        if errors:
            raise AssertionError("distributed run failed:\n" + "\n".join(errors))
        return results


def run_cases(fn, world_size: int, cases: list[tuple], **kwargs):
    """``fn(*case)`` for every case in one start of ``world_size`` ranks (a grid of cases should
    not pay the start per case); per rank, the list of results in case order. ``kwargs`` go to
    :func:`run_distributed`."""
    return run_distributed(_each_case, world_size, fn, cases, **kwargs)


def _each_case(fn, cases: list[tuple]) -> list:
    return [fn(*case) for case in cases]
