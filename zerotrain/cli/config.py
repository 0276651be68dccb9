"""``zerotrain config check FILE``: the config check ``initialize`` runs, offline, before a job
is submitted (also ``python -m zerotrain.config FILE``)."""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from zerotrain.cli.arguments import ParserSpec, positive_int

__all__ = ["PARSER", "add_arguments", "check_file"]


def check_file(path: str, world_size: int | None = None) -> tuple[bool, str]:
    """(whether ``path`` passes, the report to print): every problem with its key path, or
    what the config asks for. With ``world_size`` the batch keys are resolved as the engine
    resolves them for that many data-parallel ranks."""
    from zerotrain.config import ConfigError, check_config, load_config, read_config_file
    from zerotrain.config.load import has_auto

    with warnings.catch_warnings(record=True) as notes:
        warnings.simplefilter("always")
        try:
            raw = read_config_file(Path(path))
            unfilled = has_auto(raw)
            config = check_config(raw, unfilled=unfilled)
            if world_size is not None and not unfilled:
                config = load_config(raw, world_size=world_size)
        except ConfigError as error:
            return False, f"{path}: {len(str(error).splitlines())} problem(s)\n{error}"
    lines = [f"{path}: valid"]
    lines += [f"  note: {str(note.message).removeprefix('zerotrain config: ')}" for note in notes]
    zero = config.zero_optimization
    precision = "bf16" if config.bf16.enabled else "fp16" if config.fp16.enabled else "fp32"
    optimizer = config.optimizer.type if config.optimizer is not None else "none (the script's)"
    lines.append(
        f"  ZeRO stage {zero.stage}, {precision}, optimizer {optimizer}, offload: optimizer "
        f"{zero.offload_optimizer.device}, parameters {zero.offload_param.device}"
    )
    if unfilled:
        lines.append(
            '  "auto" values are left for HuggingFace\'s Trainer to fill; the batch keys are '
            "checked when it has"
        )
    elif world_size is None:
        lines.append("  batch keys: checked at initialize; --world-size N checks them now")
    else:
        sizes = config.batch_sizes()
        lines.append(
            f"  batch: train_batch_size {sizes.train_batch_size} = micro-batch "
            f"{sizes.train_micro_batch_size_per_gpu} x accumulation "
            f"{sizes.gradient_accumulation_steps} x {world_size} data-parallel rank(s)"
        )
    return True, "\n".join(lines)


def _check_command(args: argparse.Namespace, rest: list[str]) -> int:
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
