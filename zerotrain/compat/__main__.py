"""``python -m zerotrain.compat [--shadow-deepspeed] [--local-rank-arg] [-m] SCRIPT [ARGS]``: run
SCRIPT as ``python SCRIPT ARGS`` would (with ``-m``: the module SCRIPT, as ``python -m``), with
``import deepspeed`` resolving to zerotrain from its first line on
(:func:`zerotrain.compat.deepspeed.activate`). ``--local-rank-arg`` puts ``--local_rank=N``
(N: the LOCAL_RANK torchrun set) before ARGS, as DeepSpeed's launcher does.
``zerotrain run --deepspeed-compat`` and ``zerotrain deepspeed`` start every rank this way."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from zerotrain.compat.deepspeed import DeepSpeedInstalled, activate

_SHADOW = "--shadow-deepspeed"
_LOCAL_RANK = "--local-rank-arg"
_MODULE = "-m"
_USAGE = f"usage: python -m zerotrain.compat [{_SHADOW}] [{_LOCAL_RANK}] [{_MODULE}] SCRIPT [ARGS]"


def main(argv: list[str]) -> int:
    flags = set()
    while argv and argv[0] in (_SHADOW, _LOCAL_RANK, _MODULE):
        flags.add(argv[0])
        argv = argv[1:]
    if not argv:
        print(_USAGE, file=sys.stderr)
        return 2
    try:
        activate(shadow=_SHADOW in flags)
    except DeepSpeedInstalled as error:
        print(error, file=sys.stderr)
        return 2
    script, args = argv[0], argv[1:]
    if _LOCAL_RANK in flags:
        args = [f"--local_rank={os.environ.get('LOCAL_RANK', '0')}", *args]
    sys.argv = [script, *args]
    if _MODULE in flags:  # sys.path[0] is the working directory already, as `python -m` has it
        runpy.run_module(script, run_name="__main__", alter_sys=True)
    else:
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
