"""A short torchrun job on this machine that writes one JSON result: how the planner runs its
link probe (zerotrain/plan/probe.py) and its trials (zerotrain/plan_trial.py) over a real
process group of the launch's ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from zerotrain.errors import ZeroTrainError

__all__ = ["JobError", "run_local_job"]


class JobError(ZeroTrainError, RuntimeError):
    """A planner job that failed or ran too long, with the end of its output."""


def run_local_job(
    module: str,
    world: int,
    payload: dict,
    *,
    env: dict[str, str] | None = None,
    timeout: float = 600,
    what: str = "job",
) -> Any:
    """Run ``python -m <module> --payload FILE --out FILE`` on ``world`` local ranks
    (torchrun, standalone rendezvous, one thread per rank unless ``env`` says otherwise) and
    return the JSON that rank 0 wrote to ``--out``. The working directory is on the ranks'
    ``sys.path`` (a ``module:factory`` names a module there). :class:`JobError` when the job
    fails, writes nothing or runs past ``timeout`` seconds."""
    with tempfile.TemporaryDirectory(prefix="zerotrain-plan-") as tmp:
        payload_path, out = Path(tmp) / "payload.json", Path(tmp) / "out.json"
        payload_path.write_text(json.dumps(payload))
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(world),
            "-m", module, "--payload", str(payload_path), "--out", str(out),
        ]  # fmt: skip
        merged = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        merged.update(env or {})
        path = merged.get("PYTHONPATH", "")
        if os.getcwd() not in path.split(os.pathsep):
            merged["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), path]))
        # torchrun starts its ranks in sessions of their own: on a timeout it is asked to stop
        # them (SIGTERM), and killed only if it does not
        launched = subprocess.Popen(
            command, env=merged, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            stdout, stderr = launched.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as error:
            launched.terminate()
            try:
                launched.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                launched.kill()
                launched.communicate()
            raise JobError(f"the {what} ran past {timeout:.0f} s and was stopped") from error
        done = subprocess.CompletedProcess(command, launched.returncode, stdout, stderr)
        if done.returncode != 0 or not out.exists():
            lines = (done.stderr or done.stdout).strip().splitlines()
            # the ranks' own tracebacks, not torchrun's summary of them
            ranks = [line for line in lines if line.startswith("[rank")]
            tail = "\n".join((ranks or lines)[-12:])
            raise JobError(f"the {what} failed (exit {done.returncode}):\n{tail}")
        return json.loads(out.read_text())


def job_arguments() -> tuple[dict, Path]:
    """In a rank of :func:`run_local_job`: its payload, and where rank 0 writes the result."""
    import argparse

    parser = argparse.ArgumentParser(description="a zerotrain plan job (a torchrun rank)")
    parser.add_argument("--payload", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    return json.loads(Path(args.payload).read_text()), Path(args.out)
