"""zerotrain's logger and DeepSpeed's rank-aware logging helpers (``deepspeed.utils.logging``)."""

from __future__ import annotations

import functools
import logging
import sys

__all__ = ["log_dist", "log_dist_once", "logger", "print_dist", "set_log_level_from_string"]


def _make_logger() -> logging.Logger:
    log = logging.getLogger("zerotrain")
    if not log.handlers:  # once, also when this module is imported under two names
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(
            logging.Formatter("[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d] %(message)s")
        )
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


logger = _make_logger()
"""The ``zerotrain`` logger: INFO and above to stdout (DeepSpeed's ``deepspeed.utils.logger``)."""


def _message_for(message: str, ranks: list[int] | None) -> str | None:
    """``message`` prefixed with this rank, or None where it is not logged. As in DeepSpeed:
    without a process group every call logs; with one, only the ranks in ``ranks`` (-1 first:
    all ranks), so ``ranks=None`` logs nothing."""
    from zerotrain.comm import get_rank, is_initialized

    if not is_initialized():
        return f"[Rank -1] {message}"
    rank = get_rank()
    if ranks and (ranks[0] == -1 or rank in ranks):
        return f"[Rank {rank}] {message}"
    return None


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message``, prefixed with the rank, on the ranks in ``ranks`` ([-1]: every rank;
    without a process group: always)."""
    text = _message_for(message, ranks)
    if text is not None:
        logger.log(level, text)


def print_dist(message: str, ranks: list[int] | None = None) -> None:
    """As :func:`log_dist`, printed whatever the log level."""
    text = _message_for(message, ranks)
    if text is not None:
        print(text, flush=True)


@functools.cache
def _log_once(message: str, ranks: tuple[int, ...] | None, level: int) -> None:
    log_dist(message, list(ranks) if ranks is not None else None, level)


def log_dist_once(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """:func:`log_dist`, each distinct message once per process."""
    _log_once(message, tuple(ranks) if ranks is not None else None, level)


def set_log_level_from_string(log_level_str: str, custom_logger: logging.Logger | None = None):
    """Set ``custom_logger`` (default: zerotrain's) to a level named like ``"info"``."""
    level = logging.getLevelName(log_level_str.upper())
    if not isinstance(level, int):
        raise ValueError(
            f"set_log_level_from_string: {log_level_str!r} is not a log level; use debug, info, "
            "warning, error or critical"
        )
    (custom_logger or logger).setLevel(level)
