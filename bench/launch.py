"""Run one benchmark row as a torchrun job on this machine and collect every rank's result."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_ranks(script: str, worker: str, world: int, port: int, args: list[str]) -> list | str:
    """``script --worker <worker> --out <file> <args>`` on ``world`` local ranks (gloo, one
    thread each, DeepSpeed told to use the CPU); rank 0 writes the ranks' results as JSON to
    ``--out``. Returns them, or why the job failed."""
    out = Path(f"/tmp/bench-{os.getpid()}-{worker}.json")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
        "--master-port", str(port), script, "--worker", worker, "--out", str(out), *args,
    ]  # fmt: skip
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    # DeepSpeed picks its accelerator by what it finds; on a CPU-only machine it must be told
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0 or not out.exists():
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return f"failed (exit {done.returncode}): " + " | ".join(tail)
    results = json.loads(out.read_text())
    out.unlink()
    return results


def run_all(names: list[str], uses_deepspeed, run) -> tuple[dict[str, list], dict[str, str]]:
    """``run(name)`` for each of ``names`` (``run_ranks``' result) with a progress line: the
    results by name, and why the others did not run (``uses_deepspeed(name)`` ones without
    deepspeed installed, failed jobs)."""
    results, skipped = {}, {}
    for name in names:
        if uses_deepspeed(name) and importlib.util.find_spec("deepspeed") is None:
            skipped[name] = "deepspeed is not installed (pip install deepspeed==0.19.8)"
            continue
        print(f"running {name} ...", flush=True)
        started = time.perf_counter()
        got = run(name)
        if isinstance(got, str):
            skipped[name] = got
            print(f"  {got}", flush=True)
            continue
        results[name] = got
        print(f"  done in {time.perf_counter() - started:.0f} s", flush=True)
    return results, skipped
