"""In-memory snapshots and recovery from them (issue 42; [Note: in-memory snapshots] in
zerotrain/checkpoint/snapshots.py).

gloo ranks, the awkward model with AdamW at stage 2. Emulated nodes are ranks given their own
snapshot folder (``ZEROTRAIN_SNAPSHOT_DIR``), as each node has its own /dev/shm. A snapshot
holds the files a disk checkpoint of its step holds, byte for byte; a restart resumes from the
newest snapshot when it is newer than the disk's checkpoint, at another world size too, with a
lost node's files taken from its buddies, and trains on exactly as a resume from a disk
checkpoint of that step; a snapshot failing its checksum is skipped for an older one.
The end-to-end run with torchrun's elastic agents and kill -9 is
tests/test_elastic_recovery.py.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tests.distributed import run_distributed
from tests.models import AwkwardModel, make_batches, run_steps
from zerotrain.checkpoint.snapshots import SNAPSHOT_DIR_ENV

MICRO = 2


@pytest.fixture(autouse=True)
def _job(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test-snapshots")


def _engine(snapshots: bool = True, every: int = 1):
    import zerotrain

    torch.manual_seed(0)
    model = AwkwardModel()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 2},
        "checkpoint": {"in_memory_snapshots": {"enabled": snapshots, "every_steps": every}},
        "steps_per_print": 10**6,
    }
    engine, *_ = zerotrain.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    return engine


def _train(engine, steps: int, seed: int) -> None:
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    # the same global batches at any world size: each rank its rows of them
    idx, tgt = make_batches(steps, MICRO * 6, seed=seed)
    per_rank = 6 // world
    for step in range(steps):
        rows = slice(rank * per_rank * MICRO, (rank + 1) * per_rank * MICRO)
        run_steps(
            engine,
            idx[step : step + 1, rows],
            tgt[step : step + 1, rows],
            per_rank * MICRO,
            1,
            1,
            0,
        )


def _node(root: str, nodes: list[int]) -> None:
    """This rank's emulated node: ``nodes[rank]``'s own snapshot folder."""
    os.environ[SNAPSHOT_DIR_ENV] = f"{root}/node{nodes[torch.distributed.get_rank()]}"


def _params(engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.consolidated_state_dict().items()}


def _hashes(directory) -> dict[str, str]:
    manifest = json.loads(open(os.path.join(directory, "manifest.json")).read())
    roles = manifest["roles"]
    return {
        f"{role}{i}": manifest["files"][name]["sha256"]
        for role, names in roles.items()
        for i, name in enumerate(names if isinstance(names, list) else [names])
        if name is not None
    }


def _as_if_killed() -> None:
    """These processes end as killed ones would: a clean exit would remove the job's snapshots
    (test_a_clean_exit_removes_the_job_s_snapshots)."""
    from zerotrain.checkpoint import snapshots

    snapshots._cleaned_at_exit.clear()


def _take(root: str, nodes: list[int], killed: bool = True) -> dict:
    _node(root, nodes)
    engine = _engine()
    if killed:
        _as_if_killed()
    _train(engine, 2, seed=1)
    engine.save_checkpoint(f"{root}/disk", tag="global_step2")
    _train(engine, 1, seed=2)
    return {"params": _params(engine), "steps": engine.global_steps}


def _resume(root: str, nodes: list[int], train_steps: int) -> dict:
    _node(root, nodes)
    engine = _engine()
    _as_if_killed()
    path, _ = engine.load_checkpoint(f"{root}/disk")
    resumed = _params(engine)
    _train(engine, train_steps, seed=3)
    return {
        "path": str(path),
        "resumed": resumed,
        "trained": _params(engine),
        "steps": engine.global_steps,
    }


def _resume_from_disk(root: str, tag: str, train_steps: int) -> dict:
    engine = _engine(snapshots=False)
    engine.load_checkpoint(f"{root}/disk", tag=tag)
    _train(engine, train_steps, seed=3)
    return {"trained": _params(engine)}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_snapshot_is_a_checkpoint_of_its_step_and_a_restart_resumes_from_the_newest(tmp_path):
    taken = run_distributed(_take, 2, str(tmp_path), [0, 0])
    job = tmp_path / "node0" / "test-snapshots"
    assert sorted(p.name for p in job.iterdir()) == ["global_step2", "global_step3"]  # keep 2
    assert _hashes(job / "global_step2") == _hashes(tmp_path / "disk" / "global_step2")
    resumed = run_distributed(_resume, 2, str(tmp_path), [0, 0], 1)
    for got in resumed:
        assert got["path"] == str(job / "global_step3")  # newer than the disk's step 2
        assert _equal(got["resumed"], taken[0]["params"])
        assert got["steps"] == 4


def test_a_lost_node_s_state_comes_from_its_buddies_at_the_new_world_size(tmp_path):
    # 3 ranks on 2 nodes; node 1 (rank 2) is lost; 2 ranks go on from node 0's folder
    taken = run_distributed(_take, 3, str(tmp_path), [0, 0, 1])
    node0 = tmp_path / "node0" / "test-snapshots" / "global_step3"
    assert len(list(node0.glob("*-rank00002.*"))) == 2  # rank 2's files, its buddy's copy
    shutil.rmtree(tmp_path / "node1")
    resumed = run_distributed(_resume, 2, str(tmp_path), [0, 0], 1)
    # the same as resuming a disk checkpoint of step 3 at world 2 (the one node 0 completed)
    complete = tmp_path / "node0" / "test-snapshots" / "global_step3"
    assert len(list(complete.glob("*.safetensors"))) == 4  # 3 shards and the module
    shutil.copytree(complete, tmp_path / "disk" / "global_step3")
    reference = run_distributed(_resume_from_disk, 2, str(tmp_path), "global_step3", 1)
    for got in resumed:
        assert got["path"] == str(node0)
        assert _equal(got["resumed"], taken[0]["params"])  # step 3's state, rank 2's included
        assert _equal(got["trained"], reference[0]["trained"])


def _resume_warned(root: str, nodes: list[int]) -> dict:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _resume(root, nodes, 0)
    got["warnings"] = [str(w.message) for w in caught if "skipped for an older" in str(w.message)]
    return got


def test_a_snapshot_failing_its_checksum_is_skipped_for_an_older_one(tmp_path):
    run_distributed(_take, 2, str(tmp_path), [0, 0])
    job = tmp_path / "node0" / "test-snapshots"
    shard = next((job / "global_step3").glob("*-rank00001.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    # the disk's step 2 is as new as the older snapshot: the snapshot is taken (it is faster)
    results = run_distributed(_resume_warned, 2, str(tmp_path), [0, 0])
    for got in results:
        assert got["path"] == str(job / "global_step2") and got["steps"] == 2
    assert any("global_step3" in w for w in results[0]["warnings"]), results[0]["warnings"]


def test_a_clean_exit_removes_the_job_s_snapshots(tmp_path):
    run_distributed(_take, 2, str(tmp_path), [0, 0], False)
    assert (tmp_path / "node0").is_dir() and not (tmp_path / "node0" / "test-snapshots").exists()


def test_zerotrain_run_removes_the_job_s_snapshots_when_the_job_ends(tmp_path):
    """Also after a failure with the restarts used up: a new job cannot resume from them."""
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(
        "import os, pathlib, sys\n"
        "folder = pathlib.Path(os.environ['ZEROTRAIN_SNAPSHOT_DIR'], "
        "os.environ['TORCHELASTIC_RUN_ID'], 'global_step1')\n"
        "folder.mkdir(parents=True, exist_ok=True)\n"
        "sys.exit(int(sys.argv[1]))\n"
    )
    env = dict(os.environ, ZEROTRAIN_SNAPSHOT_DIR=str(tmp_path / "shm"), PYTHONPATH=".")
    for code in (0, 3):
        command = [sys.executable, "-m", "zerotrain.cli", "run", "--nproc-per-node", "1"]
        ended = subprocess.run(
            [*command, str(script), str(code)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert ended.returncode == code, ended.stderr[-2000:]
        assert (tmp_path / "shm").is_dir() and not list((tmp_path / "shm").iterdir())
