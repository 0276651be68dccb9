"""Asynchronous saves: the step blocks only to copy the shards into host memory.

[Note: asynchronous saves]
``save_checkpoint(..., async_save=True)`` (or ``checkpoint.async_save``) runs the first part of
a save as a synchronous one does, on every rank: the tag, the save id and the directory's claim
(one collective), and this rank's files as :func:`~zerotrain.checkpoint.save.rank_files` lists
them (collective where stage 3 gathers frozen parameters). Then it takes a *snapshot*: every
tensor is copied into a host buffer kept for the next save (pinned, and copied on a side stream,
on CUDA), every pickled object is serialized to bytes. That is all the step waits for. A
background thread writes the files with their checksums, then runs the synchronous save's
exchange and commit (:func:`~zerotrain.checkpoint.save.commit_save`) over a gloo group of its
own: collectives of the training's group and of this one are ordered independently, and every
rank's thread issues the same ones, one job (a save, or an in-memory snapshot: snapshots.py) at
a time; a rank's error, wherever it arises, travels to the exchange as a string rather than
raising on that rank alone. So the commit protocol is the
synchronous one: a crash or kill -9 before the commit leaves no manifest, and the previous
checkpoint stays the newest complete one.

One save is in flight at a time: the next save (``checkpoint.async_save_pending``: ``wait``,
or ``skip`` it with a warning, decided by all ranks together), a load, and
``engine.wait_for_checkpoint()`` wait for it. A save that failed in the background warns at
once and raises its ``CheckpointError`` at the next of those calls: on every rank when the
outcome was exchanged, on the ranks whose collective timed out when a peer died; the step
itself never raises for it. At interpreter exit, and in ``engine.destroy()``, a pending save is
finished before the process group ends.

Where the snapshot does not fit in host memory (the buffers this save would add, times the
node's ranks, against :func:`~zerotrain.accelerator.available_host_memory`) the rank writes its
files before returning, with a warning that gives the numbers, and its thread only commits.
"""

from __future__ import annotations

import atexit
import io
import threading
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from zerotrain.accelerator import available_host_memory
from zerotrain.checkpoint.files import TensorEntry
from zerotrain.checkpoint.load import LoadOptions, load_checkpoint
from zerotrain.checkpoint.manifest import CheckpointError
from zerotrain.checkpoint.save import (
    PendingFile,
    RankFiles,
    SaveJob,
    begin_save,
    commit_save,
    rank_failure,
    rank_files,
    write_files,
)
from zerotrain.checkpoint.snapshots import InMemorySnapshots
from zerotrain.comm import Communicator
from zerotrain.zero.host import gib, local_ranks

if TYPE_CHECKING:
    from zerotrain.checkpoint.protocol import TrainingState
    from zerotrain.config.schema import CheckpointConfig

_HEADROOM = 1 << 30  # host memory left free after a snapshot: the process goes on allocating


class CheckpointWriter:
    """An engine's saves and loads: synchronous saves, at most one asynchronous save in flight,
    and the in-memory snapshots (snapshots.py) when configured."""

    def __init__(self, comm: Communicator, config: CheckpointConfig):
        self._comm = comm
        snapshots = config.in_memory_snapshots
        self.snapshots = InMemorySnapshots(comm, snapshots) if snapshots.enabled else None
        self._own: Communicator | None = None  # the background exchange's group (made once)
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}  # host copies, reused
        self._thread: threading.Thread | None = None
        self._job: SaveJob | None = None  # the last asynchronous save
        self._saving = False  # the background job is that save (not a snapshot)
        self._failure: CheckpointError | None = None  # a background save's, not yet raised
        _writers.add(self)
        if config.async_save or self.snapshots is not None:  # now, not in the first one's time
            self._background_comm()

    # -- the engine's calls ---------------------------------------------------------------------
    def save(
        self,
        engine: TrainingState,
        save_dir: str | Path,
        tag: str | None,
        client_state: dict | None,
        save_latest: bool,
        exclude_frozen: bool,
        async_save: bool,
    ) -> Path | None:
        """See :meth:`ZeroTrainEngine.save_checkpoint`; None when an asynchronous save is
        skipped because the previous one is still being written."""
        if async_save and engine.zerotrain_config.checkpoint.async_save_pending == "skip":
            busy = self._comm.all_gather_object(self.pending() and self._saving)
            if any(busy):
                warnings.warn(
                    f"save_checkpoint: skipped (tag {tag or engine.global_steps}): the previous "
                    f"asynchronous save {self._job.directory if self._job else ''} is still "
                    f"being written on rank(s) {[r for r, b in enumerate(busy) if b]} "
                    "(checkpoint.async_save_pending is skip)",
                    stacklevel=3,
                )
                return None
        self.wait()
        job = begin_save(engine, save_dir, tag, save_latest)
        error, files = rank_files(engine, client_state, exclude_frozen)
        if not async_save:
            error, written = write_files(engine.comm.rank, job, files, error)
            return commit_save(engine.comm, job, error, written)
        self._job, self._saving = job, True
        self._in_background(job, files, error, self._commit)
        return job.directory

    def _in_background(
        self,
        job: SaveJob,
        files: RankFiles | None,
        error: str | None,
        then: Callable[[Communicator, SaveJob, str | None, dict], None],
    ) -> None:
        """Copy ``files`` into host buffers (or, where they do not fit, write them now), then on
        the background thread write the copy and run ``then(comm, job, error, written)`` over
        the writer's group: one job (a save or a snapshot) at a time, in the same order on
        every rank, so their collectives pair up."""
        own = self._background_comm()
        copies = _SideStreamCopies()
        snapshot, written = None, {}
        if files is not None and error is None:
            try:
                snapshot = self._snapshot(files, copies)
                if snapshot is None:  # did not fit: written now
                    error, written = write_files(own.rank, job, files, error)
            except Exception as exc:  # to the exchange, as a failed write's: never alone
                snapshot, error = None, rank_failure(own.rank, exc)

        def work() -> None:
            done_error, done = error, written
            if snapshot is not None:
                try:
                    copies.synchronize()
                    done_error, done = write_files(own.rank, job, snapshot, error)
                except Exception as exc:
                    done_error, done = rank_failure(own.rank, exc), {}
            then(own, job, done_error, done)  # catches its own errors

        self._thread = threading.Thread(
            target=work,
            name=f"zerotrain-checkpoint-{job.tag}",
            daemon=True,  # finished by _finish_pending_saves, before the process group ends
        )
        self._thread.start()

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def finish_pending(self) -> None:
        """Let the background job end (its failure stays for the next save, load or wait)."""
        self._join()

    def after_step(self, engine: TrainingState) -> None:
        """At the end of each optimizer step: an in-memory snapshot when one is due, taken as
        an asynchronous save is (the step waits for the host copy and for the background job
        before it), written to memory and to the buddy in the background."""
        snapshots = self.snapshots
        if snapshots is None or not snapshots.due(engine):
            return
        self._join()
        self._saving = False  # a snapshot runs now: a save in skip mode waits for it
        job, files, error = snapshots.begin(engine)
        self._in_background(job, files, error, snapshots.finish)

    def load(
        self, engine: TrainingState, load_dir: str | Path, tag: str | None, options: LoadOptions
    ) -> tuple[str | None, dict | None]:
        """See :meth:`ZeroTrainEngine.load_checkpoint`: after the save in flight is committed,
        from the newest in-memory snapshot where it is at least as new as ``load_dir``'s."""
        self.wait()
        failed: list[str] = []  # snapshots whose files failed the load's checks
        while tag is None and self.snapshots is not None:
            found = self.snapshots.recover(Path(load_dir), skip=failed)
            if found is None:
                break
            try:  # a failed load leaves the engine as it was: an older one can be tried
                return load_checkpoint(engine, found.parent, found.name, options)
            except CheckpointError as error:
                if self._comm.rank == 0:
                    warnings.warn(
                        f"in-memory snapshot {found.name} skipped for an older one: {error}",
                        stacklevel=3,
                    )
                self.snapshots.discard(found)
                failed.append(found.name)
        return load_checkpoint(engine, load_dir, tag, options)

    def pending(self) -> bool:
        """Whether an asynchronous save (or snapshot) is still being written or committed on
        this rank."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> Path | None:
        """Wait for the asynchronous save in flight; its directory (None: there was none).
        Raises the ``CheckpointError`` of a background save that failed, once."""
        job, self._job = self._job, None
        self._join()
        self._thread = None
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure
        return job.directory if job is not None else None

    # -- the snapshot ---------------------------------------------------------------------------
    def _snapshot(self, files: RankFiles, copies: _SideStreamCopies) -> RankFiles | None:
        """``files`` with every tensor copied into a host buffer and every object serialized;
        None where the copies would not fit in host memory (see the module note)."""
        tensors = [(f.role, e) for f in files.files if f.tensors is not None for e in f.tensors]
        adding = sum(e.nbytes for role, e in tensors if not self._reusable(role, e))
        available = available_host_memory()
        if available is not None and adding * local_ranks() + _HEADROOM > available:
            warnings.warn(
                f"checkpoint: the host copy of an asynchronous save or snapshot needs "
                f"{gib(adding)} more host memory on each of {local_ranks()} rank(s) of this "
                f"node, {gib(available)} is available (less {gib(_HEADROOM)} headroom); this "
                "rank writes its files before returning (a synchronous save's time)",
                stacklevel=4,
            )
            return None
        snapshot = []
        for file in files.files:
            if file.tensors is not None:
                entries = [self._copy(file.role, e, copies) for e in file.tensors]
                snapshot.append(PendingFile(file.role, file.suffix, tensors=entries))
            else:
                buffer = io.BytesIO()
                torch.save(file.obj, buffer)
                snapshot.append(PendingFile(file.role, file.suffix, data=buffer.getvalue()))
        copies.wait_on_current_stream()
        return RankFiles(snapshot, files.report)

    def _reusable(self, role: str, entry: TensorEntry) -> bool:
        held = self._buffers.get((role, entry.name))
        return held is not None and held.dtype == entry.dtype and held.shape == entry.shape

    def _copy(self, role: str, entry: TensorEntry, copied: _SideStreamCopies) -> TensorEntry:
        if not self._reusable(role, entry):
            pin = torch.cuda.is_available()
            self._buffers[role, entry.name] = torch.empty(
                entry.shape, dtype=entry.dtype, pin_memory=pin
            )
        buffer = self._buffers[role, entry.name]
        view = buffer.view(-1)
        at = 0
        for chunk in entry.chunks():
            flat = chunk.detach().reshape(-1)
            copied.copy(view[at : at + flat.numel()], flat)
            at += flat.numel()
        return TensorEntry(entry.name, entry.dtype, entry.shape, lambda b=buffer: (b,))

    # -- the background thread ------------------------------------------------------------------
    def _background_comm(self) -> Communicator:
        """A gloo group over the engine's ranks, made with the engine (or at its first
        asynchronous save), its collectives ordered apart from the training's."""
        if self._own is None:
            _finish_pending_saves_at_exit()
            made = self._comm.new_group(backend="gloo")
            # its own byte counts, out of the progress records (the training's place)
            self._own = Communicator(made.group, device="cpu", tracked=False)
        return self._own

    def _commit(self, comm: Communicator, job: SaveJob, error: str | None, written: dict) -> None:
        """A background save's exchange and commit; its failure kept for the next call."""
        try:
            commit_save(comm, job, error, written)
        except CheckpointError as failure:
            self._failure = failure
            warnings.warn(
                f"asynchronous save_checkpoint failed; training goes on, and the next save, "
                f"load or wait_for_checkpoint raises it: {failure}",
                stacklevel=1,
            )
        except Exception as exc:  # a collective that timed out: a peer died or stalled
            self._failure = CheckpointError(
                f"checkpoint {job.directory} was not saved: {type(exc).__name__}: {exc}"
            )
            warnings.warn(str(self._failure), stacklevel=1)


class _SideStreamCopies:
    """Device-to-host copies on a side stream (CUDA): the training's next kernels wait for
    them, the writer thread synchronizes on them; on the CPU, plain copies."""

    def __init__(self):
        self._stream = None
        self._done = None

    def copy(self, to: torch.Tensor, source: torch.Tensor) -> None:
        if not source.is_cuda:  # CUDA-only below: the host has nothing to overlap
            to.copy_(source)
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        # after whatever made the source (a reshape's copy too), and kept alive until copied
        self._stream.wait_stream(torch.cuda.current_stream())
        source.record_stream(self._stream)
        with torch.cuda.stream(self._stream):
            to.copy_(source, non_blocking=True)

    def wait_on_current_stream(self) -> None:
        """The training may overwrite the sources only once they are copied."""
        if self._stream is not None:
            torch.cuda.current_stream().wait_stream(self._stream)
            self._done = self._stream.record_event()

    def synchronize(self) -> None:
        if self._done is not None:
            self._done.synchronize()


_writers: weakref.WeakSet[CheckpointWriter] = weakref.WeakSet()
_exit_hook = False


def _finish_pending_saves_at_exit() -> None:
    """A script that ends right after an asynchronous save still commits it. Registered when
    the writer's group is made, after the process group's exit hook (init_distributed's), so it
    runs before it (atexit runs hooks last registered first)."""
    global _exit_hook
    if not _exit_hook:
        atexit.register(_finish_pending_saves)
        _exit_hook = True


def _finish_pending_saves() -> None:
    for writer in list(_writers):
        writer.finish_pending()
