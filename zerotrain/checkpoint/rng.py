"""This rank's random-number generator states, as plain containers of tensors and numbers
(what ``torch.load(weights_only=True)`` accepts), so that a resumed run draws the same dropout
masks and random numbers as an uninterrupted one."""

from __future__ import annotations

import random
from typing import cast

import torch


def capture_rng_state() -> dict:
    """The states of Python's, NumPy's (if installed), torch's CPU and CUDA generators."""
    version, internal, gauss = random.getstate()
    state = {
        "python": [version, list(internal), gauss],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    try:
        import numpy as np
    except ImportError:
        return state
    # numpy's stubs type this call as get_state(legacy=False)'s dict; it returns the legacy tuple
    legacy = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state())
    name, keys, pos, has_gauss, cached = legacy
    state["numpy"] = [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached]
    return state


def restore_rng_state(state: dict) -> None:
    """Set the generators to a state :func:`capture_rng_state` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
