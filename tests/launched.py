"""Processes a test launches (``zerotrain run`` and its torchrun workers), in a session of their
own so that a timeout can kill them together."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest


def output_or_kill(process: subprocess.Popen, timeout: float, what: str) -> str:
    """The output of ``process`` once it exits; past ``timeout`` seconds its session is killed
    and the test fails, showing what ``what`` printed."""
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{what} ran past {timeout} s; output:\n{output}")
    return output


def run_in_session(
    argv: list[str], *, cwd, env: dict[str, str], timeout: float, what: str
) -> subprocess.CompletedProcess:
    """Run ``argv`` in a session of its own (torchrun and its workers die together past
    ``timeout``), stderr into stdout; returns its exit status and output."""
    process = subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        text=True,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    output = output_or_kill(process, timeout, what)
    return subprocess.CompletedProcess(argv, process.returncode, output, None)
