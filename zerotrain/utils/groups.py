"""DeepSpeed's ``deepspeed.utils.groups``: the lookups of the sequence-parallel group that
Accelerate and the HF Trainer call under ALST (``_get_sequence_parallel_group`` and its rank
and size), answered from the groups a registration or an engine made last
(zerotrain/sequence/groups.py), and the data-parallel size."""

from __future__ import annotations

from typing import Any

from zerotrain.comm import get_world_group, get_world_size
from zerotrain.sequence.groups import SequenceParallelGroups, latest


def _groups() -> SequenceParallelGroups:
    groups = latest()
    if groups is None:
        raise RuntimeError(
            "deepspeed.utils.groups: no sequence-parallel group has been made; register Ulysses "
            "(UlyssesSPAttentionHF.register_with_transformers) or set sequence_parallel_size "
            "in the config before asking"
        )
    return groups


def _get_sequence_parallel_group() -> Any:
    return _groups().get_sequence_parallel_group()


def _get_sequence_parallel_world_size() -> int:
    groups = latest()
    return 1 if groups is None else groups.get_sequence_parallel_world_size()


def _get_sequence_parallel_rank() -> int:
    groups = latest()
    return 0 if groups is None else groups.get_sequence_parallel_rank()


def _get_sequence_data_parallel_group() -> Any:
    groups = latest()
    return get_world_group() if groups is None else groups.get_sequence_data_parallel_group()


def _get_data_parallel_world_size() -> int:
    """The ranks that see different data (the world, without sequence-parallel groups)."""
    groups = latest()
    return get_world_size() if groups is None else groups.get_data_parallel_world_size()


__all__ = [
    "_get_data_parallel_world_size",
    "_get_sequence_data_parallel_group",
    "_get_sequence_parallel_group",
    "_get_sequence_parallel_rank",
    "_get_sequence_parallel_world_size",
]
