"""DeepSpeed config keys that zerotrain accepts without a field of its own.

[Note: lenient where nothing is asked, strict where something is]
Public ds_config files carry many keys that ask zerotrain for nothing: a feature switched off
(``mics_shard_size: -1``, ``offload_param: {device: none}``), a knob of a mechanism zerotrain
does differently (``prescale_gradients``), a section that only another DeepSpeed tool reads
(``autotuning``). Refusing them made four of five public configs
unusable. Each such key is listed here, per config section, as an :class:`Accepted`:
* ``idle`` None: every value is accepted; ``why`` says why the key changes nothing here;
* ``idle`` a predicate: the values that ask for nothing are accepted; any other value asks
  for ``asks``, which zerotrain does not have yet, and is refused naming it.
``why`` is printed in docs/config.md. A key that is neither a field nor listed here is unknown
and refused with a did-you-mean, as a typo must never go unnoticed. Keys starting with ``_``
are comments (JSON has none) and are skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BF16",
    "CHECKPOINT",
    "FP16",
    "OPTIMIZER",
    "TOP_LEVEL",
    "ZERO_OPTIMIZATION",
    "Accepted",
    "is_comment",
]


@dataclass(frozen=True)
class Accepted:
    """A DeepSpeed key with no zerotrain field (see the note above)."""

    why: str
    idle: Callable[[Any], bool] | None = None  # None: any value
    asks: str = ""  # the behaviour a non-idle value asks for
    idle_values: str = ""  # the accepted values, as the docs and errors show them
    warn: bool = False  # accepted, but say so: the user may expect an effect


def is_comment(key: str) -> bool:
    """Keys starting with ``_`` are comments (JSON has none)."""
    return key.startswith("_")


def _same(value: Any, wanted: Any) -> bool:
    # false is not 0 and 1 is not true: a config value means what its JSON type says
    return value == wanted and isinstance(value, bool) == isinstance(wanted, bool)


def _equals(*wanted: Any) -> Callable[[Any], bool]:
    return lambda value: any(_same(value, w) for w in wanted)


def _disabled(value: Any) -> bool:
    """A section switched off: null, false, or a mapping in which no `enabled` (at any depth:
    DeepSpeed's compression sections switch on per sub-feature) is anything but false."""
    if value is None or _same(value, False):
        return True
    if not isinstance(value, dict):
        return False
    if not _same(value.get("enabled", False), False):
        return False
    return all(_disabled(v) for v in value.values() if isinstance(v, dict))


def _disabled_or(*keys_at_default: tuple[str, Any]) -> Callable[[Any], bool]:
    """Switched off, or a mapping whose listed keys are all at their (idle) values."""

    def idle(value: Any) -> bool:
        if _disabled(value):
            return True
        if not isinstance(value, dict):
            return False
        defaults = dict(keys_at_default)
        return all(k in defaults and _same(v, defaults[k]) for k, v in value.items())

    return idle


def _off(what: str) -> Accepted:
    """A boolean DeepSpeed feature that is accepted while false."""
    return Accepted(f"Accepted while false: true asks for {what}.", _equals(False), what, "false")


def _section_off(what: str) -> Accepted:
    """A DeepSpeed section that is accepted while switched off (`enabled: false`)."""
    return Accepted(
        f"Accepted while switched off (`enabled: false`, or left out): it asks for {what}.",
        _disabled,
        what,
        "`enabled: false`",
    )


_NO_EFFECT_DIVIDE = (
    "No effect: zerotrain always multiplies each gradient by 1/world size before reducing it "
    "(one pass, as it enters the bucket), which is prescaling by the whole world size."
)

TOP_LEVEL: dict[str, Accepted] = {
    "prescale_gradients": Accepted(_NO_EFFECT_DIVIDE),
    "gradient_predivide_factor": Accepted(_NO_EFFECT_DIVIDE),
    "autotuning": Accepted(
        "No effect in training (DeepSpeed's engine ignores it too): `zerotrain plan --config` "
        "reads it, the tuning space's limits and the metric (docs/plan.md)."
    ),
    "cuda_visible_devices": Accepted(
        "No effect: read only by DeepSpeed's launcher; with `zerotrain run` (torchrun) set "
        "`CUDA_VISIBLE_DEVICES` in the environment."
    ),
    "zero_force_ds_cpu_optimizer": Accepted(
        "No effect: DeepSpeed uses it to insist on its own CPU Adam when the optimizer is "
        "offloaded; zerotrain steps torch's optimizers wherever the states live."
    ),
    "memory_breakdown": Accepted(
        "No effect: DeepSpeed prints memory use at a few points of the step; zerotrain's "
        "throughput line reports memory (current and peak) every `steps_per_print` steps, and "
        "`engine.memory_breakdown()` the model-state bytes."
    ),
    "timers": Accepted(
        "No effect: zerotrain always times forward, backward and step for the throughput line "
        "(`wall_clock_breakdown` prints them)."
    ),
    "seq_parallel_communication_data_type": Accepted(
        "No effect: Ulysses' all-to-alls (`sequence_parallel_size`) carry the activations in "
        "their own dtype, so the attention sees exactly what one process computes."
    ),
    "monitor_config": Accepted(
        "Not a DeepSpeed key: DeepSpeed 0.19.8 reads no `monitor_config` and ignores it "
        "silently; zerotrain ignores it too, with a warning. The monitors are the "
        "`tensorboard`, `csv_monitor` and `wandb` sections.",
        warn=True,
    ),
    "comms_config": Accepted(
        "Not a DeepSpeed key: DeepSpeed 0.19.8 reads no `comms_config` and ignores it "
        "silently; zerotrain ignores it too, with a warning. Communication logging is the "
        "`comms_logger` section.",
        warn=True,
    ),
    "expert_parallel": _section_off("expert parallelism (AutoEP)"),
    "compile": Accepted(
        "Accepted while `deepcompile` is false or left out (the section's other keys tune "
        "DeepCompile only); plain torch.compile is `engine.compile()`.",
        lambda v: v is None or (isinstance(v, dict) and _same(v.get("deepcompile", False), False)),
        "DeepCompile",
        "`deepcompile: false`",
    ),
    "amp": _section_off("NVIDIA Apex AMP"),
    "fp8": _section_off("fp8 training"),
    "comet": _section_off("the Comet monitor"),
    "trackio": _section_off("the Trackio monitor"),
    "nebula": _section_off("Nebula checkpointing"),
    "datastates_ckpt": _section_off("DataStates asynchronous checkpointing"),
    "data_efficiency": _section_off("DeepSpeed's data efficiency library"),
    "curriculum_learning": _section_off("curriculum learning"),
    "progressive_layer_drop": _section_off("progressive layer dropping"),
    "eigenvalue": _section_off("eigenvalue computation"),
    "compression_training": _section_off("compression training"),
    "quantize_training": _section_off("quantization-aware training (MoQ)"),
    "sparse_attention": Accepted(
        "Accepted while null or left out.", _equals(None), "sparse attention kernels", "null"
    ),
    "elasticity": _section_off("elastic training"),
    "hybrid_engine": _section_off("the hybrid (RLHF) engine"),
    "weight_quantization": Accepted(
        "Accepted while null or left out.", _equals(None), "weight quantization", "null"
    ),
    "graph_harvesting": _off("CUDA graph capture (graph harvesting)"),
    "sparse_gradients": _off("sparse gradients of embeddings"),
    "disable_allgather": _off("DeepSpeed's legacy all-reduce in place of all-gather"),
    "use_data_before_expert_parallelism": _off("expert-parallel data topology"),
    "managed_gradient_accumulation": Accepted(
        "Accepted while true (DeepSpeed's default): `engine.step()` counts micro-steps.",
        _equals(True),
        "unmanaged gradient accumulation (step() as the only boundary)",
        "true",
    ),
    "gradient_allreduce_op": Accepted(
        'Accepted while "mean" (DeepSpeed\'s default): gradients are averaged over ranks.',
        _equals("mean"),
        "summed (not averaged) gradients",
        '"mean"',
    ),
    "disable_python_gc": Accepted(
        "Accepted while 0 or false.",
        _equals(0, False, None),
        "periodic manual garbage collection",
        "0",
    ),
    "vocabulary_size": Accepted(
        "No effect: DeepSpeed reads it only for its data efficiency library."
    ),
}

ZERO_OPTIMIZATION: dict[str, Accepted] = {
    "elastic_checkpoint": Accepted(
        "No effect: every zerotrain checkpoint loads at any world size and stage."
    ),
    "load_from_fp32_weights": Accepted(
        "Accepted while true (DeepSpeed's default): zerotrain checkpoints hold fp32 master "
        "weights and load from them.",
        _equals(True),
        "master weights rebuilt from the 16-bit weights on load",
        "true",
    ),
    "ignore_unused_parameters": Accepted(
        "Accepted while true (DeepSpeed's default): parameters without a gradient get zeros.",
        _equals(True),
        "an error on parameters that got no gradient",
        "true",
    ),
    "compute_grad_norm": Accepted(
        "No effect: zerotrain always computes the global gradient norm (for clipping, "
        "`get_global_grad_norm()` and fp16 overflow)."
    ),
    "use_multi_rank_bucket_allreduce": Accepted(
        "No effect: a DeepSpeed choice of all-reduce algorithm; zerotrain chooses its own "
        "(comm/pairwise.py on gloo)."
    ),
    "parameter_alignment": _off("padding parameters to an alignment"),
    "legacy_stage1": _off("DeepSpeed's legacy stage-1 optimizer"),
    "zero_quantized_nontrainable_weights": _off("ZeRO++ quantized frozen weights"),
    "zeropp_loco_param": Accepted(
        "Accepted while null or left out.", _equals(None), "ZeRO++ LoCo error feedback", "null"
    ),
    "mics_shard_size": Accepted(
        "Accepted while -1 (off).", _equals(-1), "MiCS sub-group sharding", "-1"
    ),
    "mics_hierarchical_params_gather": _off("MiCS hierarchical gathers"),
    "memory_efficient_linear": Accepted(
        "No effect: DeepSpeed replaces linear layers under ZeRO-3 to save memory; zerotrain "
        "keeps the model's own modules."
    ),
    "override_module_apply": Accepted(
        "No effect: a DeepSpeed ZeRO-3 patch of `Module.apply`; zerotrain gathers parameters "
        "per block instead."
    ),
    "pipeline_loading_checkpoint": _off("pipeline-engine checkpoint loading"),
    "log_trace_cache_warnings": Accepted("No effect: a DeepSpeed ZeRO-3 debug log."),
    "enable_sanity_checks": Accepted(
        "No effect: DeepSpeed's optional ZeRO-3 consistency checks; zerotrain checks its "
        "gathers and reductions always."
    ),
    "save_muon_momentum_buffer_in_memory": _off("Muon optimizer buffers"),
    "zenflow": Accepted(
        "Accepted while null or left out.", _equals(None), "ZenFlow asynchronous updates", "null"
    ),
    "model_persistence_threshold": Accepted(
        "No effect: a cap on the total of persistent ZeRO-3 parameters; zerotrain's "
        "persistence is decided per unit by `stage3_param_persistence_threshold`."
    ),
    "module_granularity_threshold": Accepted(
        "No effect: DeepSpeed's coarser gathering of small modules; zerotrain already gathers "
        "whole blocks."
    ),
    "use_all_reduce_for_fetch_params": _off("all-reduce in place of ZeRO-3 all-gathers"),
    "allgather_sequential": _off("sequential ZeRO-3 all-gathers"),
    "stage3_partition_stream_chunk_size": Accepted("No effect: a DeepSpeed stream tuning knob."),
}

FP16: dict[str, Accepted] = {
    "fp16_master_weights_and_grads": _off("fp16 master weights and gradients"),
    "fused_mode": Accepted("No effect: a DeepSpeed kernel choice."),
}

BF16: dict[str, Accepted] = {
    "immediate_grad_update": Accepted(
        "No effect: zerotrain writes each gradient into its bucket as it arrives."
    ),
    "check_grad_overflow": _off("overflow checks in bf16 training"),
    "check_overflow": _off("overflow checks in bf16 training"),
}

OPTIMIZER: dict[str, Accepted] = {
    "legacy_fusion": Accepted("No effect: a DeepSpeed kernel choice (old fused optimizers)."),
}

TENSOR_PARALLEL: dict[str, Accepted] = {
    "tp_overlap_comm": _off("overlapping the tensor-parallel all-reduce with computation"),
    "dtype": Accepted(
        "The training dtype comes from the `bf16` and `fp16` sections; DeepSpeed's AutoTP "
        "reads this key for inference only.",
        warn=True,
    ),
    "tp_size": Accepted(
        "Accepted while 1 (DeepSpeed's older name); the tensor-parallel degree is `autotp_size`.",
        _equals(1),
        "tensor parallelism by its older key",
        "1 (set `autotp_size` instead)",
    ),
    "tp_grain_size": Accepted(
        "zerotrain splits layers into equal pieces only (a size the degree does not divide is "
        "an error naming the layer), so there is no grain to choose."
    ),
}

PIPELINE: dict[str, Accepted] = {
    key: Accepted(
        "The `PipelineModule`'s own arguments decide this in zerotrain (DeepSpeed's engine reads "
        "the section only for its partitioned send/receive)."
    )
    for key in (
        "stages",
        "partition",
        "seed_layers",
        "activation_checkpoint_interval",
        "pipe_partitioned",
        "grad_partitioned",
        "use_reentrant",
    )
}

CHECKPOINT: dict[str, Accepted] = {
    "parallel_write": Accepted(
        "No effect: every zerotrain rank writes its shard in parallel already."
    ),
}

# DeepSpeed names these ZeRO-3 keys both with and without the `stage3_` prefix.
ZERO_OPTIMIZATION.update(
    {
        f"stage3_{key}": ZERO_OPTIMIZATION[key]
        for key in (
            "model_persistence_threshold",
            "module_granularity_threshold",
            "use_all_reduce_for_fetch_params",
            "allgather_sequential",
        )
    }
)
