"""``deepspeed.ops.op_builder.builder``: the base of DeepSpeed's op builders, as probes.

[Note: op builders as capability probes]
DeepSpeed compiles its C++/CUDA ops with one builder class each; client code asks a builder
``is_compatible()``, or reads ``deepspeed.ops.__compatible_ops__[Builder.NAME]``, to choose a
config (NVMe offload only where ``async_io`` is, CPU offload where ``cpu_adam`` is) or to skip
tests. zerotrain compiles nothing: each op is either served by zerotrain's own Python/torch code
(``SERVED_BY`` says by what) or not at all. ``is_compatible()`` answers whether zerotrain can do
what the op is for, so a probe chooses exactly the configs zerotrain runs. ``load()`` would hand
out DeepSpeed's compiled extension module, which does not exist here: it raises
:class:`OpNotAvailable`, naming what to use instead.
"""

from __future__ import annotations

import torch

from zerotrain.errors import ZeroTrainError

__all__ = ["CUDAOpBuilder", "OpBuilder", "OpNotAvailable", "TorchCPUOpBuilder"]


class OpNotAvailable(ZeroTrainError, RuntimeError):
    """An op builder's ``load()``: zerotrain has no compiled DeepSpeed extension to return.
    A ``RuntimeError``, as DeepSpeed's own failed load is."""


class OpBuilder:
    """A DeepSpeed op: ``NAME`` (its key in ``__compatible_ops__``), what serves it in zerotrain
    (``SERVED_BY``, None where nothing does) or what it is (``MISSING``, for the message)."""

    NAME = ""
    SERVED_BY: str | None = None
    MISSING = "a compiled DeepSpeed op"

    def __init__(self, name: str | None = None):
        self.name = name or self.NAME
        self.jit_mode = False
        self.build_for_cpu = False
        self.enable_bf16 = False
        self.error_log: str | None = None

    def absolute_name(self) -> str:
        return f"deepspeed.ops.{self.name}_op"

    def is_compatible(self, verbose: bool = False) -> bool:
        """Whether zerotrain serves this op (see [Note: op builders as capability probes])."""
        if self.SERVED_BY is None:
            self.error_log = f"zerotrain does not implement DeepSpeed's {self.name} op"
            if verbose:
                self.warning(self.error_log)
            return False
        return True

    def load(self, verbose: bool = True):
        del verbose
        where = f"deepspeed.ops.op_builder.{type(self).__name__}().load()"
        if self.SERVED_BY is None:
            raise OpNotAvailable(
                f"{where}: zerotrain does not implement DeepSpeed's {self.name} op "
                f"({self.MISSING}); deepspeed.ops.__compatible_ops__[{self.name!r}] is False, "
                "check it (or is_compatible()) before loading"
            )
        raise OpNotAvailable(
            f"{where}: zerotrain compiles no DeepSpeed extension modules, so there is no "
            f"{self.name} op module to return; what the op is for is served by "
            f"{self.SERVED_BY}"
        )

    def jit_load(self, verbose: bool = True):
        return self.load(verbose)

    def warning(self, msg: str) -> None:
        self.error_log = msg
        print(f" [WARNING]  {msg}")

    @staticmethod
    def is_rocm_pytorch() -> bool:
        return getattr(torch.version, "hip", None) is not None

    @staticmethod
    def is_sycl_enabled() -> bool:
        return False


class CUDAOpBuilder(OpBuilder):
    """DeepSpeed's base of its CUDA ops."""


class TorchCPUOpBuilder(CUDAOpBuilder):
    """DeepSpeed's base of its CPU ops."""
