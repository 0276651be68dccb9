"""``python -m zerotrain.compat [--shadow-deepspeed] SCRIPT [ARGS]``: run SCRIPT as ``python
SCRIPT ARGS`` would, with ``import deepspeed`` resolving to zerotrain from its first line on
(:func:`zerotrain.compat.deepspeed.activate`). ``zerotrain run --deepspeed-compat`` starts
every rank this way."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from zerotrain.compat.deepspeed import DeepSpeedInstalled, activate

_SHADOW = "--shadow-deepspeed"


def main(argv: list[str]) -> int:
    shadow = bool(argv) and argv[0] == _SHADOW
    argv = argv[1:] if shadow else argv
    if not argv:
        print(f"usage: python -m zerotrain.compat [{_SHADOW}] SCRIPT [ARGS]", file=sys.stderr)
        return 2
    try:
        activate(shadow=shadow)
    except DeepSpeedInstalled as error:
        print(error, file=sys.stderr)
        return 2
    script = argv[0]
    sys.argv = list(argv)
    sys.path[0] = str(Path(script).resolve().parent)  # as `python SCRIPT` sets it
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
