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
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value
