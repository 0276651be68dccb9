"""The `comm_compression` section: fewer bytes between data-parallel ranks (see
docs/compression.md)."""

import json
import warnings
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from zerotrain.config.errors import fail
from zerotrain.config.params import OptimizerConfig
from zerotrain.config.section import NonNegativeInt, PositiveInt, Section, reject_bool
from zerotrain.optim.onebit import ONE_BIT_OPTIMIZERS

__all__ = [
    "CommCompressionConfig",
    "GradientCompressionConfig",
    "ParameterCompressionConfig",
    "check_compression",
    "check_local_steps",
    "from_zero_plus_plus",
]


class GradientCompressionConfig(Section):
    """`comm_compression.gradients`: how gradients are compressed on their way between
    data-parallel ranks. See docs/compression.md. (A zerotrain section.)"""

    method: Literal["none", "powersgd", "acp_sgd", "topk", "gtopk", "int8", "int4"] = "none"
    """`powersgd` (arXiv:1905.13727) and `acp_sgd` (arXiv:2306.08881): each gradient matrix as
    rank-`rank` factors; `topk`: each rank's `ratio` largest elements; `gtopk`
    (arXiv:1901.04359): the same number of coordinates for all ranks, by a tree merge; `int8`,
    `int4`: block-wise quantized reduce-scatter by an all-to-all exchange (ZeRO++'s qgZ,
    arXiv:2306.10209; by node first with `hierarchical`).
    The low-rank and sparse methods work at stages 0-2, the quantized ones at stages 0-3.
    With optimizer OneBitAdam or ZeroOneAdam, the method replaces their 1-bit signs after the
    freeze (none: the signs)."""
    rank: PositiveInt = 4
    """powersgd / acp_sgd: the factors' rank. A matrix whose factors would not be smaller than
    itself travels whole."""
    ratio: Annotated[float, BeforeValidator(reject_bool), Field(gt=0, le=1)] = 0.01
    """topk / gtopk: the fraction of each bucket's compressed elements sent per step (at least
    one)."""
    warmup_steps: NonNegativeInt = 0
    """Optimizer steps taken uncompressed before compression starts."""
    error_feedback: bool = True
    """powersgd, acp_sgd, topk, gtopk: keep what compression left out on each rank and add it
    to the next step's gradient (one fp32 copy of the compressed gradients per rank,
    `memory_breakdown()["compression"]`). Quantization's error is bounded per block and not
    carried."""
    min_numel: NonNegativeInt = 1024
    """Parameters with fewer elements (biases, norms) travel whole with the low-rank and sparse
    methods; so do vectors with the low-rank ones."""
    compress_embeddings: bool = False
    """powersgd / acp_sgd: send embedding tables (`nn.Embedding` weights, and layers tied to
    them) as factors too. By default they travel whole: a batch's gradient of one is nonzero
    in its tokens' rows only, which few factors represent badly."""
    block_size: PositiveInt = 256
    """int8 / int4: elements per quantization block, each with its own fp32 scale."""
    hierarchical: bool = False
    """int8 / int4 (ZeRO++'s qgZ hierarchy): reduce-scatter inside each node first, each rank
    summing the pieces of its place on every node, then across the nodes, each rank sending
    one node sum per node: the bytes between nodes drop by the ranks per node, for a second
    quantization (of the node sums). Ranks per node: `hierarchical_partition_size`, or
    torchrun's LOCAL_WORLD_SIZE; with one rank per node, or one node, a warning and one
    exchange."""
    catch_up: bool = True
    """topk / gtopk with error feedback, under optimizer Adam or AdamW: a coordinate's moments
    and value stay while nothing of it arrives, and when its gradient arrives, the sum of n
    steps', it takes those n steps at once (see docs/compression.md). False: Adam steps the
    sparse gradients as they come, which moves a coordinate sent every n steps √n times less
    than uncompressed Adam. Counting the steps costs one int32 per compressed element per rank.
    Other optimizers take the sparse gradients as they come (SGD's momentum sums them; the
    1-bit optimizers' variance is frozen)."""


class ParameterCompressionConfig(Section):
    """`comm_compression.parameters`: quantized all-gather of updated parameters (ZeRO++'s
    qwZ). (A zerotrain section.)"""

    method: Literal["none", "int8", "int4"] = "none"
    """`int8`, `int4`: block-wise quantized parameter all-gather at stages 1-3."""
    block_size: PositiveInt = 256
    """Elements per quantization block."""


class CommCompressionConfig(Section):
    """`comm_compression`: fewer bytes between data-parallel ranks, for slow networks. See
    docs/compression.md. (A zerotrain section.)"""

    gradients: GradientCompressionConfig = Field(default_factory=GradientCompressionConfig)
    """Gradient compression; see the comm_compression.gradients section."""
    parameters: ParameterCompressionConfig = Field(default_factory=ParameterCompressionConfig)
    """Parameter compression; see the comm_compression.parameters section."""
    hierarchical_partition: bool = False
    """Stage 3: after the first gather of a unit in a step, keep its parameters partitioned
    again among the ranks of each node, so that the step's later gathers (backward's) stay
    inside the node (ZeRO++'s hpZ). Costs 1/(ranks per node) of the unit's parameters per rank,
    in `memory_breakdown()["compression"]`. Ranks per node: `hierarchical_partition_size`, or
    torchrun's LOCAL_WORLD_SIZE."""
    hierarchical_partition_size: NonNegativeInt = 0
    """hierarchical_partition and gradients.hierarchical: the ranks of each node, consecutive
    ranks (torchrun numbers a node's ranks consecutively); 0: torchrun's LOCAL_WORLD_SIZE.
    DeepSpeed's `zero_optimization.zero_hpz_partition_size` sets it."""
    auto: bool = False
    """Start uncompressed, then measure the links (latency and bandwidth), the steps and each
    compression's own compute, and use a compression only where it is predicted to make the
    step faster by 5%, reverting if the measured steps are slower. It chooses among
    `gradients.method` and `parameters.method` as configured (each on or off); with both left
    at none, among int8 gradients and, at stages 1-3, int8 parameters, which train as well as
    uncompressed training. Each decision is printed with its prediction. See
    docs/compression.md."""
    auto_recheck_steps: NonNegativeInt = 1000
    """auto: measure and decide again this often, in optimizer steps (0: decide once)."""


def check_compression(
    section: CommCompressionConfig, stage: int, optimizer: OptimizerConfig | None
) -> None:
    """``section`` against the ZeRO ``stage`` and the ``optimizer`` section (None: none): a
    ConfigError naming what works where."""
    method = section.gradients.method
    if method in ("powersgd", "acp_sgd", "topk", "gtopk") and stage == 3:
        raise fail(
            f"comm_compression.gradients.method: {method} compresses a sum every rank holds "
            "whole, which stage 3 never forms; it works at zero_optimization.stage 0-2. At "
            "stage 3 use int8 or int4 (quantized reduce-scatter)"
        )
    onebit = optimizer.type if optimizer and optimizer.type.lower() in ONE_BIT_OPTIMIZERS else ""
    if onebit and stage == 3:
        raise fail(
            f"optimizer.type: {onebit} compresses what each rank sends of the gradients of "
            "zero_optimization.stage 0-2 (its compressed exchange needs whole gradients on "
            "every rank); at stage 3 use comm_compression.gradients.method int8 or int4"
        )
    if onebit and section.gradients.warmup_steps:
        raise fail(
            f"comm_compression.gradients.warmup_steps: optimizer.type {onebit} chooses the "
            "steps that travel exactly itself (OneBitAdam: the first freeze_step; ZeroOneAdam: "
            "those that update its variance); set warmup_steps to 0 and use those keys"
        )
    if onebit and section.auto:
        raise fail(
            f"comm_compression.auto: optimizer.type {onebit} compresses the gradients itself; "
            "set auto to false"
        )
    if section.auto and section.gradients.hierarchical:
        raise fail(
            "comm_compression.gradients.hierarchical: not with auto yet (auto measures and "
            "switches the exchange over the whole group, and a switch would build the node's "
            "groups mid-run); set auto to false to reduce by node, or hierarchical to false"
        )
    hierarchical = section.hierarchical_partition or section.gradients.hierarchical
    if section.hierarchical_partition_size and not hierarchical:
        raise fail(
            "comm_compression.hierarchical_partition_size: the ranks per node of "
            "hierarchical_partition and gradients.hierarchical, which are both false; set one "
            "to true, or the size to 0"
        )
    if section.hierarchical_partition and stage != 3:
        raise fail(
            "comm_compression.hierarchical_partition: partitions stage 3's parameters a second "
            f"time inside each node; zero_optimization.stage is {stage}, which keeps them whole "
            "on every rank. Set the stage to 3, or hierarchical_partition to false"
        )
    _check_catch_up(section.gradients, optimizer)
    _check_keys_in_use(section, stage, onebit)
    parameters = section.parameters.method
    if parameters != "none" and stage == 0:
        raise fail(
            f"comm_compression.parameters.method: {parameters} quantizes the parameter "
            "all-gather of zero_optimization.stage 1-3; stage 0 gathers no parameters. Set the "
            "stage to 1 or more, or parameters.method to none"
        )


# what comm_compression.auto chooses among with no method configured: int8 gradients and, at
# stages 1-3, int8 parameters, or each uncompressed
AUTO_DEFAULT_METHOD = "int8"
# the gradient methods each key of comm_compression.gradients acts on
_GRADIENT_KEYS = {
    "rank": ("powersgd", "acp_sgd"),
    "ratio": ("topk", "gtopk"),
    "error_feedback": ("powersgd", "acp_sgd", "topk", "gtopk"),
    "min_numel": ("powersgd", "acp_sgd", "topk", "gtopk"),
    "compress_embeddings": ("powersgd", "acp_sgd"),
    "catch_up": ("topk", "gtopk"),
    "block_size": ("int8", "int4"),
    "hierarchical": ("int8", "int4"),
    "warmup_steps": ("powersgd", "acp_sgd", "topk", "gtopk", "int8", "int4"),
}


def _check_keys_in_use(section: CommCompressionConfig, stage: int, onebit: str) -> None:
    """A key set where nothing reads it (``ratio`` with powersgd, ``block_size`` of parameters
    travelling whole, ``auto_recheck_steps`` without auto): a ConfigError, not a silent no-op.
    With auto and both methods left at none, the keys shape auto's default candidates."""
    gradients, parameters = section.gradients.method, section.parameters.method
    gradients_is, parameters_is = gradients, parameters
    if section.auto and gradients == parameters == "none":
        gradients = AUTO_DEFAULT_METHOD
        parameters = AUTO_DEFAULT_METHOD if stage > 0 else "none"
        gradients_is = f"none (auto's default candidate: {AUTO_DEFAULT_METHOD})"
        if stage > 0:
            parameters_is = gradients_is
    elif onebit and gradients == "none":
        gradients_is = f"none ({onebit} sends its own signs)"
    for key in sorted(section.gradients.model_fields_set & _GRADIENT_KEYS.keys()):
        if gradients not in _GRADIENT_KEYS[key]:
            _unused(f"gradients.{key}", ", ".join(_GRADIENT_KEYS[key]), "gradients", gradients_is)
    if "block_size" in section.parameters.model_fields_set and parameters == "none":
        _unused("parameters.block_size", "int8, int4", "parameters", parameters_is)
    if "auto_recheck_steps" in section.model_fields_set and not section.auto:
        raise fail(
            "comm_compression.auto_recheck_steps: paces auto's decisions, and auto is false, so "
            "nothing reads it. Remove the key, or set auto to true"
        )


def _unused(key: str, methods: str, direction: str, method: str) -> None:
    raise fail(
        f"comm_compression.{key}: acts on {methods}, and {direction}.method is {method}, so "
        "nothing reads it. Remove the key, or choose a method it acts on"
    )


def _check_catch_up(
    gradients: GradientCompressionConfig, optimizer: OptimizerConfig | None
) -> None:
    """`catch_up` set true where top-k or gTop-k's arrivals carry one step or an optimizer
    takes them as they come: a ConfigError (left at its default, it applies where it can;
    with another method :func:`_check_keys_in_use` refuses it)."""
    asked = "catch_up" in gradients.model_fields_set and gradients.catch_up
    if not asked or gradients.method not in ("topk", "gtopk"):
        return
    why = ""
    if not gradients.error_feedback:
        why = "gradients.error_feedback is false, so an arrival carries one step's gradient"
    elif optimizer is not None and optimizer.type.lower() not in ("adam", "adamw"):
        why = f"optimizer.type {optimizer.type} takes the sparse gradients as they come"
    if why:
        raise fail(
            f"comm_compression.gradients.catch_up: true makes an Adam step a sparsely sent "
            f"coordinate by the steps its gradient carries, but {why}. Remove the key"
        )


def check_local_steps(config: Any) -> None:
    """0/1 Adam's local steps (``optimizer.params.local_step_clipper`` above 1) against the
    rest of ``config`` (a ZeroTrainConfig): a ConfigError where a replica cannot step alone."""
    optimizer = config.optimizer
    if optimizer is None or optimizer.type.lower() != "zerooneadam":
        return
    clipper = optimizer.params.get("local_step_clipper", 1)
    if clipper == 1:
        return
    asks = f"optimizer.params.local_step_clipper: {clipper} asks 0/1 Adam for local steps"
    stage = config.zero_optimization.stage
    if stage != 0:
        raise fail(
            f"{asks} (each rank stepping its own replica between synchronizations), which needs "
            f"the whole model and optimizer state on every rank; zero_optimization.stage {stage} "
            "partitions them. Set the stage to 0, or local_step_clipper to 1 (every step "
            "synchronizes, in 1 bit after var_freeze_step)"
        )


def from_zero_plus_plus(zero: dict[str, Any], section: Any) -> dict[str, Any] | None:
    """The raw `comm_compression` ``section`` with what DeepSpeed's ZeRO++ keys in the raw
    `zero_optimization` ``zero`` ask for at stage 3 (see their docs); None where they ask for
    nothing. DeepSpeed reads them at stage 3 only, so below it they are ignored, with a
    warning. A ZeRO++ key and a comm_compression key that disagree are a ConfigError."""
    if not isinstance(section, dict):
        return None  # its validation says what it must be
    size = zero.get("zero_hpz_partition_size", 1)
    hpz = isinstance(size, int) and not isinstance(size, bool) and size > 1
    asked = [
        k for k in ("zero_quantized_weights", "zero_quantized_gradients") if zero.get(k) is True
    ]
    asked += ["zero_hpz_partition_size"] if hpz else []
    if not asked:
        return None
    if zero.get("stage") != 3:
        warnings.warn(
            f"zerotrain config: zero_optimization.{', '.join(asked)}: ZeRO++ acts at stage 3, "
            "and below it DeepSpeed ignores these keys; so does zerotrain (at stages 1-2, "
            "comm_compression compresses: docs/compression.md)",
            stacklevel=2,
        )
        return None
    section = dict(section)
    if "zero_quantized_weights" in asked:
        _ask(section, "parameters", "method", "int8", "zero_quantized_weights: true")
    if "zero_quantized_gradients" in asked:
        _ask(section, "gradients", "method", "int4", "zero_quantized_gradients: true")
    if hpz:
        reason = f"zero_hpz_partition_size: {size}"
        _ask(section, None, "hierarchical_partition", True, reason)
        _ask(section, None, "hierarchical_partition_size", size, reason)
    return section


def _ask(section: dict[str, Any], sub: str | None, key: str, value: Any, reason: str) -> None:
    """Set ``key`` (of the subsection ``sub``) of the raw ``section`` to ``value``, or refuse
    a different value the config already set there."""
    target = section
    if sub is not None:
        if not isinstance(section.get(sub, {}), dict):
            return  # not a mapping: validation says so
        target = section[sub] = dict(section.get(sub, {}))
    if key in target and target[key] != value:
        path = ".".join(["comm_compression", *([sub] if sub else []), key])
        raise fail(
            f"zero_optimization.{reason} asks for `{path}: {json.dumps(value)}`, and the config "
            f"sets {json.dumps(target[key])}; keep one of the two"
        )
    target[key] = value
