"""Numbers for people: byte sizes, counts and durations, written one way everywhere.

[Note: which prefixes]
Bytes, FLOPs and rates take SI prefixes, K, M, G, T (powers of 1000), as disks, links and
HuggingFace's shard sizes do; binary ones, Ki, Mi, Gi, Ti (powers of 1024), only where a value
is compared with memory sold in them (device memory in ``zerotrain estimate``, file sizes beside
their exact byte count). A model's parameter count is written as model sizes are, ``7.00B``: K,
M, B, T for thousand, million, billion, trillion, no space. Two decimals after a prefix; below a
thousand, three significant digits and no prefix.

This module imports nothing, so that every layer, ``zerotrain.comm`` included, can use it.
"""

from __future__ import annotations

__all__ = [
    "GB",
    "KB",
    "MB",
    "TB",
    "GiB",
    "KiB",
    "MiB",
    "TiB",
    "clock",
    "count",
    "duration",
    "parse_size",
    "quantity",
    "scaled",
]

KB, MB, GB, TB = 10**3, 10**6, 10**9, 10**12
KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40

_SI = (("T", TB), ("G", GB), ("M", MB), ("K", KB))
_BINARY = (("Ti", TiB), ("Gi", GiB), ("Mi", MiB), ("Ki", KiB))
_COUNT = (("T", TB), ("B", GB), ("M", MB), ("K", KB))
_SCALES = {**dict(_SI), **dict(_BINARY)}
# parse_size's units, upper-cased: HuggingFace's spellings of max_shard_size
_SIZE_UNITS = {"": 1, "B": 1, **{f"{p.upper()}B": scale for p, scale in _SI + _BINARY}}


def _prefix(value: float, prefixes: tuple[tuple[str, int], ...]) -> str:
    return next((p for p, scale in prefixes if abs(value) >= scale), "")


def scaled(value: float, prefix: str, digits: int = 2) -> str:
    """``value`` in units of ``prefix`` ("K" to "T", "Ki" to "Ti"), as a bare number for a table
    column whose header names the unit: ``scaled(3 * GiB, "Gi") == "3.00"``."""
    return f"{value / _SCALES[prefix]:.{digits}f}"


def quantity(
    value: float,
    unit: str = "",
    *,
    prefix: str | None = None,
    binary: bool = False,
    digits: int = 2,
) -> str:
    """``value`` of ``unit`` with an SI prefix (see [Note: which prefixes]):
    ``quantity(1.5e9, "B") == "1.50 GB"``, ``quantity(197120) == "197.12 K"``,
    ``quantity(512, "B") == "512 B"``. ``prefix`` fixes the prefix ("G", "Gi"; "" for none), for
    values read line after line; ``binary`` picks among Ki, Mi, Gi, Ti."""
    if prefix is None:
        prefix = _prefix(value, _BINARY if binary else _SI)
    number = scaled(value, prefix, digits) if prefix else f"{value:.3g}"
    return f"{number} {prefix}{unit}".rstrip()


def count(value: float) -> str:
    """A parameter count as model sizes are written: ``count(6.74e9) == "6.74B"``,
    ``count(350e6) == "350.00M"``, ``count(512) == "512"``."""
    prefix = _prefix(value, _COUNT)
    if not prefix:
        return f"{value:.3g}"
    return f"{value / dict(_COUNT)[prefix]:.2f}{prefix}"


def duration(seconds: float) -> str:
    """``seconds`` in s, ms or us: ``duration(0.0123) == "12.30 ms"``."""
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.2f} us"


def clock(seconds: float) -> str:
    """A longer span as a clock reads it, for progress and ETAs: ``clock(75) == "1:15"``,
    ``clock(3725) == "1:02:05"``."""
    minutes, secs = divmod(max(0, round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def parse_size(text: str) -> int:
    """A byte count as HuggingFace writes it: ``500MB``/``5GB`` (powers of 10), ``5GiB``
    (powers of 2), or plain bytes, any case, spaces allowed. Raises ``ValueError`` for anything
    else and for negative or infinite sizes."""
    number = text.strip().rstrip("BbIiKkMmGgTt ")
    unit = text.strip()[len(number) :].strip().upper()
    try:
        size = int(float(number) * _SIZE_UNITS[unit])
    except (KeyError, ValueError, OverflowError):
        size = -1
    if size < 0:
        raise ValueError(
            f"{text!r} is not a size; write bytes (1000000) or a number with KB, MB, GB "
            "(powers of 10) or KiB, MiB, GiB (powers of 2), e.g. 500MB or 5GB"
        )
    return size
