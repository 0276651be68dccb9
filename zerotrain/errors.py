"""zerotrain's own errors, and how a rank started by ``zerotrain run`` reports one.

[Note: one message per failure, not a traceback per rank]
Every error zerotrain raises for a problem the user can fix (a config key, a checkpoint file,
a rank that stopped answering, too little memory) is a :class:`ZeroTrainError`: its message
names the object and the fix, so its traceback adds nothing but length. Under ``zerotrain run``
(which sets ``ZEROTRAIN_RUN=1``), a rank that ends on one writes it to torchrun's error file
(``TORCHELASTIC_ERROR_FILE``, the file torchrun's ``@record`` writes) instead of printing it;
``zerotrain run`` then prints each distinct message once, naming the ranks that raised it
(zerotrain/cli/torchrun.py): a config typo on 8 ranks is one line, not 8 tracebacks and
torchrun's report. Any other exception prints its traceback as Python does, and a script
started without ``zerotrain run`` sees no change at all.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from types import TracebackType

__all__ = ["LAUNCHED_ENV", "ZeroTrainError", "report_errors_to_launcher"]

LAUNCHED_ENV = "ZEROTRAIN_RUN"


class ZeroTrainError(Exception):
    """Base of the errors whose message says what is wrong and how to fix it (see [Note: one
    message per failure, not a traceback per rank]). Each subclass also derives from the
    builtin error it has always been (``ConfigError`` is a ``ValueError``), so existing
    ``except`` clauses still catch it."""


def _write_error_file(error: BaseException, tb: TracebackType | None) -> bool:
    """torchrun's error file for ``error``, in the format its ``@record`` writes; False where
    torchrun gave no file."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    record = {
        "message": {
            "message": f"{type(error).__name__}: {error}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(type(error), error, tb)),
                "timestamp": str(int(time.time())),
            },
        }
    }
    try:
        with open(path, "w") as file:
            json.dump(record, file)
    except OSError:
        return False
    return True


def report_errors_to_launcher() -> None:
    """Under ``zerotrain run``, route an uncaught :class:`ZeroTrainError` to the launcher (see
    the module note); does nothing in a process zerotrain run did not start."""
    if os.environ.get(LAUNCHED_ENV) != "1" or getattr(sys.excepthook, "_zerotrain", False):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        if not (isinstance(error, ZeroTrainError) and _write_error_file(error, tb)):
            previous(kind, error, tb)

    hook._zerotrain = True  # type: ignore[attr-defined]
    sys.excepthook = hook
