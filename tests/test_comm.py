"""The communication layer: the only user of torch.distributed, bounded by timeouts."""

from __future__ import annotations

import ast
import contextlib
import pathlib
import re
import time

import pytest
import torch
from distributed import run_distributed

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "zerotrain"


# The launcher reads torchrun's own argument parser; it issues no collectives.
LAUNCHER_ONLY = {  # torchrun itself: the launcher is no training process
    "cli/launch.py": ("torch.distributed.run", "torch.distributed.run.get_args_parser"),
    "cli/torchrun.py": (
        "torch.distributed.run",
        "torch.distributed.run.parse_args",
        "torch.distributed.run.run",
        "torch.distributed.elastic.multiprocessing.api",
        "torch.distributed.elastic.multiprocessing.api.SignalException",
        "torch.distributed.elastic.multiprocessing.errors",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError",
    ),
}


def test_only_comm_imports_torch_distributed():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] == "comm":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            names = [
                n
                for n in names
                if n not in LAUNCHER_ONLY.get(path.relative_to(PACKAGE).as_posix(), ())
            ]
            if any(n == "torch.distributed" or n.startswith("torch.distributed.") for n in names):
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not offenders, f"only zerotrain/comm may import torch.distributed: {offenders}"


def stalled_peer():
    from zerotrain.comm import CollectiveError, Communicator

    comm = Communicator()
    if comm.rank == 1:
        time.sleep(6)  # stalls past rank 0's collective timeout
        return "slept"
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(4))
    except CollectiveError as err:
        return {"message": str(err), "seconds": time.monotonic() - start}
    return "no error"


def test_stalled_rank_gives_error_naming_the_collective():
    result, _ = run_distributed(stalled_peer, 2, collective_timeout_s=2, timeout=60)
    assert isinstance(result, dict), result
    assert "all_reduce of 16 bytes failed on rank 0 of 2" in result["message"]
    assert result["seconds"] < 5


def stalled_peer_in_pairwise_exchange():
    from zerotrain.comm import CollectiveError, Communicator

    comm = Communicator()
    comm.barrier()
    if comm.rank == 1:
        time.sleep(4)  # stalls past the others' collective timeout, never joins the gather
        return "slept"
    start = time.monotonic()
    try:
        comm.all_gather(torch.empty(3 * 4), torch.ones(4))
    except CollectiveError as err:
        return {"message": str(err), "seconds": time.monotonic() - start}
    return "no error"


def test_stalled_rank_is_named_by_its_pairwise_peers():
    # gloo's all-gather is a pairwise exchange (pairwise.py): each message has one peer, so the
    # error names the rank that stalled. Rank 2 hears from rank 0 first, then waits for rank 1.
    results = run_distributed(
        stalled_peer_in_pairwise_exchange, 3, collective_timeout_s=2, timeout=60
    )
    assert results[1] == "slept"
    for rank in (0, 2):
        got = results[rank]
        assert isinstance(got, dict), got
        assert got["message"].startswith(
            f"all_gather of 48 bytes failed on rank {rank} of 3 (collective timeout 0:00:02): "
            f"rank {rank} waited 2."
        ), got["message"]
        assert " s for rank 1 to send its piece of the pairwise all_gather: " in got["message"]
        named, _, where = got["message"].partition("\n  where the ranks are")
        assert named.endswith("Rank 1 probably died or stalled; check its log."), named
        assert where.startswith(" that have not reached all_gather #2:\n    rank 1 ("), where
        assert got["seconds"] < 4.5 + 1  # and up to a second reading where rank 1 is


def dead_peer():
    import os

    from zerotrain.comm import CollectiveError, Communicator

    comm = Communicator()
    comm.barrier()
    if comm.rank == 1:
        os._exit(3)  # dies without a word
    try:
        for _ in range(3):
            out = torch.empty(8)
            comm.all_gather(out, torch.ones(4))
    except CollectiveError as err:
        return str(err)
    return "no error"


def test_dead_rank_gives_error_not_hang():
    survivor, dead = run_distributed(dead_peer, 2, collective_timeout_s=5, timeout=60, may_die=(1,))
    assert dead == 3
    assert "all_gather of 32 bytes failed on rank 0 of 2" in survivor
    assert "Rank 1 probably died or stalled" in survivor  # the pairwise peer that died


def silent_peers(kind: str):
    """Ranks 0-1 all-reduce on the world (a backend collective, not a pairwise exchange) while
    rank 2 is elsewhere: in its own code, waiting in another collective, or dead."""
    import os

    from zerotrain.comm import CollectiveError, Communicator

    comm = Communicator()
    pair = comm.split([[0], [1, 2]]) if kind == "deadlock" else None
    comm.all_reduce(torch.ones(4))
    if comm.rank == 2:
        if kind == "stalled":
            time.sleep(5)  # past the others' timeout (2 s) and their reading (1 s)
        elif kind == "deadlock":
            with contextlib.suppress(CollectiveError):  # rank 1 never joins it
                pair.broadcast(torch.ones(4), src=1)  # a rank of the default group
            time.sleep(3)  # its end would break ranks 0-1's collective before it times out
        else:
            os._exit(3)
        return "elsewhere"
    try:
        comm.all_reduce(torch.ones(4))
    except CollectiveError as err:
        time.sleep(2)  # rank 0 holds the store the other ranks read their peers' records from
        return str(err)
    return "no error"


@pytest.mark.parametrize("kind", ["stalled", "deadlock", "dead"])
def test_a_backend_collective_names_where_the_silent_peer_is(kind):
    results = run_distributed(
        silent_peers, 3, kind, collective_timeout_s=2, timeout=60, may_die=(2,)
    )
    for rank in (0, 1):
        message = results[rank]
        assert f"all_reduce of 16 bytes failed on rank {rank} of 3" in message, message
        head, _, where = message.partition("where the ranks are that have not reached ")
        assert where.startswith("all_reduce #2:\n    rank 2"), message
        assert "1 other rank(s) reached it" in where
        if kind == "stalled":
            assert "its last collective on this group is all_reduce #1, " in where, where
            assert "it is in its own code, not in a collective: stalled or slow" in where
        elif kind == "deadlock":
            assert re.search(r"it is waiting in broadcast #1 on group \S+ for \d", where), where
        else:
            assert "no record since this wait began: its process is dead" in where, where


def collectives():
    from zerotrain.comm import Communicator

    comm = Communicator()
    r, n = comm.rank, comm.world_size
    t = torch.full((3,), float(r + 1))
    comm.all_reduce(t)
    gathered = torch.zeros(2 * n)
    gathered[2 * r : 2 * r + 2] = r + 1
    comm.all_gather(gathered, gathered[2 * r : 2 * r + 2])
    shard = torch.zeros(2)
    comm.reduce_scatter(shard, torch.arange(2.0 * n))
    rows = torch.arange(2.0 * n).view(n, 2) + 10 * r  # row p for rank p
    exchanged = torch.empty_like(rows)
    comm.all_to_all(exchanged, rows)  # equal pieces: pairwise on gloo
    return {
        "sum": t.tolist(),
        "gathered": gathered.tolist(),
        "shard": shard.tolist(),
        "exchanged": exchanged.tolist(),
        "stats": {k: (v.calls, v.bytes, v.sent) for k, v in comm.stats.items()},
    }


def test_collectives_and_byte_counts():
    for rank, got in enumerate(run_distributed(collectives, 3)):
        assert got["sum"] == [6.0] * 3
        assert got["gathered"] == [1, 1, 2, 2, 3, 3]
        assert got["shard"] == [3.0 * 2 * rank, 3.0 * (2 * rank + 1)]
        # row r of every rank p, in rank order
        assert got["exchanged"] == [[2 * rank + 10 * p, 2 * rank + 1 + 10 * p] for p in range(3)]
        # sent: (N-1)/N of the buffer for a reduce-scatter, an all-gather or an all-to-all (the
        # pairwise exchange on gloo sends exactly that), twice that for an all-reduce
        assert got["stats"] == {
            "all_reduce": (1, 12, 16),
            "all_gather": (1, 24, 16),
            "reduce_scatter": (1, 24, 16),
            "all_to_all": (1, 24, 16),
        }


def new_group_of_rank_0():
    from zerotrain.comm import Communicator

    try:
        return Communicator().new_group([0]).world_size
    except ValueError as err:
        return str(err)


def test_new_group_names_the_rank_left_out():
    """A rank outside ``ranks`` gets an error that says so (found by the type checker: torch's
    non-member marker reached Communicator, which failed with "Invalid process group")."""
    member, outside = run_distributed(new_group_of_rank_0, 2)
    assert member == 1
    assert "new_group: rank 1 is not in ranks [0]" in outside


def dropped_gather():
    import gc
    import time

    from zerotrain.comm import Communicator, pairwise

    comm = Communicator()
    out = torch.zeros(8)
    if comm.rank == 1:
        time.sleep(0.5)  # rank 0 drops its operation while the message is still on its way
    op = comm.all_gather(out, torch.full((4,), float(comm.rank + 1)), async_op=True)
    held_after_drop = None
    if comm.rank == 0:
        del op, out
        gc.collect()
        held_after_drop = len(pairwise._dropped)  # its receive buffer is kept alive
    else:
        op.wait()
    later = torch.zeros(8)
    comm.all_gather(later, torch.full((4,), float(comm.rank + 10)))  # a later operation
    return held_after_drop, later.tolist(), len(pairwise._dropped)


def test_an_unwaited_pairwise_operation_cannot_write_into_freed_memory():
    (held, later, left), _ = run_distributed(dropped_gather, 2)
    assert held == 1  # kept until its messages have landed
    assert later == [10.0] * 4 + [11.0] * 4  # and no message went to the wrong operation
    assert left == 0  # the later operation completed it


@pytest.mark.parametrize(
    ("environ", "hosts", "threads_before", "expected"),
    [
        ({"LOCAL_WORLD_SIZE": "4"}, None, 8, 2),  # torchrun's count: 8 cores / 4 ranks
        ({}, [("a", [0]), ("a", [0]), ("b", [0])], 8, 4),  # plain: 2 of 3 ranks on this host
        ({}, [("a", [0, 1]), ("a", [2, 3])], 8, None),  # pinned apart: all of its own cores
        ({"LOCAL_WORLD_SIZE": "16"}, None, 8, 1),  # more ranks than cores: at least 1
        ({"OMP_NUM_THREADS": "8", "LOCAL_WORLD_SIZE": "4"}, None, 8, None),  # the user's
        ({"LOCAL_WORLD_SIZE": "2"}, None, 1, None),  # already below the share: kept
    ],
)
def test_cpu_ranks_on_one_node_share_its_cores(
    monkeypatch, environ, hosts, threads_before, expected
):
    from zerotrain.comm import setup

    for name in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(setup, "usable_cpus", lambda: 8)
    if hosts is not None:
        monkeypatch.setattr(setup.socket, "gethostname", lambda: "a")
        monkeypatch.setattr(setup.os, "sched_getaffinity", lambda pid: set(hosts[0][1]))
        monkeypatch.setattr(setup.dist, "get_world_size", lambda: len(hosts))
        monkeypatch.setattr(
            setup.dist, "all_gather_object", lambda out, _: out.__setitem__(slice(None), hosts)
        )
    threads = [threads_before]
    monkeypatch.setattr(setup.torch, "get_num_threads", lambda: threads[0])
    monkeypatch.setattr(setup.torch, "set_num_threads", lambda n: threads.__setitem__(0, n))
    assert setup._share_cpu_cores() == expected
    assert threads[0] == (expected or threads_before)


def test_usable_cpus_read_the_smallest_cgroup_quota(tmp_path, monkeypatch):
    from zerotrain import accelerator

    (tmp_path / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs: 2 cores usable
    assert accelerator._cpu_quota_at(str(tmp_path), "cpu.max") == 2
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert accelerator._cpu_quota_at(str(tmp_path), "cpu.max") is None
    (tmp_path / "cpu.cfs_quota_us").write_text("300000\n")  # cgroup v1
    (tmp_path / "cpu.cfs_period_us").write_text("100000\n")
    assert accelerator._cpu_quota_at(str(tmp_path), "") == 3
    monkeypatch.setattr(accelerator, "_cgroup_cpu_quota", lambda: 1)
    assert accelerator.usable_cpus() == 1
