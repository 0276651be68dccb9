"""``zerotrain.zero.Init``: partition parameters as the model is built.

[Note: construction-time partitioning]
Inside the context, every ``nn.Module`` subclass's ``__init__`` is wrapped; when the outermost
``__init__`` of a module returns (its own ``reset_parameters`` has run on full tensors), each of
its parameters not yet partitioned is broadcast from rank 0 (all ranks start equal), flattened,
padded to a multiple of the world size, and replaced by this rank's contiguous chunk. Children
finish their ``__init__`` before their parents, so at most one module's own parameters are ever
whole: a model larger than one rank's memory can be built. Initialisation code that runs later
(HuggingFace's ``post_init``) sees the 1-D chunks; element-wise initialisers (``normal_``,
``zero_``, ``fill_``) are correct on them, shape-dependent ones are not.

``zerotrain.initialize`` with stage 3 re-lays the chunks into its own units one parameter at a
time; stages 0-2 gather them whole. :class:`GatheredParameters` gives temporary full access.

[Note: torch's tensor constructors inside Init]
DeepSpeed's Init also replaces torch's tensor constructors (``torch.tensor``, ``empty``,
``zeros``, ``ones``, ``full``, ``arange``, ``eye``, ``randn``) by wrappers that put tensors on
its device and cast floating ones to the training dtype. It makes each wrapper by calling the
module attribute ``zero_wrapper_for_fp_tensor_constructor`` on torch's original (the
``_orig_torch_*`` names), looked up when the context is entered, so that a client can change
it: transformers does, around every ``from_pretrained`` under ZeRO-3, to keep ``torch.arange``
(RoPE's inverse frequencies) out of the cast. zerotrain's Init makes the same replacement
through the same lookup, restored on exit, and asks for neither a dtype nor a device
(``target_fp_dtype=None, target_device=None``): it casts parameters when it partitions them,
so a module's ``__init__`` runs as it would without Init (the same random draws, the same
values before the cast, buffers in the dtypes their code asked for, tensors on torch's default
device) and a model built under Init holds exactly what the same model built whole and then
partitioned would hold.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from zerotrain.accelerator import get_accelerator
from zerotrain.comm import Communicator
from zerotrain.comm.functional import control_device
from zerotrain.precision import training_dtype
from zerotrain.progress import progress
from zerotrain.zero.host import local_ranks

if TYPE_CHECKING:
    from zerotrain.config import ZeroTrainConfig

_FULL_SHAPE = "_zerotrain_full_shape"  # set on a parameter while it is an Init chunk
_OVER = "_zerotrain_partitioned_over"  # and the default-group ranks it is a chunk among
# those ranks' communicators, as the Init contexts made them (GatheredParameters' groups)
_PARTITION_COMMS: dict[tuple[int, ...], Communicator] = {}
_OWNER = "_zerotrain_owner"  # the ZeroOptimizer that manages a parameter after initialize
_EXTERNAL = "_zerotrain_external_params"  # on a module: parameters its forward reads


class ZeroParamStatus(enum.Enum):
    """Whether a partitioned parameter holds its full value now (DeepSpeed's enum: code asks
    ``p.ds_status == ZeroParamStatus.NOT_AVAILABLE`` before gathering)."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


# torch's constructors as they were when zerotrain was imported: what Init wraps, and what a
# client's wrapper compares against (transformers: ``fn is pp._orig_torch_arange``)
_orig_torch_tensor = torch.tensor
_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full
_orig_torch_arange = torch.arange
_orig_torch_eye = torch.eye
_orig_torch_randn = torch.randn


def _torch_constructors() -> dict[str, Callable[..., torch.Tensor]]:
    """torch's constructors that Init wraps, by their name in ``torch``."""
    return {
        "tensor": _orig_torch_tensor,
        "empty": _orig_torch_empty,
        "zeros": _orig_torch_zeros,
        "ones": _orig_torch_ones,
        "full": _orig_torch_full,
        "arange": _orig_torch_arange,
        "eye": _orig_torch_eye,
        "randn": _orig_torch_randn,
    }


def zero_wrapper_for_fp_tensor_constructor(
    fn: Callable[..., torch.Tensor],
    target_fp_dtype: torch.dtype | None,
    target_device: torch.device | str | None = None,
) -> Callable[..., torch.Tensor]:
    """DeepSpeed's: ``fn``, one of torch's tensor constructors, made to put its tensor on
    ``target_device`` when the call names no device, and to cast a floating-point tensor to
    ``target_fp_dtype``; None leaves that as the call has it. :class:`Init` passes None for both
    (see [Note: torch's tensor constructors inside Init]): zerotrain casts parameters when it
    partitions them, so constructors keep the dtypes their callers ask for and a model's
    initialisation runs as in an unpartitioned model. Init looks this name up when it is
    entered, so a replacement assigned to it (here or in
    ``zerotrain.runtime.zero.partition_parameters``) is what Init uses."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs) -> torch.Tensor:
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        if target_fp_dtype is not None and tensor.is_floating_point():
            tensor.data = tensor.data.to(target_fp_dtype)
        return tensor

    return wrapped


class ParamOwner(Protocol):
    """What the ZeroOptimizer that manages a parameter offers (:func:`owner_of`); a protocol,
    since zero/optimizer.py imports this module."""

    def holds_whole_during_step(self, param: nn.Parameter) -> bool: ...

    def full_value(self, param: nn.Parameter, kind: str) -> torch.Tensor | None: ...

    def set_full_value(self, param: nn.Parameter, kind: str, value: torch.Tensor) -> bool: ...

    def local_value(self, param: nn.Parameter, kind: str) -> torch.Tensor | None: ...

    def set_local_value(self, param: nn.Parameter, kind: str, value: torch.Tensor) -> bool: ...

    def begin_access(self, params: list[nn.Parameter]) -> object: ...

    def end_access(self, access: object, modifier_rank: int | None) -> None: ...


class _PartitionNumel:
    """``param.partition_numel()``: a picklable callable (``torch.save(model)`` pickles the
    attributes of parameters)."""

    def __init__(self, numel: int):
        self.numel = numel

    def __call__(self) -> int:
        return self.numel


_next_ds_id = 0


def mark_partitioned(
    param: nn.Parameter, shape: torch.Size, world_size: int, status: ZeroParamStatus
) -> None:
    """Give a partitioned parameter of logical ``shape`` DeepSpeed's ZeRO-3 attributes, which
    libraries read (``hasattr(p, "ds_id")`` to tell ZeRO-3, ``ds_numel`` to count parameters):
    ``ds_id``, ``ds_shape``, ``ds_numel``, ``ds_status``, ``partition_numel()``."""
    global _next_ds_id
    numel = shape.numel()
    # DeepSpeed's attributes, set on the Parameter object: torch's class does not declare them
    if not hasattr(param, "ds_id"):
        param.ds_id = _next_ds_id  # pyrefly: ignore[missing-attribute]
        _next_ds_id += 1
    param.ds_shape = shape  # pyrefly: ignore[missing-attribute]
    param.ds_numel = numel  # pyrefly: ignore[missing-attribute]
    param.ds_status = status  # pyrefly: ignore[missing-attribute]
    partition_numel = _PartitionNumel(-(-numel // world_size))
    param.partition_numel = partition_numel  # pyrefly: ignore[missing-attribute]


_PARTITION_MARKS = ("ds_id", "ds_shape", "ds_numel", "ds_status", "partition_numel")


def _clear_partition_marks(param: nn.Parameter) -> None:
    """Drop :func:`mark_partitioned`'s attributes from a parameter that is whole again (a
    stage-3 engine marks its own parameters afresh); libraries would take it for ZeRO-3's."""
    for name in _PARTITION_MARKS:
        if name in param.__dict__:
            delattr(param, name)


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Declare that ``module``'s forward reads ``parameter``, which another module owns
    (DeepSpeed's name). At stage 3 such a parameter is gathered for the whole forward and
    backward (it joins the root unit; see [Note: choosing gather units]), so call this before
    ``zerotrain.initialize``, e.g. in the model's ``__init__`` as HuggingFace models do."""
    if not isinstance(parameter, nn.Parameter):
        raise RuntimeError(
            f"register_external_parameter: expected an nn.Parameter, got {type(parameter).__name__}"
        )
    owner = owner_of(parameter)
    if owner is not None and not owner.holds_whole_during_step(parameter):
        raise RuntimeError(
            "register_external_parameter: this parameter is already partitioned into a stage-3 "
            "gather unit by zerotrain.initialize; register it before initialize (in the model's "
            "__init__), so that it is gathered for every module that reads it"
        )
    module.__dict__.setdefault(_EXTERNAL, {})[id(parameter)] = parameter


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Undo :func:`register_external_parameter` (before ``initialize``)."""
    module.__dict__.get(_EXTERNAL, {}).pop(id(parameter), None)


def external_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters registered as read by ``module``'s forward."""
    return list(module.__dict__.get(_EXTERNAL, {}).values())


def is_init_partitioned(param: torch.Tensor) -> bool:
    """Whether ``param`` currently holds only this rank's Init chunk."""
    return hasattr(param, _FULL_SHAPE)


def full_shape(param: torch.Tensor) -> torch.Size:
    """The parameter's logical shape, also while it is an Init chunk."""
    return getattr(param, _FULL_SHAPE, param.shape)


def partition_param(
    param: nn.Parameter, comm: Communicator, dtype: torch.dtype | None, src: int | None = None
) -> None:
    """Replace ``param``'s data by this rank's chunk of rank ``src``'s values (a default-group
    rank; None: ``comm``'s first) (collective)."""
    full = param.data
    on_wire = full.to(comm.device)  # NCCL sends device tensors; the chunk stays on full's
    comm.broadcast(on_wire, src=comm.root if src is None else src)
    flat = on_wire.reshape(-1)
    chunk = -(-flat.numel() // comm.world_size)
    # Copy only this rank's piece (no padded copy of the whole: memory is what Init is for).
    mine = torch.zeros(chunk, dtype=flat.dtype, device=full.device)
    piece = flat[comm.rank * chunk : (comm.rank + 1) * chunk]
    mine[: piece.numel()] = piece
    param.data = mine.to(dtype) if dtype is not None else mine
    setattr(param, _FULL_SHAPE, full_shape(param) if is_init_partitioned(param) else full.shape)
    setattr(param, _OVER, tuple(comm.members()))
    mark_partitioned(param, full_shape(param), comm.world_size, ZeroParamStatus.NOT_AVAILABLE)


def partitioned_over(param: torch.Tensor) -> tuple[int, ...] | None:
    """The default-group ranks an Init chunk is one of, in order (None: not a chunk)."""
    return getattr(param, _OVER, None)


def partition_comm(param: torch.Tensor) -> Communicator:
    """The communicator over the ranks an Init chunk is one of."""
    ranks = partitioned_over(param) or ()
    comm = _PARTITION_COMMS.get(ranks)
    if comm is not None:
        return comm
    world = Communicator(device=control_device())
    if ranks and list(ranks) != list(range(world.world_size)):
        raise RuntimeError(
            f"zero.Init: this chunk is partitioned over ranks {list(ranks)}, for which this "
            "process has no group (built by another process, or copied?)"
        )
    return world


def gather_param(param: nn.Parameter, comm: Communicator) -> torch.Tensor:
    """The full value of an Init-partitioned parameter (collective; the chunk is kept)."""
    shape = full_shape(param)
    chunk = param.data.to(comm.device)  # NCCL gathers device tensors
    padded = torch.empty(chunk.numel() * comm.world_size, dtype=chunk.dtype, device=chunk.device)
    comm.all_gather(padded, chunk)
    return padded[: shape.numel()].view(shape).to(param.device)


def unpartition_param(param: nn.Parameter, comm: Communicator) -> None:
    """Make an Init-partitioned parameter whole again (collective)."""
    full = gather_param(param, comm).clone()
    param.data = full
    delattr(param, _FULL_SHAPE)
    delattr(param, _OVER)
    _clear_partition_marks(param)


def take_ownership(param: nn.Parameter, owner: ParamOwner) -> None:
    """Hand ``param`` to an engine's optimizer: it is no longer an Init chunk."""
    for name in (_FULL_SHAPE, _OVER):
        if hasattr(param, name):
            delattr(param, name)
    _clear_partition_marks(param)
    setattr(param, _OWNER, owner)


def owner_of(param: torch.Tensor) -> ParamOwner | None:
    """The ZeroOptimizer managing ``param``, if any."""
    return getattr(param, _OWNER, None)


def _module_classes() -> list[type[nn.Module]]:
    seen: list[type[nn.Module]] = []
    stack = [nn.Module]
    while stack:
        cls = stack.pop()
        if cls not in seen:
            seen.append(cls)
            stack.extend(cls.__subclasses__())
    return seen


class Init:
    """Context manager: modules built inside it have their parameters partitioned at once.

    DeepSpeed's signature. ``config_dict_or_path`` (or its old name ``config``): a config dict
    or path, checked at once (a ConfigError before any module is built), of which only the
    precision is read (bf16 or fp16 enabled: the chunks take that dtype, as in DeepSpeed) and
    the ``sites`` section (each site's ranks hold a whole model: the parameters are partitioned
    over the site's ranks, not every rank); a config HuggingFace has not filled yet
    (``"auto"`` values) is fine. ``dtype`` overrides the precision; without either the dtype
    is unchanged. ``enabled=False`` is a no-op; ``module`` partitions an existing module's
    parameters now. ``remote_device`` "cpu" asks for the chunks in CPU memory, where they are on a CPU-only run; from a GPU it is
    refused until zerotrain offloads. ``mem_efficient_linear`` and ``pin_memory`` tune
    DeepSpeed's kernels and copies and have no effect here; nor does ``tensor_overrides``: torch's
    tensor constructors are wrapped inside the context as in DeepSpeed, through
    :func:`zero_wrapper_for_fp_tensor_constructor`, but asked to change neither dtype nor device
    (see [Note: torch's tensor constructors inside Init]). The process-group arguments must be
    None (the default group) and ``zero_quantized_*`` False. Parameters stay partitioned after
    the context; train with ``zerotrain.initialize`` at stage 3, or read them with
    :class:`GatheredParameters`. Leaving the context, also by an exception, or a failure while
    entering it, restores torch's constructors and module classes as they were.
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group=None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path=None,
        config=None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu=None,
        zero_param_parallel_group=None,
        zero_quantized_weights: bool = False,
        zero_quantized_nontrainable_weights: bool = False,
        sequence_data_parallel_group=None,
        param_swapper=None,
        tensor_overrides=None,
    ):
        del mem_efficient_linear, pin_memory, tensor_overrides  # see the docstring
        groups = {
            "data_parallel_group": data_parallel_group,
            "mpu": mpu,
            "zero_param_parallel_group": zero_param_parallel_group,
            "sequence_data_parallel_group": sequence_data_parallel_group,
            "param_swapper": param_swapper,
        }
        for name, value in groups.items():
            if value is not None:
                raise ValueError(
                    f"zerotrain.zero.Init({name}=...): only the default process group and no "
                    "parameter swapping are supported; pass None"
                )
        if zero_quantized_weights or zero_quantized_nontrainable_weights:
            raise ValueError(
                "zerotrain.zero.Init: ZeRO++ quantized weights are not implemented yet; pass "
                "zero_quantized_weights=False"
            )
        if remote_device not in (None, "none", "cpu"):
            raise ValueError(
                f"zerotrain.zero.Init(remote_device={remote_device!r}): NVMe offload is not "
                'implemented yet; pass None or "cpu"'
            )
        if remote_device == "cpu" and get_accelerator().device_name() != "cpu":
            raise ValueError(
                'zerotrain.zero.Init(remote_device="cpu"): zerotrain does not offload from a '
                "GPU yet; pass None"
            )
        self.enabled = enabled
        config = config if config is not None else config_dict_or_path
        checked = _checked(config)
        self.dtype = dtype if dtype is not None else _precision_dtype(checked)
        self.sites = None if checked is None else checked[0].sites
        self._comm: Communicator | None = None
        self._depth: dict[int, int] = {}
        self._patched: list[tuple[type, object]] = []
        self._replaced_constructors: dict[str, object] = {}  # torch's attributes before enter
        # a large model takes minutes to build partitioned: shown on a terminal (progress.py)
        self._phase = contextlib.ExitStack()
        self._advance: Callable[[float], object] = lambda numel: None
        if module is not None and enabled:
            self._partition(module)

    @property
    def comm(self) -> Communicator:
        """The ranks the parameters are partitioned over: every rank, or with a ``sites``
        section its site's (each site holds a whole model: docs/sites.md); made the first
        time a parameter is (collective; a ConfigError there where the ranks do not split
        into the sites)."""
        if self._comm is None:
            world = Communicator(device=control_device())
            count = 1 if self.sites is None else self.sites.count(world.world_size, local_ranks())
            per_site = world.world_size // count
            sites = [list(range(s * per_site, (s + 1) * per_site)) for s in range(count)]
            mine = tuple(sites[world.rank // per_site])
            if count == 1:
                self._comm = world
            elif mine in _PARTITION_COMMS:  # an earlier Init's (every rank finds its own)
                self._comm = _PARTITION_COMMS[mine]
            else:
                self._comm = world.split(sites)
            _PARTITION_COMMS[tuple(self._comm.members())] = self._comm
        return self._comm

    def _partition(self, module: nn.Module) -> None:
        for param in module.parameters():
            if not is_init_partitioned(param):
                numel = param.numel()
                partition_param(param, self.comm, self.dtype)
                self._advance(numel)

    def _wrap(self, init):
        @functools.wraps(init)
        def wrapped(module, *args, **kwargs):
            key = id(module)
            depth = self._depth.get(key, 0)
            self._depth[key] = depth + 1
            try:
                init(module, *args, **kwargs)
            finally:
                if depth == 0:
                    del self._depth[key]
                else:
                    self._depth[key] = depth
            if depth == 0:  # the outermost __init__ of this module has finished
                self._partition(module)

        return wrapped

    def _patch(self, cls: type) -> None:
        if "__init__" in cls.__dict__:
            original = cls.__dict__["__init__"]
            self._patched.append((cls, original))
            cls.__init__ = self._wrap(original)

    def _wrap_constructors(self) -> None:
        """Replace torch's tensor constructors by wrappers made by the module attribute
        ``zero_wrapper_for_fp_tensor_constructor`` as it is now (a client's override counts);
        all are made before any is installed, so a failing wrapper changes nothing."""
        # torch's device context (with torch.device(...)) caches the set of constructors it
        # redirects the first time it is used: built while the wrappers are in place, it would
        # hold them, and torch.device("meta") would build on the CPU for the rest of the process
        # (OnDevice's meta models included). Build it from torch's own functions first.
        from torch.utils._device import _device_constructors  # torch's, not imported by torch

        _device_constructors()
        make = zero_wrapper_for_fp_tensor_constructor  # the module global as it is now
        wrappers = {
            name: make(original, target_fp_dtype=None, target_device=None)
            for name, original in _torch_constructors().items()
        }
        for name, wrapper in wrappers.items():
            self._replaced_constructors[name] = getattr(torch, name)
            setattr(torch, name, wrapper)

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        try:
            self._wrap_constructors()
            self._advance = self._phase.enter_context(
                progress("zero.Init: parameters built and partitioned", unit=" params")
            )
            for cls in _module_classes():
                self._patch(cls)
            # Classes defined inside the context are patched when they are created.
            original_hook = nn.Module.__dict__.get("__init_subclass__")
            init = self

            def __init_subclass__(cls, **kwargs):
                super(nn.Module, cls).__init_subclass__(**kwargs)
                init._patch(cls)

            # a patch of torch's class, undone in _restore (the checker sees a method reassigned)
            # pyrefly: ignore[bad-assignment]
            nn.Module.__init_subclass__ = classmethod(__init_subclass__)
            self._patched.append((nn.Module, ("__init_subclass__", original_hook)))
        except BaseException:
            # Python calls no __exit__ for a failed __enter__ (nor does an ExitStack, as
            # transformers' from_pretrained uses): undo what was done so far here
            self._restore()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def _restore(self) -> None:
        """Undo every patch of this context, also after a failure part-way."""
        for cls, original in reversed(self._patched):
            if isinstance(original, tuple):  # the __init_subclass__ hook
                name, value = original
                if value is None:
                    delattr(cls, name)
                else:
                    setattr(cls, name, value)
            else:  # the __init__ _patch wrapped (the checker sees a method reassigned)
                cls.__init__ = original  # pyrefly: ignore[bad-assignment]
        self._patched.clear()
        for name, value in self._replaced_constructors.items():
            setattr(torch, name, value)
        self._replaced_constructors.clear()
        self._depth.clear()
        self._phase.close()
        self._advance = lambda numel: None


def _checked(config) -> tuple[ZeroTrainConfig, dict | None] | None:
    """A config given to Init, checked so that a typo is reported before the model is built
    rather than at ``initialize``: the checked config, and the raw mapping (None: given
    checked); "auto" values (HuggingFace fills them later) are left out of the check."""
    if config is None:
        return None
    from zerotrain.config import ConfigError, ZeroTrainConfig, check_config, read_config_file

    if isinstance(config, ZeroTrainConfig):
        return config, None
    raw = read_config_file(Path(config)) if isinstance(config, (str, os.PathLike)) else config
    if not isinstance(raw, dict):
        raise ConfigError(
            f"zero.Init(config_dict_or_path=...): expected a config dict or path, got "
            f"{type(raw).__name__}"
        )
    return check_config(raw, unfilled=True), raw


def _precision_dtype(checked: tuple[ZeroTrainConfig, dict | None] | None) -> torch.dtype | None:
    """The training dtype a config asks for (None: neither bf16 nor fp16); "auto" counts as
    not enabled."""
    if checked is None:
        return None
    config, raw = checked
    if raw is None:
        bf16, fp16 = config.bf16.enabled, config.fp16.enabled
    else:
        bf16, fp16 = _enabled(raw, "bf16", "bfloat16"), _enabled(raw, "fp16")
    dtype = training_dtype(bf16, fp16)
    return dtype if dtype != torch.float32 else None


def _enabled(raw: dict, *names: str) -> bool:
    """Whether a raw config enables one of the sections ``names`` (``"auto"``: not)."""
    sections = [raw.get(name) for name in names]
    return any(isinstance(s, dict) and s.get("enabled") is True for s in sections)
