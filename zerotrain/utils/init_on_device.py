"""DeepSpeed's ``deepspeed.OnDevice`` (``deepspeed.utils.init_on_device``): build a module's
tensors on a device, ``"meta"`` included, and in a floating-point dtype."""

from __future__ import annotations

from contextlib import ExitStack

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["OnDevice"]

# DeepSpeed casts the floating-point results of these constructors; module initialisation
# (nn.Linear, nn.Embedding, nn.LayerNorm...) makes every parameter through one of them
_CAST = {torch.empty, torch.zeros, torch.ones, torch.full}


class OnDevice:
    """Context manager: tensors made inside it are on ``device`` unless the call names one
    (torch's own device context, so every factory function and module constructor follows it),
    and the floating-point ones that ``torch.empty/zeros/ones/full`` make are in ``dtype``
    (None: as the call asks)::

        with OnDevice(dtype=torch.bfloat16, device="meta"):
            model = MyModel()  # no memory: shapes and dtypes only

    ``enabled=False`` makes it a no-op. torch's functions are not replaced (both are torch
    function modes), so nothing is left behind, also after an error.
    """

    def __init__(
        self, dtype: torch.dtype | None, device: str | torch.device = "meta", enabled: bool = True
    ):
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"OnDevice: dtype must be a floating-point torch.dtype, got {dtype!r}")
        self.dtype = dtype
        self.device = torch.device(device)
        self.enabled = enabled
        self._stack: ExitStack | None = None

    def __enter__(self) -> OnDevice:
        if not self.enabled:
            return self
        if self._stack is not None:
            raise RuntimeError("OnDevice: already entered; use a new OnDevice to nest one")
        stack = ExitStack()
        try:
            stack.enter_context(self.device)
            if self.dtype is not None:  # entered last, so it sees a call first
                stack.enter_context(_CastFloating(self.dtype))
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def __exit__(self, *exc) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()


class _CastFloating(TorchFunctionMode):
    """Floating-point results of ``_CAST`` constructors in ``dtype``."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func in _CAST and result.is_floating_point():
            return result.to(self.dtype)
        return result
