"""The ``zerotrain`` console script.

``zerotrain run [launcher options] SCRIPT [SCRIPT ARGS]`` starts SCRIPT once per local device
through torchrun (``python -m torch.distributed.run``): we do not write our own launcher or
rendezvous, we only pick defaults that suit ZeRO training and then hand over to torchrun.
``zerotrain checkpoint consolidate|inspect`` works on saved checkpoints (see
zerotrain/checkpoint/export.py). ``zerotrain estimate`` prints the memory a training job needs
per device at each ZeRO stage (zerotrain/estimate.py).

# [Note: how `zerotrain run` splits its arguments]
argparse cannot tell a torchrun option's value from the script path (in ``--nnodes 2 train.py``
it would take ``2`` as the script), so the ``run`` arguments are split by hand: every token before
the first positional that is not an option's value is a launcher option, the first positional is
the script, and everything after it belongs to the script. Which options take a value is read
from torchrun's own parser, so options that torchrun adds later pass through as well. The
launcher options we do not own are then validated by torchrun's parser and forwarded unchanged.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from zerotrain import __version__
from zerotrain.fmt import parse_size

__all__ = ["EstimateError", "LaunchError", "LaunchPlan", "main", "plan_launch"]

# Options that belong to `zerotrain run` itself; all other launcher options go to torchrun.
_DRY_RUN = "--dry-run"
_HELP = ("-h", "--help")
_NPROC = ("--nproc-per-node", "--nproc_per_node")

# Launcher options (torchrun `dest` names) that choose how the nodes meet. With none of them and
# a single node, `--standalone` is added: torchrun then runs its own c10d store on a free local
# port, so two runs on one machine do not collide on the default master port 29500.
_RENDEZVOUS_DESTS = frozenset(
    {
        "standalone",
        "rdzv_backend",
        "rdzv_endpoint",
        "rdzv_id",
        "rdzv_conf",
        "master_addr",
        "master_port",
        "node_rank",
        "local_addr",
    }
)

_RUN_USAGE = (
    "zerotrain run [--nproc-per-node N] [--dry-run] [TORCHRUN OPTIONS] SCRIPT [SCRIPT ARGS]"
)
_RUN_DESCRIPTION = """\
Launch SCRIPT once per local device with torchrun (python -m torch.distributed.run).

options:
  --nproc-per-node N  processes on this node (default: the number of CUDA devices, or 1
                      without CUDA)
  --dry-run           print the torchrun command line instead of running it
  -h, --help          show this help and exit

Every other option before SCRIPT is passed to torchrun unchanged, e.g. the multi-node flags
--nnodes, --node-rank, --rdzv-backend, --rdzv-endpoint, --rdzv-id, --master-addr, --master-port,
--max-restarts (see `python -m torch.distributed.run --help`).

Defaults added for you:
  --standalone        on a single node without rendezvous options: torchrun picks a free port
  OMP_NUM_THREADS     with several processes and no CUDA, set to (CPU cores // processes)
                      unless already set, so the processes share the cores without
                      oversubscribing them

examples:
  zerotrain run --nproc-per-node 2 examples/train_gpt.py --steps 200
  zerotrain run --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
      --rdzv-endpoint node0:29500 --rdzv-id job42 train.py
"""


class LaunchError(ValueError):
    """A `zerotrain run` command line that cannot be turned into a torchrun command."""


@dataclass(frozen=True, kw_only=True)
class LaunchPlan:
    """The torchrun invocation that `zerotrain run` executes."""

    argv: list[str]
    """The full command: ``[python, -m, torch.distributed.run, ...launcher options, script, ...]``."""
    env_overrides: dict[str, str] = field(default_factory=dict)
    """Environment variables set on top of the caller's environment."""
    dry_run: bool = False
    """Print the command instead of running it."""

    def shell_line(self) -> str:
        """The command as one shell line, environment overrides first."""
        env = [f"{name}={shlex.quote(value)}" for name, value in self.env_overrides.items()]
        return " ".join([*env, shlex.join(self.argv)])


def _torchrun_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "zerotrain run"
    parser.usage = _RUN_USAGE  # its own usage lists every torchrun option: 20 lines
    return parser


def _option_arity(parser: argparse.ArgumentParser) -> dict[str, bool]:
    """Maps every option string of `parser` to whether it takes a value."""
    # argparse has no public accessor for its actions; `_actions` has been stable since 3.2.
    return {
        option: action.nargs != 0 for action in parser._actions for option in action.option_strings
    }


def _split_run_argv(
    run_argv: Sequence[str], takes_value: Mapping[str, bool]
) -> tuple[list[str], str | None, list[str]]:
    """Splits ``run`` arguments into (launcher options, script, script args).

    See [Note: how `zerotrain run` splits its arguments]. The script is None when absent.
    """
    tokens = list(run_argv)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token == "--":
            if i + 1 == len(tokens):
                return tokens[:i], None, []
            return tokens[:i], tokens[i + 1], tokens[i + 2 :]
        if not token.startswith("-") or token == "-":
            return tokens[:i], token, tokens[i + 1 :]
        name = token.split("=", 1)[0]
        if name in takes_value:
            attached = "=" in token
        elif not token.startswith("--") and token[:2] in takes_value:
            name, attached = token[:2], True  # short option with its value attached: -r3
        else:
            raise LaunchError(
                f"zerotrain run: unknown launcher option {token!r} before the script; "
                "see `zerotrain run --help` and `python -m torch.distributed.run --help`"
            )
        if takes_value[name] and not attached:
            if i + 1 == len(tokens):
                raise LaunchError(f"zerotrain run: option {name} needs a value")
            i += 2
        else:
            i += 1
    return tokens, None, []


def _take_own_options(launcher_argv: list[str]) -> tuple[list[str], str | None, bool, bool]:
    """Removes our own options; returns (rest, nproc value or None, dry_run, help)."""
    rest: list[str] = []
    nproc: str | None = None
    dry_run = show_help = False
    i = 0
    while i < len(launcher_argv):
        token = launcher_argv[i]
        name, _, attached = token.partition("=")
        if token == _DRY_RUN:
            dry_run = True
        elif token in _HELP:
            show_help = True
        elif name in _NPROC:
            if "=" in token:
                nproc = attached
            else:
                nproc = launcher_argv[i + 1]  # present: _split_run_argv checked it
                i += 1
        else:
            rest.append(token)
        i += 1
    return rest, nproc, dry_run, show_help


def _parse_nproc(value: str | None, cuda_devices: int) -> int:
    if value is None:
        return max(1, cuda_devices)
    try:
        nproc = int(value)
    except ValueError:
        nproc = 0
    if nproc < 1:
        raise LaunchError(
            f"zerotrain run: --nproc-per-node must be a positive integer, got {value!r} "
            "(leave it out for one process per CUDA device, or 1 without CUDA)"
        )
    return nproc


def _is_single_node(nnodes: str) -> bool:
    # torchrun accepts "N" or an elastic range "MIN:MAX".
    return all(part.strip() == "1" for part in str(nnodes).split(":"))


def plan_launch(
    run_argv: Sequence[str],
    *,
    environ: Mapping[str, str],
    cpu_count: int,
    cuda_devices: int,
    python: str = sys.executable,
) -> LaunchPlan | None:
    """Builds the torchrun command for ``zerotrain run RUN_ARGV``.

    Launches nothing, so it can be tested. `environ` is the environment the launch inherits
    (torchrun's parser reads its PET_* defaults from `os.environ` itself); `cuda_devices` is the
    number of local CUDA devices. Returns None when help was requested, after printing it.
    Raises `LaunchError` on a bad command line.
    """
    torchrun = _torchrun_parser()
    takes_value = _option_arity(torchrun)
    takes_value.update({_DRY_RUN: False, _HELP[0]: False, _HELP[1]: False})
    launcher_argv, script, script_args = _split_run_argv(run_argv, takes_value)
    forwarded, nproc_value, dry_run, show_help = _take_own_options(launcher_argv)
    if show_help:
        print(f"usage: {_RUN_USAGE}\n\n{_RUN_DESCRIPTION}", end="")
        return None
    if script is None:
        raise LaunchError(f"zerotrain run: missing SCRIPT\nusage: {_RUN_USAGE}")
    if script.startswith("-"):  # python itself would read it as an option
        raise LaunchError(f"zerotrain run: SCRIPT {script!r} starts with '-'; write ./{script}")
    nproc = _parse_nproc(nproc_value, cuda_devices)

    # torchrun's parser validates the forwarded options and fills in what comes from its
    # PET_* environment variables; exits with a usage message on an invalid option value.
    parsed = torchrun.parse_args([*forwarded, script])
    given = {
        action.dest
        for action in torchrun._actions
        for token in forwarded
        if token.split("=", 1)[0] in action.option_strings
    }
    given |= {dest for dest in _RENDEZVOUS_DESTS if f"PET_{dest.upper()}" in environ}
    has_rendezvous = bool(given & _RENDEZVOUS_DESTS)
    single_node = _is_single_node(parsed.nnodes)
    if not single_node and not has_rendezvous:
        raise LaunchError(
            f"zerotrain run: --nnodes {parsed.nnodes} needs a rendezvous so that the nodes find "
            "each other: pass --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id JOB_ID "
            "(or --master-addr, --master-port and --node-rank)"
        )

    env_overrides: dict[str, str] = {}
    if nproc > 1 and "OMP_NUM_THREADS" not in environ and cuda_devices == 0:
        # Without CUDA the processes do their math on CPU threads. torchrun would set 1 thread
        # per process (right for GPU jobs, where the CPU only feeds the device), which leaves
        # cores idle when there are fewer processes than cores; the default of every process
        # taking all cores oversubscribes them. Split the cores evenly instead.
        env_overrides["OMP_NUM_THREADS"] = str(max(1, cpu_count // nproc))

    argv = [python, "-m", "torch.distributed.run"]
    if single_node and not has_rendezvous:
        argv.append("--standalone")
    argv += ["--nproc-per-node", str(nproc), *forwarded, script, *script_args]
    return LaunchPlan(argv=argv, env_overrides=env_overrides, dry_run=dry_run)


def _available_cpus() -> int:
    # The affinity mask respects taskset, cgroup cpusets and SLURM's --cpus-per-task.
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _run_command(args: argparse.Namespace, rest: list[str]) -> int:
    try:
        plan = plan_launch(
            rest,
            environ=os.environ,
            cpu_count=_available_cpus(),
            cuda_devices=_cuda_device_count(),
        )
    except LaunchError as error:
        print(error, file=sys.stderr)
        return 2
    if plan is None:
        return 0
    if plan.dry_run:
        print(plan.shell_line())
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    # exec rather than a child process: torchrun then receives SIGINT/SIGTERM directly (and
    # forwards them to the workers), and its exit status is ours without any relaying.
    os.execve(plan.argv[0], plan.argv, {**os.environ, **plan.env_overrides})


# -- `zerotrain checkpoint` ----------------------------------------------------------------------
_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _parse_size(text: str) -> int:
    """A positive byte count as :func:`zerotrain.fmt.parse_size` reads it."""
    try:
        size = parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if size == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; it must be more than 0 bytes")
    return size


def _checkpoint_error(command: str, error: Exception) -> int:
    print(f"zerotrain checkpoint {command}: {error}", file=sys.stderr)
    return 1


def _consolidate_command(args: argparse.Namespace, rest: list[str]) -> int:
    import torch  # here, not at the top: `zerotrain --version` must not wait for torch

    from zerotrain.checkpoint import CheckpointError, consolidate

    options = {"tag": args.tag, "dtype": getattr(torch, _DTYPE_NAMES[args.dtype])}
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


def _add_checkpoint_parser(commands) -> None:
    checkpoint = commands.add_parser(
        "checkpoint",
        help="export or inspect zerotrain checkpoints",
        description="Work on checkpoints written by engine.save_checkpoint.",
    )
    actions = checkpoint.add_subparsers(dest="checkpoint_command", required=True, metavar="ACTION")
    consolidate = actions.add_parser(
        "consolidate",
        help="write the full model state dict as HuggingFace-style safetensors",
        description="Write a checkpoint's full model state dict (fp32 master weights, frozen "
        "parameters and buffers) to OUT as model.safetensors, or as shards plus "
        "model.safetensors.index.json when it is larger than --max-shard-size.",
    )
    consolidate.add_argument(
        "ckpt_dir", metavar="CKPT_DIR", help="a save directory, or one checkpoint's directory"
    )
    consolidate.add_argument("out", metavar="OUT", help="the output directory")
    consolidate.add_argument(
        "--tag", help="the checkpoint in CKPT_DIR (default: the newest complete one)"
    )
    consolidate.add_argument(
        "--dtype",
        choices=list(_DTYPE_NAMES),
        default="fp32",
        help="dtype of the floating-point tensors written (default: fp32)",
    )
    consolidate.add_argument(
        "--max-shard-size",
        type=_parse_size,
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
    inspect.add_argument(
        "ckpt_dir", metavar="CKPT_DIR", help="a save directory, or one checkpoint's directory"
    )
    inspect.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip checking every file's size and SHA-256 against the manifest (faster)",
    )
    inspect.set_defaults(handler=_inspect_command)


# -- `zerotrain estimate` ------------------------------------------------------------------------
_COUNT_UNITS = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


class EstimateError(ValueError):
    """A `zerotrain estimate` command line that cannot be estimated."""


def _parse_count(text: str) -> int:
    """A parameter count: ``7B``, ``6.74B``, ``350M``, ``7e9`` or ``7000000000``."""
    stripped = text.strip().replace("_", "")
    unit = stripped[-1:].upper() if stripped[-1:].isalpha() else ""
    number = stripped[: len(stripped) - len(unit)]
    try:
        count = round(float(number) * _COUNT_UNITS[unit])
    except (KeyError, ValueError, OverflowError):
        count = 0
    if count <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a parameter count; write 7B, 6.74B, 350M, 7e9 or 7000000000 "
            "(K, M, B or T for thousands, millions, billions, trillions)"
        )
    return count


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def _import_target(target: str):
    import importlib
    import importlib.util

    if target.endswith(".py") or os.sep in target or "/" in target:
        if not os.path.isfile(target):
            raise EstimateError(f"--model: no file {target!r}")
        name = os.path.splitext(os.path.basename(target))[0]
        spec = importlib.util.spec_from_file_location(f"_zerotrain_estimate_{name}", target)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    if os.getcwd() not in sys.path and "" not in sys.path:  # console scripts leave it out
        sys.path.insert(0, os.getcwd())
    return importlib.import_module(target)


def _build_on_meta(spec: str):
    """``module.path:factory`` or ``path/to/file.py:factory`` called on the meta device: the
    parameters have shapes and no storage, so a 70B model costs nothing to build."""
    import torch
    from torch import nn

    target, _, name = spec.rpartition(":")
    if not target or not name:
        raise EstimateError(
            f"--model: expected module.path:factory or path/to/file.py:factory, got {spec!r}"
        )
    try:
        module = _import_target(target)
    except EstimateError:
        raise
    except Exception as error:  # whatever the user's module raises: report it, no traceback
        raise EstimateError(
            f"--model: cannot import {target!r}: {type(error).__name__}: {error}"
        ) from error
    factory = getattr(module, name, None)
    if not callable(factory) or isinstance(factory, nn.Module):
        raise EstimateError(
            f"--model: {target!r} has no function or class {name!r} that builds the model"
        )
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as error:
        raise EstimateError(
            f"--model: {spec}() failed on the meta device: {type(error).__name__}: {error}"
        ) from error
    if not isinstance(model, nn.Module):
        raise EstimateError(f"--model: {spec}() returned {type(model).__name__}, not an nn.Module")
    return model


_SHAPE_FLAGS = {
    "batch_size": "--batch-size",
    "seq_len": "--seq-len",
    "hidden_size": "--hidden-size",
    "layers": "--layers",
    "heads": "--heads",
}


def _estimate_job(args: argparse.Namespace):
    from zerotrain.estimate import TrainingJob, TransformerShape, count_parameters
    from zerotrain.zero.optimizer import Stage3Options

    defaults = Stage3Options()
    shape_values = {key: getattr(args, key) for key in (*_SHAPE_FLAGS, "vocab_size")}
    counts = {"trainable_params": args.params, "largest_layer": args.largest_layer or 0}
    if args.model:
        if args.largest_layer is not None:
            raise EstimateError(
                "--largest-layer: measured from --model; give it only with --params"
            )
        count = count_parameters(
            _build_on_meta(args.model), persistence_threshold=defaults.persistence_threshold
        )
        counts = {
            "trainable_params": count.trainable,
            "frozen_params": count.frozen,
            "largest_layer": count.largest_layer,
            "root_and_largest_block": count.root_and_largest_block,
            "persistent_numel": count.persistent,
        }
        for key, value in count.config.items():  # the model's config fills what is not given
            if shape_values[key] is None:
                shape_values[key] = value
    shape = None
    if args.batch_size is not None or args.seq_len is not None:
        missing = [flag for key, flag in _SHAPE_FLAGS.items() if shape_values[key] is None]
        if missing:
            raise EstimateError(
                f"activations need {', '.join(_SHAPE_FLAGS.values())}; missing {', '.join(missing)}"
                + ("" if args.model else " (or --model with an HF-like .config)")
            )
        shape = TransformerShape(**shape_values)
    try:
        return TrainingJob(
            **counts,
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            dtype=args.dtype,
            optimizer=args.optimizer,
            offload=args.offload,
            stages=(args.stage,)
            if args.stage is not None
            else ((1, 2, 3) if args.offload else (0, 1, 2, 3)),
            max_live_numel=defaults.max_live_numel
            if args.max_live_parameters is None
            else args.max_live_parameters,
            shape=shape,
            attention=args.attention,
            dropout=not args.no_dropout,
        )
    except ValueError as error:
        raise EstimateError(str(error)) from error


def _estimate_command(args: argparse.Namespace, rest: list[str]) -> int:
    import json

    from zerotrain.estimate import estimate, format_table, plot, to_json

    try:
        job = _estimate_job(args)
    except EstimateError as error:
        print(f"zerotrain estimate: {error}", file=sys.stderr)
        return 2
    rows = estimate(job)
    if args.json:
        print(json.dumps(to_json(job, rows, args.device_memory), indent=2))
    else:
        print(format_table(job, rows, args.device_memory))
    if args.plot:
        try:
            plot(job, rows, args.plot, args.device_memory)
        except ImportError as error:
            print(f"zerotrain estimate: {error}", file=sys.stderr)
            return 2
        except OSError as error:
            print(f"zerotrain estimate: --plot: cannot write {args.plot}: {error}", file=sys.stderr)
            return 1
    return 0


def _add_estimate_parser(commands) -> None:
    from zerotrain.estimate import OPTIMIZER_STATE_BYTES, PRECISIONS

    parser = commands.add_parser(
        "estimate",
        help="estimate memory per device for each ZeRO stage, before running",
        description="Bytes per device of parameters, gradients, optimizer states and (given the "
        "batch shape) activations, per ZeRO stage, as zerotrain allocates them; which stages fit "
        "a device. See docs/estimator.md.",
    )
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument(
        "--params", type=_parse_count, metavar="COUNT", help="trainable parameters: 7B, 7e9, ..."
    )
    model.add_argument(
        "--model",
        metavar="MODULE:FACTORY",
        help="module.path:factory or path/to/file.py:factory, called on the meta device (no "
        "memory); counts trainable and frozen parameters, stage 3's units, and reads hidden "
        "size, layers, heads and vocabulary from an HF-like .config",
    )
    parser.add_argument(
        "--largest-layer",
        type=_parse_count,
        metavar="COUNT",
        help="with --params: most parameters in one layer (DeepSpeed's largest_layer_params); "
        "stage 3 gathers at least that many",
    )
    parser.add_argument("--nodes", type=_positive_int, default=1, help="(default: 1)")
    parser.add_argument(
        "--gpus-per-node", type=_positive_int, default=1, help="devices per node (default: 1)"
    )
    parser.add_argument(
        "--stage", type=int, choices=(0, 1, 2, 3), help="one ZeRO stage (default: all)"
    )
    parser.add_argument(
        "--offload",
        choices=("cpu", "nvme"),
        help="estimate what offload would move off the device (zerotrain cannot run it yet)",
    )
    parser.add_argument(
        "--dtype", choices=list(PRECISIONS), default="bf16", help="training dtype (default: bf16)"
    )
    parser.add_argument(
        "--optimizer",
        choices=list(OPTIMIZER_STATE_BYTES),
        default="adam",
        help="decides the optimizer state per parameter (default: adam, 8 bytes + 4 of fp32 "
        "master in 16-bit training)",
    )
    parser.add_argument(
        "--max-live-parameters",
        type=lambda text: 0 if text.strip() == "0" else _parse_count(text),
        metavar="COUNT",
        help="stage3_max_live_parameters (default: 1e9, as in DeepSpeed)",
    )
    shape = parser.add_argument_group(
        "activations", "a transformer's activations per device (Korthikanti et al. 2022)"
    )
    shape.add_argument("--batch-size", type=_positive_int, help="micro-batch per device")
    shape.add_argument("--seq-len", type=_positive_int, help="tokens per sample")
    shape.add_argument("--hidden-size", type=_positive_int)
    shape.add_argument("--layers", type=_positive_int)
    shape.add_argument("--heads", type=_positive_int)
    shape.add_argument(
        "--vocab-size", type=_positive_int, help="adds the loss's fp32 logits (optional)"
    )
    shape.add_argument(
        "--attention",
        choices=("eager", "flash"),
        default="eager",
        help="eager keeps the s x s softmax (the paper's 5as/h term, default); flash (fused "
        "SDPA kernels) keeps only a log-sum-exp per row",
    )
    shape.add_argument(
        "--no-dropout", action="store_true", help="no dropout masks (the paper assumes dropout)"
    )
    parser.add_argument(
        "--device-memory",
        type=_parse_size,
        metavar="SIZE",
        help="device memory, e.g. 80GB, 80GiB: adds a column saying which stages fit",
    )
    parser.add_argument(
        "--plot", metavar="PNG", help="draw stacked bars per stage (needs matplotlib)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON (bytes) instead")
    parser.set_defaults(handler=_estimate_command)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zerotrain",
        description="ZeRO data-parallel training for PyTorch with a DeepSpeed-compatible API.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # `run` declares no arguments to argparse, so parse_known_args hands back every token after
    # `run`, in order, as unrecognized: the handler splits them itself (see the module note)
    # and prints its own help.
    run = commands.add_parser(
        "run",
        help="launch a training script on every local device with torchrun",
        add_help=False,
        usage=_RUN_USAGE,
    )
    run.set_defaults(handler=_run_command, takes_raw_arguments=True)
    _add_checkpoint_parser(commands)
    _add_estimate_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``zerotrain`` console script; returns the exit status."""
    parser = _build_parser()
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    if rest and not getattr(args, "takes_raw_arguments", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.handler(args, rest)


if __name__ == "__main__":
    sys.exit(main())
