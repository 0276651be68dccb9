"""argparse value types that several ``zerotrain`` commands share."""

from __future__ import annotations

import argparse
from typing import TypedDict

from zerotrain.fmt import parse_size

__all__ = ["ParserSpec", "positive_int", "size_argument"]


class ParserSpec(TypedDict, total=False):
    """The ``add_parser`` keyword arguments a command module declares as ``PARSER``."""

    help: str
    description: str
    usage: str
    add_help: bool


def size_argument(text: str) -> int:
    """A positive byte count as :func:`zerotrain.fmt.parse_size` reads it: ``500MB``, ``5GiB``."""
    try:
        size = parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if size == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; it must be more than 0 bytes")
    return size


def positive_int(text: str) -> int:
    """An integer of at least 1."""
    return _at_least(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    """An integer of at least 0."""
    return _at_least(text, 0, "an integer of 0 or more")


def _at_least(text: str, minimum: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value
