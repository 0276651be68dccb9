"""Tests of zerotrain.config: DeepSpeed configs load unchanged, every mistake is a ConfigError
whose message names the key path and the fix, and docs/config.md matches the schema."""

import ast
import graphlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from zerotrain.config import (
    BF16Config,
    ConfigError,
    CSVMonitorConfig,
    FlopsProfilerConfig,
    FP16Config,
    OptimizerConfig,
    SchedulerConfig,
    TensorBoardConfig,
    WandbConfig,
    ZeroOptimizationConfig,
    ZeroTrainConfig,
    config_reference_markdown,
    load_config,
)

REPO_ROOT = Path(__file__).resolve().parents[1]

# The shape of DeepSpeed's own tutorial configs (ZeRO / Megatron GPT-2 and BERT pre-training):
# Adam with params, WarmupLR, dynamic fp16 loss scaling, ZeRO stage 2 with 5e8 buckets.
DEEPSPEED_TUTORIAL_JSON = """
{
  "train_batch_size": 64,
  "train_micro_batch_size_per_gpu": 8,
  "steps_per_print": 2000,
  "optimizer": {
    "type": "Adam",
    "params": {"lr": 0.00015, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
  },
  "scheduler": {
    "type": "WarmupLR",
    "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.00015, "warmup_num_steps": 1000}
  },
  "gradient_clipping": 1.0,
  "fp16": {
    "enabled": true,
    "loss_scale": 0,
    "loss_scale_window": 1000,
    "initial_scale_power": 16,
    "hysteresis": 2,
    "min_loss_scale": 1
  },
  "zero_optimization": {
    "stage": 2,
    "allgather_partitions": true,
    "allgather_bucket_size": 5e8,
    "overlap_comm": true,
    "reduce_scatter": true,
    "reduce_bucket_size": 5e8,
    "contiguous_gradients": true
  },
  "zero_allow_untested_optimizer": true,
  "wall_clock_breakdown": false
}
"""

SMALL = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 3,
    "optimizer": {"type": "adamw", "params": {"lr": 1e-3, "weight_decay": 0.1}},
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8},
}
SMALL_YAML = """\
train_micro_batch_size_per_gpu: 2
gradient_accumulation_steps: 3
optimizer:
  type: adamw
  params: {lr: 1e-3, weight_decay: 0.1}
bf16: {enabled: true}
zero_optimization: {stage: 1, reduce_bucket_size: 5e8}
"""


def load_error(config: Any, world_size: int = 2) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(config, world_size=world_size)
    return str(info.value)


def nested(path: str, value: Any) -> dict[str, Any]:
    """{"a": {"b": value}} for "a.b", on top of a valid minimal config."""
    *parents, leaf = path.split(".")
    inner: dict[str, Any] = {leaf: value}
    for parent in reversed(parents):
        inner = {parent: inner}
    if parents[:1] == ["optimizer"]:
        inner["optimizer"].setdefault("type", "Adam")
    return {"train_batch_size": 8, **inner}


# --- DeepSpeed configs load unchanged --------------------------------------------------------


def test_deepspeed_tutorial_config_loads_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(DEEPSPEED_TUTORIAL_JSON)
    cfg = load_config(path, world_size=4)
    assert (
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    ) == (64, 8, 2)
    assert cfg.optimizer == OptimizerConfig(
        type="Adam",
        params={"lr": 0.00015, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01},
    )
    assert cfg.optimizer.params["betas"] == (0.9, 0.999)
    assert cfg.scheduler is not None and cfg.scheduler.type == "WarmupLR"
    assert cfg.scheduler.params == {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 0.00015,
        "warmup_num_steps": 1000,
    }
    assert cfg.gradient_clipping == 1.0
    assert cfg.fp16 == FP16Config(
        enabled=True,
        loss_scale=0.0,
        loss_scale_window=1000,
        initial_scale_power=16,
        hysteresis=2,
        min_loss_scale=1.0,
    )
    assert cfg.bf16.enabled is False
    zero = cfg.zero_optimization
    assert (
        zero.stage,
        zero.overlap_comm,
        zero.contiguous_gradients,
        zero.reduce_scatter,
        zero.allgather_partitions,
    ) == (2, True, True, True, True)
    assert zero.reduce_bucket_size == 500_000_000 and type(zero.reduce_bucket_size) is int
    assert zero.allgather_bucket_size == 500_000_000 and type(zero.allgather_bucket_size) is int
    assert (cfg.steps_per_print, cfg.wall_clock_breakdown, cfg.seed) == (2000, False, None)
    assert cfg.zero_allow_untested_optimizer is True


def test_defaults_match_deepspeed() -> None:
    assert ZeroTrainConfig().model_dump() == {
        "train_batch_size": None,
        "train_micro_batch_size_per_gpu": None,
        "gradient_accumulation_steps": None,
        "data_parallel_size": None,
        "sequence_parallel_size": 1,
        "optimizer": None,
        "scheduler": None,
        "gradient_clipping": 1.0,  # DeepSpeed 0.19.8's default
        "data_types": {"grad_accum_dtype": None},
        "communication_data_type": None,
        "dataloader_drop_last": False,
        "fp16": {
            "enabled": False,
            "auto_cast": False,
            "loss_scale": 0.0,
            "initial_scale_power": 16,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "consecutive_hysteresis": False,
            "min_loss_scale": 1.0,
        },
        "bf16": {
            "enabled": False,
            "auto_cast": False,  # zerotrain's
            "bf16_master_weights_and_grads": False,
            "bf16_optimizer_states": False,
            "stochastic_rounding": False,  # zerotrain's
        },
        "aio": {
            "block_size": 1_048_576,
            "queue_depth": 8,
            "intra_op_parallelism": 1,
            "single_submit": False,
            "overlap_events": True,
            "use_gds": False,
        },
        "zero_optimization": {
            "stage": 0,
            "offload_optimizer": {
                "device": "none",
                "nvme_path": None,
                "buffer_count": 4,
                "pin_memory": True,
                "pipeline_read": False,
                "pipeline_write": False,
                "fast_init": False,
                "ratio": 1.0,
                "super_offload": False,
                "cpuadam_cores_perc": 0.8,
            },
            "offload_param": {
                "device": "none",
                "nvme_path": None,
                "buffer_count": 5,
                "buffer_size": 100_000_000,
                "max_in_cpu": 1_000_000_000,
                "pin_memory": True,
            },
            "cpu_offload": None,
            "cpu_offload_param": None,
            "sub_group_size": 1_000_000_000,
            "cpu_offload_use_pin_memory": None,
            "reduce_bucket_size": 500_000_000,
            "allgather_bucket_size": 500_000_000,
            "overlap_comm": False,
            "contiguous_gradients": True,
            "reduce_scatter": True,
            "allgather_partitions": True,
            "overlap_param_gather": False,
            "round_robin_gradients": False,
            "stage3_prefetch_bucket_size": 50_000_000,
            "stage3_param_persistence_threshold": 100_000,
            "stage3_max_live_parameters": 1_000_000_000,
            "stage3_max_reuse_distance": 1_000_000_000,
            "stage3_gather_16bit_weights_on_model_save": False,
            "leaf_module": {  # DeepSpeed's: HF's MoE blocks
                "classes": [
                    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
                    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
                    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
                ],
                "names": [],
                "name_suffixes": [],
            },
            "zero_quantized_weights": False,
            "zero_quantized_gradients": False,
            "zero_hpz_partition_size": 1,
        },
        "checkpoint": {
            "tag_validation": "Warn",
            "keep_last": 0,
            "async_save": False,  # zerotrain's
            "async_save_pending": "wait",  # zerotrain's
            "in_memory_snapshots": {  # zerotrain's
                "enabled": False,
                "every_steps": 10,
                "keep": 2,
                "path": "/dev/shm/zerotrain",
            },
            "require_resume": False,  # zerotrain's
            "load_universal": False,
            "use_node_local_storage": False,
        },
        "lora_fa": {"enabled": False, "target_modules": [], "r": 8, "alpha": 16.0},  # zerotrain's
        "torch_autocast": {"enabled": False, "dtype": "bf16", "lower_precision_safe_modules": None},
        "tiled_compute": {  # zerotrain's
            "mlp": False,
            "mlp_tile_tokens": None,
            "loss": False,
            "loss_tile_tokens": None,
        },
        "tensor_parallel": {  # zerotrain's
            "autotp_size": 1,
            "tp_plan": None,
            "sequence_parallel": False,
            "check_inputs": True,
        },
        "pipeline": {"schedule": "1f1b"},
        "moe": {"token_dedup": False, "overlap_chunks": 1},  # zerotrain's
        "comm_compression": {  # zerotrain's
            "gradients": {
                "method": "none",
                "rank": 4,
                "ratio": 0.01,
                "warmup_steps": 0,
                "error_feedback": True,
                "min_numel": 1024,
                "compress_embeddings": False,
                "block_size": 256,
                "hierarchical": False,
                "catch_up": True,
            },
            "parameters": {"method": "none", "block_size": 256},
            "hierarchical_partition": False,
            "hierarchical_partition_size": 0,
            "auto": False,
            "auto_recheck_steps": 1000,
        },
        "sites": None,  # zerotrain's
        "activation_checkpointing": None,
        "comms_logger": {
            "enabled": False,
            "verbose": False,
            "prof_all": True,
            "prof_ops": [],
            "debug": False,
        },
        "flops_profiler": {
            "enabled": False,
            "recompute_fwd_factor": 0.0,
            "profile_step": 1,
            "module_depth": -1,
            "top_modules": 1,
            "detailed": True,
            "output_file": None,
            "peak_tflops": None,
        },
        "tensorboard": {"enabled": False, "output_path": "", "job_name": "DeepSpeedJobName"},
        "csv_monitor": {"enabled": False, "output_path": "", "job_name": "DeepSpeedJobName"},
        "wandb": {"enabled": False, "group": None, "team": None, "project": "deepspeed"},
        "steps_per_print": 10,
        "dump_state": False,
        "log_level": None,
        "wall_clock_breakdown": False,
        "count_model_flops": True,
        "seed": None,
        "zero_allow_untested_optimizer": False,
    }
    assert OptimizerConfig(type="SGD").params == {}
    assert BF16Config() == BF16Config(enabled=False)


@pytest.mark.parametrize("source", ["dict", "json", "yaml", "yml", "str", "typed"])
def test_every_input_form_gives_the_same_config(source: str, tmp_path: Path) -> None:
    files = {
        "json": json.dumps(SMALL),
        "yaml": SMALL_YAML,
        "yml": SMALL_YAML,
        "str": json.dumps(SMALL),
    }
    if source == "dict":
        config: Any = SMALL
    elif source == "typed":
        config = ZeroTrainConfig.model_validate(SMALL)
    else:
        path = tmp_path / f"cfg.{'json' if source == 'str' else source}"
        path.write_text(files[source])
        config = str(path) if source == "str" else path
    cfg = load_config(config, world_size=4)
    assert (
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    ) == (24, 2, 3)
    assert cfg.optimizer == OptimizerConfig(type="AdamW", params={"lr": 1e-3, "weight_decay": 0.1})
    assert cfg.bf16.enabled is True and cfg.fp16.enabled is False
    assert cfg.zero_optimization.stage == 1
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000


def test_yaml_reads_exponents_without_a_dot_as_numbers(tmp_path: Path) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text(
        "train_batch_size: 8\noptimizer: {type: Adam, params: {lr: 1e-5, eps: 1E-8}}\n"
        "zero_optimization: {stage: 2, allgather_bucket_size: 2e8}\n"
    )
    cfg = load_config(path, world_size=1)
    assert cfg.optimizer is not None and cfg.optimizer.params == {"lr": 1e-5, "eps": 1e-8}
    assert cfg.zero_optimization.allgather_bucket_size == 200_000_000


def test_typed_input_is_rechecked_against_the_world_size() -> None:
    cfg = load_config({"train_batch_size": 8}, world_size=2)
    assert load_config(cfg, world_size=2) == cfg
    assert load_error(cfg, world_size=4) == (
        "train_batch_size (8) != train_micro_batch_size_per_gpu (4) * gradient_accumulation_steps"
        " (1) * world_size (4) = 16; fix one of them, or leave one out to derive it"
    )


def test_configs_are_immutable_and_resolve_batch_returns_a_copy() -> None:
    cfg = ZeroTrainConfig(train_batch_size=12)
    resolved = cfg.resolve_batch(3)
    assert (resolved.train_micro_batch_size_per_gpu, resolved.gradient_accumulation_steps) == (4, 1)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (None, None)
    with pytest.raises(ValidationError):
        cfg.train_batch_size = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("name", "canonical"),
    [("adam", "Adam"), ("ADAMW", "AdamW"), ("AdamW", "AdamW"), ("sgd", "SGD"), ("lamb", "Lamb")],
)
def test_optimizer_type_any_capitalisation(name: str, canonical: str) -> None:
    assert OptimizerConfig(type=name).type == canonical


@pytest.mark.parametrize(
    ("name", "canonical"),
    [
        ("warmuplr", "WarmupLR"),
        ("WARMUPDECAYLR", "WarmupDecayLR"),
        ("warmupcosinelr", "WarmupCosineLR"),
        ("onecycle", "OneCycle"),
    ],
)
def test_scheduler_type_any_capitalisation(name: str, canonical: str) -> None:
    params = {"total_num_steps": 10} if "decay" in name.lower() or "cosine" in name else {}
    if canonical == "OneCycle":
        params = {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}
    assert SchedulerConfig(type=name, params=params).type == canonical


def test_old_deepspeed_names_are_read_as_the_new_ones() -> None:
    cfg = load_config(
        {
            "train_batch_size": 2,
            "bfloat16": {"enabled": True},
            "zero_optimization": {"stage3_gather_fp16_weights_on_model_save": True},
        },
        world_size=1,
    )
    assert cfg.bf16.enabled is True
    assert cfg.zero_optimization.stage3_gather_16bit_weights_on_model_save is True
    # DeepSpeed's own field names for the stage3_ keys; its oldest form of the section
    zero = load_config(
        nested("zero_optimization", {"max_live_parameters": 7, "prefetch_bucket_size": 3}),
        world_size=1,
    ).zero_optimization
    assert (zero.stage3_max_live_parameters, zero.stage3_prefetch_bucket_size) == (7, 3)
    assert (
        load_config(nested("zero_optimization", False), world_size=1).zero_optimization.stage == 0
    )
    assert load_config(nested("zero_optimization", True), world_size=1).zero_optimization.stage == 1
    old_offload = {"stage": 2, "cpu_offload": True, "cpu_offload_use_pin_memory": False}
    zero = load_config(nested("zero_optimization", old_offload), world_size=1).zero_optimization
    assert zero.offload_optimizer.device == "cpu" and zero.offload_optimizer.pin_memory is False
    assert zero.offload_param.device == "none"
    both = {"cpu_offload": True, "offload_optimizer": {"device": "cpu"}}
    assert "set only `offload_optimizer`" in load_error(nested("zero_optimization", both))


# --- batch arithmetic ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "world_size", "expected"),
    [
        ((32, 4, 2), 4, (32, 4, 2)),
        ((32, 4, None), 4, (32, 4, 2)),
        ((32, None, 2), 4, (32, 4, 2)),
        ((None, 4, 2), 4, (32, 4, 2)),
        ((32, None, None), 4, (32, 8, 1)),
        ((None, 4, None), 4, (16, 4, 1)),
        ((7, None, None), 1, (7, 7, 1)),
        ((30, 5, None), 3, (30, 5, 2)),
        ((None, 3, 5), 3, (45, 3, 5)),
    ],
)
def test_batch_fields_are_derived(given: tuple, world_size: int, expected: tuple) -> None:
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    raw = {key: value for key, value in zip(keys, given, strict=True) if value is not None}
    cfg = load_config(raw, world_size=world_size)
    assert (
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    ) == expected


@pytest.mark.parametrize(
    ("given", "world_size", "message"),
    [
        (
            (32, 4, 2),
            3,
            "train_batch_size (32) != train_micro_batch_size_per_gpu (4) * "
            "gradient_accumulation_steps (2) * world_size (3) = 24; fix one of them, or leave one out "
            "to derive it",
        ),
        (
            (30, 4, None),
            3,
            "train_batch_size (30) is not divisible by train_micro_batch_size_per_gpu"
            " (4) * world_size (3) = 12, so gradient_accumulation_steps cannot be derived; make "
            "train_batch_size a multiple of 12 or set all three batch keys",
        ),
        (
            (30, None, 4),
            3,
            "train_batch_size (30) is not divisible by gradient_accumulation_steps "
            "(4) * world_size (3) = 12, so train_micro_batch_size_per_gpu cannot be derived; make "
            "train_batch_size a multiple of 12 or set all three batch keys",
        ),
        (
            (10, None, None),
            3,
            "train_batch_size (10) is not divisible by gradient_accumulation_steps"
            " (1) * world_size (3) = 3, so train_micro_batch_size_per_gpu cannot be derived; make "
            "train_batch_size a multiple of 3 or set all three batch keys",
        ),
        (
            (None, None, 4),
            2,
            "only gradient_accumulation_steps is set; set train_batch_size or "
            "train_micro_batch_size_per_gpu (or both)",
        ),
        (
            (None, None, None),
            2,
            "no batch size is set; set train_batch_size or "
            "train_micro_batch_size_per_gpu (or both)",
        ),
        ((0, None, None), 2, "train_batch_size: must be > 0, got 0"),
        ((None, -4, None), 2, "train_micro_batch_size_per_gpu: must be > 0, got -4"),
        ((8, None, 0), 2, "gradient_accumulation_steps: must be > 0, got 0"),
        ((2.5, None, None), 1, "train_batch_size: must be an integer, got 2.5"),
        ((True, None, None), 1, "train_batch_size: must be a number, got true"),
    ],
)
def test_batch_errors_show_the_arithmetic(given: tuple, world_size: int, message: str) -> None:
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    raw = {key: value for key, value in zip(keys, given, strict=True) if value is not None}
    assert load_error(raw, world_size) == message


def test_no_config_fails_for_want_of_a_batch_size() -> None:
    assert load_error(None) == (
        "no batch size is set; set train_batch_size or train_micro_batch_size_per_gpu (or both)"
    )


@pytest.mark.parametrize("world_size", [0, -1, True, 2.0])
def test_world_size_must_be_a_positive_integer(world_size: Any) -> None:
    assert load_error({"train_batch_size": 8}, world_size) == (
        f"world_size: must be a positive integer, got {world_size!r}"
    )


# --- errors: unknown, unimplemented, "auto", values ------------------------------------------


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"train_batch_sze": 8}, "train_batch_sze: unknown key; did you mean 'train_batch_size'?"),
        (
            nested("zero_optimization.stag", 2),
            "zero_optimization.stag: unknown key; did you mean 'stage'?",
        ),
        (
            nested("fp16.loss_scale_windw", 10),
            "fp16.loss_scale_windw: unknown key; did you mean 'loss_scale_window'?",
        ),
        (
            nested("optimizer.params.lrr", 0.1),
            "optimizer.params.lrr: unknown key; did you mean 'lr'?",
        ),
        (
            {
                "train_batch_size": 8,
                "scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 5}},
            },
            "scheduler.params.warmup_num_step: unknown key; did you mean 'warmup_num_steps'?",
        ),
        ({"train_batch_size": 8, "xyzzy": 1}, "xyzzy: unknown key"),
        (
            nested("optimizer.params.momentum", 0.9),
            "optimizer.params.momentum: not a parameter of Adam; only of SGD, Muon",
        ),
        (
            {
                "train_batch_size": 8,
                "optimizer": {"type": "SGD", "params": {"bias_correction": False}},
            },
            "optimizer.params.bias_correction: not a parameter of SGD; only of Adam, AdamW, Lamb, "
            "OneBitAdam, ZeroOneAdam",
        ),
        (
            {"train_batch_size": 8, "monitor": {"enabled": True}},
            "monitor: unknown key; did you mean 'csv_monitor'?",
        ),
        (  # HuggingFace's TrainingArguments names: spelling alone would not find these
            nested("optimizer.params.adam_eps", 1e-8),
            "optimizer.params.adam_eps: unknown key; did you mean 'eps'? DeepSpeed's name for it",
        ),
        (
            nested("optimizer.params.adam_beta2", 0.95),
            "optimizer.params.adam_beta2: unknown key; did you mean 'betas' (both betas in one "
            "list: [beta1, beta2])? DeepSpeed's name for it",
        ),
        (
            nested("optimizer.params.learning_rate", 0.1),
            "optimizer.params.learning_rate: unknown key; did you mean 'lr'? DeepSpeed's name "
            "for it",
        ),
        (
            nested("optimizer.params.max_grad_norm", 1.0),
            "optimizer.params.max_grad_norm: not an "
            "optimizer parameter; use the top-level `gradient_clipping` instead",
        ),
    ],
)
def test_unknown_keys_name_the_path_and_a_fix(config: dict, message: str) -> None:
    assert load_error(config) == message


# [Note: lenient where nothing is asked, strict where something is] in config/deepspeed_keys.py
ASKS_NOTHING = [
    ("prescale_gradients", True),
    ("gradient_predivide_factor", 8),
    ("autotuning", {"enabled": True, "fast": True, "arg_mappings": {"a": "--a"}}),
    ("cuda_visible_devices", "0,1"),
    ("zero_force_ds_cpu_optimizer", True),
    ("memory_breakdown", True),
    ("timers", {"throughput": {"enabled": True}}),
    ("pipeline", {"stages": 2, "partition": "parameters"}),
    ("tensor_parallel", {"autotp_size": 1, "tp_grain_size": 64}),
    ("torch_autocast", {"enabled": False, "dtype": "bfloat16"}),
    ("compile", {"deepcompile": False}),
    ("amp", {"enabled": False}),
    ("comet", {"enabled": False}),
    ("data_types", {"grad_accum_dtype": None}),
    ("managed_gradient_accumulation", True),
    ("_comment", "JSON has no comments"),
    ("zero_optimization._why", "stage 2 fits"),
    ("zero_optimization.elastic_checkpoint", True),
    ("zero_optimization.zero_quantized_gradients", False),
    ("zero_optimization.zero_hpz_partition_size", 1),
    ("zero_optimization.mics_shard_size", -1),
    ("zero_optimization.offload_optimizer", {"device": "none", "pin_memory": True}),
    ("zero_optimization.offload_param", {"device": None}),
    ("zero_optimization.stage3_module_granularity_threshold", 100),
    ("fp16.fp16_master_weights_and_grads", False),
    ("bf16.immediate_grad_update", True),
    ("bf16.bf16_master_weights_and_grads", False),
    ("optimizer.legacy_fusion", False),
    ("checkpoint.use_node_local_storage", False),
    ("checkpoint.parallel_write", {"pipeline_stage": False}),
]


@pytest.mark.parametrize(("path", "value"), ASKS_NOTHING)
def test_keys_that_ask_for_nothing_are_accepted_and_change_nothing(path: str, value: Any) -> None:
    config = nested(path, value)
    *parents, leaf = path.split(".")
    without = json.loads(json.dumps(config))
    section = without
    for parent in parents:
        section = section[parent]
    del section[leaf]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and say nothing
        assert load_config(config, world_size=1) == load_config(without, world_size=1), path


ASKS_FOR_MISSING = [
    ("comet", {"enabled": True}, "the Comet monitor", "`enabled: false`"),
    ("fp8", {"enabled": True}, "fp8 training", "`enabled: false`"),
    (
        "compression_training",
        {"weight_quantization": {"shared_parameters": {"enabled": True}}},
        "compression training",
        "`enabled: false`",
    ),
    ("compile", {"deepcompile": True}, "DeepCompile", "`deepcompile: false`"),
    ("managed_gradient_accumulation", False, "unmanaged gradient accumulation", "true"),
    (
        "zero_optimization.zero_quantized_nontrainable_weights",
        True,
        "ZeRO++ quantized frozen",
        "false",
    ),
    ("zero_optimization.mics_shard_size", 4, "MiCS sub-group sharding", "-1"),
    ("zero_optimization.zenflow", {"topk_ratio": 0.1}, "ZenFlow", "null"),
    ("fp16.fp16_master_weights_and_grads", True, "fp16 master weights and gradients", "false"),
]


@pytest.mark.parametrize(("path", "value", "behaviour", "idle"), ASKS_FOR_MISSING)
def test_keys_that_ask_for_a_missing_behaviour_are_refused_naming_it(
    path: str, value: Any, behaviour: str, idle: str
) -> None:
    message = load_error(nested(path, value))
    assert message.startswith(f"`{path}: {json.dumps(value)}` asks for {behaviour}"), message
    assert message.endswith(f"which zerotrain does not have yet; set it to {idle} or remove it")


def test_offload_sections_are_typed_and_checked() -> None:
    config = nested("zero_optimization", {"stage": 3, "offload_param": {"device": "CPU"}})
    zero = load_config(config, world_size=1).zero_optimization
    assert zero.offload_param.device == "cpu" and zero.offload_param.max_in_cpu == 1_000_000_000
    nvme = {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/x", "ratio": "AUTO"}}
    zero = load_config(nested("zero_optimization", nvme), world_size=1).zero_optimization
    assert (zero.offload_optimizer.device, zero.offload_optimizer.ratio) == ("nvme", "auto")
    no_path = {"stage": 1, "offload_optimizer": {"device": "nvme"}}
    assert load_error(nested("zero_optimization", no_path)) == (
        'zero_optimization: offload_optimizer.device: "nvme" needs offload_optimizer.nvme_path '
        "(a directory)"
    )
    stage_0 = nested("zero_optimization.offload_optimizer", {"device": "cpu"})
    assert "at stage 0 nothing is partitioned: set stage to 1, 2 or 3" in load_error(stage_0)
    assert 'ratio: must be a number between 0 and 1, or "auto"; got 1.5' in load_error(
        nested("zero_optimization.offload_optimizer", {"ratio": 1.5})
    )
    assert "zero_optimization.offload_param.ratio: unknown key" in load_error(
        nested("zero_optimization.offload_param", {"ratio": 0.5})
    )
    aio = load_config({"train_batch_size": 1, "aio": {"thread_count": 4}}, world_size=1).aio
    assert aio.intra_op_parallelism == 4
    assert "aio.block_size: must be a multiple of 4096 (direct I/O's alignment), got 1000" in (
        load_error(nested("aio", {"block_size": 1000}))
    )


def test_keys_deepspeed_ignores_are_accepted_with_a_warning() -> None:
    config = {"train_batch_size": 8, "monitor_config": {"enabled": True}, "comms_config": {}}
    with pytest.warns(UserWarning) as caught:
        load_config(config, world_size=1)
    messages = [str(w.message) for w in caught]
    assert any("monitor_config: ignored. Not a DeepSpeed key" in m for m in messages)
    assert any("comms_config: ignored" in m for m in messages)


def test_deepspeed_values_zerotrain_reads() -> None:
    config = load_config(
        {
            "train_batch_size": 8,
            "steps_per_print": float("inf"),  # accelerate writes this
            "communication_data_type": "fp32",
            "dataloader_drop_last": True,
            "log_level": "WARNING",
            "fp16": {"enabled": True, "auto_cast": True, "min_loss_scale": 0},
            "optimizer": {
                "type": "Adam",
                "params": {"adam_w_mode": False, "bias_correction": False},
            },
        },
        world_size=1,
    )
    assert config.steps_per_print is None and config.communication_data_type == "fp32"
    assert config.dataloader_drop_last and config.log_level == "warning"
    assert config.fp16.auto_cast and config.fp16.min_loss_scale == 0
    assert config.optimizer.params == {"adam_w_mode": False, "bias_correction": False}
    assert load_config(nested("steps_per_print", None), world_size=1).steps_per_print is None
    assert "communication_data_type: must be one of" in load_error(
        nested("communication_data_type", "bfp16")
    )
    assert load_config(nested("data_parallel_size", 2), world_size=2).data_parallel_size == 2
    assert "data_parallel_size: 2, but the mesh has 4 data-parallel ranks" in load_error(
        nested("data_parallel_size", 2), world_size=4
    )


def test_every_problem_is_reported_at_once() -> None:
    config = {
        "train_batch_sze": 8,
        "comet": {"enabled": True},
        "zero_optimization": {"stage": 2, "zero_quantized_nontrainable_weights": True},
        "gradient_clipping": "auto",
    }
    assert load_error(config).splitlines() == [
        "train_batch_sze: unknown key; did you mean 'train_batch_size'?",
        '`comet: {"enabled": true}` asks for the Comet monitor, which zerotrain does not have '
        "yet; set it to `enabled: false` or remove it",
        "`zero_optimization.zero_quantized_nontrainable_weights: true` asks for ZeRO++ "
        "quantized frozen weights, which zerotrain does not have yet; set it to false or remove "
        "it",
        'gradient_clipping: "auto" must be resolved before passing the config to zerotrain '
        "(HuggingFace's Trainer does that for DeepSpeed); set a concrete value",
    ]


@pytest.mark.parametrize(
    ("config", "path"),
    [
        ({"train_batch_size": "auto"}, "train_batch_size"),
        (
            nested("zero_optimization.reduce_bucket_size", "auto"),
            "zero_optimization.reduce_bucket_size",
        ),
        (nested("optimizer.params.lr", "auto"), "optimizer.params.lr"),
        (nested("optimizer.params.betas", [0.9, "auto"]), "optimizer.params.betas.1"),
        (
            {
                "train_batch_size": 8,
                "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "Auto"}},
            },
            "scheduler.params.warmup_max_lr",
        ),
        (nested("fp16.enabled", "auto"), "fp16.enabled"),
    ],
)
def test_auto_values_must_be_resolved_first(config: dict, path: str) -> None:
    assert load_error(config) == (
        f'{path}: "auto" must be resolved before passing the config to zerotrain '
        "(HuggingFace's Trainer does that for DeepSpeed); set a concrete value"
    )


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            nested("zero_optimization.stage", 4),
            "zero_optimization.stage: must be between 0 and 3, got 4",
        ),
        (
            nested("zero_optimization.stage", -1),
            "zero_optimization.stage: must be between 0 and 3, got -1",
        ),
        (
            nested("zero_optimization.reduce_bucket_size", 1.5),
            "zero_optimization.reduce_bucket_size: must be an integer, got 1.5",
        ),
        (
            {"train_batch_size": 8, "zero_optimization": 3},
            "zero_optimization: must be a mapping, got 3",
        ),
        (
            {"train_batch_size": 8, "gradient_clipping": -1.0},
            "gradient_clipping: must be >= 0, got -1.0",
        ),
        (nested("fp16.enabled", "maybe"), 'fp16.enabled: must be true or false, got "maybe"'),
        (nested("fp16.loss_scale_window", 0), "fp16.loss_scale_window: must be > 0, got 0"),
        (nested("fp16.loss_scale", -1), "fp16.loss_scale: must be >= 0, got -1"),
        (
            nested("bf16.bf16_optimizer_states", True),
            "bf16.bf16_optimizer_states: applies to bf16 training; set bf16.enabled true or "
            "remove it",
        ),
        (
            {
                "train_batch_size": 8,
                "bf16": {"enabled": True, "stochastic_rounding": True},
            },
            "bf16.stochastic_rounding: rounds bf16 master weights; set "
            "bf16.bf16_master_weights_and_grads true or remove it",
        ),
        (
            {
                "train_batch_size": 8,
                "zero_optimization": {"stage": 1},
                "bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
                "data_types": {"grad_accum_dtype": "fp32"},
            },
            "data_types.grad_accum_dtype: fp32 gradients, and bf16.bf16_master_weights_and_grads "
            "asks for bf16 gradients; remove one of them",
        ),
        (
            {
                "train_batch_size": 8,
                "optimizer": {"type": "OneBitAdam"},
                "bf16": {"enabled": True, "bf16_optimizer_states": True},
            },
            "bf16: bf16 master weights or optimizer states with OneBitAdam, whose compressed "
            "steps keep fp32 state of their own, are not supported yet; use fp32 masters and "
            "states (remove bf16_master_weights_and_grads and bf16_optimizer_states) or another "
            "optimizer",
        ),
        (
            nested("torch_autocast.lower_precision_safe_modules", ["torch.nn.Linearr"]),
            "torch_autocast.lower_precision_safe_modules: 'torch.nn.Linearr' is not an "
            "importable class ('torch.nn.Linearr' names no class)",
        ),
        ({"train_batch_size": 8, "optimizer": {}}, "optimizer.type: required key is missing"),
        (
            nested("optimizer.type", "adamx"),
            "optimizer.type: unknown optimizer 'adamx'; did you mean "
            "'Adam'? zerotrain supports Adam, AdamW, SGD, Lamb, Lion, Adagrad, Muon, OneBitAdam, "
            "ZeroOneAdam",
        ),
        (
            nested("optimizer.type", "OneBitLamb"),
            "optimizer.type: 'OneBitLamb' is a DeepSpeed optimizer that zerotrain does not "
            "implement yet; use one of Adam, AdamW, SGD, Lamb, Lion, Adagrad, Muon, OneBitAdam, "
            "ZeroOneAdam",
        ),
        (
            nested("optimizer.type", 5),
            "optimizer.type: must be one of 'Adam', 'AdamW', 'SGD', 'Lamb', 'Lion', 'Adagrad', "
            "'Muon', 'OneBitAdam' or 'ZeroOneAdam', got 5",
        ),
        (nested("optimizer.params.lr", "x"), 'optimizer.params.lr: must be a number, got "x"'),
        # JSON's Infinity and NaN (Python's json reads both): no float key takes them
        (
            nested("optimizer.params.lr", float("inf")),
            "optimizer.params.lr: must be a finite number, got Infinity",
        ),
        (
            nested("optimizer.params.lr", float("nan")),
            "optimizer.params.lr: must be a finite number, got NaN",
        ),
        (
            {"train_batch_size": 8, "gradient_clipping": float("inf")},
            "gradient_clipping: must be a finite number, got Infinity",
        ),
        (
            nested("fp16.initial_scale_power", float("inf")),
            "fp16.initial_scale_power: must be a finite number, got Infinity",
        ),
        (
            nested("optimizer.params.betas", [0.9]),
            "optimizer.params.betas: must be a list of two numbers, got [0.9]",
        ),
        (
            nested("optimizer.params.betas", [0.9, 1.0]),
            "optimizer.params.betas.1: must be < 1, got 1.0",
        ),
        (
            nested("scheduler.type", "LRRangeTest"),
            "scheduler.type: 'LRRangeTest' is a DeepSpeed "
            "scheduler that zerotrain does not implement yet; use one of WarmupLR, WarmupDecayLR, "
            "WarmupCosineLR, OneCycle",
        ),
        (
            {"train_batch_size": 8, "scheduler": {"type": "WarmupDecayLR"}},
            "scheduler.params.total_num_steps: required key is missing",
        ),
        (
            {"train_batch_size": 8, "scheduler": {"type": "OneCycle", "params": {}}},
            "scheduler.params.cycle_min_lr: required key is missing\n"
            "scheduler.params.cycle_max_lr: required key is missing",
        ),
        (
            {
                "train_batch_size": 8,
                "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cos"}},
            },
            "scheduler.params.warmup_type: must be one of 'log' or 'linear', got \"cos\"",
        ),
        (
            {
                "train_batch_size": 8,
                "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "0"}},
            },
            "scheduler.params.warmup_min_lr: must be a number or a list of numbers (one per param "
            'group), got "0"',
        ),
        # a union's members: each one's problem on one line, without pydantic's names for them
        (
            {"train_batch_size": 8, "sites": {"work_split": "fast"}},
            "sites.work_split: must be one of 'equal' or 'measured', or must be a list, "
            'got "fast"',
        ),
        # or, where one member took the value, the problem inside it alone
        (
            {"train_batch_size": 8, "sites": {"clusters": [[0, 1], [-1]]}},
            "sites.clusters.1.0: must be >= 0, got -1",
        ),
    ],
)
def test_bad_values_name_the_path(config: dict, message: str) -> None:
    assert load_error(config) == message


@pytest.mark.parametrize("section", ["offload_optimizer", "offload_param"])
def test_nvme_path_that_cannot_hold_working_files_is_refused(section: str, tmp_path: Path) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for path, problem in [
        (a_file, f"{a_file} is a file; give a directory"),
        ("/proc/zerotrain", "/proc/zerotrain is on a kernel pseudo-filesystem (/proc)"),
    ]:
        config = {
            "train_batch_size": 8,
            "zero_optimization": {
                "stage": 3,
                section: {"device": "nvme", "nvme_path": str(path)},
            },
        }
        assert f"{section}.nvme_path: {problem}" in load_error(config)
    shm = {"device": "nvme", "nvme_path": "/dev/shm/zerotrain"}  # a tmpfs, as tests use it
    load_config(
        {"train_batch_size": 8, "zero_optimization": {"stage": 3, section: shm}}, world_size=1
    )


def test_nvme_directory_that_cannot_be_written_is_a_config_error(tmp_path: Path) -> None:
    from zerotrain.zero.host import prepare_directory

    a_file = tmp_path / "a_file"
    a_file.write_text("")
    with pytest.raises(ConfigError, match=r"offload_param.nvme_path: cannot write working files"):
        prepare_directory(a_file / "below", key="offload_param")  # made after the config check
    prepare_directory(tmp_path / "new" / "dir")
    assert (tmp_path / "new" / "dir").is_dir() and not list((tmp_path / "new" / "dir").iterdir())


def test_per_param_group_learning_rates_are_accepted() -> None:
    config = {
        "train_batch_size": 8,
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": [0, 0], "warmup_max_lr": [1e-3, 1e-4]},
        },
    }
    scheduler = load_config(config, world_size=1).scheduler
    assert scheduler is not None
    assert scheduler.params == {"warmup_min_lr": [0.0, 0.0], "warmup_max_lr": [1e-3, 1e-4]}


def test_stage_3_and_its_keys_load() -> None:
    config = load_config(
        {
            "train_batch_size": 4,
            "zero_optimization": {
                "stage": 3,
                "stage3_prefetch_bucket_size": 7,
                "stage3_max_live_parameters": 11,
                "stage3_param_persistence_threshold": 0,
            },
        },
        world_size=1,
    )
    zero = config.zero_optimization
    assert zero.stage == 3
    assert (zero.stage3_prefetch_bucket_size, zero.stage3_max_live_parameters) == (7, 11)
    assert zero.stage3_param_persistence_threshold == 0


@pytest.mark.parametrize("bf16_key", ["bf16", "bfloat16"])
def test_fp16_and_bf16_together_are_rejected(bf16_key: str) -> None:
    config = {"train_batch_size": 8, "fp16": {"enabled": True}, bf16_key: {"enabled": True}}
    assert load_error(config) == (
        "fp16.enabled and bf16.enabled are both true; enable at most one of them"
    )


def test_bf16_under_both_names_is_rejected() -> None:
    config = {"train_batch_size": 8, "bf16": {"enabled": True}, "bfloat16": {"enabled": True}}
    assert load_error(config) == "`bfloat16` is DeepSpeed's old name for `bf16`; set only `bf16`"


# --- files -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("missing.json", None, "{path}: config file does not exist; check the path"),
        ("list.json", "[1, 2]", "{path}: the top level must be a mapping of config keys, got list"),
        ("scalar.yaml", "8\n", "{path}: the top level must be a mapping of config keys, got int"),
        ("empty.yml", "", "{path}: the top level must be a mapping of config keys, got NoneType"),
        (
            "cfg.toml",
            "a = 1",
            "{path}: not a .json, .yaml or .yml file; rename it, or pass the config as a dict",
        ),
        (
            "ds_config",
            "{}",
            "{path}: not a .json, .yaml or .yml file; rename it, or pass the config as a dict",
        ),
    ],
)
def test_file_errors_name_the_path(
    name: str, text: str | None, message: str, tmp_path: Path
) -> None:
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    assert load_error(path) == message.format(path=path)


@pytest.mark.parametrize(
    ("name", "text", "kind"),
    [
        ("bad.json", '{"train_batch_size": 8,}', "JSON"),
        ("dup.json", '{"train_batch_size": 8, "train_batch_size": 16}', "JSON"),
        ("bad.yaml", "train_batch_size: [8\n", "YAML"),
    ],
)
def test_unparsable_files_name_the_path(name: str, text: str, kind: str, tmp_path: Path) -> None:
    path = tmp_path / name
    path.write_text(text)
    message = load_error(str(path))
    assert message.startswith(f"{path}: not valid {kind} (")
    assert message.endswith("); fix the file syntax")
    if name == "dup.json":
        assert "duplicate key 'train_batch_size'" in message


def test_other_config_objects_are_rejected() -> None:
    assert load_error([("train_batch_size", 8)]) == (
        "config: must be a dict, a path or a ZeroTrainConfig, got list"
    )


# --- documentation -----------------------------------------------------------------------


def test_docs_config_md_is_generated_from_the_schema(tmp_path: Path) -> None:
    committed = (REPO_ROOT / "docs" / "config.md").read_text()
    assert committed == config_reference_markdown(), (
        "docs/config.md is stale; run `python -m zerotrain.config > docs/config.md`"
    )
    # The module entry point prints the same text (run outside the checkout, so that the
    # installed package or PYTHONPATH decides what is imported, as it would for a user).
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO_ROOT)])),
    }
    result = subprocess.run(
        [sys.executable, "-m", "zerotrain.config"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert result.stdout == committed


@pytest.mark.parametrize(
    "section",
    [
        ZeroTrainConfig,
        OptimizerConfig,
        SchedulerConfig,
        FP16Config,
        BF16Config,
        ZeroOptimizationConfig,
        FlopsProfilerConfig,
        TensorBoardConfig,
        CSVMonitorConfig,
        WandbConfig,
    ],
)
def test_every_field_is_documented(
    section: type,
) -> None:
    markdown = config_reference_markdown()
    for name, field in section.model_fields.items():
        assert field.description, f"{section.__name__}.{name} has no docstring"
        assert f"{name}` |" in markdown


def test_no_effect_options_say_so() -> None:
    round_robin = ZeroOptimizationConfig.model_fields["round_robin_gradients"].description or ""
    untested = ZeroTrainConfig.model_fields["zero_allow_untested_optimizer"].description or ""
    assert "no effect on numerics" in " ".join(round_robin.split())
    assert "has no effect: zerotrain wraps any torch optimizer" in " ".join(untested.split())


def test_checkpoint_section() -> None:
    config = load_config(
        {"train_batch_size": 8, "checkpoint": {"tag_validation": "fail", "keep_last": 3}},
        world_size=1,
    )
    assert config.checkpoint.tag_validation == "Fail" and config.checkpoint.keep_last == 3
    assert "checkpoint.keep_last: must be >= 0" in load_error(nested("checkpoint.keep_last", -1))
    assert "checkpoint.tag_validation: must be one of" in load_error(
        nested("checkpoint.tag_validation", "sometimes")
    )


def test_overlap_param_gather_only_at_stages_1_and_2() -> None:
    config = {"train_batch_size": 8, "zero_optimization": {"overlap_param_gather": True}}
    for stage in (1, 2):
        config["zero_optimization"]["stage"] = stage
        assert load_config(config, world_size=1).zero_optimization.overlap_param_gather
    for stage in (0, 3):
        config["zero_optimization"]["stage"] = stage
        assert "overlap_param_gather applies to stages 1-2" in load_error(config)


def test_flops_profiler_and_monitor_sections() -> None:
    config = load_config(
        {
            "train_batch_size": 8,
            "flops_profiler": {"enabled": True, "profile_step": 0, "module_depth": 2},
            "tensorboard": {"enabled": True, "output_path": "runs", "job_name": "j"},
            "csv_monitor": {"enabled": True},
            "wandb": {"enabled": True, "team": "t"},
        },
        world_size=1,
    )
    assert (config.flops_profiler.profile_step, config.flops_profiler.module_depth) == (0, 2)
    assert config.tensorboard.output_path == "runs" and config.wandb.team == "t"
    assert "flops_profiler.module_depth: must be -1 (every level) or a depth >= 0, got -2" in (
        load_error(nested("flops_profiler.module_depth", -2))
    )
    assert "flops_profiler.top_modules: must be > 0" in load_error(
        nested("flops_profiler.top_modules", 0)
    )
    assert "flops_profiler.peak_tflops: must be > 0" in load_error(
        nested("flops_profiler.peak_tflops", 0)
    )
    assert load_error(nested("tensorboard.job_nam", "x")) == (
        "tensorboard.job_nam: unknown key; did you mean 'job_name'?"
    )
    assert "asks for the Comet monitor" in load_error(nested("comet", {"enabled": True}))


def test_auto_that_huggingface_leaves_unfilled_takes_the_default() -> None:
    config = {
        "train_batch_size": 8,
        "bfloat16": {"enabled": "auto"},  # the Trainer fills only `bf16`
        "zero_optimization": {"stage": 2, "stage3_prefetch_bucket_size": "auto"},
    }
    with pytest.warns(UserWarning) as caught:
        loaded = load_config(config, world_size=1)
    messages = " ".join(str(w.message) for w in caught)
    assert 'bfloat16.enabled: "auto", which HuggingFace leaves unfilled here' in messages
    assert 'stage3_prefetch_bucket_size: "auto", which HuggingFace' in messages
    assert loaded.bf16.enabled is False
    assert loaded.zero_optimization.stage3_prefetch_bucket_size == 50_000_000
    config["zero_optimization"]["stage"] = 3  # filled at stage 3: an "auto" left is a mistake
    assert 'stage3_prefetch_bucket_size: "auto" must be resolved' in load_error(config)


def _zerotrain_imports(path: Path) -> dict[str, list[str]]:
    """What a file imports from zerotrain, module -> names, anywhere in its code (functions and
    TYPE_CHECKING blocks included)."""
    found: dict[str, list[str]] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.setdefault(alias.name, [])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.setdefault(node.module, []).extend(alias.name for alias in node.names)
    return {module: names for module, names in found.items() if module.startswith("zerotrain")}


def test_config_modules_import_one_way() -> None:
    package = REPO_ROOT / "zerotrain" / "config"
    modules = {path.stem for path in package.glob("*.py")} - {"__init__", "__main__"}
    graph: dict[str, set[str]] = {}
    outside: set[str] = set()
    for name in modules:
        graph[name] = set()
        for module, names in _zerotrain_imports(package / f"{name}.py").items():
            if module == "zerotrain.config":  # only submodules: the package imports them all
                assert set(names) <= modules, f"config/{name}.py imports {names} from the package"
                graph[name] |= set(names)
            elif module.startswith("zerotrain.config."):
                graph[name].add(module.removeprefix("zerotrain.config."))
            else:
                outside.add(module)
    list(graphlib.TopologicalSorter(graph).static_order())  # raises CycleError on a cycle
    # the config reads the optimizer and scheduler names, the 1-bit optimizers' names and limits,
    # and the dtype names, never the runtime (engine, zero, comm)
    allowed = {
        "zerotrain.errors",
        "zerotrain.optim.registry",
        "zerotrain.optim.schedulers",
        "zerotrain.optim.onebit",
        "zerotrain.precision",
    }
    assert outside <= allowed, outside
    for path in (REPO_ROOT / "zerotrain" / "optim").glob("*.py"):
        assert not any(m.startswith("zerotrain.config") for m in _zerotrain_imports(path)), path


def test_every_registered_scheduler_has_its_params_checked():
    """One list of schedule names (zerotrain.optim.schedulers.SCHEDULERS): the config accepts
    exactly those types, and describes the `params` of each."""
    from zerotrain.optim.schedulers import SCHEDULERS

    assert set(SchedulerConfig._PARAMS) == set(SCHEDULERS)
    for name in SCHEDULERS:
        params = {"total_num_steps": 10} if name in ("WarmupDecayLR", "WarmupCosineLR") else {}
        if name == "OneCycle":
            params = {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}
        scheduler = {"type": name.lower(), "params": params}  # any capitalisation
        config = load_config({"train_batch_size": 1, "scheduler": scheduler}, world_size=1)
        assert config.scheduler.type == name


def test_sub_group_size_zero_is_the_smallest_sub_group() -> None:
    """DeepSpeed accepts 0 (one parameter per sub-group at stage 3; three public configs set
    it): zerotrain's smallest sub-group, one alignment unit."""
    from zerotrain.zero.nvme import SUB_GROUP_ALIGNMENT, sub_group_numel

    cfg = load_config(nested("zero_optimization.sub_group_size", 0), world_size=1)
    assert cfg.zero_optimization.sub_group_size == 0
    assert sub_group_numel(0) == SUB_GROUP_ALIGNMENT
    assert "must be >= 0" in load_error(nested("zero_optimization.sub_group_size", -1))
