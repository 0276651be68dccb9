"""Asynchronous saves (issue 42; [Note: asynchronous saves] in
zerotrain/checkpoint/background.py): the step waits only for a host snapshot, a background
thread writes and commits.

2 gloo ranks, the awkward model with AdamW. A slow-disk stand-in (every safetensors write
sleeps first) keeps the background write running while training goes on, which is where a
snapshot that is not a copy would show: the checkpoint must equal a synchronous save of the
same step, file for file (SHA-256). A kill -9 during the background write leaves the previous
checkpoint the newest complete one; two saves in a row both commit, or the second is skipped;
a full disk raises at the next wait on every rank and leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import signal
import time
import warnings

import pytest
import torch

from tests.distributed import run_distributed
from tests.models import AwkwardModel, make_batches, run_steps
from zerotrain.checkpoint import scan

MICRO, ACCUM, WORLD = 2, 1, 2


def _engine(stage: int = 2, offload: dict | None = None, **checkpoint):
    import zerotrain

    torch.manual_seed(0)
    model = AwkwardModel()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, **(offload or {})},
        "checkpoint": checkpoint,
        "steps_per_print": 10**6,
    }
    engine, *_ = zerotrain.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    return engine


def _train(engine, steps: int, seed: int) -> None:
    idx, tgt = make_batches(steps, MICRO * ACCUM * WORLD, seed=seed)
    run_steps(engine, idx, tgt, MICRO, ACCUM, WORLD, torch.distributed.get_rank())


def _slow_disk(seconds: float) -> None:
    """Every safetensors file of a save waits ``seconds`` before it is written."""
    from zerotrain.checkpoint import save

    write = save.write_safetensors

    def slow(path, entries):
        time.sleep(seconds)
        return write(path, entries)

    save.write_safetensors = slow


def _hashes(directory: str) -> dict[str, str]:
    """role -> SHA-256 of each file of a committed checkpoint (names hold the save id)."""
    manifest = json.loads(open(os.path.join(directory, "manifest.json")).read())
    files = manifest["files"]
    hashes = {}
    for role, names in manifest["roles"].items():
        for i, name in enumerate(names if isinstance(names, list) else [names]):
            if name is not None:
                hashes[f"{role}{i}"] = files[name]["sha256"]
    return hashes


OFFLOAD = {
    None: None,
    "cpu": {"offload_optimizer": {"device": "cpu"}},
    "nvme": {"offload_optimizer": {"device": "nvme", "nvme_path": "NVME"}, "sub_group_size": 64},
}


def _async_equals_sync(root: str, stage: int, offload: str | None) -> dict:
    zero = json.loads(json.dumps(OFFLOAD[offload]).replace("NVME", f"{root}/nvme"))
    engine = _engine(stage, zero)
    _train(engine, 2, seed=1)
    engine.save_checkpoint(f"{root}/sync", tag="step2", client_state={"note": "x"})
    _slow_disk(0.5)
    returned = time.time()
    engine.save_checkpoint(
        f"{root}/async", tag="step2", client_state={"note": "x"}, async_save=True
    )
    returned = time.time() - returned
    pending = engine.checkpoint_pending()
    _train(engine, 2, seed=2)  # changes every master and moment while the write goes on
    trained = time.time()
    path = engine.wait_for_checkpoint()
    manifest = json.loads(open(f"{root}/async/step2/manifest.json").read())
    return {
        "returned_s": returned,
        "pending_after_save": pending,
        "steps_ended_before_commit": trained < manifest["commit_time"],
        "path": str(path),
        "pending_after_wait": engine.checkpoint_pending(),
    }


@pytest.mark.parametrize(("stage", "offload"), [(1, None), (3, None), (2, "cpu"), (3, "nvme")])
def test_an_async_save_equals_a_sync_save_of_its_step_while_training_goes_on(
    tmp_path, stage, offload
):
    results = run_distributed(_async_equals_sync, WORLD, str(tmp_path), stage, offload)
    for got in results:
        assert got["returned_s"] < 0.5, got  # the disk takes 0.5 s per file
        assert got["pending_after_save"] and not got["pending_after_wait"]
        assert got["steps_ended_before_commit"]  # two steps ran during the write
        assert got["path"] == str(tmp_path / "async" / "step2")
    assert _hashes(tmp_path / "sync" / "step2") == _hashes(tmp_path / "async" / "step2")
    assert (tmp_path / "async" / "latest").read_text() == "step2"


def _two_in_a_row(root: str, pending: str) -> dict:
    engine = _engine(2, async_save=True, async_save_pending=pending)
    _train(engine, 1, seed=1)
    _slow_disk(0.5)
    first = engine.save_checkpoint(root)
    _train(engine, 1, seed=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second = engine.save_checkpoint(root)
    engine.wait_for_checkpoint()
    return {
        "first": first and first.name,
        "second": second and second.name,
        "warned": [str(w.message) for w in caught if "skipped" in str(w.message)],
    }


def test_two_saves_in_a_row_wait_for_each_other_or_skip(tmp_path):
    for got in run_distributed(_two_in_a_row, WORLD, str(tmp_path / "wait"), "wait"):
        assert (got["first"], got["second"], got["warned"]) == ("global_step1", "global_step2", [])
    complete = [s.path.name for s in scan(tmp_path / "wait") if s.complete]
    assert complete == ["global_step1", "global_step2"]
    assert (tmp_path / "wait" / "latest").read_text() == "global_step2"
    for got in run_distributed(_two_in_a_row, WORLD, str(tmp_path / "skip"), "skip"):
        assert (got["first"], got["second"]) == ("global_step1", None)
        assert "still being written" in got["warned"][0], got
    assert [s.path.name for s in scan(tmp_path / "skip") if s.complete] == ["global_step1"]


def _full_disk(root: str) -> dict:
    from zerotrain.checkpoint import CheckpointError, save

    engine = _engine(2)
    _train(engine, 1, seed=1)
    engine.save_checkpoint(root, tag="good")
    write = save.write_safetensors

    def full(path, entries):
        if torch.distributed.get_rank() == 1:
            time.sleep(0.3)
            raise OSError(28, "No space left on device")
        return write(path, entries)

    save.write_safetensors = full
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.save_checkpoint(root, tag="full", async_save=True)
        _train(engine, 1, seed=2)  # the step does not raise for it
        with pytest.raises(CheckpointError) as error:
            engine.wait_for_checkpoint()
    engine.wait_for_checkpoint()  # raised once
    save.write_safetensors = write
    path = engine.save_checkpoint(root, tag="after", async_save=True)  # saving goes on
    engine.wait_for_checkpoint()
    return {
        "error": str(error.value),
        "warned": any("asynchronous save_checkpoint failed" in str(w.message) for w in caught),
        "after": path.name,
    }


def test_a_full_disk_during_the_write_raises_at_the_next_wait_and_leaves_nothing(tmp_path):
    for got in run_distributed(_full_disk, WORLD, str(tmp_path)):
        assert "rank 1: OSError: [Errno 28] No space left on device" in got["error"], got
        assert "was not saved (earlier checkpoints are untouched)" in got["error"]
        assert got["warned"] and got["after"] == "after"
    assert not (tmp_path / "full").exists()  # its partial files and directory are gone
    assert [s.path.name for s in scan(tmp_path) if s.complete] == ["good", "after"]


def _killed_during_the_write(root: str) -> None:
    engine = _engine(2)
    _train(engine, 1, seed=1)
    engine.save_checkpoint(root, tag="before")
    _slow_disk(1.0)
    engine.save_checkpoint(root, tag="killed", async_save=True)
    _train(engine, 1, seed=2)
    time.sleep(1.5)  # rank files partly written, nothing committed
    os.kill(os.getpid(), signal.SIGKILL)


def test_kill_9_during_the_write_leaves_the_previous_checkpoint_the_newest(tmp_path):
    exits = run_distributed(_killed_during_the_write, WORLD, str(tmp_path), may_die=(0, 1))
    assert exits == [-signal.SIGKILL] * WORLD
    assert list((tmp_path / "killed").glob("*.safetensors"))  # the write had started
    states = {s.path.name: s.complete for s in scan(tmp_path)}
    assert states == {"before": True, "killed": False}
    assert (tmp_path / "latest").read_text() == "before"
    for got in run_distributed(_load_newest, WORLD, str(tmp_path)):
        assert got.endswith("before")


def _load_newest(root: str) -> str:
    engine = _engine(2)
    path, _ = engine.load_checkpoint(root)
    return str(path)


def _snapshot_does_not_fit(root: str) -> dict:
    from zerotrain.checkpoint import background

    engine = _engine(2)
    _train(engine, 1, seed=1)
    background.available_host_memory = lambda: 1 << 20  # 1 MiB free
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.save_checkpoint(root, async_save=True)
    rank = torch.distributed.get_rank()
    written = f"rank{rank:05d}.safetensors" in {
        p.name.split("-", 1)[1] for p in os.scandir(f"{root}/global_step1")
    }
    engine.wait_for_checkpoint()
    return {
        "warning": next(str(w.message) for w in caught if "host copy" in str(w.message)),
        "written_before_return": written,
    }


def test_a_snapshot_that_does_not_fit_in_host_memory_is_written_before_returning(tmp_path):
    results = run_distributed(_snapshot_does_not_fit, WORLD, str(tmp_path))
    for got in results:
        assert "more host memory on each of 1 rank(s)" in got["warning"], got
        assert "1.00 MiB is available" in got["warning"], got
        assert got["written_before_return"]  # this rank's shard, before save_checkpoint returned
    assert [s.path.name for s in scan(tmp_path) if s.complete] == ["global_step1"]
