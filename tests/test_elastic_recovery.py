"""Recovery after a kill -9, end to end: torchrun's elastic agents restart the workers and the
script's own ``load_checkpoint`` resumes from the in-memory snapshot (issue 42).

Two emulated nodes on this host: two torchrun agents sharing one c10d rendezvous, node A with 2
ranks, node B with 1, each with its own snapshot folder (``ZEROTRAIN_SNAPSHOT_DIR``, its
/dev/shm). The script snapshots every step, saves to disk only at step 2, and at a step chosen
at random a worker is killed with SIGKILL:
- node A's ranks (its agent lives): the agent restarts them, the job goes on at 3 ranks;
- node B's rank and its agent (the node is lost): node A's agent goes on alone at 2 ranks,
  rank B's state coming from node A's buddy copies.
Either way the final parameters must equal those of a run resumed from a disk checkpoint of the
recovered step at the same world size, bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TOTAL = 8

SCRIPT = """
import json, os, signal, sys, time
import torch, zerotrain

root, load_dir, load_tag, kill_at, victim, snapshots = sys.argv[1:7]
zerotrain.init_distributed(verbose=False)
rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
engine, *_ = zerotrain.initialize(
    model=model,
    model_parameters=model.parameters(),
    config={
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 2},
        "checkpoint": {
            "in_memory_snapshots": {"enabled": snapshots == "on", "every_steps": 1}
        },
        "steps_per_print": 10**6,
    },
)
started = time.time()
path, _ = engine.load_checkpoint(load_dir, tag=None if load_tag == "-" else load_tag)
report = {"attempt": attempt, "world": world, "start": engine.global_steps, "path": str(path),
          "started": started}
while engine.global_steps < TOTAL_STEPS:
    step = engine.global_steps
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(12, 16, generator=g), torch.randn(12, 1, generator=g)
    rows = slice(rank * 12 // world, (rank + 1) * 12 // world)
    engine.backward(torch.nn.functional.mse_loss(engine(x[rows]), y[rows]))
    engine.step()
    report.setdefault("first_step_done", time.time())
    if snapshots == "on":
        engine.save_checkpoint(f"{root}/every", tag=f"global_step{engine.global_steps}")
        if engine.global_steps == 2:
            engine.save_checkpoint(f"{root}/disk")
    if attempt == 0 and engine.global_steps == int(kill_at) and os.environ.get("VICTIM") == "1":
        with open(f"{root}/killed", "w") as f:
            f.write(str(time.time()))
        if victim == "node":
            os.kill(os.getppid(), signal.SIGKILL)  # the node's agent
        os.kill(os.getpid(), signal.SIGKILL)
with open(f"{root}/report-{attempt}-{rank}.json", "w") as f:
    json.dump(report, f)
final = engine.consolidated_state_dict()  # collective
if rank == 0:
    torch.save(final, f"{root}/final-{load_tag}.pt")
""".replace("TOTAL_STEPS", str(TOTAL))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent(root: Path, port: int, nproc: int, node: str, victim: bool, *args: str):
    """One emulated node: a ``zerotrain run`` agent with its own snapshot folder."""
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO),
        ZEROTRAIN_SNAPSHOT_DIR=str(root / f"shm-{node}"),
        VICTIM="1" if victim else "0",
        OMP_NUM_THREADS="1",
    )
    elastic = ["--nnodes", "1:2", "--max-restarts", "3", "--monitor-interval", "0.2"]
    rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    rendezvous += ["--rdzv-id", "recovery-test", "--rdzv-conf", "last_call_timeout=2"]
    command = [sys.executable, "-m", "zerotrain.cli", "run", "--nproc-per-node", str(nproc)]
    command += [*elastic, *rendezvous, str(root / "train.py"), str(root), *args]
    # output to a file: the workers of a killed agent would hold a pipe open
    log = open(root / f"agent-{node}.log", "w")
    return subprocess.Popen(
        command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def _reports(root: Path) -> list[dict]:
    """What each rank of the round that finished reported (the others were stopped)."""
    return [json.loads(p.read_text()) for p in sorted(root.glob("report-*.json"))]


def _recover(tmp_path: Path, victim: str) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    kill_at = random.randint(3, TOTAL - 2)
    port = _free_port()
    args = (str(tmp_path / "disk"), "-", str(kill_at), victim, "on")
    # node A's agent first: it hosts the rendezvous store, which must outlive node B
    a = _agent(tmp_path, port, 2, "a", victim == "rank", *args)
    time.sleep(1.0)
    b = _agent(tmp_path, port, 1, "b", victim == "node", *args)
    try:
        a.wait(timeout=240)
        if victim == "rank":
            b.wait(timeout=30)
    finally:
        for agent in (a, b):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)
    logs = {n: (tmp_path / f"agent-{n}.log").read_text()[-3000:] for n in "ab"}
    assert a.returncode == 0, logs
    after = _reports(tmp_path)
    world = 3 if victim == "rank" else 2
    assert len(after) == world and all(r["world"] == world for r in after), (kill_at, after, logs)
    assert all(r["start"] == kill_at for r in after), (kill_at, after)
    assert "shm-" in after[0]["path"]  # from a snapshot, not the disk's step 2
    killed = float((tmp_path / "killed").read_text())
    seconds = max(r["first_step_done"] for r in after) - killed
    print(f"kill -9 of a {victim} at step {kill_at}: first step after recovery {seconds:.1f} s")
    assert seconds < 60
    # the reference: a disk checkpoint of the recovered step, resumed at the same world size
    reference = subprocess.run(
        [
            sys.executable,
            "-m",
            "zerotrain.cli",
            "run",
            "--nproc-per-node",
            str(world),
            str(tmp_path / "train.py"),
            str(tmp_path),
            str(tmp_path / "every"),
            f"global_step{kill_at}",
            "0",
            "none",
            "off",
        ],
        env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert reference.returncode == 0, reference.stdout[-2000:] + reference.stderr[-2000:]
    mine = torch.load(tmp_path / "final--.pt")
    theirs = torch.load(tmp_path / f"final-global_step{kill_at}.pt")
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


@pytest.mark.slow  # 50 s; tests/test_snapshots.py checks the same recovery in 5 s
def test_a_lost_node_is_survived_from_the_buddy_copies_at_2_ranks(tmp_path):
    _recover(tmp_path, "node")


@pytest.mark.slow
def test_a_killed_rank_is_restarted_and_resumes_from_its_snapshot_at_3_ranks(tmp_path):
    _recover(tmp_path, "rank")
