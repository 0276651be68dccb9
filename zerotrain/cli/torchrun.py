"""``zerotrain run``'s launch: torchrun in this process, a bounded check of the rendezvous
endpoint before it, and one line per way the ranks ended after it.

[Note: torchrun in the launcher's own process]
torchrun's console script is ``torch.distributed.run.main``: parse the options, then
``run(args)``, which starts the elastic agent (rendezvous, worker processes, restarts, signal
forwarding). ``zerotrain run`` calls the same ``parse_args`` and ``run`` here instead of
exec'ing ``python -m torch.distributed.run``, which imported torch a second time (3-4 s on a
small machine) and ended a failed job with torchrun's traceback and failure table (40 lines
for a missing script). Ranks still run as torchrun starts them; what changes is the end: a
``ChildFailedError`` becomes one line per distinct message, naming its ranks, with the message a
rank's ZeroTrainError left in torchrun's error file (zerotrain/errors.py), a signal's likely
cause, or a pointer to the traceback the rank printed itself.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import sys
from collections.abc import Mapping, Sequence

from zerotrain.errors import LAUNCHED_ENV

__all__ = ["check_endpoint", "failure_report", "run_torchrun"]

# how long the endpoint probe waits for a program that accepted the connection to answer
PROBE_TIMEOUT_S = 15.0


class _FailedLines(logging.Filter):
    """Drops the agent's own lines for a failed rank and for stopping the others: the failure
    report says both."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        return not (text.startswith("failed (exitcode") or "closing signal" in text)


def run_torchrun(torchrun_argv: Sequence[str], env_overrides: Mapping[str, str]) -> int:
    """Run torchrun with ``torchrun_argv`` (its options, the script and its arguments) in this
    process; returns the exit status (see [Note: torchrun in the launcher's own process])."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    os.environ.update(env_overrides)
    os.environ[LAUNCHED_ENV] = "1"  # the ranks report their ZeroTrainErrors to us
    # A store per rendezvous round: with the agents' shared store, workers of a restarted round
    # read the previous round's addresses when the agents' restart counts differ (the agent
    # whose worker died counts a restart, the others a membership change), and their process
    # group never starts (pytorch#135712; tests/test_elastic_recovery.py).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    args = parse_args(list(torchrun_argv))
    if not args.max_restarts:  # with restarts, the agent's lines are the only record of an attempt
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_FailedLines())
    try:
        run(args)
    except ChildFailedError as failed:
        sys.stdout.flush()
        print(failure_report(failed.name, failed.failures), file=sys.stderr, flush=True)
        codes = [f.exitcode for f in failed.failures.values() if f.exitcode > 0]
        _remove_snapshots(args.rdzv_id)
        return codes[0] if codes else 1
    except SignalException as stopped:  # torchrun's agent has stopped the ranks already
        name = signal.Signals(stopped.sigval).name
        print(f"zerotrain run: stopped by {name}; the ranks were stopped", file=sys.stderr)
        return 128 + stopped.sigval  # as a shell reports a process a signal ended
    _remove_snapshots(args.rdzv_id)
    return 0


def _remove_snapshots(job: str) -> None:
    """This node's in-memory snapshots of ``job`` (zerotrain/checkpoint/snapshots.py), once its
    agent is done: a job that ended, or failed with its restarts used up, cannot resume from
    them, and they hold host memory. Kept when the agent was stopped from outside (a scheduler
    may requeue the job under the same id). Snapshots under another configured ``path`` are
    the workers' to remove."""
    from zerotrain.config.schema import DEFAULT_SNAPSHOT_PATH

    if job and job != "none":
        root = os.environ.get("ZEROTRAIN_SNAPSHOT_DIR") or DEFAULT_SNAPSHOT_PATH
        shutil.rmtree(os.path.join(root, job), ignore_errors=True)


def failure_report(script: str, failures: Mapping[int, object]) -> str:
    """One line per distinct way ranks of ``script`` ended, the first failure first."""
    ways: dict[str, list[int]] = {}
    # ranks torchrun stopped because another failed come last: the others are the cause
    stopped = {rank for rank, f in failures.items() if getattr(f, "exitcode", 1) == -15}
    cause = len(stopped) < len(failures)
    order = sorted(failures, key=lambda r: (r in stopped, getattr(failures[r], "timestamp", 0), r))
    for rank in order:
        ways.setdefault(_how_it_ended(failures[rank], cause), []).append(rank)
    lines = [f"zerotrain run: {script} failed"]
    for how, ranks in ways.items():
        lines.append(f"  {_ranks(ranks)}: {how}")
    return "\n".join(lines)


def _how_it_ended(failure: object, another_failed: bool) -> str:
    message = getattr(failure, "message", "")
    if isinstance(message, dict):  # written by zerotrain/errors.py or torchrun's @record
        return str(message.get("message", message))
    exitcode = getattr(failure, "exitcode", 1)
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        cause = {
            "SIGKILL": " (often the kernel's out-of-memory killer: see `dmesg`)",
            "SIGTERM": (
                " (torchrun stops the other ranks once one has failed)"
                if another_failed
                else " (stopped from outside: the job's scheduler, or kill)"
            ),
            "SIGSEGV": " (a crash in native code)",
            "SIGABRT": " (aborted by native code, e.g. a collective given mismatched sizes)",
        }.get(name, "")
        return f"killed by {name}{cause}"
    return f"exit code {exitcode} (the rank's own output above says why)"


def _ranks(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def check_endpoint(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be a rendezvous (c10d store) endpoint, or None. A program that
    accepts the connection but does not answer as a store (another service on the port) would
    keep torchrun waiting with no timeout; nothing listening is fine (this node's agent, or a
    node that starts later, will listen)."""
    try:
        with socket.create_connection((host, port), timeout=2.0):
            pass
    except OSError:
        return None  # nothing there yet
    from zerotrain.comm.setup import store_answers

    if store_answers(host, port, PROBE_TIMEOUT_S):
        return None
    return (
        f"zerotrain run: the rendezvous endpoint {host}:{port} is taken by a program that "
        f"does not answer as a c10d store (no answer in {PROBE_TIMEOUT_S:.0f} s): another "
        "service holds the port; choose a free port"
    )
