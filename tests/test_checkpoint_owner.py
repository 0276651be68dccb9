"""One job per save directory (issue 42): a second job saving into a directory another running
job owns gets a clear error naming that job; a claim whose process ended, or of this very job
(an elastic restart), is taken over. See [Note: one job per save directory] in
zerotrain/checkpoint/owner.py."""

from __future__ import annotations

import dataclasses
import json
import os
import socket

import pytest
import torch

from tests.distributed import run_distributed
from zerotrain.accelerator import process_start_time
from zerotrain.checkpoint.owner import LOCK, Owner, _release, claim, this_process

DEAD_PID = 2**22 + 1  # above Linux's pid_max: no process has it


def _owner(**changes) -> Owner:
    return dataclasses.replace(this_process(), **changes)


def _lock_owner(save_dir) -> Owner:
    return Owner(**json.loads((save_dir / LOCK).read_text()))


def test_a_directory_is_claimed_once_and_stays_its_jobs(tmp_path):
    me = _owner(job=None)
    assert claim(tmp_path / "run", me) is None  # made, and claimed
    assert _lock_owner(tmp_path / "run") == me
    assert claim(tmp_path / "run", me) is None  # its own claim: every later save
    _release(tmp_path / "run" / LOCK, _owner(pid=DEAD_PID))  # another's exit leaves it
    assert (tmp_path / "run" / LOCK).exists()
    _release(tmp_path / "run" / LOCK, me)  # its own exit gives it back
    assert not (tmp_path / "run" / LOCK).exists()


def test_another_running_job_is_refused_with_its_name(tmp_path):
    # this very process, as a job of its own: running, on this host
    running = _owner(job="train-7")
    assert claim(tmp_path, running) is None
    other = _owner(job="eval-3", pid=DEAD_PID, started=None)
    problem = claim(tmp_path, other)
    assert problem is not None
    assert "another running job (job train-7, pid" in problem, problem
    assert socket.gethostname() in problem and "remove the lock file" in problem, problem
    assert _lock_owner(tmp_path) == running  # left as it was
    # a job on another host cannot be seen to have ended: refused the same way
    (tmp_path / LOCK).write_text(json.dumps(dataclasses.asdict(_owner(host="elsewhere"))))
    assert "on elsewhere" in (claim(tmp_path, other) or "")


def test_a_stale_claim_or_this_jobs_is_taken_over(tmp_path):
    ended = _owner(pid=DEAD_PID, started="1", job="old")
    (tmp_path / LOCK).write_text(json.dumps(dataclasses.asdict(ended)))
    me = _owner(job="new")
    assert claim(tmp_path, me) is None  # its process is gone
    assert _lock_owner(tmp_path) == me
    # a reused pid: alive, but a process started at another time
    reused = _owner(started="1", job="old")
    (tmp_path / LOCK).write_text(json.dumps(dataclasses.asdict(reused)))
    assert process_start_time(os.getpid()) != "1"
    assert claim(tmp_path, me) is None
    # an elastic restart: new processes of the same job
    restarted = _owner(job="new", pid=DEAD_PID, host="elsewhere")
    assert claim(tmp_path, restarted) is None
    (tmp_path / LOCK).write_text("not json")  # unreadable: refused, naming the file
    problem = claim(tmp_path, me) or ""
    assert "is unreadable; if no other job saves there, remove it" in problem, problem


def _save_into_claimed(save_dir: str) -> str:
    """Save where another running job holds the claim; the error every rank raises."""
    import zerotrain
    from zerotrain.checkpoint import CheckpointError

    model = torch.nn.Linear(4, 4)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {}}}
    engine, *_ = zerotrain.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    with pytest.raises(CheckpointError) as error:
        engine.save_checkpoint(save_dir)
    return str(error.value)


def test_an_engine_does_not_save_into_another_jobs_directory(tmp_path):
    holder = _owner(job="train-7")  # the test's own process: running
    assert claim(tmp_path, holder) is None
    errors = run_distributed(_save_into_claimed, 2, str(tmp_path))
    assert errors[0] == errors[1]
    assert "another running job (job train-7" in errors[0] and "nothing was saved" in errors[0]
    assert [p.name for p in tmp_path.iterdir()] == [LOCK]  # no checkpoint directory
