"""``zerotrain deepspeed [DEEPSPEED LAUNCHER OPTIONS] SCRIPT [ARGS]``: what ``deepspeed ARGS``
starts, on this node through ``zerotrain run`` (:mod:`zerotrain.launcher.runner`)."""

from __future__ import annotations

import argparse

from zerotrain.cli.arguments import ParserSpec

__all__ = ["PARSER", "add_arguments"]

PARSER: ParserSpec = {
    "help": "the deepspeed launcher's command line, run with zerotrain run on this node",
    "add_help": False,
}
"""``add_parser`` arguments of the ``deepspeed`` command."""


def _deepspeed_command(args: argparse.Namespace, rest: list[str]) -> int:
    from zerotrain.launcher.runner import main

    return main(rest)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``deepspeed``: every token after it goes to the launcher's own parser."""
    parser.set_defaults(handler=_deepspeed_command, takes_raw_arguments=True)
