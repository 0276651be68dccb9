"""DeepSpeed's ``deepspeed.checkpointing`` path: activation checkpointing (keep a block's inputs,
recompute its activations in backward), implemented in zerotrain/activation_checkpointing.py.
Not to be confused with ``zerotrain.checkpoint``, which saves training state to files."""

from zerotrain.activation_checkpointing import (
    RecomputeStats,
    SavedActivations,
    checkpoint,
    configure,
    count_saved_activations,
    is_configured,
    recompute_stats,
    reset,
    reset_stats,
    wrap,
)

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
