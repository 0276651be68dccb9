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
tensors are saved the same way; ``cpu_checkpointing`` wraps the call in :class:`HostOffload`'s
hooks, which therefore move exactly the retained inputs.

[Note: activation offload]
With ``cpu_checkpointing`` each region's saved inputs are copied to host memory (pinned, on a
side stream on CUDA, so the forward does not wait) and the device copies are freed once the
copy is done. Backward runs the regions in reverse order: when it unpacks region i's inputs
(to recompute it), the copies of region i-1's start back on the side stream, so they are on
the device by the time its recomputation needs them. At any point of backward the device holds
the inputs of at most two regions, the one recomputing and the next (tested with the copies
forced on a CPU); the numbers do not change. On a CPU device they are in host memory already:
nothing moves.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
import warnings
import weakref
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
    "HostOffload",
    "RecomputeStats",
    "SavedActivations",
    "checkpoint",
    "configure",
    "count_saved_activations",
    "is_configured",
    "recompute_stats",
    "reset",
    "reset_stats",
    "use_for_transformers",
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
        _offload_for(device).region() if offload and device else contextlib.nullcontext(),
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


def use_for_transformers(model: nn.Module) -> int:
    """Route a transformers model's gradient checkpointing through :func:`checkpoint`, so the
    policy (``cpu_checkpointing``, timing) applies to it: the modules whose checkpointing is on
    now (``gradient_checkpointing_enable`` before ``initialize``); the count routed."""
    routed = 0
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) and hasattr(
            module, "_gradient_checkpointing_func"
        ):
            module._gradient_checkpointing_func = checkpoint  # pyrefly: ignore[bad-argument-type]
            routed += 1
    return routed


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


# -- offload ---------------------------------------------------------------------------------
class _Saved:
    """One saved input of a region: its host copy, and a device copy while one is wanted."""

    def __init__(self, tensor: torch.Tensor, offload: HostOffload, region: list):
        self.offload, self.region = offload, region
        self.device = tensor.device
        self.host = torch.empty(
            tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=offload.pinned
        )
        self.on_device: torch.Tensor | None = None
        self.ready: Any = None  # CUDA: the event after which on_device (or host) is complete
        stream = offload.stream
        if stream is None:
            self.host.copy_(tensor)
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))  # CUDA only
        with torch.cuda.stream(stream):
            self.host.copy_(tensor, non_blocking=True)
            tensor.record_stream(stream)  # freed only once the copy is done
            self.ready = torch.cuda.Event()
            self.ready.record(stream)

    def fetch(self) -> None:
        """Start the copy back to the device (on the side stream on CUDA)."""
        if self.on_device is not None:
            return
        stream = self.offload.stream
        if stream is None:
            self.on_device = self.host.to(self.device, copy=True)
            return
        with torch.cuda.stream(stream):  # CUDA only
            if self.ready is not None:
                stream.wait_event(self.ready)  # the host copy is complete
            self.on_device = self.host.to(self.device, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record(stream)

    def take(self) -> torch.Tensor:
        """The device copy, waited for; this object no longer holds it."""
        self.fetch()
        tensor, self.on_device = self.on_device, None
        assert tensor is not None
        if self.ready is not None and self.offload.stream is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready)  # CUDA only
            tensor.record_stream(torch.cuda.current_stream(self.device))
        return tensor


class HostOffload:
    """The saved inputs of checkpointed regions in host memory between forward and backward,
    fetched back one region ahead of backward (see [Note: activation offload]). ``device``:
    where the regions compute."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pinned = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._regions: list[list[weakref.ref[_Saved]]] = []  # forward order

    @contextlib.contextmanager
    def region(self) -> Iterator[None]:
        """One region's saved tensors go to host memory while this context is open."""
        self._regions = [r for r in self._regions if any(ref() is not None for ref in r)]
        handles: list[weakref.ref[_Saved]] = []
        self._regions.append(handles)

        def pack(tensor: torch.Tensor) -> _Saved | torch.Tensor:
            if tensor.device.type != self.device.type:
                return tensor  # in host memory already (torch's checkpoint saves a CPU marker)
            saved = _Saved(tensor, self, handles)
            handles.append(weakref.ref(saved))
            return saved

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield

    def _unpack(self, saved: _Saved | torch.Tensor) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        tensor = saved.take()
        position = next((i for i, r in enumerate(self._regions) if r is saved.region), 0)
        for earlier in reversed(self._regions[:position]):  # the next region backward runs
            alive = [s for ref in earlier if (s := ref()) is not None]
            if alive:
                for other in alive:
                    other.fetch()
                break
        return tensor

    def resident(self) -> int:
        """Saved inputs whose device copy this offload holds (fetched ahead, not yet taken)."""
        return sum(
            1
            for r in self._regions
            for ref in r
            if (s := ref()) is not None and s.on_device is not None
        )


_offloads: dict[torch.device, HostOffload] = {}


def _offload_for(device: torch.device) -> HostOffload:
    if device not in _offloads:
        _offloads[device] = HostOffload(device)
    return _offloads[device]


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
