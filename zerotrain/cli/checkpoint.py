"""``zerotrain checkpoint consolidate|inspect``: work on saved checkpoints (the work itself is
in zerotrain/checkpoint/export.py)."""

from __future__ import annotations

import argparse
import sys

from zerotrain.cli.arguments import ParserSpec, size_argument

__all__ = ["PARSER", "add_arguments"]


_CKPT_DIR_HELP = (
    "a save directory (global_step*/ beside latest), one checkpoint's directory, or a "
    "HuggingFace Trainer checkpoint-N folder"
)


def _checkpoint_error(command: str, error: Exception) -> int:
    print(f"zerotrain checkpoint {command}: {error}", file=sys.stderr)
    return 1


def _consolidate_command(args: argparse.Namespace, rest: list[str]) -> int:
    from zerotrain.checkpoint import CheckpointError, consolidate
    from zerotrain.precision import DTYPES

    options = {"tag": args.tag, "dtype": DTYPES[args.dtype]}
    if args.max_shard_size is not None:
        options["max_shard_size"] = args.max_shard_size
    try:
        written = consolidate(args.ckpt_dir, args.out, **options)
    except (CheckpointError, OSError) as error:
        return _checkpoint_error("consolidate", error)
    for path in written:
        print(path)
    return 0


def _inspect_command(args: argparse.Namespace, rest: list[str]) -> int:
    from zerotrain.checkpoint import CheckpointError, inspect_checkpoints

    try:
        print(inspect_checkpoints(args.ckpt_dir, verify=args.verify))
    except (CheckpointError, OSError) as error:
        return _checkpoint_error("inspect", error)
    return 0


PARSER: ParserSpec = {
    "help": "export or inspect zerotrain checkpoints",
    "description": "Work on checkpoints written by engine.save_checkpoint.",
}
"""``add_parser`` arguments of the ``checkpoint`` command."""


def add_arguments(checkpoint: argparse.ArgumentParser) -> None:
    """Declare ``checkpoint``'s actions and their arguments (imports torch: the dtype names)."""
    from zerotrain.precision import DTYPES

    actions = checkpoint.add_subparsers(dest="checkpoint_command", required=True, metavar="ACTION")
    consolidate = actions.add_parser(
        "consolidate",
        help="write the full model state dict as HuggingFace-style safetensors",
        description="Write a checkpoint's full model state dict (fp32 master weights, frozen "
        "parameters and buffers) to OUT as model.safetensors, or as shards plus "
        "model.safetensors.index.json when it is larger than --max-shard-size.",
    )
    consolidate.add_argument("ckpt_dir", metavar="CKPT_DIR", help=_CKPT_DIR_HELP)
    consolidate.add_argument("out", metavar="OUT", help="the output directory")
    consolidate.add_argument(
        "--tag",
        help="the checkpoint in CKPT_DIR (default: the one CKPT_DIR/latest names, else the "
        "newest complete one)",
    )
    consolidate.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default="fp32",
        help="dtype of the floating-point tensors written (default: fp32)",
    )
    consolidate.add_argument(
        "--max-shard-size",
        type=size_argument,
        metavar="SIZE",
        help="largest file written, e.g. 500MB, 5GB (powers of 10), 5GiB, or bytes (default: 5GiB)",
    )
    consolidate.set_defaults(handler=_consolidate_command)
    inspect = actions.add_parser(
        "inspect",
        help="summarize the checkpoints of a save directory",
        description="List each checkpoint in CKPT_DIR, oldest first: complete, INCOMPLETE or "
        "CORRUPT, its step, world size, ZeRO stage, precision, sizes and commit time.",
    )
    inspect.add_argument("ckpt_dir", metavar="CKPT_DIR", help=_CKPT_DIR_HELP)
    inspect.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip checking every file's size and SHA-256 against the manifest (faster)",
    )
    inspect.set_defaults(handler=_inspect_command)
