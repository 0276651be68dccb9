"""Who ends the default process group (see [Note: who ends the process group] in
zerotrain/comm/setup.py): zerotrain at exit when it made the group, the script otherwise;
``engine.destroy()`` never.

Each rank is a plain subprocess with torchrun's variables set, so its stderr and its exit are
the ones a user sees. torch's warning is NCCL's (ProcessGroupNCCL's destructor): with one rank on
a GPU machine these runs use NCCL and would show it; on the CPU (gloo, which never warns) the
line the script prints after zerotrain's exit hook shows whether the group was destroyed.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "process_group_lifetime.py"
# torch's text (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp, ~ProcessGroupNCCL): "WARNING:
# destroy_process_group() was not called before program exit, which can leak resources."
TORCH_WARNING = "destroy_process_group() was not called"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(maker: str, world: int) -> list[subprocess.Popen]:
    """The script on ``world`` ranks, started."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
    )
    if torch.cuda.device_count() < world:  # NCCL needs a GPU per rank: use gloo
        env["CUDA_VISIBLE_DEVICES"] = ""
    return [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), maker],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]


RUNS = [("zerotrain", 1), ("zerotrain", 2), ("user", 1), ("remade", 1)]


@pytest.fixture(scope="module")
def runs() -> dict[tuple[str, int], list[subprocess.CompletedProcess]]:
    """Every run of RUNS, started together (each rank's start is mostly importing torch); each
    rank's result once it has exited, within 60 s."""
    started = {run: start_ranks(*run) for run in RUNS}
    finished = {}
    try:
        for run, procs in started.items():
            finished[run] = []
            for proc in procs:
                out, err = proc.communicate(timeout=60)
                finished[run].append(
                    subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
                )
    finally:
        for procs in started.values():
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
    return finished


def _ranks(runs, maker: str, world: int) -> list[subprocess.CompletedProcess]:
    for rank, result in enumerate(runs[maker, world]):
        assert result.returncode == 0, f"rank {rank}:\n{result.stdout}\n{result.stderr}"
        assert TORCH_WARNING not in result.stderr, result.stderr
    return runs[maker, world]


@pytest.mark.parametrize("world", [1, 2])
def test_a_group_zerotrain_made_is_destroyed_at_exit_not_by_engine_destroy(runs, world):
    for rank in _ranks(runs, "zerotrain", world):
        lines = rank.stdout.splitlines()
        assert "zerotrain made the group: True" in lines, rank.stdout
        # destroy() left it: the second engine trained, a collective ran afterwards
        assert f"after destroy: group initialized=True sum={world}" in lines, rank.stdout
        assert lines[-1] == "at exit: group initialized=False", rank.stdout  # the exit hook


@pytest.mark.parametrize("maker", ["user", "remade"])
def test_a_group_the_script_made_survives_engine_destroy_and_exit_hook(runs, maker):
    # "remade": the script destroyed zerotrain's group and made its own, which is the script's
    (rank,) = _ranks(runs, maker, 1)
    lines = rank.stdout.splitlines()
    assert "zerotrain made the group: False" in lines, rank.stdout
    assert "after destroy: group initialized=True sum=1" in lines, rank.stdout
    assert lines[-1] == "at exit: group initialized=True", rank.stdout  # left to the script
