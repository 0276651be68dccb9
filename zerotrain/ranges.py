"""Half-open element ranges ``[start, end)``: where a parameter, a shard, a saved segment meet."""

from __future__ import annotations


def intersect(start: int, end: int, other_start: int, other_end: int) -> tuple[int, int]:
    """The overlap of ``[start, end)`` and ``[other_start, other_end)`` as ``(lo, hi)``; empty
    when ``lo >= hi``."""
    return max(start, other_start), min(end, other_end)


def overlaps(start: int, end: int, other_start: int, other_end: int) -> bool:
    """Whether the two ranges share an element."""
    lo, hi = intersect(start, end, other_start, other_end)
    return lo < hi
