"""The ``zerotrain`` console script: ``zerotrain run``, ``zerotrain checkpoint``,
``zerotrain config``, ``zerotrain estimate``, ``zerotrain plan``, ``zerotrain deepspeed``.

One module per command: :mod:`~zerotrain.cli.launch` (``run``, a thin wrapper of torchrun),
:mod:`~zerotrain.cli.checkpoint` (consolidate, inspect), :mod:`~zerotrain.cli.config` (check),
:mod:`~zerotrain.cli.estimate`, :mod:`~zerotrain.cli.plan` and :mod:`~zerotrain.cli.deepspeed`
(DeepSpeed's launcher flags);
each has ``PARSER`` (its ``add_parser`` arguments) and ``add_arguments(parser)``.

[Note: `zerotrain --version` imports nothing heavy]
``zerotrain --version`` and ``zerotrain --help`` are answered by argparse alone, without torch:
``import zerotrain`` loads its submodules on first use (zerotrain/__init__.py), the command
modules import torch and the runtime only inside their handlers, and a command's arguments are
declared only when that command is on the command line, because some of them need torch to be
declared (the estimate's dtype choices are torch dtypes).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from zerotrain import __version__
from zerotrain.cli import checkpoint, config, deepspeed, estimate, launch, plan
from zerotrain.cli.estimate import EstimateError
from zerotrain.cli.launch import LaunchError, LaunchPlan, plan_launch

__all__ = ["EstimateError", "LaunchError", "LaunchPlan", "main", "plan_launch"]

_COMMANDS = {
    "run": launch,
    "checkpoint": checkpoint,
    "config": config,
    "estimate": estimate,
    "plan": plan,
    "deepspeed": deepspeed,
}


def _build_parser(command: str | None) -> argparse.ArgumentParser:
    """The parser, with the arguments of ``command`` only (see the module note)."""
    parser = argparse.ArgumentParser(
        prog="zerotrain",
        description="ZeRO data-parallel training for PyTorch with a DeepSpeed-compatible API.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in _COMMANDS.items():
        subparser = commands.add_parser(name, **module.PARSER)
        if name == command:
            module.add_arguments(subparser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``zerotrain`` console script; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # zerotrain's own options (--help, --version) take no value: the first other token is the
    # command
    command = next((token for token in argv if not token.startswith("-")), None)
    parser = _build_parser(command)
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "takes_raw_arguments", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.handler(args, rest)
