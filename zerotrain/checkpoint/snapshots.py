"""In-memory snapshots: the training state in host shared memory, and on a rank of another node.

[Note: in-memory snapshots]
With ``checkpoint.in_memory_snapshots.enabled``, every ``every_steps`` optimizer steps each rank
writes the files a checkpoint of that step holds (:func:`~zerotrain.checkpoint.save.rank_files`,
the same bytes and checksums; taken as an asynchronous save is, the step waiting only for the
host copy: :meth:`InMemorySnapshots.begin` in the foreground, :meth:`~InMemorySnapshots.finish`
on the checkpoint writer's thread) into a memory file system that outlives the process
(``/dev/shm/zerotrain/<job id>/global_step<N>/``), and sends them to its *buddy*: the rank at
the same position on the next node (nodes in the order of their first rank, cyclically), which
writes them into its own node's folder. Rank 0 builds the manifest from every rank's report, as
for a disk checkpoint, and the first rank of each node commits it there. A node's folder then
holds its own ranks' files and its predecessor's: losing any one node leaves every file on some
surviving node. Only the newest ``keep`` snapshots stay.

A node is a host and its snapshot folder (``ZEROTRAIN_SNAPSHOT_DIR`` gives each emulated node on
one host its own). The job id (torchrun's run id, SLURM's job id) names the folder: it is the
same after torchrun's elastic agent restarts the workers, and a new job never reads an older
job's snapshots.

Recovery is ``engine.load_checkpoint(load_dir)`` with ``tag=None`` at the start of the restarted
script (:meth:`InMemorySnapshots.recover`): the first rank of each node lists the snapshots its
folder holds and which of their files are there at their recorded size; the ranks agree on the
newest snapshot whose files the surviving nodes hold between them; if it is at least as new as
the newest complete checkpoint in ``load_dir``, the missing files travel to every node that
lacks them (one all-to-all), and the ordinary load reads the node's folder, checking every
file's SHA-256 as it does for any checkpoint and resharding to the new world size. A load that
fails its checks leaves the engine as it was, so the next older snapshot is tried, with a
warning; without one, the disk checkpoint is loaded, as without snapshots.

A clean exit (no exception) removes the job's folder; a killed job leaves it, and the next
job that lacks memory for its snapshots names the folders other jobs left.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import sys
import uuid
import warnings
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from zerotrain.accelerator import available_host_memory
from zerotrain.checkpoint.files import commit_text, fsync_dir
from zerotrain.checkpoint.locate import find_checkpoints
from zerotrain.checkpoint.manifest import MANIFEST, CheckpointError, scan
from zerotrain.checkpoint.owner import job_id
from zerotrain.checkpoint.save import (
    RankFiles,
    SaveJob,
    apply_retention,
    build_manifest,
    manifest_header,
    rank_failure,
    rank_files,
    remove_stale_files,
)
from zerotrain.config import ConfigError
from zerotrain.zero.host import gib

if TYPE_CHECKING:
    from zerotrain.checkpoint.protocol import TrainingState
    from zerotrain.comm import Communicator
    from zerotrain.config.schema import InMemorySnapshotsConfig

SNAPSHOT_DIR_ENV = "ZEROTRAIN_SNAPSHOT_DIR"
_TAG = "global_step"


@dataclass(frozen=True)
class Nodes:
    """Which ranks share a snapshot folder, and who keeps whose copy."""

    leaders: list[int]  # per rank: the first rank of its node (commits, lists, fetches)
    buddy: list[int | None]  # per rank: the rank holding its copy (None: a single node)

    @staticmethod
    def of(comm: Communicator, folder: Path) -> Nodes:
        """Learned from every rank's host and folder (collective)."""
        keys = comm.all_gather_object((socket.gethostname(), str(folder)))
        nodes: dict[tuple[str, str], list[int]] = {}
        for rank, key in enumerate(keys):
            nodes.setdefault(key, []).append(rank)
        members = list(nodes.values())  # in the order of their first rank
        node_of = {rank: i for i, ranks in enumerate(members) for rank in ranks}
        buddy: list[int | None] = []
        for rank in range(comm.world_size):
            i = node_of[rank]
            if len(members) == 1:
                buddy.append(None)
                continue
            mine, theirs = members[i], members[(i + 1) % len(members)]
            buddy.append(theirs[mine.index(rank) % len(theirs)])
        return Nodes(
            leaders=[members[node_of[r]][0] for r in range(comm.world_size)],
            buddy=buddy,
        )


class InMemorySnapshots:
    """One engine's snapshots (see [Note: in-memory snapshots])."""

    def __init__(self, comm: Communicator, config: InMemorySnapshotsConfig):
        job = job_id()
        if job is None:
            raise ConfigError(
                "checkpoint.in_memory_snapshots: needs a job id to find its snapshots after a "
                "restart (torchrun's TORCHELASTIC_RUN_ID or SLURM's SLURM_JOB_ID); launch with "
                "`zerotrain run`, or set enabled: false"
            )
        self._comm = comm
        self.every_steps = config.every_steps
        self.keep = config.keep
        self.root = Path(os.environ.get(SNAPSHOT_DIR_ENV) or config.path)
        self.folder = self.root / job
        self._nodes: Nodes | None = None
        _cleaned_at_exit.append(self)

    def nodes(self) -> Nodes:
        if self._nodes is None:
            self._nodes = Nodes.of(self._comm, self.folder)
        return self._nodes

    def _leads(self) -> bool:
        """Whether this rank is its node's first (it commits, lists and fetches)."""
        return self.nodes().leaders[self._comm.rank] == self._comm.rank

    # -- taking one -----------------------------------------------------------------------------
    def due(self, engine: TrainingState) -> bool:
        return engine.global_steps % self.every_steps == 0

    def begin(self, engine: TrainingState) -> tuple[SaveJob, RankFiles | None, str | None]:
        """The foreground part of a snapshot of this step (collective): the job, this rank's
        files, or the error that stopped it (every rank still runs :meth:`finish`)."""
        comm = self._comm
        self.nodes()  # learned once, by every rank: collective
        save_id = comm.all_gather_object(uuid.uuid4().hex[:12])[0]
        tag = f"{_TAG}{engine.global_steps}"
        job = SaveJob(
            self.folder / tag,
            tag,
            save_id,
            new_directory=True,
            latest=False,
            keep_last=0,
            header=manifest_header(engine) if comm.rank == 0 else None,
        )
        error, files = rank_files(engine, None, exclude_frozen=False)
        if error is None and files is not None:
            error = self._room_for(files.tensor_bytes)
        return job, files, error

    def finish(self, comm: Communicator, job: SaveJob, error: str | None, written: dict) -> None:
        """The rest, on the writer's thread and its group (``comm``: the same ranks): the copy
        to the buddy, the exchange of reports, the commit on every node; a failure warns."""
        try:
            self._finish(comm, job, error, written)
        except Exception as exc:  # a collective that failed: a peer died or stalled
            warnings.warn(f"in-memory snapshot {job.tag} was not taken: {exc}", stacklevel=1)

    def _finish(self, comm: Communicator, job: SaveJob, error: str | None, written: dict) -> None:
        # every rank issues the same collectives: an error travels as a string
        error = self._send_to_buddy(comm, job, written, error)
        reports = comm.all_gather_object((error, written))
        failures = [e for e, _ in reports if e is not None]
        manifest = None
        if not failures and comm.rank == 0:
            try:
                manifest = build_manifest(job, [w for _, w in reports])
            except Exception as exc:
                failures = [rank_failure(0, exc)]
        manifest, failures = comm.all_gather_object((manifest, failures))[0]
        if manifest is None:
            for path in job.directory.glob(f"{job.save_id}-*"):
                path.unlink(missing_ok=True)
            if comm.rank == 0:
                warnings.warn(
                    f"in-memory snapshot {job.tag} was not taken (training goes on):\n  "
                    + "\n  ".join(failures),
                    stacklevel=1,
                )
            return
        if self._leads():
            fsync_dir(job.directory)
            commit_text(job.directory / MANIFEST, json.dumps(manifest, indent=1))
            remove_stale_files(job.directory, set(manifest["files"]))  # a retaken step's
            self._retire(job.directory)

    def _room_for(self, nbytes: int) -> str | None:
        """Why this rank's next snapshot (its files and its buddy's copy of another rank's) does
        not fit in host memory, naming what other jobs left there; None when it fits."""
        ranks = self.nodes().leaders.count(self.nodes().leaders[self._comm.rank])
        needed = 2 * nbytes * ranks
        self.root.mkdir(parents=True, exist_ok=True)
        limits = [shutil.disk_usage(self.root).free, available_host_memory()]
        available = min(n for n in limits if n is not None)
        if needed <= available:
            return None
        others = [
            f"{p} ({gib(_bytes_under(p))})"
            for p in sorted(self.root.iterdir())
            if p != self.folder and p.is_dir()
        ]
        left = f"; other jobs' snapshots there: {', '.join(others)}" if others else ""
        return (
            f"rank {self._comm.rank}: a snapshot needs {gib(needed)} of host memory on this "
            f"node ({ranks} rank(s), each its files and a copy of another rank's), "
            f"{gib(available)} is available under {self.root}{left}"
        )

    def _send_to_buddy(
        self, comm: Communicator, job: SaveJob, written: dict, error: str | None
    ) -> str | None:
        """This rank's files to its buddy, and the files of the ranks whose buddy it is into
        this node's folder (collective, unless there is one node)."""
        rank = comm.rank
        buddy = self.nodes().buddy[rank]
        if buddy is None:
            return error
        try:
            names = sorted(written["files"]) if error is None else []
            files = {name: (job.directory / name).read_bytes() for name in names}
            error_here = None
        except Exception as exc:  # the exchange below still runs, without its files
            files, error_here = {}, rank_failure(rank, exc)
        try:
            exchange_files(comm, {buddy: files} if files else {}, job.directory)
        except OSError as exc:  # writing what it received
            error_here = rank_failure(rank, exc)
        return error or error_here

    def _retire(self, newest: Path) -> None:
        """Keep the newest ``keep`` complete snapshots; remove incomplete older ones (not a
        newer one: the node's other ranks may be writing the next already)."""
        step = _step_of(newest.name)
        for status in scan(self.folder):
            if not status.complete and _step_of(status.tag) < step:
                shutil.rmtree(status.path, ignore_errors=True)
        apply_retention(newest, self.keep)

    def discard(self, directory: Path) -> None:
        """A snapshot whose load failed its checks: no longer complete, on any node."""
        if self._leads():
            (directory / MANIFEST).unlink(missing_ok=True)

    # -- recovering from one --------------------------------------------------------------------
    def recover(self, load_dir: Path, skip: Collection[str] = ()) -> Path | None:
        """The newest complete snapshot (not in ``skip``), fetched onto every node, when it is
        at least as new as ``load_dir``'s newest complete checkpoint (collective); else None.
        Its files are checked by the load that follows (sizes here)."""
        comm = self._comm
        self.nodes()  # collective
        listing, disk, problem = None, None, None
        try:  # every rank reaches the exchange: a problem travels as a string
            listing = self._listing() if self._leads() else None
            disk = _newest_steps(load_dir) if comm.rank == 0 else None
        except Exception as exc:
            problem = rank_failure(comm.rank, exc)
        gathered = comm.all_gather_object((listing, disk, problem))
        problems = [p for _, _, p in gathered if p is not None]
        if problems:
            raise CheckpointError(
                "load_checkpoint: the in-memory snapshots could not be listed:\n  "
                + "\n  ".join(problems)
            )
        disk_steps = gathered[0][1]
        listings = {r: entry[0] for r, entry in enumerate(gathered) if entry[0] is not None}
        chosen, incomplete = _newest_complete(listings, skip)
        if incomplete and comm.rank == 0:
            warnings.warn(
                f"in-memory snapshots skipped (a file missing on every node): {incomplete}",
                stacklevel=4,
            )
        if chosen is None or (disk_steps is not None and chosen["global_steps"] < disk_steps):
            return None
        tag = chosen["tag"]
        # every node gets the files it lacks, each from the first node that holds it
        plan: dict[int, dict[int, list[str]]] = {}  # sender -> receiver -> names
        for leader, entry in listings.items():
            have = set(entry.get(tag, {}).get("present", []))
            for name in chosen["files"]:
                if name not in have:
                    holder = next(
                        r for r, e in listings.items() if name in e.get(tag, {}).get("present", [])
                    )
                    plan.setdefault(holder, {}).setdefault(leader, []).append(name)
        directory = self.folder / tag
        try:
            sends = {
                to: {name: (directory / name).read_bytes() for name in names}
                for to, names in plan.get(comm.rank, {}).items()
            }
        except OSError:  # sent without them: the receiving node's load finds them missing
            sends = {}
        exchange_files(comm, sends, directory)
        if self._leads():
            directory.mkdir(parents=True, exist_ok=True)
            commit_text(directory / MANIFEST, chosen["manifest_text"])
            fsync_dir(directory)
        comm.barrier()  # every node's folder is complete before any rank reads
        if comm.rank == 0:
            disk = f"{_TAG}{disk_steps}" if disk_steps is not None else "none"
            print(
                f"zerotrain: resuming from in-memory snapshot {tag} (newest on disk: {disk})",
                flush=True,
            )
        return directory

    def _listing(self) -> dict:
        """This node's snapshots: each one's manifest (as text) and the files it holds at their
        recorded size (their SHA-256 is the load's to check)."""
        snapshots = {}
        for status in scan(self.folder):
            if not status.complete:
                continue
            manifest = status.manifest
            assert manifest is not None
            snapshots[status.tag] = {
                "global_steps": manifest["global_steps"],
                "files": sorted(manifest["files"]),
                "present": [
                    name
                    for name, record in manifest["files"].items()
                    if _size(status.path / name) == record["bytes"]
                ],
                "manifest_text": (status.path / MANIFEST).read_text(),
            }
        return snapshots

    def remove_at_clean_exit(self) -> None:
        """The job ended well: its snapshots are not needed (a crash keeps them)."""
        if hasattr(sys, "last_value") or hasattr(sys, "last_exc"):
            return
        if self._nodes is not None and self._leads():
            shutil.rmtree(self.folder, ignore_errors=True)


def exchange_files(comm: Communicator, sends: dict[int, dict[str, bytes]], directory: Path) -> None:
    """Send ``sends[rank]`` (file name -> bytes) to each rank and write what this rank receives
    into ``directory`` (collective: an object exchange, then one all-to-all if any bytes
    travel)."""
    sizes = {to: [(name, len(data)) for name, data in files.items()] for to, files in sends.items()}
    input_splits = [sum(n for _, n in sizes.get(to, [])) for to in range(comm.world_size)]
    payload = bytearray().join(
        data for to in range(comm.world_size) for data in sends.get(to, {}).values()
    )
    send = (
        torch.frombuffer(payload, dtype=torch.uint8)
        if payload
        else torch.empty(0, dtype=torch.uint8)
    )
    everyone = comm.all_gather_object(sizes)
    if not any(files for plan in everyone for files in plan.values()):
        return
    incoming = [everyone[src].get(comm.rank, []) for src in range(comm.world_size)]
    output_splits = [sum(n for _, n in files) for files in incoming]
    receive = torch.empty(sum(output_splits), dtype=torch.uint8)
    comm.all_to_all(receive, send, output_splits, input_splits, name="snapshot_files")
    directory.mkdir(parents=True, exist_ok=True)
    data = receive.numpy().data
    at = 0
    for files in incoming:
        for name, size in files:
            with open(directory / name, "wb") as out:
                out.write(data[at : at + size])
                out.flush()
                os.fsync(out.fileno())
            at += size


def _newest_complete(
    listings: dict[int, dict], skip: Collection[str]
) -> tuple[dict | None, list[str]]:
    """The newest snapshot not in ``skip`` whose every file some node holds, and the newer
    ones that lack a file on every node."""
    tags: dict[str, dict] = {}
    for entry in listings.values():
        for tag, snap in entry.items():
            merged = tags.setdefault(tag, {**snap, "tag": tag, "present": set()})
            merged["present"] |= set(snap["present"])
    incomplete = []
    for snap in sorted(tags.values(), key=lambda s: s["global_steps"], reverse=True):
        if snap["tag"] in skip:
            continue
        if set(snap["files"]) <= snap["present"]:
            return snap, incomplete
        incomplete.append(snap["tag"])
    return None, incomplete


def _newest_steps(load_dir: Path) -> int | None:
    """The step of the newest complete checkpoint in the folder ``load_checkpoint`` was given
    (a save directory or one checkpoint, as every checkpoint tool reads it)."""
    try:
        found = find_checkpoints(load_dir)
    except CheckpointError:  # missing, or a file: the disk load says so
        return None
    steps = [s.manifest["global_steps"] for s in found.checkpoints if s.manifest is not None]
    return max(steps) if steps else None


def _step_of(tag: str) -> int:
    return int(tag[len(_TAG) :]) if tag[len(_TAG) :].isdigit() else -1


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def _bytes_under(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


_cleaned_at_exit: list[InMemorySnapshots] = []


@atexit.register
def _remove_snapshots_at_clean_exit() -> None:
    for snapshots in _cleaned_at_exit:
        snapshots.remove_at_clean_exit()
