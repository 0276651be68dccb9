"""``deepspeed.runtime.zero.partition_parameters``.

``zero_wrapper_for_fp_tensor_constructor`` is read and written through to
:mod:`zerotrain.zero.init`, where ``zero.Init`` looks it up on entry: transformers replaces it
in this module around every ``from_pretrained`` under ZeRO-3 (``prevent_arange_dtype_change``),
and its replacement must be the one Init uses, as in DeepSpeed.
"""

import sys
import types

from zerotrain.accelerator import get_accelerator
from zerotrain.zero import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    register_external_parameter,
    unregister_external_parameter,
)
from zerotrain.zero import init as _init
from zerotrain.zero.init import (
    _orig_torch_arange,
    _orig_torch_empty,
    _orig_torch_eye,
    _orig_torch_full,
    _orig_torch_ones,
    _orig_torch_randn,
    _orig_torch_tensor,
    _orig_torch_zeros,
)


class _Served(types.ModuleType):
    """This module, with ``zero_wrapper_for_fp_tensor_constructor`` held by zerotrain.zero.init:
    one value, whichever module a client reads or assigns it through (a property, so that
    tools that save and restore attributes, pytest's monkeypatch, see an ordinary one)."""

    @property
    def zero_wrapper_for_fp_tensor_constructor(self):
        return _init.zero_wrapper_for_fp_tensor_constructor

    @zero_wrapper_for_fp_tensor_constructor.setter
    def zero_wrapper_for_fp_tensor_constructor(self, value) -> None:
        _init.zero_wrapper_for_fp_tensor_constructor = value


sys.modules[__name__].__class__ = _Served

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "_orig_torch_arange",
    "_orig_torch_empty",
    "_orig_torch_eye",
    "_orig_torch_full",
    "_orig_torch_ones",
    "_orig_torch_randn",
    "_orig_torch_tensor",
    "_orig_torch_zeros",
    "get_accelerator",
    "register_external_parameter",
    "unregister_external_parameter",
    # a property of _Served, which static checkers do not see
    # pyrefly: ignore[bad-dunder-all]
    "zero_wrapper_for_fp_tensor_constructor",  # noqa: F822
]
