"""``zerotrain estimate``: the memory a training job needs per device at each ZeRO stage
(zerotrain/estimate/), from a parameter count or a model built on the meta device."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from zerotrain.cli.arguments import ParserSpec, positive_int, size_argument
from zerotrain.errors import ZeroTrainError

__all__ = ["PARSER", "EstimateError", "add_arguments"]

_COUNT_UNITS = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


class EstimateError(ZeroTrainError, ValueError):
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


def _memory_size(text: str) -> int:
    """A memory size with its unit: ``80GB`` (10^9 bytes), ``80GiB`` (2^30), ``512MB``. A bare
    number is refused: ``--device-memory 80`` would be 80 bytes, never what was meant."""
    if not text.strip()[-1:].isalpha():
        raise argparse.ArgumentTypeError(
            f"{text!r} has no unit; write 80GB (10^9 bytes) or 80GiB (2^30 bytes), or B for "
            "bytes (80000000000B)"
        )
    return size_argument(text)


_SHAPE_FLAGS = {
    "batch_size": "--batch-size",
    "seq_len": "--seq-len",
    "hidden_size": "--hidden-size",
    "layers": "--layers",
    "heads": "--heads",
}


def _offload_settings(args: argparse.Namespace) -> dict[str, int]:
    """The offload flags given, checked against ``--offload`` (they size nothing without it)."""
    given = {
        "--reduce-bucket-size": args.reduce_bucket_size,
        "--buffer-count": args.buffer_count,
        "--sub-group-size": args.sub_group_size,
        "--host-memory": args.host_memory,
    }
    stray = [flag for flag, value in given.items() if value is not None]
    if not args.offload and stray:
        raise EstimateError(f"{', '.join(stray)}: only with --offload cpu or nvme")
    if args.offload == "cpu" and args.sub_group_size is not None:
        raise EstimateError("--sub-group-size: only with --offload nvme (cpu steps whole buckets)")
    keys = {"reduce_bucket_size", "buffer_count", "sub_group_size"}
    return {key: getattr(args, key) for key in keys if getattr(args, key) is not None}


def _estimate_job(args: argparse.Namespace):
    from zerotrain.config import ZERO_DEFAULTS
    from zerotrain.estimate import TrainingJob, TransformerShape, count_parameters

    shape_values = {
        key: getattr(args, key) for key in (*_SHAPE_FLAGS, "vocab_size", "intermediate_size")
    }
    mlp = args.mlp
    counts: dict[str, Any] = {  # --params; a --model's count replaces them
        "trainable_params": args.params,
        "largest_layer": args.largest_layer or 0,
    }
    count = None
    if args.model:
        if args.largest_layer is not None:
            raise EstimateError(
                "--largest-layer: measured from --model; give it only with --params"
            )
        from zerotrain.estimate.factory import ModelFactoryError, build_on_meta

        try:
            model = build_on_meta(args.model)
        except ModelFactoryError as error:
            raise EstimateError(str(error)) from error
        count = count_parameters(
            model,
            persistence_threshold=ZERO_DEFAULTS.stage3_param_persistence_threshold,
        )
        counts = {}
        if args.optimizer == "muon":  # its matrices' momentum, AdamW's moments for the rest
            counts["optimizer_state_bytes"] = count.muon_state_bytes()
        for key, value in count.config.items():  # the model's config fills what is not given
            if shape_values[key] is None:
                shape_values[key] = value
        mlp = mlp or count.mlp
    shape = None
    if args.batch_size is not None or args.seq_len is not None:
        missing = [flag for key, flag in _SHAPE_FLAGS.items() if shape_values[key] is None]
        if missing:
            raise EstimateError(
                f"activations need {', '.join(_SHAPE_FLAGS.values())}; missing {', '.join(missing)}"
                + ("" if args.model else " (or --model with an HF-like .config)")
            )
        shape = TransformerShape(**shape_values, mlp=mlp or "gelu")
    offload = _offload_settings(args)
    try:
        settings: dict[str, Any] = dict(
            **counts,
            **offload,
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            dtype=args.dtype,
            grad_accum_dtype=args.grad_accum_dtype,
            master_dtype=args.master_dtype,
            optimizer_state_dtype=args.optimizer_state_dtype,
            optimizer=args.optimizer,
            offload=args.offload,
            stages=(args.stage,)
            if args.stage is not None
            else ((1, 2, 3) if args.offload else (0, 1, 2, 3)),
            max_live_numel=ZERO_DEFAULTS.stage3_max_live_parameters
            if args.max_live_parameters is None
            else args.max_live_parameters,
            shape=shape,
            attention=args.attention,
            dropout=not args.no_dropout,
        )
        if count is not None:
            return TrainingJob.for_model(count, **settings)
        return TrainingJob(**settings)
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
        print(json.dumps(to_json(job, rows, args.device_memory, args.host_memory), indent=2))
    else:
        print(format_table(job, rows, args.device_memory, args.host_memory))
    if args.plot:
        try:
            plot(job, rows, args.plot, args.device_memory, args.host_memory)
        except ImportError as error:
            print(f"zerotrain estimate: {error}", file=sys.stderr)
            return 2
        except OSError as error:
            print(f"zerotrain estimate: --plot: cannot write {args.plot}: {error}", file=sys.stderr)
            return 1
    return 0


def _count_default(value: int) -> str:
    return f"{value:.0e}".replace("e+0", "e")


PARSER: ParserSpec = {
    "help": "estimate memory per device for each ZeRO stage, before running",
    "description": "Bytes per device of parameters, gradients, optimizer states and (given the "
    "batch shape) activations, per ZeRO stage, as zerotrain allocates them; which stages fit "
    "a device. See docs/estimator.md.",
}
"""``add_parser`` arguments of the ``estimate`` command."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``estimate``'s arguments (imports torch: the dtype and optimizer choices come from
    the estimator)."""
    from zerotrain.config import ZERO_DEFAULTS
    from zerotrain.estimate import OPTIMIZER_STATE_BYTES
    from zerotrain.estimate.stages import OFFLOAD_DEVICES
    from zerotrain.precision import DTYPES

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
    parser.add_argument("--nodes", type=positive_int, default=1, help="(default: 1)")
    parser.add_argument(
        "--gpus-per-node", type=positive_int, default=1, help="devices per node (default: 1)"
    )
    parser.add_argument(
        "--stage", type=int, choices=(0, 1, 2, 3), help="one ZeRO stage (default: all)"
    )
    offload = parser.add_argument_group(
        "offload",
        "offload_optimizer (ratio 1): host memory and NVMe per node, as the preflight of "
        "initialize counts them",
    )
    offload.add_argument(
        "--offload",
        choices=OFFLOAD_DEVICES,
        help="offload_optimizer.device: the fp32 masters and optimizer state in host memory "
        "(cpu) or NVMe working files (nvme), stepped there",
    )
    offload.add_argument(
        "--reduce-bucket-size",
        type=_parse_count,
        metavar="COUNT",
        help="reduce_bucket_size: sizes the transfer ring at stages 1-2 (default: "
        f"{_count_default(ZERO_DEFAULTS.reduce_bucket_size)})",
    )
    offload.add_argument(
        "--buffer-count",
        type=positive_int,
        help="offload_optimizer.buffer_count: ring buffers, and NVMe staging sets (default: "
        f"{ZERO_DEFAULTS.offload_optimizer.buffer_count}, as in DeepSpeed)",
    )
    offload.add_argument(
        "--sub-group-size",
        type=_parse_count,
        metavar="COUNT",
        help="with --offload nvme: sub_group_size, elements stepped at once (default: "
        f"{_count_default(ZERO_DEFAULTS.sub_group_size)}, as in DeepSpeed)",
    )
    offload.add_argument(
        "--host-memory",
        type=_memory_size,
        metavar="SIZE",
        help="a node's available host memory, e.g. 512GiB: adds a column with the verdict of "
        "initialize's host-memory preflight",
    )
    parser.add_argument(
        "--dtype", choices=list(DTYPES), default="bf16", help="training dtype (default: bf16)"
    )
    parser.add_argument(
        "--grad-accum-dtype",
        choices=list(DTYPES),
        help="data_types.grad_accum_dtype: the dtype gradients accumulate in (default: the "
        "training dtype; fp32 under bf16 keeps 4 bytes per gradient element and no fp32 copy "
        "at the step)",
    )
    parser.add_argument(
        "--optimizer",
        choices=list(OPTIMIZER_STATE_BYTES),
        default="adam",
        help="decides the optimizer state per parameter (default: adam, 8 bytes + 4 of fp32 "
        "master in 16-bit training; lion and adagrad keep 4; muon 4 for its matrices and 8 for "
        "the rest, counted from --model, else 4 for all)",
    )
    parser.add_argument(
        "--master-dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="the optimizer's master weights (bf16: bf16.bf16_master_weights_and_grads; under "
        "--dtype bf16 they are then the parameters themselves, no copy)",
    )
    parser.add_argument(
        "--optimizer-state-dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="the optimizer's per-element state (bf16: bf16.bf16_optimizer_states, half the bytes)",
    )
    parser.add_argument(
        "--max-live-parameters",
        type=lambda text: 0 if text.strip() == "0" else _parse_count(text),
        metavar="COUNT",
        help="stage3_max_live_parameters (default: "
        f"{_count_default(ZERO_DEFAULTS.stage3_max_live_parameters)}, as in DeepSpeed)",
    )
    shape = parser.add_argument_group(
        "activations", "a transformer's activations per device (Korthikanti et al. 2022)"
    )
    shape.add_argument("--batch-size", type=positive_int, help="micro-batch per device")
    shape.add_argument("--seq-len", type=positive_int, help="tokens per sample")
    shape.add_argument("--hidden-size", type=positive_int)
    shape.add_argument("--layers", type=positive_int)
    shape.add_argument("--heads", type=positive_int)
    shape.add_argument(
        "--vocab-size", type=positive_int, help="adds the loss's fp32 logits (optional)"
    )
    shape.add_argument(
        "--intermediate-size",
        type=positive_int,
        help="width of the MLP's hidden layer (default: 4 x --hidden-size, or the model's)",
    )
    shape.add_argument(
        "--mlp",
        choices=("gelu", "swiglu"),
        help="gelu: two hidden x intermediate matrices (GPT-2); swiglu: gated, three (Llama, "
        "Mistral), keeps twice the MLP's activations (default: what --model holds, else gelu)",
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
        type=_memory_size,
        metavar="SIZE",
        help="device memory with its unit, 80GB (10^9 bytes) or 80GiB (2^30): adds a column "
        "saying which stages fit",
    )
    parser.add_argument(
        "--plot", metavar="PNG", help="draw stacked bars per stage (needs matplotlib)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON (bytes) instead")
    parser.set_defaults(handler=_estimate_command)
