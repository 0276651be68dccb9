"""``initialize`` and the argparse helpers: the DeepSpeed-compatible entry points."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import random
import socket
import sys
import warnings
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from zerotrain import activation_checkpointing as checkpointing
from zerotrain.accelerator import get_accelerator, settle_host_math
from zerotrain.comm import CommsLog, Communicator, init_distributed, is_initialized, local_rank
from zerotrain.config import ConfigError, ZeroTrainConfig, load_config, read_config_file
from zerotrain.data import ResumableDataLoader, ResumableDistributedSampler, SiteShareBatches
from zerotrain.engine import ZeroTrainEngine
from zerotrain.estimate.preflight import check_memory
from zerotrain.observability.monitor import check_monitor_packages
from zerotrain.optimizer_plan import (
    OptimizerPlan,
    optimizer_plan,
    returned_optimizer,
    scheduler_for,
)
from zerotrain.parallel import ParallelLayout, model_stages
from zerotrain.pipe.checks import check_pipeline
from zerotrain.pipe.engine import PipelineEngine
from zerotrain.plan.advice import advise_on_first_forward, prepare_advice
from zerotrain.plan.auto_batch import choose_micro_batch, sequence_length, wants_auto_micro_batch
from zerotrain.policies import group_options, loss_scaler
from zerotrain.sequence.batch import SequenceShards
from zerotrain.sequence.transform import sequence_group_of
from zerotrain.zero import ZeroOptimizer
from zerotrain.zero.init import owner_of
from zerotrain.zero.leaf_modules import apply_leaf_module_config


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
) -> tuple[
    ZeroTrainEngine,
    ZeroOptimizer | torch.optim.Optimizer | None,
    DataLoader | SequenceShards | None,
    Any,
]:
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
    _check_arguments(mpu, mesh_param)
    settle_host_math()  # before the first forward pass
    config = _config_from_args(args, config if config is not None else config_params)
    comm, device = _world(dist_init_required, distributed_port)
    config = _choose_micro_batch(config, model, training_data, comm)
    sequence_group = sequence_group_of(mpu)
    # the batch keys count data-parallel ranks: the world over the stages (and over the
    # tensor- and sequence-parallel degrees, which the config itself knows)
    cfg = load_config(
        config,
        world_size=comm.world_size // model_stages(model),
        sequence_parallel_size=sequence_group.world_size if sequence_group else None,
    )
    _prepare_run(cfg, model, comm)
    layout, model_parameters = ParallelLayout.build(
        model,
        cfg,
        comm,
        device,
        optimizer=optimizer,
        model_parameters=model_parameters,
        sequence_group=sequence_group,
    )
    if cfg.zero_optimization.stage == 3:  # before the units are chosen (DeepSpeed: at stage 3)
        apply_leaf_module_config(model, cfg.zero_optimization.leaf_module, warn=comm.rank == 0)
    if model_stages(model) > 1:
        # split_model's trace leaves the whole model in reference cycles: free the other
        # stages' layers before the preflight counts memory and the engine allocates
        gc.collect()
    plan = optimizer_plan(model, optimizer, model_parameters, cfg, comm.rank)
    # every rank agrees, before any bucket, master or store: [Note: the memory preflight]
    check_memory(model, cfg, plan.groups, plan.build, layout.mesh, device)
    advice = _advice(model, cfg, config, optimizer, layout) if comm.rank == 0 else None
    try:
        zero_optimizer = _zero_optimizer(model, cfg, layout, plan, device, comm)
        scheduler = scheduler_for(lr_scheduler, cfg, zero_optimizer.optimizer, comm.rank)
        dataloader = _dataloader(training_data, cfg, layout, collate_fn)
        engine = _engine_class(layout, cfg)(
            *(model, zero_optimizer, scheduler, cfg, comm, device, dataloader),
            layout=layout,
            raw_config=_raw_config(config, cfg),
            client_optimizer_name=type(optimizer).__name__ if optimizer is not None else None,
        )
    except BaseException:
        plan.give_back()  # the client's optimizer as it was given, not the failed engine's
        raise
    if advice is not None:  # [Note: initialize's advice] in zerotrain/plan/advice.py
        advise_on_first_forward(engine.module, advice)
    # DeepSpeed's choice (zerotrain/optimizer_plan.py); the engine holds the ZeroOptimizer
    return engine, returned_optimizer(zero_optimizer, cfg), dataloader, scheduler


# -- pieces of initialize ----------------------------------------------------------------------
def _prepare_run(cfg: ZeroTrainConfig, model: nn.Module, comm: Communicator) -> None:
    """What the config asks before the model is touched: its checks (every rank fails alike,
    before any work), the log level, DeepSpeed's version line, the seed, the comms log and the
    activation-checkpointing policy."""
    check_pipeline(cfg, model)
    check_monitor_packages(cfg)
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
        checkpointing.use_for_transformers(model)  # its gradient checkpointing follows it
    if any(owner_of(p) is not None for p in model.parameters()):
        raise ValueError(
            "zerotrain.initialize: this model is already wrapped by an engine (its parameters "
            "are views into that engine's buffers); build a new model, or keep the first engine"
        )


def _zero_optimizer(
    model: nn.Module,
    cfg: ZeroTrainConfig,
    layout: ParallelLayout,
    plan: OptimizerPlan,
    device: torch.device,
    comm: Communicator,
) -> ZeroOptimizer:
    """The shard groups the layout makes of the plan's optimizer groups, under one
    ZeroOptimizer; the model's untrained state made equal on the replicas and cast."""
    options = group_options(cfg, model, device, layout.zero, comm)
    specs = layout.shard_group_specs(plan.groups, options)
    zero_optimizer = ZeroOptimizer(
        model,
        specs,
        plan.factory(len(specs)),  # [Note: the client's optimizer object] in optimizer_plan.py
        loss_scaler=loss_scaler(cfg),
        gradient_clipping=cfg.gradient_clipping,
    )
    layout.check_optimizer(zero_optimizer.optimizer)
    layout.broadcast_untrained_state()
    # Frozen parameters and buffers follow the training dtype too (trainable ones already do,
    # and were copied into fp32 masters before the cast).
    model.to(cfg.precision_policy().param_dtype)
    return zero_optimizer


def _engine_class(layout: ParallelLayout, cfg: ZeroTrainConfig) -> Callable[..., ZeroTrainEngine]:
    """The engine for the layout: a pipeline's runs the schedule over its stages."""
    if layout.stages is None:
        return ZeroTrainEngine
    return partial(PipelineEngine, pipe_comm=layout.stages, schedule=cfg.pipeline.schedule)


def _check_arguments(mpu: Any, mesh_param: Any) -> None:
    if mesh_param is not None:
        raise ConfigError(
            "initialize(mesh_param=...): a model-parallel device mesh is not supported yet; pass "
            "None"
        )
    if mpu is not None:
        check_mpu(mpu)


def _world(dist_init_required: bool | None, port: int) -> tuple[Communicator, torch.device]:
    """The world communicator (the default process group, made here unless the caller made it
    or says not to) and this rank's training device."""
    if dist_init_required is not False and not is_initialized():
        init_distributed(distributed_port=port, verbose=False)
    device = _training_device()
    return Communicator(device=device), device


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


def _choose_micro_batch(config, model: nn.Module, training_data, comm: Communicator):
    """``config`` with a ``"auto"`` micro-batch chosen by the planner ([Note: "auto"
    micro-batches] in zerotrain/plan/auto_batch.py): rank 0 chooses, every rank takes its
    choice, or raises its error."""
    raw = read_config_file(Path(config)) if isinstance(config, (str, os.PathLike)) else config
    if not wants_auto_micro_batch(raw):
        return config
    decision: tuple[dict, str] | str = ""  # rank 0's is the one taken
    failed: Exception | None = None
    if comm.rank == 0:
        try:
            decision = choose_micro_batch(
                raw,
                model,
                world=comm.world_size // model_stages(model),
                ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                seq_len=sequence_length(model, training_data),
                pipelined=model_stages(model) > 1,
            )
        except Exception as error:  # noqa: BLE001 (told to every rank, raised as it is here)
            failed = error
            decision = str(error) if isinstance(error, ConfigError) else repr(error)
    decision = comm.all_gather_object(decision)[0]
    if failed is not None:
        raise failed
    if isinstance(decision, str):
        raise ConfigError(f'rank 0 could not choose the "auto" micro-batch: {decision}')
    resolved, line = decision
    if comm.rank == 0:  # a choice made for the user: said where the step lines go
        print(line, flush=True)
    return resolved


def _advice(model: nn.Module, cfg: ZeroTrainConfig, config, optimizer, layout: ParallelLayout):
    """What the first forward checks the config against (None: nothing the planner plans),
    taken before the model is wrapped: stage 3 partitions its parameters."""
    if isinstance(optimizer, torch.optim.Optimizer):
        optimizer_type = type(optimizer).__name__
    elif optimizer is None and cfg.optimizer is not None:
        optimizer_type = cfg.optimizer.type
    else:
        optimizer_type = None  # a callable builds it: its state is not known here
    # a typed config's own keys (its defaults dumped too would not pass the config check)
    typed = isinstance(config, ZeroTrainConfig)
    raw = config.model_dump(exclude_unset=True) if typed else _raw_config(config, cfg)
    return prepare_advice(
        model,
        cfg,
        raw,
        optimizer_type=optimizer_type,
        world=layout.mesh.sizes["dp"],  # not mesh.dp: its group is made on first use, by all
        ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        parallel_sizes=layout.mesh.sizes,
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


def _dataloader(training_data, cfg: ZeroTrainConfig, layout: ParallelLayout, collate_fn):
    """The data split over the data-parallel ranks; with sequence parallelism every batch is
    cut along its sequence for the rank's share (zerotrain/sequence/batch.py)."""
    if training_data is None:
        return None
    comm = layout.dp
    seed = cfg.seed or 0
    split = layout.work_split
    if split is None:
        sampler = ResumableDistributedSampler(
            training_data, comm.world_size, comm.rank, shuffle=True, seed=seed
        )
        batching: dict = {"batch_size": cfg.train_micro_batch_size_per_gpu, "sampler": sampler}
        batching["drop_last"] = cfg.dataloader_drop_last
    else:  # the same order, each micro-step's global batch shared out by the sites' speeds
        order = ResumableDistributedSampler(
            training_data, split.global_batch, 0, shuffle=True, seed=seed
        )
        accumulation = cfg.batch_sizes().gradient_accumulation_steps
        shares = SiteShareBatches(order, split, layout.mesh.dp.rank, accumulation)
        batching = {"batch_sampler": shares}
    loader = ResumableDataLoader(
        training_data,
        **batching,
        collate_fn=collate_fn,
        # its own generator: creating an iterator then draws no number from torch's global
        # generator, which a resumed run must find where the checkpoint left it (dropout)
        generator=torch.Generator().manual_seed(seed),
    )
    if hasattr(training_data, "__len__") and len(loader) == 0 and comm.rank == 0:
        dropped = ""
        if cfg.dataloader_drop_last:
            dropped = ", the last partial batch dropped (dataloader_drop_last)"
        warnings.warn(
            f"initialize: training_data has {len(training_data)} samples, so the dataloader "
            f"yields no batch (micro-batch {cfg.train_micro_batch_size_per_gpu} on each of "
            f"{comm.world_size} data-parallel ranks{dropped}): a training loop over it does "
            "nothing; check the dataset",
            stacklevel=3,  # initialize's caller
        )
    if layout.sequence.world_size > 1:
        return SequenceShards(loader, layout.sequence)
    return loader
