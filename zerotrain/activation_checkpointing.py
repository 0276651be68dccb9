"""Activation checkpointing: keep a block's inputs, recompute its activations in backward.

DeepSpeed's ``deepspeed.checkpointing`` API (``configure``, ``checkpoint``, ``is_configured``,
``reset``) on torch's non-reentrant ``torch.utils.checkpoint`` (Chen et al., arXiv:1604.06174),
plus ``wrap`` to checkpoint every k-th block of a model without editing its code. Scripts reach
it under DeepSpeed's name, ``zerotrain.checkpointing`` (a re-export of the public names). Not to
be confused with ``zerotrain.checkpoint``, which saves training state to files.

[Note: why the policy is module-global]
DeepSpeed's ``checkpoint(function, *args)`` is called from inside model code, which has no handle
on the engine; ``configure`` therefore sets one process-wide policy, as in DeepSpeed.
``zerotrain.initialize`` calls ``configure`` when the config has an ``activation_checkpointing``
section. The policy holds no process group: activations never cross ranks here.

[Note: activation checkpointing and stage 3]
Stage 3 gathers a block's parameters in its forward pre-hook, releases them after its forward,
and gathers them again from a hook on the block's outputs that fires before the block's backward
(zerotrain/zero/unit_cycle.py). The recomputation runs inside that backward, when the first saved
tensor of the region is unpacked, so a region that is one block, or part of one, finds the
block's parameters gathered. ``wrap`` replaces the block's ``forward``, not its ``__call__``: the
module hooks run once, around the checkpointed forward, and the recomputation calls the plain
forward. A region that calls block modules (``checkpoint(block, x)``, or several blocks in one
function) runs their hooks again during backward; the gatherer recognises a forward inside a
backward as a recomputation, gathers the block and leaves the rest of its life cycle alone.
All blocks of a region are recomputed together, so they are all gathered at once: checkpoint
one block per call to keep stage 3's working set at one block.

[Note: what a checkpoint keeps]
torch's non-reentrant checkpoint saves the region's tensor inputs through the saved-tensor
hooks (outside its own hooks) and replaces every tensor saved inside the region by a
placeholder. ``checkpoint`` passes keyword arguments to it as positional ones, so keyword
tensors are saved the same way; ``cpu_checkpointing`` wraps the call in
``torch.autograd.graph.save_on_cpu``, which therefore moves exactly the retained inputs.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from zerotrain.config import (
    ActivationCheckpointingConfig,
    ConfigError,
    ZeroTrainConfig,
    check_config,
    read_config_file,
)
from zerotrain.zero.units import find_unit_modules

__all__ = [
    "RecomputeStats",
    "SavedActivations",
    "checkpoint",
    "configure",
    "count_saved_activations",
    "is_configured",
    "recompute_stats",
    "reset",
    "reset_stats",
    "wrap",
]


@dataclass
class RecomputeStats:
    """What activation checkpointing cost in this process since the last ``reset_stats``.

    Calls are always counted; the times only with the ``profile`` option (which synchronizes the
    device at every boundary so that they are true)."""

    checkpointed_forwards: int = 0
    """Calls of ``checkpoint`` that ran with autograd recording, so kept only their inputs."""
    recomputations: int = 0
    """Regions recomputed in backward."""
    forward_seconds: float = 0.0
    """Time in checkpointed forwards (``profile`` only)."""
    recompute_seconds: float = 0.0
    """Time in recomputations, the compute that checkpointing adds (``profile`` only)."""

    def __str__(self) -> str:
        line = (
            f"activation checkpointing: {self.checkpointed_forwards} checkpointed forwards, "
            f"{self.recomputations} recomputations"
        )
        if self.forward_seconds or self.recompute_seconds:
            line += (
                f"; {self.forward_seconds:.3f} s in checkpointed forwards, "
                f"{self.recompute_seconds:.3f} s recomputing"
            )
        return line


_policy = ActivationCheckpointingConfig()
_configured = False
_warned = False  # about partition_activations, once per process
_stats = RecomputeStats()


# -- configuration ---------------------------------------------------------------------------
def configure(
    mpu_: Any = None,
    deepspeed_config: ActivationCheckpointingConfig
    | ZeroTrainConfig
    | dict[str, Any]
    | str
    | os.PathLike[str]
    | None = None,
    *,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """Set the process-wide checkpointing policy (DeepSpeed's ``configure`` signature).

    ``deepspeed_config`` is the ``activation_checkpointing`` section (typed), a whole
    ``ZeroTrainConfig``, or a whole DeepSpeed config as a dict or a ``.json``/``.yaml`` path
    (only its ``activation_checkpointing`` section is read). The keyword arguments override
    single keys under DeepSpeed's names: ``contiguous_checkpointing`` is
    ``contiguous_memory_optimization``, ``num_checkpoints`` ``number_checkpoints``,
    ``checkpoint_in_cpu`` ``cpu_checkpointing``, ``synchronize``
    ``synchronize_checkpoint_boundary``. Keys not given take their defaults, as in DeepSpeed.
    What each key does here is documented on :class:`ActivationCheckpointingConfig`.
    """
    if mpu_ is not None:
        raise ConfigError(
            "checkpointing.configure(mpu_=...): model parallelism is not supported; pass None"
        )
    section = _section_from(deepspeed_config)
    overrides = {
        "partition_activations": partition_activations,
        "contiguous_memory_optimization": contiguous_checkpointing,
        "number_checkpoints": num_checkpoints,
        "cpu_checkpointing": checkpoint_in_cpu,
        "synchronize_checkpoint_boundary": synchronize,
        "profile": profile,
    }
    section = _validated({**section.model_dump(), **_given(overrides)})
    if section.contiguous_memory_optimization:
        needs = {
            "partition_activations": section.partition_activations,
            "number_checkpoints": section.number_checkpoints is not None,
        }
        missing = " and ".join(name for name, given in needs.items() if not given)
        if missing:
            raise ConfigError(
                f"activation_checkpointing: contiguous_memory_optimization requires {missing} "
                "(DeepSpeed's configure refuses it otherwise), and has no effect in zerotrain; "
                "set it to false"
            )
    use_policy(section)


def use_policy(section: ActivationCheckpointingConfig) -> None:
    """Make a validated ``activation_checkpointing`` section the process-wide policy: what
    ``initialize`` does with the config's section. Unlike :func:`configure` (which DeepSpeed
    scripts call, and which refuses what DeepSpeed's does) it accepts every valid section."""
    global _policy, _configured, _warned
    if section.partition_activations and not _warned and os.environ.get("RANK", "0") == "0":
        _warned = True
        warnings.warn(
            "activation_checkpointing.partition_activations has no effect in zerotrain: it "
            "splits checkpointed activations across model-parallel ranks, and zerotrain is "
            "purely data-parallel (each rank's activations belong to its own samples)",
            stacklevel=2,
        )
    _policy, _configured = section, True


def is_configured() -> bool:
    """Whether :func:`configure` has been called (DeepSpeed's ``is_configured``)."""
    return _configured


def reset() -> None:
    """DeepSpeed's ``reset`` frees the buffers of ``contiguous_memory_optimization`` between
    forwards that have no backward. zerotrain keeps no such buffers, so this does nothing; it
    exists so that DeepSpeed scripts run unchanged."""


def recompute_stats() -> RecomputeStats:
    """A copy of the counters (and, with ``profile``, times) since the last reset."""
    return RecomputeStats(**vars(_stats))


def reset_stats() -> None:
    """Zero the counters and times of :func:`recompute_stats`."""
    global _stats
    _stats = RecomputeStats()


def _given(values: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in values.items() if value is not None}


def _validated(section: Any) -> ActivationCheckpointingConfig:
    """The section checked as ``load_config`` checks it, errors naming the full key path; null
    is the default section, as in a ZeroTrainConfig."""
    checked = check_config({"activation_checkpointing": section}).activation_checkpointing
    return checked if checked is not None else ActivationCheckpointingConfig()


def _section_from(config: Any) -> ActivationCheckpointingConfig:
    if config is None:
        return ActivationCheckpointingConfig()
    if isinstance(config, ActivationCheckpointingConfig):
        return config
    if isinstance(config, ZeroTrainConfig):
        return config.activation_checkpointing or ActivationCheckpointingConfig()
    if isinstance(config, (str, os.PathLike)):
        config = read_config_file(Path(config))
    if not isinstance(config, dict):
        raise ConfigError(
            "checkpointing.configure(deepspeed_config=...): expected a config dict, path, "
            f"ZeroTrainConfig or ActivationCheckpointingConfig, got {type(config).__name__}"
        )
    return _validated(config.get("activation_checkpointing", {}))


# -- checkpoint ------------------------------------------------------------------------------
def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``, keeping only its inputs for backward and recomputing the
    rest there (torch's non-reentrant checkpoint, which replays the RNG, so dropout draws the
    same masks). Tensors in ``args`` and ``kwargs`` both count as inputs and receive gradients;
    parameters that ``function`` reads receive them too. Without autograd recording
    (``torch.no_grad()``) it simply calls ``function``. Follows the :func:`configure` policy."""
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    policy = _policy
    inputs = (*args, *kwargs.values())
    device = next((t.device for t in inputs if isinstance(t, torch.Tensor)), None)
    offload = policy.cpu_checkpointing and device is not None and device.type != "cpu"
    _stats.checkpointed_forwards += 1
    with (
        _boundary(policy, device, "forward_seconds"),
        # [Note: what a checkpoint keeps]: only the region's inputs go through these hooks.
        torch.autograd.graph.save_on_cpu(pin_memory=device is not None and device.type == "cuda")
        if offload
        else contextlib.nullcontext(),
    ):
        return torch.utils.checkpoint.checkpoint(
            _call,
            function,
            len(args),
            tuple(kwargs),
            *inputs,
            use_reentrant=False,
            context_fn=functools.partial(_contexts, policy, device),
        )


def _call(function: Callable[..., Any], num_args: int, names: tuple[str, ...], *inputs: Any):
    return function(*inputs[:num_args], **dict(zip(names, inputs[num_args:], strict=True)))


def _contexts(policy: ActivationCheckpointingConfig, device: torch.device | None):
    """torch's ``context_fn``: nothing around the forward, the recomputation counted (and timed
    and synchronized as the policy says)."""
    return contextlib.nullcontext(), _recomputation(policy, device)


@contextlib.contextmanager
def _recomputation(policy: ActivationCheckpointingConfig, device: torch.device | None):
    _stats.recomputations += 1
    with _boundary(policy, device, "recompute_seconds"):
        yield


@contextlib.contextmanager
def _boundary(
    policy: ActivationCheckpointingConfig, device: torch.device | None, timer: str
) -> Iterator[None]:
    """``synchronize_checkpoint_boundary`` and ``profile`` around a checkpointed forward or a
    recomputation. The time is added even when torch stops a recomputation early (it raises
    through this context once every saved tensor has been recomputed)."""
    sync = policy.synchronize_checkpoint_boundary or policy.profile
    if sync:
        _synchronize(device)
    start = time.perf_counter()
    try:
        yield
    finally:
        if sync:
            _synchronize(device)
        if policy.profile:
            setattr(_stats, timer, getattr(_stats, timer) + time.perf_counter() - start)


def _synchronize(device: torch.device | None) -> None:
    # Operations on the CPU run synchronously: there is nothing to wait for.
    if device is not None and device.type != "cpu":
        getattr(torch, device.type).synchronize(device)


# -- wrap ------------------------------------------------------------------------------------
def wrap(
    model: nn.Module,
    *,
    block_type: type[nn.Module] | tuple[type[nn.Module], ...] | None = None,
    every: int = 1,
) -> nn.Module:
    """Checkpoint every ``every``-th block of ``model`` (the 1st, the ``every+1``-th, ...);
    returns ``model``, changed in place.

    The blocks are the outermost submodules (``model`` included) that are instances of
    ``block_type``, in registration order; by default the children of the model's outermost
    ``nn.ModuleList``s, which are also stage 3's gather units. Each chosen block's ``forward``
    is replaced by one that runs the original through :func:`checkpoint`; parameter names,
    ``state_dict`` and module hooks are unchanged. Wrap before or after ``initialize``.
    """
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"checkpointing.wrap: every must be a positive integer, got {every!r}")
    if block_type is None:
        blocks = find_unit_modules(model)
        wanted = "children of an nn.ModuleList"
    else:
        blocks = _outermost(model, block_type)
        wanted = f"instances of {block_type}"
    if not blocks:
        raise ValueError(
            f"checkpointing.wrap: {type(model).__name__} has no {wanted}; pass the class of its "
            "blocks as block_type"
        )
    chosen = blocks[::every]
    for block in chosen:
        if _is_wrapped(block):
            raise ValueError(
                f"checkpointing.wrap: a {type(block).__name__} block is already checkpointed; "
                "wrap a model once (or build a fresh one to change `every`)"
            )
    for block in chosen:
        block.forward = functools.partial(checkpoint, block.forward)
    return model


def _is_wrapped(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is checkpoint


def _outermost(model: nn.Module, block_type: type | tuple[type, ...]) -> list[nn.Module]:
    found: dict[int, nn.Module] = {}  # by id: a module registered twice is one block

    def visit(module: nn.Module) -> None:
        if isinstance(module, block_type):
            found.setdefault(id(module), module)
        else:
            for child in module.children():
                visit(child)

    visit(model)
    return list(found.values())


# -- measuring -------------------------------------------------------------------------------
@dataclass
class SavedActivations:
    """What autograd keeps for backward: distinct storages, so views and tensors saved by
    several operations count once."""

    nbytes: int = 0
    storages: int = 0


@contextlib.contextmanager
def count_saved_activations(exclude: Iterable[torch.Tensor] = ()) -> Iterator[SavedActivations]:
    """Count the bytes autograd saves for backward while the block runs, leaving out the
    storages of ``exclude`` (pass ``model.parameters()``: weights are not activations).

    Measured after a forward, this is the activation memory the step holds until its backward.
    Inside a checkpointed region torch's own hooks take over, so only what a checkpoint keeps
    (its inputs) is counted; with ``cpu_checkpointing`` on a GPU not even those."""
    seen = {t.untyped_storage().data_ptr() for t in exclude}
    result = SavedActivations()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:  # the graph keeps it alive: the address stays its own
            seen.add(storage.data_ptr())
            result.nbytes += storage.nbytes()
            result.storages += 1
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield result
