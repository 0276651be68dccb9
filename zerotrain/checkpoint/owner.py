"""Which job owns a save directory: one writer at a time.

[Note: one job per save directory]
Two jobs saving into one directory ruin each other's checkpoints: a commit deletes the other's
files of the same tag as stale, ``keep_last`` deletes its checkpoints, ``latest`` names
whichever committed last. So the first save of a job claims the directory with a lock file,
``zerotrain.lock`` (JSON: host, pid, the process's start time, job id, since when), created
atomically by rank 0; later saves find their own claim, and a clean exit gives it back.
Another job's claim is refused, naming its owner, unless it is stale: on this host its process
is gone (the start time tells a reused pid apart), or it names this job (an elastic restart:
the same job id, new processes). The job id is torchrun's run id or SLURM's job id. A lock of
another host whose job is gone cannot be told from a live one: the error names the file to
remove.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from zerotrain.accelerator import process_start_time

LOCK = "zerotrain.lock"
JOB_ENV = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")  # the first set names the job


@dataclass(frozen=True)
class Owner:
    """A job's process that claims a save directory."""

    host: str
    pid: int
    started: str | None  # the process's start time (Linux's /proc/<pid>/stat), None elsewhere
    job: str | None  # torchrun's run id or SLURM's job id (None: not launched by either)
    since: float  # when it claimed the directory (seconds since the epoch)

    def same_job(self, other: Owner) -> bool:
        if self.job is not None and self.job == other.job:
            return True
        return (self.host, self.pid, self.started) == (other.host, other.pid, other.started)

    def gone(self) -> bool:
        """Whether its process has ended (only known on this host)."""
        return self.host == socket.gethostname() and process_start_time(self.pid) != self.started

    def describe(self) -> str:
        job = f"job {self.job}, " if self.job else ""
        claimed = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"{job}pid {self.pid} on {self.host}, since {claimed}"


def job_id() -> str | None:
    """This job's id: torchrun's run id or SLURM's job id (the same after a restart)."""
    return next((os.environ[k] for k in JOB_ENV if os.environ.get(k, "none") != "none"), None)


def this_process() -> Owner:
    pid = os.getpid()
    return Owner(socket.gethostname(), pid, process_start_time(pid), job_id(), time.time())


def claim(save_dir: Path, me: Owner | None = None) -> str | None:
    """Claim ``save_dir`` for this job (see [Note: one job per save directory]); why not, or
    None once it is ours."""
    me = me or this_process()
    lock = save_dir / LOCK
    for attempt in range(3):  # another process may be writing or dropping the lock
        try:
            save_dir.mkdir(parents=True, exist_ok=True)
            with open(lock, "x", encoding="utf-8") as out:
                json.dump(asdict(me), out)
            atexit.register(_release, lock, me)
            return None
        except FileExistsError:
            pass
        owner = _read(lock)
        if owner is None:  # just removed, or still being written
            time.sleep(0.05 * (attempt + 1))
            continue
        if owner.same_job(me):
            return None
        if not owner.gone():
            return (
                f"{save_dir} is the save directory of another running job ({owner.describe()}; "
                f"its claim is {lock}): two jobs saving into one directory delete each other's "
                "files. Save into another directory, or, if that job has ended, remove the lock "
                "file"
            )
        lock.unlink(missing_ok=True)  # stale: its process has ended
    return (
        f"{save_dir}: its claim {lock} is unreadable; if no other job saves there, remove it "
        "and retry the save"
    )


def _read(lock: Path) -> Owner | None:
    try:
        return Owner(**json.loads(lock.read_text(encoding="utf-8")))
    except (FileNotFoundError, ValueError, TypeError):
        return None


def _release(lock: Path, me: Owner) -> None:
    """At exit: remove the claim if it is still this process's."""
    owner = _read(lock)
    if owner is not None and (owner.host, owner.pid) == (me.host, me.pid):
        lock.unlink(missing_ok=True)
