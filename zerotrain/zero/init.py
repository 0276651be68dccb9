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
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from zerotrain.comm import Communicator

_FULL_SHAPE = "_zerotrain_full_shape"  # set on a parameter while it is an Init chunk
_OWNER = "_zerotrain_owner"  # the ZeroOptimizer that manages a parameter after initialize


def is_init_partitioned(param: torch.Tensor) -> bool:
    """Whether ``param`` currently holds only this rank's Init chunk."""
    return hasattr(param, _FULL_SHAPE)


def full_shape(param: torch.Tensor) -> torch.Size:
    """The parameter's logical shape, also while it is an Init chunk."""
    return getattr(param, _FULL_SHAPE, param.shape)


def partition_param(
    param: nn.Parameter, comm: Communicator, dtype: torch.dtype | None, src: int = 0
) -> None:
    """Replace ``param``'s data by this rank's chunk of rank ``src``'s values (collective)."""
    full = param.data
    comm.broadcast(full, src=src)
    flat = full.reshape(-1)
    chunk = -(-flat.numel() // comm.world_size)
    # Copy only this rank's piece (no padded copy of the whole: memory is what Init is for).
    mine = torch.zeros(chunk, dtype=flat.dtype, device=flat.device)
    piece = flat[comm.rank * chunk : (comm.rank + 1) * chunk]
    mine[: piece.numel()] = piece
    param.data = mine.to(dtype) if dtype is not None else mine
    setattr(param, _FULL_SHAPE, full_shape(param) if is_init_partitioned(param) else full.shape)


def gather_param(param: nn.Parameter, comm: Communicator) -> torch.Tensor:
    """The full value of an Init-partitioned parameter (collective; the chunk is kept)."""
    shape = full_shape(param)
    chunk = param.data
    padded = torch.empty(chunk.numel() * comm.world_size, dtype=chunk.dtype, device=chunk.device)
    comm.all_gather(padded, chunk)
    return padded[: shape.numel()].view(shape)


def unpartition_param(param: nn.Parameter, comm: Communicator) -> None:
    """Make an Init-partitioned parameter whole again (collective)."""
    full = gather_param(param, comm).clone()
    param.data = full
    delattr(param, _FULL_SHAPE)


def take_ownership(param: nn.Parameter, owner: object) -> None:
    """Hand ``param`` to an engine's optimizer: it is no longer an Init chunk."""
    if hasattr(param, _FULL_SHAPE):
        delattr(param, _FULL_SHAPE)
    setattr(param, _OWNER, owner)


def owner_of(param: torch.Tensor) -> object | None:
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

    DeepSpeed's ``deepspeed.zero.Init`` keywords are accepted: ``config``/``config_dict_or_path``
    (validated; the layout needs nothing from it), ``enabled``, ``dtype`` (the chunks' dtype;
    default: unchanged), ``module`` (partition an existing module's parameters now). Parameters
    stay partitioned after the context; train with ``zerotrain.initialize`` at stage 3, or read
    them with :class:`GatheredParameters`.
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group=None,
        config_dict_or_path=None,
        config=None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
    ):
        if data_parallel_group is not None:
            raise ValueError(
                "zerotrain.zero.Init(data_parallel_group=...): only the default group is "
                "supported; pass None"
            )
        self.enabled = enabled
        self.dtype = dtype
        config = config if config is not None else config_dict_or_path
        if config is not None:
            from zerotrain.config import load_config

            load_config(config, world_size=Communicator().world_size)  # errors name the key
        self._comm: Communicator | None = None
        self._depth: dict[int, int] = {}
        self._patched: list[tuple[type, object]] = []
        if module is not None and enabled:
            self._partition(module)

    @property
    def comm(self) -> Communicator:
        if self._comm is None:
            self._comm = Communicator()
        return self._comm

    def _partition(self, module: nn.Module) -> None:
        for param in module.parameters():
            if not is_init_partitioned(param):
                partition_param(param, self.comm, self.dtype)

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

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        for cls in _module_classes():
            self._patch(cls)
        # Classes defined inside the context are patched when they are created.
        original_hook = nn.Module.__dict__.get("__init_subclass__")
        init = self

        def __init_subclass__(cls, **kwargs):
            super(nn.Module, cls).__init_subclass__(**kwargs)
            init._patch(cls)

        nn.Module.__init_subclass__ = classmethod(__init_subclass__)
        self._patched.append((nn.Module, ("__init_subclass__", original_hook)))
        return self

    def __exit__(self, *exc) -> None:
        for cls, original in reversed(self._patched):
            if isinstance(original, tuple):  # the __init_subclass__ hook
                name, value = original
                if value is None:
                    delattr(cls, name)
                else:
                    setattr(cls, name, value)
            else:
                cls.__init__ = original
        self._patched.clear()
