"""NVMe offload under pressure: what it saves in host memory (peak RSS, a memory cgroup's
limit), and how it fails (kill -9 mid-step, a full disk, preflights).

[Note: measuring RSS in these tests]
Each memory measurement is a fresh process (tests/scripts/offload_memory.py), so that its peak
is its own; the peak is VmHWM (see zerotrain.accelerator.peak_rss: ``ru_maxrss`` would carry
pytest's peak across the exec). The processes run with glibc's allocator as users have it: no
``MALLOC_*`` variable. glibc raises its mmap threshold the first time a large block is freed
and then serves blocks up to that size from heaps, which fragment; the NVMe store hands such
freed memory back while its first step creates the optimizer state (see [Note: NVMe offload
and freed host memory] in zerotrain/zero/nvme.py). Without that the NVMe run kept up to 174
MiB freed but resident and its peak RSS fell by 42-64% of the optimizer state over five runs
instead of 94%, unless ``MALLOC_MMAP_THRESHOLD_=65536`` was set, which these tests once did.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import signal
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from models import AwkwardModel, param_groups
from torch import nn

import zerotrain
from zerotrain.accelerator import current_rss
from zerotrain.zero import nvme, swap
from zerotrain.zero.host import gib

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "offload_memory.py"
MEMORY_ENV = {"OMP_NUM_THREADS": "1"}  # and no MALLOC_* variable: see the Note
MiB = 1 << 20


def run_memory_script(*args: str, prefix: tuple[str, ...] = ()) -> tuple[int, dict, str]:
    """tests/scripts/offload_memory.py with ``args`` (after ``prefix``, a command that execs
    it): (exit status, its JSON line or {}, stderr)."""
    env = dict(
        {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")},
        **MEMORY_ENV,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        CUDA_VISIBLE_DEVICES="",
    )
    done = subprocess.run(
        [*prefix, sys.executable, str(SCRIPT), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return done.returncode, json.loads(lines[-1]) if lines else {}, done.stderr


# -- memory: peak RSS -------------------------------------------------------------------------
def test_peak_rss_is_this_process_s_own():
    """A process started by a larger one reports its own peak, not its parent's."""
    parent = torch.ones(1 << 28)  # 1 GiB resident here
    code = "from zerotrain.accelerator import peak_rss; print(peak_rss())"
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    child = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert int(child.stdout) < parent.numel() * 4 <= current_rss()


def test_nvme_offload_cuts_peak_rss_by_the_optimizer_state(tmp_path):
    # 6 x Linear(2048, 2048): 25.2M parameters, 201 MB of AdamW state (exp_avg, exp_avg_sq).
    # In fp32 on a CPU device the masters are the parameters in both runs: the difference is
    # the state, less the staging sets (2 x 256Ki elements x 16 B) and the ring (2 x 1 MiB).
    steps = ("--steps", "5", "--sub-group-size", str(1 << 18), "--buffer-count", "2")
    code, in_memory, stderr = run_memory_script("--offload", "none", *steps)
    assert code == 0, stderr
    code, on_disk, stderr = run_memory_script(
        "--offload", "nvme", "--nvme-path", str(tmp_path), *steps
    )
    assert code == 0, stderr
    state_bytes = in_memory["memory"]["optimizer_states"]
    assert state_bytes >= 8 * in_memory["params"]
    assert on_disk["memory"]["optimizer_states"] < MiB  # Adam's step counters only
    saved = in_memory["peak_rss"] - on_disk["peak_rss"]
    assert saved >= 0.8 * state_bytes, (in_memory["peak_rss"], on_disk["peak_rss"], state_bytes)
    # bounded across steps: nothing accumulates once the first step has made the state. (The
    # in-memory run keeps glibc's own threshold, under which its heap still grows by a 16 MiB
    # block on some steps: see [Note: NVMe offload and freed host memory].)
    after = on_disk["rss_after_step"]
    assert max(after[1:]) - after[1] < 8 * MiB, [n // MiB for n in after]
    assert not list(tmp_path.glob("zerotrain-*.swap"))  # removed at exit


# -- memory: a cgroup's limit -------------------------------------------------------------------
@contextlib.contextmanager
def memory_cgroup(limit: int | None):
    """A fresh memory cgroup limited to ``limit`` bytes (None: no limit), without swap; yields
    the command prefix that runs a command in it and a reader of its counters (OOM kills, peak
    usage). cgroup v2 where the root enables its memory controller for children, else v1; skips
    the test where neither can be written (not root, no memory controller, read-only)."""
    name = f"zerotrain-test-{os.getpid()}"
    root = Path("/sys/fs/cgroup")
    if "memory" in _read(root / "cgroup.subtree_control").split():
        path = root / name
        limits = {"memory.max": limit, "memory.swap.max": 0}
        peak_file, events_file = "memory.peak", "memory.events"
    elif (root / "memory" / "memory.limit_in_bytes").exists():
        path = root / "memory" / name
        # v1: memory and memory+swap; the second must be set after the first
        limits = {"memory.limit_in_bytes": limit, "memory.memsw.limit_in_bytes": limit}
        peak_file, events_file = "memory.max_usage_in_bytes", "memory.oom_control"
    else:
        pytest.skip("no memory cgroup to write: neither v2 with the memory controller nor v1")
    try:
        path.mkdir()
        for file, value in limits.items():
            if limit is not None and (path / file).exists():  # no swap accounting: no file
                (path / file).write_text(str(value))
    except OSError as error:
        with contextlib.suppress(OSError):
            path.rmdir()
        pytest.skip(f"cannot make a memory cgroup under {path.parent}: {error}")

    def counters() -> dict:
        events = dict(line.split() for line in _read(path / events_file).splitlines())
        peak = _read(path / peak_file)
        return {"oom_kill": int(events.get("oom_kill", 0)), "peak": int(peak) if peak else None}

    # the process joins the cgroup before it allocates: charges do not move with a process
    prefix = ("sh", "-c", f'echo $$ > {path / "cgroup.procs"} && exec "$@"', "sh")
    try:
        yield prefix, counters
    finally:
        path.rmdir()  # empty: run_memory_script has waited for its process


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _filesystem(path: Path) -> str:
    """The type of the filesystem ``path`` is on (/proc/mounts; "" where unknown)."""
    path, best, kind = path.resolve(), "", ""
    with contextlib.suppress(OSError), open("/proc/mounts", encoding="ascii") as mounts:
        for line in mounts:
            point, fs = line.split()[1:3]
            if path.is_relative_to(point) and len(point) >= len(best):
                best, kind = point, fs
    return kind


@pytest.mark.slow  # 46 s, five runs; tests/test_preflight.py checks the cgroup reading
def test_nvme_trains_under_a_memory_limit_the_in_memory_run_exceeds(tmp_path):
    if _filesystem(tmp_path) in ("tmpfs", "ramfs"):  # its pages are charged to the cgroup
        pytest.skip(f"{tmp_path} is in memory ({_filesystem(tmp_path)}): no disk to offload to")
    steps = ("--steps", "3", "--sub-group-size", str(1 << 18), "--buffer-count", "2")
    with memory_cgroup(None) as (prefix, _):  # what training needs before any optimizer state
        code, baseline, stderr = run_memory_script(
            "--offload", "none", "--init-only", prefix=prefix
        )
    assert code == 0, stderr
    state_bytes = 8 * baseline["params"]  # AdamW's exp_avg and exp_avg_sq, fp32
    limit = baseline["cgroup_after_init"] + state_bytes // 2
    runs = {}
    for offload in ("cpu", "nvme", "none", "none --skip-preflight"):
        with memory_cgroup(limit) as (prefix, counters):
            args = ("--offload", *offload.split(), "--nvme-path", str(tmp_path), *steps)
            code, record, stderr = run_memory_script(*args, prefix=prefix)
            runs[offload] = (code, record, stderr, counters())
    # the memory preflight sees the cgroup's headroom, and refuses before allocating: in memory
    # and with the optimizer offloaded to the same host memory, offering NVMe, which fits
    for offload in ("cpu", "none"):
        code, record, stderr, seen = runs[offload]
        assert code == 3 and seen["oom_kill"] == 0, stderr
        message = record["config_error"]
        assert "rank 0 needs " in message and " of host memory (" in message, message
        assert 'Options that fit: offload_optimizer.device "nvme"' in message, message
        available = re.search(
            r"\(cgroup [^:]*zerotrain-test-\d+: ([\d.]+) (B|KiB|MiB|GiB)", message
        )
        assert available, message
        units = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
        assert float(available.group(1)) * units[available.group(2)] <= limit, message
    # NVMe: three steps under the limit, though the state alone exceeds its headroom
    code, record, stderr, seen = runs["nvme"]
    assert code == 0, stderr
    assert state_bytes > limit - baseline["cgroup_after_init"]
    assert len(record["rss_after_step"]) == 3 and record["memory"]["disk"] > 0
    assert seen["oom_kill"] == 0 and (seen["peak"] is None or seen["peak"] <= limit)
    # the control: in memory without the preflight, the kernel kills it for exceeding the limit
    code, record, stderr, seen = runs["none --skip-preflight"]
    assert code == -signal.SIGKILL and seen["oom_kill"] >= 1, (code, stderr)
    assert not list(tmp_path.glob("zerotrain-*.swap"))


# -- faults: kill -9 mid-step -------------------------------------------------------------------
KILL_STEPS = 4
KILLED_SUB_GROUP = 3  # of step 3, counting from 1


def _small_config(offload: dict) -> dict:
    """Stage 2, accumulation, clipping, AdamW with weight decay; sub-groups of 1024 elements."""
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "zero_optimization": {"stage": 2, "sub_group_size": 1024, "offload_optimizer": offload},
        "steps_per_print": 10**6,
    }


def _small_engine(offload: dict):
    """An MLP of 8,660 parameters (9 sub-groups: the kill lands mid-step) under ``offload``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(33, 97), nn.Tanh(), nn.Linear(97, 51), nn.Tanh())
    model.append(nn.Linear(51, 7))  # shapes no power of two divides
    engine, *_ = zerotrain.initialize(
        model=model, model_parameters=model.parameters(), config=_small_config(offload)
    )
    return engine


def _train_small(engine, steps: range) -> list[float]:
    """Steps ``steps`` (0-based) of one fixed data stream, whichever steps run; the losses."""
    gen = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(8, 33, generator=gen), torch.randn(8, 7, generator=gen))
        for _ in range(KILL_STEPS)
    ]
    losses = []
    for x, y in data[steps.start : steps.stop]:
        for micro in range(2):
            rows = slice(4 * micro, 4 * micro + 4)
            loss = (engine(x[rows]) - y[rows]).square().mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def _train_and_die(nvme_path: str, save_dir: str) -> None:
    """Two NVMe steps, a checkpoint, then SIGKILL inside the third step's third sub-group."""
    engine = _small_engine({"device": "nvme", "nvme_path": nvme_path, "buffer_count": 3})
    _train_small(engine, range(2))
    engine.save_checkpoint(save_dir, tag="two")
    step_one = nvme.NvmeShardStore._step_one
    stepped = []

    def step_then_die(store, group, staged):
        stepped.append(group)
        if len(stepped) == KILLED_SUB_GROUP:
            os.kill(os.getpid(), signal.SIGKILL)
        step_one(store, group, staged)

    # step 3's first sub-groups are stepped and written back (or being written), then the kill
    nvme.NvmeShardStore._step_one = step_then_die
    _train_small(engine, range(2, 3))
    raise AssertionError("still alive after SIGKILL")


def _resume(nvme_path: str, save_dir: str) -> dict:
    """Resume from the checkpoint with NVMe offload and train steps 3-4; then the same four
    steps uninterrupted in memory, in this process (the same threads, the same kernels)."""
    stale = sorted(p.name for p in Path(nvme_path).glob("zerotrain-*.swap"))
    engine = _small_engine({"device": "nvme", "nvme_path": nvme_path, "buffer_count": 3})
    after_init = sorted(p.name for p in Path(nvme_path).glob("zerotrain-*.swap"))
    engine.load_checkpoint(save_dir, tag="two")
    resumed_losses = _train_small(engine, range(2, KILL_STEPS))
    straight = _small_engine({"device": "none"})
    straight_losses = _train_small(straight, range(KILL_STEPS))
    return {
        "stale": stale,
        "after_init": after_init,
        "own": engine.optimizer.group.store.swap.path.name,
        "sub_groups": len(engine.optimizer.group.store.sub_groups),
        "resumed": engine.consolidated_state_dict(),
        "resumed_losses": resumed_losses,
        "straight": straight.consolidated_state_dict(),
        "straight_losses": straight_losses,
    }


def test_kill_9_mid_nvme_step_resumes_from_the_checkpoint_exactly(tmp_path):
    nvme_path, save_dir = tmp_path / "nvme", tmp_path / "checkpoints"
    (code,) = run_distributed(_train_and_die, 1, str(nvme_path), str(save_dir), may_die=(0,))
    assert code == -signal.SIGKILL
    (killed,) = nvme_path.glob("zerotrain-*.swap")  # left behind: nobody closed it
    (got,) = run_distributed(_resume, 1, str(nvme_path), str(save_dir))
    assert got["sub_groups"] >= KILLED_SUB_GROUP + 2  # the kill was mid-step
    assert got["stale"] == [killed.name]
    assert got["after_init"] == [got["own"]] and got["own"] != killed.name  # the stale removed
    assert got["resumed_losses"] == got["straight_losses"][4:]
    for key, value in got["straight"].items():
        assert torch.equal(got["resumed"][key], value), key
    assert not list(nvme_path.iterdir())  # the new process removed its own at exit


# -- faults: a full disk -----------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs (skips where mounting is not allowed)."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs: {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        if subprocess.run(["umount", str(mount_point)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(mount_point)], check=True)  # still open


def _disk_engine(nvme_path: Path):
    # 38,764 parameters: 151 KiB of fp32 masters, 454 KiB of working file with AdamW's state
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 300), nn.Tanh(), nn.Linear(300, 64))
    config = _small_config({"device": "nvme", "nvme_path": str(nvme_path), "buffer_count": 2})
    config["zero_optimization"]["sub_group_size"] = 8192
    engine, *_ = zerotrain.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    return engine


def test_a_full_disk_is_refused_before_training_naming_the_path(small_disk):
    with pytest.raises(zerotrain.ConfigError) as error:
        _disk_engine(small_disk)
    message = str(error.value)
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    assert f"nvme_path: {small_disk} has {gib(free)} free" in message, message
    assert f"working file needs {gib(38_764 * 12)}" in message, message
    assert not list(small_disk.iterdir())  # refused before any file


@pytest.mark.timeout(60)
def test_a_disk_that_fills_mid_step_raises_in_the_main_thread(small_disk, monkeypatch):
    # Past both preflights (the disk check, and the free-space check where fallocate is not
    # supported), as on a disk that other writers fill after initialize.
    monkeypatch.setattr(nvme, "check_disk", lambda *args: None)

    def no_fallocate(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(os, "posix_fallocate", no_fallocate)
    usage = types.SimpleNamespace(free=1 << 40)
    monkeypatch.setattr(swap, "shutil", types.SimpleNamespace(disk_usage=lambda path: usage))
    thread_errors = []
    monkeypatch.setattr(threading, "excepthook", thread_errors.append)
    engine = _disk_engine(small_disk)  # the masters fit; their state does not
    store = engine.optimizer.group.store
    try:
        with pytest.raises(swap.SwapIOError) as error:
            for _ in range(2):  # one step: its two micro-batches
                engine.backward(engine(torch.randn(4, 64)).square().mean())
                engine.step()
        assert error.value.errno == errno.ENOSPC
        assert str(store.swap.path) in str(error.value)
        assert "No space left on device" in str(error.value)
        assert not thread_errors  # not an exception lost in an I/O thread
    finally:
        store.swap.close()
    assert not list(small_disk.iterdir())


# -- preflight: host memory ---------------------------------------------------------------------
def test_nvme_preflight_refuses_too_little_host_memory(tmp_path, monkeypatch):
    from zerotrain.accelerator import HostMemoryLimit
    from zerotrain.estimate import preflight

    limit = [HostMemoryLimit(4096, "MemAvailable", "node")]
    monkeypatch.setattr(preflight, "host_memory_limits", lambda: limit)
    torch.manual_seed(0)
    model = AwkwardModel()
    config = _small_config({"device": "nvme", "nvme_path": str(tmp_path)})
    with pytest.raises(zerotrain.ConfigError) as error:
        zerotrain.initialize(model=model, model_parameters=param_groups(model, 0.1), config=config)
    message = str(error.value)
    assert "offload_optimizer's NVMe staging sets " in message, message
    assert "(MemAvailable: 4.00 KiB, plus " in message, message
    assert not list(tmp_path.iterdir())  # refused before the working file
