"""NVMe offload's working files after a job ends badly (issue 42): SIGTERM (a scheduler's
cancel) removes them, a leftover whose pid another process reuses is still recognised as
stale, and a refusal for lack of space names the files other running processes hold."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from zerotrain.accelerator import process_start_time
from zerotrain.config import ConfigError
from zerotrain.zero import host


def test_sigterm_removes_the_working_files(tmp_path):
    script = textwrap.dedent(
        f"""
        import os, signal, time
        from pathlib import Path
        from zerotrain.zero.host import working_file
        path = working_file(Path({str(tmp_path)!r}), "optimizer")
        path.write_bytes(b"x" * 4096)
        print(path, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # not reached: the signal ends the process
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == -signal.SIGTERM, done.stderr  # ended by the signal, as before
    assert done.stdout.strip().startswith(str(tmp_path / "zerotrain-"))
    assert list(tmp_path.iterdir()) == []


def test_a_leftover_is_told_apart_from_a_process_that_reused_its_pid(tmp_path):
    parent = os.getppid()  # a running process that is not this one
    started = process_start_time(parent)
    if started is None:
        pytest.skip("no /proc: a process's start time is unknown here")
    reused = tmp_path / f"zerotrain-{parent}-1-optimizer-1.swap"  # same pid, another process
    live = tmp_path / f"zerotrain-{parent}-{started}-optimizer-2.swap"
    gone = tmp_path / f"zerotrain-{2**22 + 1}-optimizer-3.swap"  # a name from before 2026-12
    for path in (reused, live, gone):
        path.write_bytes(b"x")
    host.remove_stale_files(tmp_path)
    assert sorted(tmp_path.iterdir()) == [live]


def test_a_refusal_for_space_names_what_other_jobs_hold(tmp_path, monkeypatch):
    parent = os.getppid()
    started = process_start_time(parent) or 0
    held = tmp_path / f"zerotrain-{parent}-{started}-params-1.swap"
    held.write_bytes(b"x" * 2048)
    monkeypatch.setattr(host.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 100})())
    with pytest.raises(ConfigError) as error:
        host.check_disk(tmp_path, needed=1 << 20, local_ranks=1)
    message = str(error.value)
    assert f"Working files of other running processes are there: {held} (" in message, message
    assert f"pid {parent})" in message, message
