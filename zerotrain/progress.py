"""Progress of long phases (``zero.Init`` building a model, NVMe offload writing its first
state, a checkpoint read or written) for a person watching a terminal.

[Note: when progress shows]
A bar (tqdm) appears on rank 0 only, only when its standard error is a terminal, and only once
the phase has lasted ``DELAY_S`` seconds, so short phases, other ranks and logs redirected to a
file stay as they were. ``ZEROTRAIN_PROGRESS=1`` shows it without a terminal (what tests
check), ``ZEROTRAIN_PROGRESS=0`` never. The bar counts what the phase moves (parameters,
bytes), with its rate; a phase whose size is known shows the fraction and the time left.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator

__all__ = ["DELAY_S", "ENV", "progress"]

DELAY_S = 2.0
ENV = "ZEROTRAIN_PROGRESS"


def _shown() -> bool:
    forced = os.environ.get(ENV)
    if forced is not None:
        return forced == "1"
    # RANK is torchrun's; a process started without it is a single rank
    return os.environ.get("RANK", "0") == "0" and sys.stderr.isatty()


@contextlib.contextmanager
def progress(
    description: str, *, total: float | None = None, unit: str = "it"
) -> Iterator[Callable[[float], object]]:
    """A context for one phase: yields ``advance(amount)``, to call as the phase moves on
    (see [Note: when progress shows]); a no-op where no bar shows."""
    if not _shown():
        yield lambda amount: None
        return
    from tqdm import tqdm  # only where a bar shows: tqdm costs an import

    delay = 0.0 if os.environ.get(ENV) == "1" else DELAY_S
    bar = tqdm(
        total=total,
        desc=description,
        unit=unit,
        unit_scale=True,
        delay=delay,
        file=sys.stderr,
        dynamic_ncols=True,
    )
    try:
        yield bar.update
    finally:
        bar.close()
