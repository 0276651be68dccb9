"""``initialize`` and the argparse helpers: the DeepSpeed-compatible entry points."""

from __future__ import annotations

import argparse
import logging
import os
import random
import socket
import sys
import warnings
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from zerotrain import activation_checkpointing as checkpointing
from zerotrain.accelerator import get_accelerator, settle_host_math
from zerotrain.comm import (
    CommsLog,
    Communicator,
    Mesh,
    init_distributed,
    is_initialized,
    local_rank,
)
from zerotrain.compression import GradientCompression, ParameterCompression
from zerotrain.compression.auto import AutoOptions, candidate_policies
from zerotrain.config import ConfigError, ZeroTrainConfig, load_config, read_config_file
from zerotrain.config.compression import AUTO_DEFAULT_METHOD
from zerotrain.data import ResumableDataLoader, ResumableDistributedSampler
from zerotrain.engine import ZeroTrainEngine
from zerotrain.estimate.preflight import check_memory
from zerotrain.lora import apply_lora_fa
from zerotrain.moe import MoE
from zerotrain.moe.layer import expert_tensors
from zerotrain.observability.monitor import check_monitor_packages
from zerotrain.optim import Lamb
from zerotrain.optimizer_plan import optimizer_plan, returned_optimizer, scheduler_for
from zerotrain.pipe.engine import PipelineEngine
from zerotrain.pipe.module import MULTI_STAGE_PLACEMENT, PipelineModule
from zerotrain.precision import DTYPES, LossScaler
from zerotrain.tensor_parallel import TensorParallel, is_split, parallelize
from zerotrain.zero import GroupOptions, ZeroOptimizer, ZeroPolicy
from zerotrain.zero.gather import Stage3Options
from zerotrain.zero.group import ModelParallel
from zerotrain.zero.init import full_shape, owner_of
from zerotrain.zero.layout import NamedParams
from zerotrain.zero.leaf_modules import apply_leaf_module_config
from zerotrain.zero.offload import OffloadOptions, device_budget, local_ranks
from zerotrain.zero.optimizer import ShardGroupSpec
from zerotrain.zero.param_home import ParamOffload
from zerotrain.zero.swap import AioOptions


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--deepspeed``, ``--deepspeed_config`` and ``--zerotrain_config`` to ``parser``."""
    group = parser.add_argument_group("zerotrain", "zerotrain (DeepSpeed-compatible) options")
    group.add_argument(
        "--deepspeed",
        action="store_true",
        help="enable the engine (accepted for DeepSpeed scripts)",
    )
    group.add_argument("--deepspeed_config", default=None, type=str, help="config file (JSON/YAML)")
    group.add_argument("--zerotrain_config", default=None, type=str, help="config file (JSON/YAML)")
    return parser


def initialize(
    args: argparse.Namespace | None = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Dataset | None = None,
    lr_scheduler: Any = None,
    distributed_port: int = 29500,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable | None = None,
    config: dict | str | ZeroTrainConfig | None = None,
    mesh_param: Any = None,
    config_params: dict | None = None,
) -> tuple[ZeroTrainEngine, ZeroOptimizer | torch.optim.Optimizer | None, DataLoader | None, Any]:
    """Wrap ``model`` for ZeRO training; returns ``(engine, optimizer, dataloader, lr_scheduler)``.

    ``config`` is a dict, a JSON/YAML path or a :class:`ZeroTrainConfig` (or comes from
    ``args.deepspeed_config``/``args.zerotrain_config``). The optimizer is the config's
    ``optimizer`` section or a torch optimizer (or a callable building one from parameter
    groups); it steps this rank's fp32 master shards (the client's object itself, as in
    DeepSpeed). Given both, the object wins and the config's section is ignored with a warning,
    as in DeepSpeed; given neither, the engine runs forward passes only. The optimizer returned
    is DeepSpeed's choice: at ZeRO stage 0 without fp16/bf16 the torch optimizer that steps
    (None without one), elsewhere the ZeRO optimizer, which ``engine.optimizer`` always is.
    ``lr_scheduler`` may be a torch scheduler of that optimizer or a callable taking the
    optimizer. With ``training_data`` the returned dataloader shards it
    over ranks with a ``DistributedSampler``. ``distributed_port`` is the port of a process
    group this call creates (see :func:`zerotrain.init_distributed`). ``mpu`` is accepted when
    its model-parallel sizes are all 1; ``mesh_param`` must be None.
    """
    if model is None:
        raise ValueError("zerotrain.initialize: model is required")
    if mesh_param is not None:
        raise ConfigError(
            "initialize(mesh_param=...): a model-parallel device mesh is not supported yet; pass "
            "None"
        )
    if mpu is not None:
        check_mpu(mpu)
    settle_host_math()  # before the first forward pass
    if config is None:
        config = config_params
    config = _config_from_args(args, config)
    if dist_init_required is not False and not is_initialized():
        init_distributed(distributed_port=distributed_port, verbose=False)
    device = _training_device()
    comm = Communicator(device=device)
    stages = model.num_stages if isinstance(model, PipelineModule) else 1
    # the batch keys count data-parallel ranks: the world over the stages (and over the
    # tensor-parallel degree, which the config itself knows)
    cfg = load_config(config, world_size=comm.world_size // stages)
    _check_pipeline(cfg, model)
    check_monitor_packages(cfg)  # before any work: every rank fails alike
    _check_offload(cfg, comm.rank)
    _check_node_local_storage(cfg, comm)
    if cfg.log_level is not None:
        # the `zerotrain` logger (zerotrain.utils.logger, DeepSpeed's deepspeed.utils.logger)
        logging.getLogger("zerotrain").setLevel(cfg.log_level.upper())
    if comm.rank == 0:  # DeepSpeed's INFO line, which clients assert on deepspeed.utils.logger
        version = sys.modules["zerotrain"].__version__  # the package root: a layer above
        info = f"DeepSpeed info: version={version}, git-hash=[none], git-branch=[none]"
        logging.getLogger("zerotrain").info(f"[Rank 0] {info}")
    if cfg.dump_state and comm.rank == 0:
        print(f"zerotrain config:\n{cfg.model_dump_json(indent=2)}", flush=True)
    comms_logger = cfg.comms_logger
    if comms_logger.enabled:  # before the engine makes more groups: they share the log
        ops = None if comms_logger.prof_all else comms_logger.prof_ops
        comm.log = CommsLog(
            ops, verbose=comms_logger.verbose, debug=comms_logger.debug, rank=comm.rank
        )
    if cfg.seed is not None:
        seed_everything(cfg.seed)
    if cfg.activation_checkpointing is not None:
        checkpointing.use_policy(cfg.activation_checkpointing)

    if any(owner_of(p) is not None for p in model.parameters()):
        raise ValueError(
            "zerotrain.initialize: this model is already wrapped by an engine (its parameters "
            "are views into that engine's buffers); build a new model, or keep the first engine"
        )
    if cfg.lora_fa.enabled:
        model_parameters = _convert_to_lora_fa(model, cfg, optimizer, model_parameters, comm.rank)
    model.to(device)
    mesh = Mesh(
        comm, tp=cfg.tensor_parallel.autotp_size, pp=stages, ep=_expert_parallel(model, cfg)
    )
    for layer in model.modules():
        if isinstance(layer, MoE):
            layer.deepspeed_moe.dedup = cfg.moe.token_dedup
            layer.deepspeed_moe.chunks = cfg.moe.overlap_chunks
            if mesh.sizes["ep"] > 1:  # else every expert is local: nothing to exchange
                layer.place(mesh.axis("ep"))
    tensor_parallel = _tensor_parallel(model, cfg, mesh)
    tied = model.tie_across_stages(mesh) if isinstance(model, PipelineModule) else {}
    if tied and cfg.zero_optimization.offload_optimizer.device != "none":
        raise ConfigError(
            "zero_optimization.offload_optimizer: a PipelineModule with tied layers on several "
            "stages cannot offload its optimizer yet; remove offload_optimizer or keep each "
            "tied key's layers on one stage"
        )
    if cfg.zero_optimization.stage == 3:  # before the units are chosen (DeepSpeed: at stage 3)
        apply_leaf_module_config(model, cfg.zero_optimization.leaf_module, warn=comm.rank == 0)
    plan = optimizer_plan(model, optimizer, model_parameters, cfg, comm.rank)
    # every rank agrees, before any bucket, master or store: [Note: the memory preflight]
    check_memory(model, cfg, plan.groups, plan.build, mesh, device)
    precision = cfg.precision_policy()
    zero = cfg.zero_optimization
    data_parallel = mesh.dp  # what ZeRO shards over and the data is split by
    auto = _auto_compression(cfg)
    section = cfg.comm_compression
    asked = section.auto or {section.gradients.method, section.parameters.method} != {"none"}
    if asked and data_parallel.world_size == 1 and comm.rank == 0:
        taken = f" (its {comm.world_size} ranks split the model)" if comm.world_size > 1 else ""
        warnings.warn(
            "zerotrain: comm_compression acts between data-parallel ranks, and this run has "
            f"one replica{taken}: nothing is compressed",
            stacklevel=2,
        )
    options = GroupOptions(
        policy=ZeroPolicy.for_stage(zero.stage),
        comm=data_parallel,
        precision=precision,
        bucket_numel=zero.reduce_bucket_size,
        stage3=Stage3Options(
            prefetch_numel=zero.stage3_prefetch_bucket_size,
            max_live_numel=zero.stage3_max_live_parameters,
            max_reuse_numel=zero.stage3_max_reuse_distance,
            persistence_threshold=zero.stage3_param_persistence_threshold,
            offload_param=_param_offload(cfg) if zero.stage == 3 else None,
            ranks_per_node=_secondary_partition(cfg),
        ),
        overlap_param_gather=zero.overlap_param_gather,
        comm_dtype=DTYPES[cfg.communication_data_type] if cfg.communication_data_type else None,
        offload=_offload_options(cfg, device),
        model_parallel=_model_parallel(mesh, tied),
        summed={**tied, **_sequence_summed(tensor_parallel)},
        chunks=model.chunks_of() if isinstance(model, PipelineModule) else {},
        compression=_gradient_compression(cfg) if auto is None else None,
        param_compression=_parameter_compression(cfg) if auto is None else auto.parameters,
        auto=auto,
    )
    try:
        specs = _shard_groups(model, plan.groups, options, mesh)
        zero_optimizer = ZeroOptimizer(
            model,
            specs,
            # [Note: the client's optimizer object] in optimizer_plan.py
            plan.factory(len(specs)),
            loss_scaler=_loss_scaler(cfg),
            gradient_clipping=cfg.gradient_clipping,
        )
        if tensor_parallel is not None and isinstance(zero_optimizer.optimizer, Lamb):
            raise ConfigError(
                "optimizer: LAMB's trust ratio needs each parameter's whole norm, and tensor "
                "parallelism (tensor_parallel.autotp_size > 1) splits parameters; use Adam or "
                "AdamW"
            )
        _broadcast_untrained_state(model, mesh)
        # Frozen parameters and buffers follow the training dtype too (trainable ones already
        # do, and were copied into fp32 masters before the cast).
        model.to(precision.param_dtype)
        scheduler = scheduler_for(lr_scheduler, cfg, zero_optimizer.optimizer, comm.rank)
        dataloader = _dataloader(training_data, cfg, data_parallel, collate_fn)
        pipeline: dict[str, Any] = {}
        if isinstance(model, PipelineModule):
            pipeline = {"pipe_comm": mesh.axis("pp"), "schedule": cfg.pipeline.schedule}
        engine = (PipelineEngine if pipeline else ZeroTrainEngine)(
            model,
            zero_optimizer,
            scheduler,
            cfg,
            comm,
            device,
            dataloader,
            raw_config=_raw_config(config, cfg),
            client_optimizer_name=type(optimizer).__name__ if optimizer is not None else None,
            tensor_parallel=tensor_parallel,
            expert_comm=mesh.axis("ep") if mesh.sizes["ep"] > 1 else None,
            **pipeline,
        )
    except BaseException:
        plan.give_back()  # the client's optimizer as it was given, not the failed engine's
        raise
    # DeepSpeed's choice (zerotrain/optimizer_plan.py); the engine holds the ZeroOptimizer
    return engine, returned_optimizer(zero_optimizer, cfg), dataloader, scheduler


# -- pieces of initialize ----------------------------------------------------------------------
def _expert_parallel(model: nn.Module, cfg: ZeroTrainConfig) -> int:
    """The expert-parallel degree of ``model``'s MoE layers (1 without any): one for all."""
    sizes = sorted({m.ep_size for m in model.modules() if isinstance(m, MoE)})
    if isinstance(model, PipelineModule) and any(Communicator().all_gather_object(bool(sizes))):
        # decided together: a stage builds only its own layers, and every rank must raise
        raise ConfigError(
            "MoE layers in a PipelineModule are not supported yet; train the MoE model without "
            "pipeline parallelism (expert and data parallelism, any ZeRO stage)"
        )
    if sizes and cfg.tensor_parallel.autotp_size > 1:
        raise ConfigError(
            "tensor_parallel.autotp_size: MoE layers with tensor parallelism are not supported "
            "yet; set autotp_size to 1 (expert parallelism spreads the experts instead)"
        )
    if sizes and cfg.lora_fa.enabled:
        raise ConfigError(
            "lora_fa: LoRA-FA adapters with MoE layers are not supported yet; disable lora_fa"
        )
    if len(sizes) > 1:
        raise ConfigError(
            f"MoE: layers with ep_size {sizes}; zerotrain places every MoE layer's experts over "
            "one expert-parallel group: give them one ep_size"
        )
    return sizes[0] if sizes else 1


def _shard_groups(
    model: nn.Module, groups: list[tuple[dict, NamedParams]], options: GroupOptions, mesh: Mesh
) -> list[ShardGroupSpec]:
    """The dense parameters, partitioned over the data-parallel group, and the experts', over
    the ranks holding the same experts (see [Note: several shard groups] in
    zero/optimizer.py): their gradients are averaged over every data-parallel rank, and the
    norm sums over the ranks holding other experts."""
    frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    of_experts = expert_tensors(model)

    def part(expert: bool) -> tuple[list[tuple[dict, NamedParams]], NamedParams]:
        mine = [
            (hyper, [(n, p) for n, p in named if (id(p) in of_experts) == expert])
            for hyper, named in groups
        ]
        return mine, [(n, p) for n, p in frozen if (id(p) in of_experts) == expert]

    dense, dense_frozen = part(expert=False)
    experts, experts_frozen = part(expert=True)
    if not any(named for _, named in experts):  # no trained expert: the dense group holds all
        if experts_frozen and mesh.sizes["ep"] > 1:
            raise ConfigError(
                "MoE: every expert parameter is frozen, with experts spread over ranks "
                f"(ep_size {mesh.sizes['ep']}); train some expert parameters, or use ep_size=1"
            )
        return [(options, dense, dense_frozen + experts_frozen)]
    axes = [axis for axis in ("pp", "ep") if mesh.sizes[axis] > 1]
    expert_options = replace(
        options,
        comm=mesh.expert_dp,
        average_over=mesh.dp.world_size,
        model_parallel=ModelParallel(mesh.axis(*axes), lambda _: 1) if axes else None,
    )
    return [(options, dense, dense_frozen), (expert_options, experts, experts_frozen)]


def _check_pipeline(cfg: ZeroTrainConfig, model: nn.Module) -> None:
    if not isinstance(model, PipelineModule) or model.num_stages * model.stages_per_rank == 1:
        return
    stages, schedule = model.num_stages, cfg.pipeline.schedule
    if cfg.zero_optimization.stage == 3:
        raise ConfigError(
            "zero_optimization.stage: 3 with pipeline parallelism is not supported: a stage "
            "runs many micro-batches per step, so its parameters are either kept gathered "
            "through the step (the peak of stage 2, which shards gradients and optimizer "
            "states too) or gathered twice per micro-batch (several times stage 2's traffic); "
            "use stage 2 (or 0, 1)"
        )
    placement = MULTI_STAGE_PLACEMENT.get(schedule)
    if placement is None and model.stages_per_rank > 1:
        raise ConfigError(
            f"pipeline.schedule: {schedule} runs one stage per rank, and the PipelineModule has "
            f"stages_per_rank={model.stages_per_rank}; use pipeline.schedule interleaved_1f1b "
            "(or zbv, with stage_placement='v')"
        )
    if placement is not None and (model.stages_per_rank == 1 or placement != model.stage_placement):
        per_rank = "stages_per_rank=2 (or more)" if placement == "loop" else "stages_per_rank=2"
        raise ConfigError(
            f"pipeline.schedule: {schedule} runs several stages per rank, placed "
            f"{placement!r}, and the PipelineModule has stages_per_rank="
            f"{model.stages_per_rank}, stage_placement={model.stage_placement!r}; build it "
            f"with {per_rank}, stage_placement={placement!r}"
        )
    looped = placement == "loop"
    micro_batches = cfg.batch_sizes().gradient_accumulation_steps
    if schedule == "1f1b" and micro_batches < stages:
        raise ConfigError(
            f"gradient_accumulation_steps: {micro_batches}, the micro-batches of a pipeline "
            f"step, must be at least the {stages} stages for the 1f1b schedule (more fill the "
            "pipeline better: its idle share is (stages - 1) / (micro-batches + stages - 1)); "
            "raise it, or use pipeline.schedule gpipe"
        )
    rounds = max(1, micro_batches // stages)
    if looped and micro_batches % rounds:
        raise ConfigError(
            f"gradient_accumulation_steps: {micro_batches} micro-batches run in {rounds} rounds "
            f"of the {stages} pipeline ranks under interleaved_1f1b, and must divide into them; "
            f"use a multiple of {stages} or fewer than {2 * stages}"
        )


def _model_parallel(mesh: Mesh, tied: dict[int, Communicator]) -> ModelParallel | None:
    """The group the gradient norm sums over beyond the data-parallel one: the pipeline stages
    and tensor-parallel peers. A parameter counts once: one whole on every tensor-parallel peer
    (or a tied layer's copy on several stages) counts 1/peers on each."""
    axes = [axis for axis in ("pp", "tp") if mesh.sizes[axis] > 1]
    if not axes:
        return None
    tp = mesh.sizes["tp"]

    def replicas(param: nn.Parameter) -> int:
        copies = tied[id(param)].world_size if id(param) in tied else 1
        return copies * (1 if is_split(param) else tp)

    return ModelParallel(mesh.axis(*axes), replicas)


def _sequence_summed(tensor_parallel: TensorParallel | None) -> dict[int, Communicator]:
    """Sequence parallelism's parameters: their gradients are summed over the tp group."""
    if tensor_parallel is None:
        return {}
    return {id(p): tensor_parallel.comm for p in tensor_parallel.summed}


def _tensor_parallel(model: nn.Module, cfg: ZeroTrainConfig, mesh: Mesh) -> TensorParallel | None:
    """Split ``model`` over the mesh's tensor-parallel axis (None: no tensor parallelism)."""
    section = cfg.tensor_parallel
    if section.autotp_size == 1:
        for key in ("tp_plan", "sequence_parallel"):
            if getattr(section, key) not in (None, False):
                raise ConfigError(
                    f"tensor_parallel.{key}: given, but autotp_size is 1 (nothing is split); "
                    f"set autotp_size to the tensor-parallel degree or remove {key}"
                )
        return None
    if cfg.lora_fa.enabled:
        raise ConfigError(
            "tensor_parallel.autotp_size: LoRA-FA adapters (lora_fa.enabled) with tensor "
            "parallelism are not supported; use one of them"
        )
    stages = mesh.axis("pp") if isinstance(model, PipelineModule) else None
    options = {"sequence_parallel": section.sequence_parallel, "check_inputs": section.check_inputs}
    return parallelize(model, mesh.axis("tp"), section.tp_plan, stages, **options)


def _broadcast_untrained_state(model: nn.Module, mesh: Mesh) -> None:
    """The frozen parameters and buffers of the data-parallel group's first rank to its other
    ranks, an expert's over the ranks holding that expert (trainable ones and frozen ones that
    stage 3 partitions, which the engine owns, are broadcast as their buckets are built), so
    all replicas start identical even without a shared seed."""
    of_experts = expert_tensors(model)
    frozen = [p for p in model.parameters() if not p.requires_grad and owner_of(p) is None]
    for tensor in frozen + list(model.buffers()):
        comm = mesh.expert_dp if id(tensor) in of_experts else mesh.dp
        comm.broadcast(tensor.data, src=comm.root)


def _convert_to_lora_fa(
    model: nn.Module, cfg: ZeroTrainConfig, optimizer, model_parameters, rank: int
) -> Iterable[Any] | None:
    """The config's ``lora_fa``: adapt the model's target layers, freeze the rest. Returns the
    parameters to train: ``model_parameters`` given as the model's trainable (or all)
    parameters, as HF's Trainer passes them, become the adapters."""
    section = cfg.lora_fa
    before = [p for p in model.parameters() if p.requires_grad]
    given = None if model_parameters is None else list(model_parameters)
    if given is not None:  # parameters, or groups of them
        given = [
            p for item in given for p in (item["params"] if isinstance(item, dict) else [item])
        ]
    taken_before = isinstance(optimizer, torch.optim.Optimizer) or (
        given is not None
        and {id(p) for p in given}
        not in ({id(p) for p in before}, {id(p) for p in model.parameters()})
    )
    if taken_before:
        argument = (
            "optimizer" if isinstance(optimizer, torch.optim.Optimizer) else "model_parameters"
        )
        raise ConfigError(
            "lora_fa.enabled: initialize adapts the model's layers, but "
            f"initialize({argument}=...) holds parameters chosen before; use the config's "
            "optimizer section (or pass an optimizer factory), or call "
            "zerotrain.lora.apply_lora_fa(model, ...) before building the optimizer and leave "
            "lora_fa out of the config"
        )
    adapted = apply_lora_fa(model, section.target_modules, r=section.r, alpha=section.alpha)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if rank == 0:
        total = sum(full_shape(p).numel() for p in model.parameters())  # Init chunks too
        print(
            f"zerotrain: lora_fa adapted {len(adapted)} layers (r {section.r}, alpha "
            f"{section.alpha:g}): {sum(p.numel() for p in trainable):,} of {total:,} parameters "
            "train",
            flush=True,
        )
    return None if given is None else trainable


def _config_from_args(args, config):
    if args is None:
        return config
    given = (getattr(args, k, None) for k in ("deepspeed_config", "zerotrain_config"))
    paths = {path for path in given if path is not None}
    if len(paths) > 1:
        raise ConfigError(
            f"--deepspeed_config and --zerotrain_config name different files ({sorted(paths)}); "
            "pass one"
        )
    if paths and config is not None:
        raise ConfigError(
            f"the config is given twice: initialize(config=...) and --deepspeed_config "
            f"{paths.pop()}; pass one"
        )
    return paths.pop() if paths else config


def _training_device() -> torch.device:
    accelerator = get_accelerator()
    if accelerator.device_name() == "cuda":  # CUDA only: one GPU per local rank
        return torch.device("cuda", local_rank() % accelerator.device_count())
    return torch.device("cpu")


_MPU_SIZES = (
    "get_model_parallel_world_size",
    "get_tensor_model_parallel_world_size",
    "get_pipeline_model_parallel_world_size",
)


def check_mpu(mpu, caller: str = "initialize") -> None:
    """An mpu (Megatron's model-parallel unit) is accepted when every model-parallel size it
    reports is 1: the data-parallel group is then the whole world, as zerotrain assumes."""
    sizes = {name: getattr(mpu, name)() for name in _MPU_SIZES if hasattr(mpu, name)}
    if not sizes:
        raise ConfigError(
            f"{caller}(mpu=...): the mpu has none of "
            f"{', '.join(_MPU_SIZES)}; pass mpu=None (zerotrain is data-parallel)"
        )
    parallel = {name: size for name, size in sizes.items() if size != 1}
    if parallel:
        shown = ", ".join(f"{name}() = {size}" for name, size in parallel.items())
        raise ConfigError(
            f"{caller}(mpu=...): tensor and pipeline model parallelism ({shown}) are not "
            "supported yet; train with model-parallel size 1"
        )


def _raw_config(config, cfg: ZeroTrainConfig) -> dict:
    """``engine.config``: the caller's own dict (DeepSpeed keeps that very object), the file's
    mapping for a path, or the typed config's values."""
    if isinstance(config, dict):
        return config
    if isinstance(config, (str, os.PathLike)):
        return read_config_file(Path(config))
    return cfg.model_dump()


def _check_node_local_storage(cfg: ZeroTrainConfig, comm: Communicator) -> None:
    """Node-local checkpoint storage holds on one node, where every rank shares the disk."""
    if not cfg.checkpoint.use_node_local_storage:
        return
    hosts = set(comm.all_gather_object(socket.gethostname()))
    if len(hosts) > 1:
        raise ConfigError(
            f"checkpoint.use_node_local_storage: true asks to load checkpoints without a "
            f"filesystem shared by the {len(hosts)} nodes of this job, which zerotrain does not "
            "do yet (every rank reads the shards it needs, wherever they were written); put "
            "save_dir on a shared filesystem and set it to false"
        )


def _check_offload(cfg: ZeroTrainConfig, rank: int) -> None:
    """Below stage 3 offload_param is not read, as in DeepSpeed: say so."""
    zero = cfg.zero_optimization
    if zero.stage < 3 and zero.offload_param.device != "none" and rank == 0:
        warnings.warn(
            f"zero_optimization.offload_param.device: {zero.offload_param.device} is ignored at "
            f"stage {zero.stage}: only stage 3 partitions parameters (as in DeepSpeed); use "
            "offload_optimizer to move the optimizer states",
            stacklevel=3,
        )


def _aio_options(cfg: ZeroTrainConfig) -> AioOptions:
    return AioOptions(
        block_size=cfg.aio.block_size,
        queue_depth=cfg.aio.queue_depth,
        thread_count=cfg.aio.intra_op_parallelism,
    )


def _param_offload(cfg: ZeroTrainConfig) -> ParamOffload:
    """The `offload_param` section as stage 3 takes it."""
    section = cfg.zero_optimization.offload_param
    return ParamOffload(
        device=section.device,
        pin_memory=section.pin_memory,
        nvme_path=section.nvme_path,
        buffer_count=section.buffer_count,
        buffer_size=section.buffer_size,
        aio=_aio_options(cfg),
    )


def _offload_options(cfg: ZeroTrainConfig, device: torch.device) -> OffloadOptions | None:
    """The `offload_optimizer` section as the shard group takes it (None: not offloaded)."""
    zero = cfg.zero_optimization
    section = zero.offload_optimizer
    if section.device == "none":
        return None
    return OffloadOptions(
        device=section.device,
        ratio=section.ratio,
        pin_memory=section.pin_memory,
        buffer_count=section.buffer_count,
        nvme_path=section.nvme_path,
        sub_group_size=zero.sub_group_size,
        device_budget=lambda: device_budget(device),
        aio=_aio_options(cfg),
    )


def _ranks_per_node(cfg: ZeroTrainConfig) -> int:
    """The ranks of a node for hpZ and the gradients' hierarchy: as configured, or torchrun's."""
    return cfg.comm_compression.hierarchical_partition_size or local_ranks()


def _secondary_partition(cfg: ZeroTrainConfig) -> int:
    """The ranks of each hpZ partition (0: no hpZ)."""
    return _ranks_per_node(cfg) if cfg.comm_compression.hierarchical_partition else 0


def _gradient_compression(cfg: ZeroTrainConfig) -> GradientCompression | None:
    """The `comm_compression.gradients` section as the reductions take it (None: off). A
    1-bit optimizer adds its exact steps (zerotrain/zero/group.py, from the optimizer built)."""
    section = cfg.comm_compression.gradients
    return None if section.method == "none" else _gradient_options(cfg)


def _gradient_options(cfg: ZeroTrainConfig) -> GradientCompression:
    """`comm_compression.gradients` as a policy, with ``hierarchical``'s ranks per node."""
    options = cfg.comm_compression.gradients.model_dump()
    ranks_per_node = _ranks_per_node(cfg) if options.pop("hierarchical") else 0
    return GradientCompression(**options, ranks_per_node=ranks_per_node)


def _parameter_compression(cfg: ZeroTrainConfig) -> ParameterCompression | None:
    """The `comm_compression.parameters` section as the parameter gathers take it."""
    section = cfg.comm_compression.parameters
    if section.method == "none":
        return None
    return ParameterCompression(**section.model_dump())


def _auto_compression(cfg: ZeroTrainConfig) -> AutoOptions | None:
    """`comm_compression.auto`: the policies to choose among (None: auto is off). The
    configured methods, each on or off; with none configured, the stage's defaults (see the
    `auto` key's docs)."""
    section = cfg.comm_compression
    if not section.auto:
        return None
    gradients, parameters = _gradient_compression(cfg), _parameter_compression(cfg)
    if gradients is None and parameters is None:
        stage = cfg.zero_optimization.stage
        # int8, not PowerSGD, whose rank 4 ended the demo GPT 12.1% above uncompressed
        # under AdamW (docs/compression.md): auto changes the speed, not how well it trains
        gradients = replace(_gradient_options(cfg), method=AUTO_DEFAULT_METHOD)
        if stage > 0:
            parameters = replace(
                ParameterCompression(**section.parameters.model_dump()), method=AUTO_DEFAULT_METHOD
            )
    return AutoOptions(
        policies=candidate_policies(gradients, parameters),
        recheck_steps=section.auto_recheck_steps,
    )


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's generators (the config's `seed`; DeepSpeed's
    ``runtime.utils.set_random_seed``). numpy takes the seed modulo 2**32."""
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    torch.manual_seed(seed)


def _loss_scaler(cfg: ZeroTrainConfig) -> LossScaler:
    fp16 = cfg.fp16
    if not fp16.enabled:
        return LossScaler()
    if fp16.loss_scale:  # static
        return LossScaler(scale=fp16.loss_scale)
    return LossScaler(
        scale=2.0**fp16.initial_scale_power,
        dynamic=True,
        scale_window=fp16.loss_scale_window,
        hysteresis=fp16.hysteresis,
        min_scale=fp16.min_loss_scale,
        consecutive_hysteresis=fp16.consecutive_hysteresis,
    )


def _dataloader(training_data, cfg: ZeroTrainConfig, comm: Communicator, collate_fn):
    if training_data is None:
        return None
    seed = cfg.seed or 0
    sampler = ResumableDistributedSampler(
        training_data, comm.world_size, comm.rank, shuffle=True, seed=seed
    )
    return ResumableDataLoader(
        training_data,
        batch_size=cfg.train_micro_batch_size_per_gpu,
        sampler=sampler,
        drop_last=cfg.dataloader_drop_last,
        collate_fn=collate_fn,
        # its own generator: creating an iterator then draws no number from torch's global
        # generator, which a resumed run must find where the checkpoint left it (dropout)
        generator=torch.Generator().manual_seed(seed),
    )
