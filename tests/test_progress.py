"""Progress bars of long phases: rank 0, a terminal (or ZEROTRAIN_PROGRESS=1), and only then."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from distributed import run_distributed

from zerotrain.progress import ENV, progress


def _run_phase(monkeypatch, env: dict[str, str], tty: bool) -> str:
    err = io.StringIO()
    err.isatty = lambda: tty  # type: ignore[method-assign]
    for name in (ENV, "RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with contextlib.redirect_stderr(err), progress("phase", total=4, unit="B") as advance:
        advance(4)
    return err.getvalue()


@pytest.mark.parametrize(
    ("env", "tty", "shown"),
    [
        ({ENV: "1"}, False, True),  # forced
        ({ENV: "0"}, True, False),  # refused
        ({}, False, False),  # a log file: nothing
        ({"RANK": "1"}, True, False),  # other ranks: nothing
    ],
)
def test_a_bar_shows_on_rank_0_of_a_terminal_or_when_forced(monkeypatch, env, tty, shown):
    out = _run_phase(monkeypatch, env, tty)
    assert ("phase: 100%" in out and "4.00/4.00" in out) == shown, out


def test_on_a_terminal_a_short_phase_shows_nothing(monkeypatch):
    # tqdm's delay: a phase shorter than DELAY_S leaves the terminal as it was
    assert _run_phase(monkeypatch, {}, True) == ""


def _built_under_init():
    import os
    import sys

    import zerotrain

    os.environ[ENV] = "1"
    err = io.StringIO()
    sys.stderr, real = err, sys.stderr
    try:
        with zerotrain.zero.Init():
            torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 3))
    finally:
        sys.stderr = real
    return err.getvalue()


def test_zero_init_counts_the_parameters_it_partitions():
    (out,) = run_distributed(_built_under_init, 1)
    assert "zero.Init: parameters built and partitioned: 143 params" in out.replace("\r", "\n")
