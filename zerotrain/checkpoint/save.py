"""``engine.save_checkpoint``: every rank writes its shard in parallel, rank 0 commits.

The sequence (see [Note: checkpoint layout] in manifest.py):
1. ranks agree on the tag and a fresh save id, and rank 0 claims the directory for this job
   (see [Note: one job per save directory] in owner.py; one collective);
2. each rank writes and fsyncs its files, hashing them as they are written;
3. the ranks exchange what they wrote, or the error that stopped them (one collective): if any
   rank failed, every rank raises and nothing is committed;
4. rank 0 writes ``manifest.json`` by rename (the commit), moves ``latest``, deletes files of
   earlier saves to the same tag and, with ``checkpoint.keep_last``, older checkpoints;
5. the ranks learn the outcome (one collective), so all return or all raise.
A rank that dies anywhere before step 4 leaves no manifest: the save is incomplete and
invisible to ``load_checkpoint(tag=None)``; the survivors' collectives time out and raise.
The parts are :func:`begin_save` (1), :func:`rank_files` and :func:`write_files` (2) and
:func:`commit_save` (3-5); ``CheckpointWriter`` (background.py) runs them in the foreground, or
2-5 on its thread for an asynchronous save.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zerotrain.checkpoint.files import (
    FileRecord,
    TensorEntry,
    commit_text,
    fsync_dir,
    tensor_entry,
    write_bytes,
    write_safetensors,
    write_torch,
)
from zerotrain.checkpoint.manifest import (
    FORMAT,
    LATEST,
    MANIFEST,
    VERSION,
    CheckpointError,
    manifest_checksum,
    scan,
    status_of,
)
from zerotrain.checkpoint.owner import claim
from zerotrain.checkpoint.rng import capture_rng_state
from zerotrain.comm.split import split_of
from zerotrain.errors import ZeroTrainError
from zerotrain.precision import dtype_name
from zerotrain.zero.model_state import frozen_keys, trained_names, untrained_comm, untrained_state
from zerotrain.zero.sharded_state import (
    group_states,
    optimizer_groups,
    optimizer_name,
    parameter_records,
    saved_tensors,
    scalar_states,
    state_keys,
)

_log = logging.getLogger("zerotrain")

if TYPE_CHECKING:
    from zerotrain.checkpoint.protocol import TrainingState
    from zerotrain.comm import Communicator

MODULE_PREFIX = "module/"  # untrained entries of a later pipeline stage, in its shard file


@dataclass(frozen=True)
class SaveJob:
    """One save as the ranks agreed on it, before anything is written."""

    directory: Path
    tag: str
    save_id: str
    new_directory: bool  # the save made the tag's directory (a failed one removes it again)
    latest: bool
    keep_last: int
    header: dict | None  # rank 0: the manifest's fields read from the engine at the save's step


@dataclass(frozen=True)
class PendingFile:
    """One file a rank saves: a safetensors file of ``tensors``, else ``torch.save(obj)``, or
    ``data``, those bytes already serialized (a snapshot's)."""

    role: str
    suffix: str  # the file's name after the save id
    tensors: list[TensorEntry] | None = None
    obj: object = None
    data: bytes | None = None

    def write(self, path: Path) -> FileRecord:
        if self.tensors is not None:
            return write_safetensors(path, self.tensors)
        if self.data is not None:
            return write_bytes(path, self.data)
        return write_torch(path, self.obj)


@dataclass(frozen=True)
class RankFiles:
    """What one rank saves: its files, not yet written, and its part of the manifest."""

    files: list[PendingFile]
    report: dict

    @property
    def tensor_bytes(self) -> int:
        return sum(e.nbytes for f in self.files if f.tensors is not None for e in f.tensors)

    def write(self, directory: Path, save_id: str) -> dict:
        """Write every file under ``directory``; the report the commit reads."""
        records, roles = {}, {}
        for file in self.files:
            name = f"{save_id}-{file.suffix}"
            records[name] = file.write(directory / name)
            roles[file.role] = name
        return {**self.report, "files": records, "roles": roles}


def begin_save(
    engine: TrainingState, save_dir: str | Path, tag: str | None, save_latest: bool
) -> SaveJob:
    """Agree on the tag and a fresh save id, claim the directory for this job (collective)."""
    comm = engine.comm
    tag = _agreed_tag(engine, tag, save_dir)
    if engine.micro_steps % engine.gradient_accumulation_steps() and comm.rank == 0:
        warnings.warn(
            "save_checkpoint: called in the middle of a gradient accumulation; the gradients "
            "accumulated since the last step are not saved (save after engine.step() at a "
            "boundary)",
            stacklevel=4,
        )
    directory = Path(save_dir) / tag
    # one job per save directory: rank 0 claims it ([Note: one job per save directory]), and
    # says whether the tag's directory is new (a failed save removes it again)
    refused = claim(Path(save_dir)) if comm.rank == 0 else None
    ours = (uuid.uuid4().hex[:12], refused, not directory.exists())
    save_id, refused, new_directory = comm.all_gather_object(ours)[0]
    if refused is not None:
        raise CheckpointError(f"save_checkpoint: {refused}; nothing was saved")
    return SaveJob(
        directory,
        tag,
        save_id,
        new_directory,
        save_latest,
        engine.zerotrain_config.checkpoint.keep_last,
        manifest_header(engine) if comm.rank == 0 else None,
    )


def rank_files(
    engine: TrainingState, client_state: dict | None, exclude_frozen: bool
) -> tuple[str | None, RankFiles | None]:
    """This rank's files (collective where stage 3 partitions frozen parameters), or the error
    that stopped it: every rank must reach the exchange in :func:`commit_save`."""
    try:
        return None, _rank_files(engine, client_state, exclude_frozen)
    except Exception as exc:
        return rank_failure(engine.comm.rank, exc), None


def write_files(
    rank: int, job: SaveJob, files: RankFiles | None, error: str | None
) -> tuple[str | None, dict]:
    """Write this rank's files (unless an error came first); ``(error, report)``."""
    if error is not None:
        return error, {}
    assert files is not None
    try:
        job.directory.mkdir(parents=True, exist_ok=True)
        return None, files.write(job.directory, job.save_id)
    except Exception as exc:  # every rank must reach the exchange, or the others hang
        return rank_failure(rank, exc), {}


def rank_failure(rank: int, exc: BaseException) -> str:
    """A rank's failure as the text the ranks exchange (an error travels to the exchange as a
    string, so that every rank still reaches it)."""
    return f"rank {rank}: {type(exc).__name__}: {exc}"


def commit_save(comm: Communicator, job: SaveJob, error: str | None, written: dict) -> Path:
    """The ranks exchange what they wrote; rank 0 commits; all return or all raise (two
    collectives over ``comm``)."""
    reports = comm.all_gather_object((error, written))
    failures = [e for e, _ in reports if e is not None]
    if failures:
        if comm.rank == 0:
            _remove_partial(job)
        raise _not_saved(job.directory, failures)

    outcome = None
    if comm.rank == 0:
        try:
            _commit(job, [w for _, w in reports])
        except Exception as exc:
            outcome = f"rank 0 could not commit: {type(exc).__name__}: {exc}"
    outcome = comm.all_gather_object(outcome)[0]
    if outcome is not None:
        if comm.rank == 0 and not _committed(job.directory, job.save_id):
            _remove_partial(job)
        raise _not_saved(job.directory, [outcome])
    return job.directory


def _remove_partial(job: SaveJob) -> None:
    """A failed save's files (and its directory, if the save made it), so that a disk it
    filled does not stay full; an earlier save of the tag keeps its own."""
    for path in job.directory.glob(f"{job.save_id}-*"):
        path.unlink(missing_ok=True)
    if job.new_directory:
        with contextlib.suppress(OSError):  # not empty: something else is in it
            job.directory.rmdir()


def _committed(directory: Path, save_id: str) -> bool:
    """Whether ``directory``'s manifest is the save ``save_id``'s (its commit happened)."""
    manifest = status_of(directory).manifest
    return manifest is not None and manifest["save_id"] == save_id


def _not_saved(directory: Path, problems: list[str]) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {directory} was not saved (earlier checkpoints are untouched):\n  "
        + "\n  ".join(problems)
    )


class TagMismatch(ZeroTrainError, ValueError, AssertionError):
    """The ranks passed different tags under ``checkpoint.tag_validation: Fail``: an
    ``AssertionError``, as DeepSpeed raises it (its tests expect one), and a ``ValueError``."""


def _agreed_tag(engine: TrainingState, tag: str | None, save_dir: str | Path | None) -> str:
    """The tag every rank saves under, and a ``save_dir`` checked on every rank, before anything
    is written."""
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    no_dir = save_dir is None or (isinstance(save_dir, str) and not save_dir.strip())
    # gather before validating: a rank raising alone would leave the others in the collective
    reports = engine.comm.all_gather_object((tag, repr(save_dir) if no_dir else None))
    tags = [t for t, _ in reports]
    empty = {rank: bad for rank, (_, bad) in enumerate(reports) if bad is not None}
    if empty:
        raise ValueError(
            f"save_checkpoint: save_dir {' / '.join(sorted(set(empty.values())))} on rank(s) "
            f"{sorted(empty)} names no directory (an empty one would write into the current "
            "directory); pass the folder to save into, the same on every rank"
        )
    mode = engine.zerotrain_config.checkpoint.tag_validation
    if len(set(tags)) > 1 and mode != "Ignore":
        message = (
            "save_checkpoint: the checkpoint tag is not consistent across all ranks: ranks "
            f"passed different tags {sorted(set(tags))}; every rank must pass the same tag (a "
            "tag with rank-specific information cannot be restored at another world size)"
        )
        if mode == "Fail":
            raise TagMismatch(message + " (checkpoint.tag_validation is Fail)")
        # as DeepSpeed warns: on every rank, through the logger (deepspeed.utils.logger)
        _log.warning(
            f"[rank={engine.comm.rank}] {message}; saving under rank 0's tag {tags[0]!r} "
            f"(this rank passed {tags[engine.comm.rank]!r})"
        )
    tag = tags[0]
    if not tag or "/" in tag or "\\" in tag or tag.startswith(".") or tag == LATEST:
        raise ValueError(
            f"save_checkpoint: tag {tag!r} cannot name a checkpoint directory; use letters, "
            "digits, '_' or '-' (not '/', a leading '.', or 'latest')"
        )
    return tag


# -- what each rank writes -----------------------------------------------------------------------
def _rank_files(
    engine: TrainingState, client_state: dict | None, exclude_frozen: bool
) -> RankFiles:
    """This rank's files and its report for the manifest (``"segments"``: [(param name,
    start, end)], its parameter records and module keys)."""
    rank = engine.comm.rank
    zero = engine.optimizer
    tp_rank = engine.layout.split_rank
    first_copy = engine.layout.replica == 0  # another site's keeps its own in its state
    written = parameter_records(zero, tp_rank) if first_copy else {}
    tensors, segments = saved_tensors(zero, written)
    entries: list[TensorEntry] = [tensor_entry(key, values) for key, values in tensors]
    # collective where stage 3 partitions frozen parameters: their values gather to rank 0
    untrained = untrained_state(zero.groups, engine.module, exclude_frozen, on_rank=0)
    split_frozen = sorted(set(untrained) & split_keys(engine.module))
    if split_frozen:
        raise CheckpointError(
            f"frozen parameters split by tensor parallelism ({split_frozen[:3]}) cannot be "
            "saved yet; save with exclude_frozen_parameters=True, or let them train"
        )
    # the buffers and frozen parameters of the other pipeline stages: in their first rank's
    # shard file (rank 0's, the first stage's, are module.safetensors)
    # one rank per set of module entries: a stage's, an expert-parallel rank's experts'
    writes_module = untrained_comm(zero.groups).rank == 0 and tp_rank == 0 and first_copy
    stage_module = writes_module and rank != 0
    if stage_module:
        entries += [tensor_entry(f"{MODULE_PREFIX}{key}", t) for key, t in untrained.items()]

    rank_state = {
        "rng": capture_rng_state(),
        # each shard group's codec (error feedback, factors) and step extensions (exact resume)
        "groups": group_states(zero),
    }
    files = [
        PendingFile("shard", f"rank{rank:05d}.safetensors", tensors=entries),
        PendingFile("rank_state", f"rank{rank:05d}.pt", obj=rank_state),
    ]
    if rank == 0:
        module_entries = [tensor_entry(key, t) for key, t in untrained.items()]
        files += [
            PendingFile("module", "module.safetensors", tensors=module_entries),
            PendingFile("engine", "engine.pt", obj=_engine_state(engine)),
        ]
        if client_state is not None:
            files.append(PendingFile("client_state", "client_state.pt", obj=client_state))
    report = {
        "segments": segments,
        "tp_rank": tp_rank,
        # what the manifest lists of this rank's part of the model (every stage's, merged)
        "params": [record for name, record in written.items()],
        "module": _module_report(engine, untrained, excluded=exclude_frozen)
        if writes_module
        else None,
        "module_in_shard": stage_module,
    }
    return RankFiles(files, report)


def _module_report(engine: TrainingState, untrained: dict, excluded: bool) -> dict:
    """This stage's module keys for the manifest (see [Note: checkpoint layout])."""
    zero = engine.optimizer
    frozen = frozen_keys(zero.groups, engine.module)
    trained = trained_names(zero.groups)
    keys = [
        (key, value)
        for key, value in engine.module.state_dict(keep_vars=True).items()
        if not (excluded and key in frozen)
    ]
    first_key: dict[int, str] = {}
    for key, value in keys:
        first_key.setdefault(id(value), key)
    return {
        "module_keys": [key for key, _ in keys],
        "frozen_keys": sorted(frozen),
        "trained_keys": {key: trained[id(v)] for key, v in keys if id(v) in trained},
        # keys whose tensor is an earlier key's (tied embedding and head): exports keep one tensor
        "tied_keys": {key: first_key[id(v)] for key, v in keys if first_key[id(v)] != key},
        "saved": sorted(untrained),
    }


def split_keys(module: torch.nn.Module) -> set[str]:
    """State-dict keys of ``module`` that tensor parallelism split."""
    return {k for k, v in module.state_dict(keep_vars=True).items() if split_of(v) is not None}


def _engine_state(engine: TrainingState) -> dict:
    loader = engine.training_dataloader
    return {
        **engine.training_counters(),
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler else None,
        "dataloader": loader.state_dict() if hasattr(loader, "state_dict") else None,
        "optimizer_groups": optimizer_groups(engine.optimizer),
        "optimizer_scalar_state": scalar_states(engine.optimizer),
    }


# -- the commit (rank 0) -------------------------------------------------------------------------
def manifest_header(engine: TrainingState) -> dict:
    """The manifest's fields read from the engine: taken when the save starts (an asynchronous
    save commits steps later)."""
    zero = engine.optimizer
    return {
        "world_size": engine.world_size,
        "stage": zero.policy.stage,
        "precision": zero.precision.name,
        "master_dtype": dtype_name(zero.precision.master_dtype),
        "optimizer_state_dtype": dtype_name(zero.precision.state_dtype),
        "optimizer": optimizer_name(zero),  # the groups step one kind of optimizer
        "optimizer_state_keys": state_keys(zero),
        "optimizer_groups": len(zero.param_groups),  # empty ones too
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
    }


def _commit(job: SaveJob, written: list[dict]) -> None:
    manifest = build_manifest(job, written)
    directory = job.directory
    fsync_dir(directory)
    commit_text(directory / MANIFEST, json.dumps(manifest, indent=1))
    if job.latest:
        commit_text(directory.parent / LATEST, job.tag)
    try:  # housekeeping: the checkpoint is committed whatever happens here
        remove_stale_files(directory, set(manifest["files"]))
        apply_retention(directory, job.keep_last)
    except OSError as exc:
        warnings.warn(
            f"save_checkpoint: {directory} saved, but cleaning up failed: {exc}", stacklevel=5
        )


def build_manifest(job: SaveJob, written: list[dict]) -> dict[str, Any]:
    """The manifest of a save from every rank's report (rank 0), checksummed."""
    assert job.header is not None  # rank 0's
    segments: dict[str, list[list[int]]] = {}
    for rank, report in enumerate(written):
        for name, start, end in report["segments"]:
            segments.setdefault(name, []).append([rank, start, end])
    tp_ranks = [report["tp_rank"] for report in written]
    records: dict[str, dict] = {}  # every stage's parameters, the first stage's first
    for report in written:
        for record in report["params"]:
            records.setdefault(record["name"], record)
    for name, record in records.items():
        record["segments"] = sorted(
            segments.get(name, []), key=lambda seg: (tp_ranks[seg[0]], seg[1])
        )
    # module keys of every stage; a later stage's untrained entries are in its shard file
    modules = [(rank, w["module"]) for rank, w in enumerate(written) if w["module"] is not None]
    module_keys = list(dict.fromkeys(k for _, m in modules for k in m["module_keys"]))
    frozen = sorted({k for _, m in modules for k in m["frozen_keys"]})
    trained_keys = {k: n for _, m in modules for k, n in m["trained_keys"].items()}
    tied_keys = {k: first for _, m in modules for k, first in m["tied_keys"].items()}
    module_ranks = {
        key: rank
        for rank, m in reversed(modules)  # the first stage holding a key is where it is read
        if written[rank]["module_in_shard"]
        for key in m["saved"]
    }
    for key in modules[0][1]["saved"]:
        module_ranks.pop(key, None)  # in module.safetensors
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "tag": job.tag,
        "save_id": job.save_id,
        "commit_time": time.time(),
        **job.header,
        "params": list(records.values()),
        "tp_ranks": tp_ranks,
        "module_keys": module_keys,
        "frozen_keys": frozen,  # frozen parameters, saved in "module_keys" or not
        "trained_keys": trained_keys,
        "tied_keys": tied_keys,  # key -> the earlier key whose tensor it is
        "module_ranks": module_ranks,  # untrained keys in a rank's shard file, not the module's
        "roles": {
            "shard": [w["roles"]["shard"] for w in written],
            "rank_state": [w["roles"]["rank_state"] for w in written],
            **{
                role: written[0]["roles"].get(role) for role in ("module", "engine", "client_state")
            },
        },
        "files": {
            name: {"bytes": rec.bytes, "sha256": rec.sha256}
            for w in written
            for name, rec in w["files"].items()
        },
    }
    manifest["checksum"] = manifest_checksum(manifest)  # an edited manifest is detected
    return manifest


def remove_stale_files(directory: Path, keep: set[str]) -> None:
    """Files of earlier or failed saves to this tag."""
    for stale in directory.iterdir():
        if stale.is_file() and stale.name != MANIFEST and stale.name not in keep:
            stale.unlink(missing_ok=True)


def apply_retention(directory: Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints (0: keep all)."""
    if not keep_last:
        return
    complete = [s for s in scan(directory.parent) if s.complete and s.path != directory]
    for old in complete[: max(0, len(complete) - (keep_last - 1))]:
        (old.path / MANIFEST).unlink()  # un-commit first: never a manifest without its files
        shutil.rmtree(old.path, ignore_errors=True)
