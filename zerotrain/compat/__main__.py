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
    _end_process_group()
    return 0


def _end_process_group() -> None:
    """The script has returned and this process is about to exit: end the process group even
    where the framework made it (Accelerate's CPU path calls init_process_group itself, so
    zerotrain's exit hook leaves that group alone). Left to the interpreter's last garbage
    collection, gloo's threads can abort the process (see comm/setup.py, _tear_down_at_exit)."""
    import gc

    from zerotrain.comm import destroy_process_group, is_initialized

    if is_initialized():
        destroy_process_group()
    gc.collect()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
