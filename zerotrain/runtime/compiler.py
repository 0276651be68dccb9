"""``deepspeed.runtime.compiler``."""

import torch

__all__ = ["is_compile_supported"]


def is_compile_supported() -> bool:
    """Whether ``torch.compile`` exists (``engine.compile()`` needs it)."""
    return hasattr(torch, "compile")
