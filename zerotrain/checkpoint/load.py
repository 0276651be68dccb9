"""``engine.load_checkpoint``: check everything first, then stream this rank's share in.

Loading is a pure function of the manifest (see [Note: checkpoint layout] in manifest.py):
each rank walks the parameter runs its master tensors hold, at its own world size and stage,
and reads the overlapping segments of the saved ranks' files, one piece at a time, straight
into place. Before anything changes, every rank checks what it will read (names, shapes, the
optimizer, sizes and SHA-256 of each file) and the ranks exchange their findings, so that a bad
checkpoint raises the same error on every rank and leaves the engine untouched.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zerotrain.checkpoint.locate import NoCheckpoint, resolve
from zerotrain.checkpoint.manifest import CheckpointError, HeldFiles, Manifest, ShardReader
from zerotrain.checkpoint.rng import restore_rng_state
from zerotrain.checkpoint.save import split_keys
from zerotrain.optim.adam import same_state_kind
from zerotrain.precision import DTYPES, PrecisionPolicy, dtype_name
from zerotrain.ranges import overlaps
from zerotrain.zero.extension import Resume
from zerotrain.zero.model_state import load_untrained, untrained_keys
from zerotrain.zero.sharded_state import (
    held_ranges,
    load_group_states,
    load_optimizer_groups,
    load_tensors,
    optimizer_name,
    split_params,
    trained_shapes,
)

if TYPE_CHECKING:
    from zerotrain.checkpoint.protocol import TrainingState


@dataclass(frozen=True)
class LoadOptions:
    """What to take from the checkpoint (DeepSpeed's ``load_checkpoint`` arguments)."""

    module_strict: bool = True
    optimizer_states: bool = True
    lr_scheduler_states: bool = True
    module_only: bool = False
    require_resume: bool = False  # no checkpoint to load is an error (checkpoint.require_resume)


# [Note: when there is no checkpoint to load]
# A script that resumes "if there is a checkpoint" calls load_checkpoint on every start, so
# finding none must not sound alarming on a first run, yet a mistyped path must not pass as one
# (it trains from scratch). With tag=None the kinds of NoCheckpoint (locate.py) are told apart:
# an empty folder, or one not made yet with no similar name beside it, is a first run (one line
# on stdout); a path that does not exist beside a similar name (a typo: that name is offered),
# only incomplete saves (named), or a folder holding something else (a consolidated export,
# another layout) warn. checkpoint.require_resume (or
# ZEROTRAIN_REQUIRE_RESUME=1: `zerotrain run --require-resume`) makes each of them an error,
# for jobs that must resume. Rank 0 decides for everyone, so every rank returns or raises alike.
REQUIRE_RESUME_ENV = "ZEROTRAIN_REQUIRE_RESUME"


@dataclass
class _Loaded:
    engine_state: dict | None = None
    rank_state: dict | None = None  # this rank's: random generators, gradient codecs
    # the shard groups' state: this rank's, or the one the layout names (state_source)
    groups_state: dict | None = None
    client_state: dict | None = None

    def engine(self) -> dict:
        """``engine.pt``'s contents, read unless ``module_only``."""
        if self.engine_state is None:
            raise RuntimeError("load_checkpoint: engine.pt was not read (module_only)")
        return self.engine_state


def load_checkpoint(
    engine: TrainingState, load_dir: str | Path, tag: str | None, options: LoadOptions
) -> tuple[str | None, dict | None]:
    """Load a checkpoint into ``engine`` (collective); see
    :meth:`ZeroTrainEngine.load_checkpoint`."""
    comm = engine.comm
    choice = _choose(Path(load_dir), tag, options.require_resume) if comm.rank == 0 else None
    decided = comm.all_gather_object(choice)[0]  # rank 0 decides for everyone
    assert decided is not None  # rank 0's own choice
    kind, value = decided
    if kind == "error":
        raise CheckpointError(value)
    if kind != "load":  # see [Note: when there is no checkpoint to load]
        if comm.rank == 0 and kind == "empty":
            print(f"zerotrain: load_checkpoint: {value}", flush=True)
        elif comm.rank == 0:
            warnings.warn(f"load_checkpoint: {value}", stacklevel=3)
        return None, None

    directory = Path(value)
    loaded, problems, manifest = _Loaded(), [], None
    # every file this rank reads, opened and verified before anything changes, and read
    # through these handles: another job's retention deleting it meanwhile takes nothing
    held = HeldFiles(directory)
    try:
        try:
            manifest = Manifest.read(directory)
            problems = _check(engine, manifest, options, held)
            if not problems:
                loaded = _read_small_files(engine, manifest, options, held)
        except CheckpointError as exc:
            problems = [str(exc)]
        except Exception as exc:  # unreadable small files: report, like any other problem
            problems = [f"{directory}: {type(exc).__name__}: {exc}"]
        everyone = comm.all_gather_object(problems)
        merged = list(dict.fromkeys(p for rank_problems in everyone for p in rank_problems))
        if merged:
            raise CheckpointError(
                f"cannot load checkpoint {directory} (nothing was changed):\n  "
                + "\n  ".join(merged)
            )
        assert manifest is not None  # else reading it was a problem, raised above
        _apply(engine, manifest, loaded, options, held)
    finally:
        held.close()
    return str(manifest.directory), loaded.client_state if loaded.client_state is not None else {}


def _choose(load_dir: Path, tag: str | None, require: bool) -> tuple[str, str]:
    """("load", the checkpoint directory), ("error", why), or (the NoCheckpoint kind, what to
    say): see [Note: when there is no checkpoint to load]."""
    try:
        return "load", str(resolve(load_dir, tag).directory)
    except NoCheckpoint as exc:
        if tag is not None:  # the checkpoint asked for by name is not there
            return "error", str(exc)
        if require:
            return "error", (
                f"{exc}; nothing to resume from, and checkpoint.require_resume (or "
                f"{REQUIRE_RESUME_ENV}=1, set by `zerotrain run --require-resume`) makes that "
                "an error"
            )
        if exc.kind in ("empty", "absent"):
            return "empty", f"no checkpoint in {load_dir} yet (a first run); nothing loaded"
        return exc.kind, (
            f"{exc}; nothing loaded, the engine is unchanged (checkpoint.require_resume makes "
            "this an error)"
        )
    except CheckpointError as exc:  # every rank raises it, not rank 0 alone
        return "error", str(exc)
    except Exception as exc:  # anything else too: the other ranks would wait for rank 0
        return "error", f"{load_dir}: {type(exc).__name__}: {exc}"


# -- checks (nothing changes yet) ----------------------------------------------------------------
def _check(
    engine: TrainingState, manifest: Manifest, options: LoadOptions, held: HeldFiles
) -> list[str]:
    where = manifest.path
    zero = engine.optimizer
    problems = []
    split = split_params(zero)
    model = trained_shapes(zero, split)
    saved = {name: record.shape for name, record in manifest.params.items()}
    missing = [n for n in model if n not in saved]
    # where ranks hold different layers (pipeline stages) or experts, the entries this rank
    # lacks are the other ranks' (so a name in the checkpoint that no rank trains is not
    # caught here)
    staged = not engine.layout.whole_model_here
    unexpected = [] if staged else [n for n in saved if n not in model]
    if missing or unexpected:
        problems.append(
            f"{where}: saved from another model: trainable parameters missing from the "
            f"checkpoint {missing[:5]}, in the checkpoint but not trained by this engine "
            f"{unexpected[:5]}" + (" (and more)" if len(missing) > 5 or len(unexpected) > 5 else "")
        )
    for name in model.keys() & saved.keys():
        if model[name] != saved[name]:
            problems.append(
                f"{where}: parameter {name} has shape {list(saved[name])} in the checkpoint, "
                f"{list(model[name])} in the model"
            )
    problems += manifest.layout_problems()
    if problems:
        return problems

    saved_untrained = set(manifest["module_keys"]) - set(manifest["trained_keys"])
    # frozen parameters left out by exclude_frozen_parameters keep the model's own values
    excluded = set(manifest.data.get("frozen_keys", ())) - set(manifest["module_keys"])
    ours = untrained_keys(zero.groups, engine.module) - excluded
    unexpected = set() if staged else saved_untrained - ours
    if options.module_strict and (ours - saved_untrained or unexpected):
        problems.append(
            f"{where}: frozen parameters and buffers differ: missing from the checkpoint "
            f"{sorted(ours - saved_untrained)[:5]}, not in the model "
            f"{sorted(unexpected)[:5]} (load_module_strict=False loads the common ones)"
        )
    if options.optimizer_states and not options.module_only:
        ours_type = optimizer_name(zero)
        if not same_state_kind(manifest["optimizer"], ours_type):
            problems.append(
                f"{where}: optimizer states are of {manifest['optimizer']}, the engine steps "
                f"{ours_type}; pass load_optimizer_states=False to load only the weights"
            )
        groups = len(zero.param_groups)
        saved_groups = manifest["optimizer_groups"]  # empty groups count too
        if groups != saved_groups:
            problems.append(
                f"{where}: saved with {saved_groups} optimizer parameter groups, the engine has "
                f"{groups}; pass load_optimizer_states=False to load only the weights"
            )

    split_frozen = sorted(ours & split_keys(engine.module))
    if split_frozen:
        problems.append(
            f"{where}: frozen parameters split by tensor parallelism ({split_frozen[:3]}) "
            "cannot be loaded yet; let them train (requires_grad), or load into the model "
            "without tensor parallelism"
        )
    ranks = {
        seg[0]
        for name, start, end in held_ranges(zero)
        for seg in manifest.params[name].segments
        # a split parameter, here or there, is read whole (see [Note: checkpoint layout])
        if name in split
        or manifest.params[name].split is not None
        or overlaps(start, end, *seg[1:])
    }
    ranks |= {manifest.module_ranks[k] for k in ours if k in manifest.module_ranks}
    files = [manifest.file("shard", r) for r in sorted(ranks)] + [manifest.file("module")]
    if not options.module_only:
        files.append(manifest.file("engine"))
        rank_files = {r for r in _rank_states(engine, manifest) if r is not None}
        files += [manifest.file("rank_state", r) for r in sorted(rank_files)]
        client_state = manifest.optional_file("client_state")
        if client_state:
            files.append(client_state)
    return problems + manifest.hold(files, held)


def _read_small_files(engine, manifest: Manifest, options: LoadOptions, held: HeldFiles) -> _Loaded:
    loaded = _Loaded()
    if options.module_only:
        return loaded

    def read(name: str, weights_only: bool = True):
        return torch.load(held.path(name), map_location="cpu", weights_only=weights_only)

    loaded.engine_state = read(manifest.file("engine"))

    def read_rank(rank: int) -> dict:
        state = read(manifest.file("rank_state", rank))
        # written before the codecs' state: the generators alone
        return {"rng": state} if "python" in state else state

    own, source = _rank_states(engine, manifest)
    if own is not None:
        loaded.rank_state = read_rank(own)
    if source is not None:
        loaded.groups_state = loaded.rank_state if source == own else read_rank(source)
    client_state = manifest.optional_file("client_state")
    if client_state:
        # The one pickled file: the user's own objects (documented in docs/checkpoints.md).
        loaded.client_state = read(client_state, weights_only=False)
    return loaded


# -- applying ------------------------------------------------------------------------------------
def _apply(
    engine: TrainingState,
    manifest: Manifest,
    loaded: _Loaded,
    options: LoadOptions,
    held: HeldFiles,
):
    zero = engine.optimizer
    load_optimizer = options.optimizer_states and not options.module_only
    reader = ShardReader(manifest, held)
    split = split_params(zero)
    tp_rank = engine.layout.split_rank

    def read(name: str, kind: str, start: int, end: int) -> list[tuple[int, torch.Tensor]]:
        return reader.read(name, kind, start, end, split.get(name), tp_rank)

    for warning in _conversions(manifest, zero.precision, load_optimizer):
        warnings.warn(f"load_checkpoint: {warning}", stacklevel=4)
    try:
        # the checkpoint's per-element state replaces the engine's (it may have none)
        load_tensors(zero, read, manifest["optimizer_state_keys"] if load_optimizer else None)
        saved = set(manifest["module_keys"])
        load_untrained(
            zero.groups,
            engine.module,
            lambda key: reader.module_tensor(key) if key in saved else None,
        )
    finally:
        reader.close()
    zero.zero_grad()
    if load_optimizer:  # hyperparameters (lr) too when there is no per-element state (SGD)
        state = loaded.engine()
        load_optimizer_groups(zero, state["optimizer_groups"], state["optimizer_scalar_state"])
    rank_state: dict[str, Any] = loaded.rank_state or {}
    groups_state: dict[str, Any] = loaded.groups_state or {}
    if options.module_only:
        zero.publish_params()
        for group in zero.groups:  # the loaded parameters, every rank's alike, are the new start
            group.masters_set()
        return

    state = loaded.engine()
    # the loss scale is state only for dynamic fp16 scaling, here and in the checkpoint
    engine.restore_training_counters(
        state, loss_scaler=zero.loss_scaler.dynamic and manifest["precision"] == "fp16"
    )
    # each group's codec and step extensions, before the gathers below (auto's policy may
    # quantize them); without the optimizer's state its step count starts again, and so do
    # the compression's (a warm-up, a 1-bit optimizer's exact steps) and the local steps
    resume = Resume(
        steps=engine.global_steps if load_optimizer else 0,
        saved_world_size=manifest["world_size"],
        world_size=engine.world_size,
        optimizer_loaded=load_optimizer,
    )
    for warning in load_group_states(zero, _group_states(groups_state, len(zero.groups)), resume):
        warnings.warn(f"load_checkpoint: {warning}", stacklevel=4)
    zero.publish_params()
    scheduler_state = state["lr_scheduler"]
    if options.lr_scheduler_states and engine.lr_scheduler is not None and scheduler_state:
        engine.lr_scheduler.load_state_dict(scheduler_state)
        if not load_optimizer and hasattr(engine.lr_scheduler, "get_last_lr"):
            # the groups' lr was not loaded with the optimizer: continue at the scheduler's
            last_lrs = engine.lr_scheduler.get_last_lr()
            for param_group, lr in zip(zero.param_groups, last_lrs, strict=True):
                param_group["lr"] = lr
    loader = engine.training_dataloader
    if state["dataloader"] is not None and hasattr(loader, "load_state_dict"):
        loader.load_state_dict(state["dataloader"])
    if "rng" in rank_state:
        restore_rng_state(rank_state["rng"])


def _conversions(manifest: Manifest, precision: PrecisionPolicy, with_state: bool) -> list[str]:
    """What a load converts between the checkpoint's precision policy and the engine's: its
    masters (and optimizer state) in another dtype (a checkpoint from before these fields
    kept both in fp32)."""
    copies = [("master weights", "master_dtype", precision.master_dtype)]
    if with_state and manifest["optimizer_state_keys"]:
        copies.append(("optimizer states", "optimizer_state_dtype", precision.state_dtype))
    out = []
    for what, key, ours in copies:
        saved = DTYPES[manifest.data.get(key, "fp32")]
        if saved == ours:
            continue
        how = (
            "rounded to nearest"
            if ours.itemsize < saved.itemsize
            else "widened exactly (the bits the checkpoint did not keep stay zero)"
        )
        out.append(
            f"the checkpoint's {what} are {dtype_name(saved)}, this engine keeps them in "
            f"{dtype_name(ours)}: {how}"
        )
    return out


def _rank_states(engine: TrainingState, manifest: Manifest) -> tuple[int | None, int | None]:
    """The ranks whose rank files this rank reads: its own (for its random generators) and
    the one whose shard groups' state it continues from (the layout's ``state_source``);
    None where there is none."""
    own = engine.comm.rank if engine.comm.rank < manifest["world_size"] else None
    return own, engine.layout.state_source(manifest["world_size"])


def _group_states(rank_state: dict[str, Any], count: int) -> list[dict | None]:
    """Each shard group's own state (``ShardGroup.state_dict``) from this rank's file; before
    2026-12 it was kept under one key per part, each a list over the groups: ``compression``
    (the codecs), ``compression_policy`` (auto's tuners), ``local_steps``. A list for another
    number of groups is not this run's."""
    if "groups" in rank_state:
        saved = rank_state["groups"]
        return saved if len(saved) == count else [None] * count

    def per_group(key: str) -> list:
        values = rank_state.get(key)
        return values if values is not None and len(values) == count else [None] * count

    return [
        {"codec": codec, "extensions": {"auto": tuner, "local_steps": window}}
        for codec, tuner, window in zip(
            per_group("compression"),
            per_group("compression_policy"),
            per_group("local_steps"),
            strict=True,
        )
    ]
