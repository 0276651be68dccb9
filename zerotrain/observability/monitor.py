"""Monitors: the per-step training scalars to TensorBoard, CSV files or Weights & Biases.

One small interface (:class:`Monitor`: ``write``, ``flush``, ``close``), one class per backend,
and :class:`MonitorMaster` (DeepSpeed's name) holding the enabled ones. The engine writes one
:class:`~zerotrain.observability.metrics.StepRecord`'s scalars per optimizer step, from rank 0 only: the
other ranks build no backend and create no file.

[Note: nothing is lost at exit]
Backends buffer: the engine flushes them on every step that prints (`steps_per_print`), and
closing flushes what is left. ``MonitorMaster`` closes its backends in ``engine.destroy()``,
when it is garbage-collected, and at interpreter exit (``weakref.finalize``, which runs from
an atexit hook), whichever comes first. A process killed by a signal loses what was written
since the last flush.
"""

from __future__ import annotations

import abc
import csv
import importlib
import weakref
from pathlib import Path
from typing import IO, Any

from zerotrain.config import ConfigError, ZeroTrainConfig

__all__ = [
    "CSVMonitor",
    "Monitor",
    "MonitorMaster",
    "TensorBoardMonitor",
    "WandbMonitor",
    "check_monitor_packages",
]


class Monitor(abc.ABC):
    """One backend: writes scalars by name at an optimizer step."""

    @abc.abstractmethod
    def write(self, step: int, scalars: dict[str, float]) -> None:
        """Record ``scalars`` (name -> value) at ``step``."""

    def flush(self) -> None:  # noqa: B027 (backends that write through need no flush)
        """Push what is buffered to its destination."""

    @abc.abstractmethod
    def close(self) -> None:
        """Flush and release the backend; later writes are errors."""


class TensorBoardMonitor(Monitor):
    """Scalars to an event file in ``output_path/job_name`` (torch's ``SummaryWriter``)."""

    def __init__(self, output_path: str, job_name: str):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(output_path or ".") / job_name
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def write(self, step: int, scalars: dict[str, float]) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class CSVMonitor(Monitor):
    """Scalars to CSV files in ``output_path/job_name``, DeepSpeed's layout: one file per
    scalar, named after it with ``/`` as ``_`` (``Train_loss.csv``), with the columns ``step``
    and the scalar's last name component (``loss``). A scalar that appears only on some steps
    (``tokens_per_second`` needs token ids) has rows for those steps only."""

    def __init__(self, output_path: str, job_name: str):
        self.log_dir = Path(output_path or ".") / job_name
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, tuple[IO[str], Any]] = {}

    def _writer(self, name: str):
        if name not in self._files:
            path = self.log_dir / (name.replace("/", "_").replace(" ", "_") + ".csv")
            new = not path.exists() or path.stat().st_size == 0
            handle = path.open("a", newline="", encoding="utf-8")
            writer = csv.writer(handle)
            if new:
                writer.writerow(["step", name.rsplit("/", 1)[-1]])
            self._files[name] = (handle, writer)
        return self._files[name][1]

    def write(self, step: int, scalars: dict[str, float]) -> None:
        for name, value in scalars.items():
            self._writer(name).writerow([step, repr(float(value))])

    def flush(self) -> None:
        for handle, _ in self._files.values():
            handle.flush()

    def close(self) -> None:
        for handle, _ in self._files.values():
            handle.close()
        self._files.clear()


class WandbMonitor(Monitor):
    """Scalars to a Weights & Biases run (``wandb.init(project, group, entity=team)``), one
    ``wandb.log(scalars, step=step)`` per step."""

    def __init__(self, project: str, group: str | None, team: str | None):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=project, group=group, entity=team)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self.wandb.log(dict(scalars), step=step)

    def close(self) -> None:
        finish = getattr(self.run, "finish", None) or getattr(self.wandb, "finish", None)
        if finish is not None:
            finish()


def _close_all(backends: list[Monitor]) -> None:
    for backend in backends:
        backend.close()
    backends.clear()


class MonitorMaster:
    """The enabled monitors of a config, on rank 0 (elsewhere: none); see [Note: nothing is
    lost at exit]."""

    def __init__(self, config: ZeroTrainConfig, rank: int):
        self.enabled = any(
            section.enabled for section in (config.tensorboard, config.csv_monitor, config.wandb)
        )
        self.backends: list[Monitor] = []
        if rank == 0:
            if config.tensorboard.enabled:
                tb = config.tensorboard
                self.backends.append(TensorBoardMonitor(tb.output_path, tb.job_name))
            if config.csv_monitor.enabled:
                cm = config.csv_monitor
                self.backends.append(CSVMonitor(cm.output_path, cm.job_name))
            if config.wandb.enabled:
                wb = config.wandb
                self.backends.append(WandbMonitor(wb.project, wb.group, wb.team))
        self._finalizer = weakref.finalize(self, _close_all, self.backends)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        """Write ``scalars`` at ``step`` to every backend."""
        for backend in self.backends:
            backend.write(step, scalars)

    def flush(self) -> None:
        """Flush every backend."""
        for backend in self.backends:
            backend.flush()

    def close(self) -> None:
        """Flush and close every backend (once; later calls do nothing)."""
        self._finalizer()


_PACKAGES = {  # config section -> (module to import, pip package)
    "tensorboard": ("torch.utils.tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
}


def check_monitor_packages(config: ZeroTrainConfig) -> None:
    """Raise ``ConfigError`` naming the ``pip install`` when an enabled monitor's package is
    missing. Every rank checks (the config is the same everywhere), so all ranks fail together
    instead of rank 0 alone."""
    problems = []
    for section, (module, package) in _PACKAGES.items():
        if not getattr(config, section).enabled:
            continue
        try:
            importlib.import_module(module)
        except ImportError:
            problems.append(
                f"{section}.enabled: the `{package}` package is not installed; "
                f"`pip install {package}`, or set {section}.enabled to false"
            )
    if problems:
        raise ConfigError("\n".join(problems))
