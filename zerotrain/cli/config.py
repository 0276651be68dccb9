"""``zerotrain config check FILE``: the config check ``initialize`` runs, offline, before a job
is submitted (also ``python -m zerotrain.config FILE``)."""

from __future__ import annotations

import argparse
import sys

from zerotrain.cli.arguments import ParserSpec, positive_int

__all__ = ["PARSER", "add_arguments"]


def _check_command(args: argparse.Namespace, rest: list[str]) -> int:
    from zerotrain.config.report import check_file

    ok, report = check_file(args.file, args.world_size)
    print(report, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


PARSER: ParserSpec = {
    "help": "check a DeepSpeed-style config file",
    "description": "Check a ds_config.json / .yaml as zerotrain.initialize would, without "
    "starting anything.",
}
"""``add_parser`` arguments of the ``config`` command."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``config check``."""
    actions = parser.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    check = actions.add_parser(
        "check",
        help="report every problem of a config file, with its key path and fix",
        description="Report every problem of FILE (unknown keys with a did-you-mean, values "
        "out of range, keys asking for what zerotrain lacks), or what it asks for. Exit "
        "status 1 when there is a problem.",
    )
    check.add_argument("file", metavar="FILE", help="a .json, .yaml or .yml config")
    check.add_argument(
        "--world-size",
        type=positive_int,
        help="data-parallel ranks: also resolve the batch keys for this many",
    )
    check.set_defaults(handler=_check_command)
