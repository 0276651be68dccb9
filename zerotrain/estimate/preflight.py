"""The memory preflight of ``initialize``: a run that does not fit is refused on every rank
alike, before anything large is allocated.

[Note: the memory preflight]
Once the config is loaded and the model's parameters are known, and before any bucket, fp32
master, optimizer state or offload store exists, each rank estimates what it will hold with
the estimator's own formula (zerotrain/estimate/stages.py: ZeRO's model states, stage 3's
gathered parameters, the step's fp32 gradients, and the host bytes optimizer and parameter
offload allocate) for its model (whole sizes, also of ``zero.Init`` chunks), the config's
stage, precision and offload, and the optimizer it will build (asked on one-element
stand-ins). It reads the limits it has: the free memory of its CUDA device; on the host
MemAvailable, every memory cgroup from its own up to the root, and RLIMIT_AS
(zerotrain.accelerator.host_memory_limits). On a CPU-only run the host holds the model states
too. The ranks gather these numbers (one ``all_gather_object``) and each computes the same
verdict from them (zerotrain/estimate/verdict.py): a limit is divided among the ranks that
share it, the memory the model's own tensors hold now counts as available (the buckets take
their place), and the changes of the config offered are those that fit on every rank. Every
rank raises the same ConfigError, so no rank is left waiting in a collective for one that
refused.

Left out, so that the preflight errs on the side of running: activations (it does not know the
batch), the gradient bucket being reduce-scattered at stages 2-3, workspaces and allocator
fragmentation; expert parameters are counted as partitioned over every data-parallel rank,
though their group is smaller.
"""

from __future__ import annotations

import socket
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from zerotrain.accelerator import host_memory_limits
from zerotrain.comm import Mesh
from zerotrain.config import ConfigError, ZeroTrainConfig
from zerotrain.estimate.model import ParameterCount, count_parameters
from zerotrain.estimate.stages import (
    NOT_ON_NVME,
    TrainingJob,
    estimate,
    memory_options,
    more_ranks,
    rank_needs,
)
from zerotrain.estimate.verdict import Limit, RankMemory, shortfall
from zerotrain.optim import NoOptimizer
from zerotrain.optim.muon import Muon
from zerotrain.optim.state_bytes import optimizer_state_bytes_per_element
from zerotrain.precision import dtype_name
from zerotrain.zero.compression_options import compression_policies
from zerotrain.zero.group import OptimizerFactory
from zerotrain.zero.layout import NamedParams
from zerotrain.zero.offload import (
    device_budget,
    device_bytes_per_element,
    probe_optimizer,
    probe_stand_ins,
)
from zerotrain.zero.store import OptimizerOver, needs_whole_parameters

__all__ = ["check_memory", "config_job", "job_of", "optimizer_state"]


def check_memory(
    model: nn.Module,
    cfg: ZeroTrainConfig,
    groups: list[tuple[dict, NamedParams]],
    make_optimizer: OptimizerFactory,
    mesh: Mesh,
    device: torch.device,
) -> None:
    """Refuse, with the same ConfigError on every rank of ``mesh``, a run that some rank cannot
    hold (see [Note: the memory preflight]). ``groups`` and ``make_optimizer``: the optimizer
    groups and the optimizer's builder, as the shard groups will take them; ZeRO partitions
    over ``mesh``'s data-parallel axis. Collective."""

    def optimizer_over(masters: list[list[torch.Tensor]], probe: bool = False):
        hyper = [h for h, _ in groups]
        return make_optimizer(
            [{**h, "params": m} for h, m in zip(hyper, masters, strict=True)], None
        )

    job = job_of(
        model, cfg, optimizer_over, len(groups), data_parallel=mesh.zero.world_size, device=device
    )
    comm = mesh.world
    mine = None if job is None else _rank_memory(job, model, comm.rank, device)
    ranks = [r for r in comm.all_gather_object(mine) if r is not None]
    message = shortfall(ranks) if ranks else None
    if message is not None:
        raise ConfigError(message)


def job_of(
    model: nn.Module,
    cfg: ZeroTrainConfig,
    optimizer_over: OptimizerOver,
    groups: int,
    *,
    data_parallel: int,
    device: torch.device,
) -> TrainingJob | None:
    """This rank's training as the estimator models it (None: nothing to check: no trainable
    parameter, or a combination the store builders refuse with their own message)."""
    zero = cfg.zero_optimization
    count = count_parameters(model, persistence_threshold=zero.stage3_param_persistence_threshold)
    if count.trainable == 0:
        return None
    optimizer = optimizer_state(optimizer_over, groups, count)
    return config_job(count, cfg, optimizer=optimizer, data_parallel=data_parallel, device=device)


def optimizer_state(
    optimizer_over: OptimizerOver, groups: int, count: ParameterCount
) -> tuple[str, float]:
    """The optimizer ``optimizer_over`` builds, as the estimator prices it: its kind (a key of
    OPTIMIZER_STATE_BYTES: ``lamb`` where it needs whole parameters, ``muon``, else ``adam``)
    and its bytes of state per element of ``count``'s trainable parameters."""
    whole, state_bytes = _optimizer_state(optimizer_over, groups)
    if state_bytes is None:  # Muon: its matrices' momentum, AdamW's moments for the rest
        return "muon", count.muon_state_bytes()
    return ("lamb" if whole else "adam"), state_bytes


def config_job(
    count: ParameterCount,
    cfg: ZeroTrainConfig,
    *,
    optimizer: tuple[str, float],
    data_parallel: int,
    device: torch.device,
    **settings: Any,
) -> TrainingJob | None:
    """The estimator's job for ``count``'s parameters trained as ``cfg`` says (its stage,
    precision policy, optimizer and parameter offload and their sizes) over ``data_parallel``
    ranks, with ``optimizer`` (:func:`optimizer_state`) stepping them and the estimator's other
    fields from ``settings`` (the activations' shape); None where the stores refuse the
    combination (an optimizer that needs whole parameters on NVMe)."""
    zero = cfg.zero_optimization
    kind, state_bytes = optimizer
    offload = zero.offload_optimizer.device
    if kind in NOT_ON_NVME and offload == "nvme":  # NvmePlacement refuses it, naming Lamb
        return None
    policy = cfg.precision_policy()
    job = TrainingJob.for_model(
        count,
        gpus_per_node=data_parallel,
        dtype=policy.name,
        grad_accum_dtype=cfg.data_types.grad_accum_dtype,  # counted in the gradients' bytes
        master_dtype=dtype_name(policy.master_dtype),
        optimizer_state_dtype=dtype_name(policy.state_dtype),
        optimizer=kind,
        optimizer_state_bytes=state_bytes,
        offload=None if offload == "none" else offload,
        offload_param=None if zero.offload_param.device == "none" else zero.offload_param.device,
        param_buffer_count=zero.offload_param.buffer_count,
        stages=(zero.stage,),
        quantized_gather=any(p.parameters is not None for p in compression_policies(cfg)),
        max_live_numel=zero.stage3_max_live_parameters,
        reduce_bucket_size=zero.reduce_bucket_size,
        buffer_count=zero.offload_optimizer.buffer_count,
        sub_group_size=zero.sub_group_size,
        **settings,
    )
    ratio = zero.offload_optimizer.ratio
    return replace(job, offload_ratio=_auto_ratio(job, device) if ratio == "auto" else ratio)


def _optimizer_state(optimizer_over: OptimizerOver, groups: int) -> tuple[bool, float | None]:
    """Whether the optimizer needs whole parameters (Lamb), and its bytes of state per
    element: from its class where known, else from one step over one-element stand-ins;
    None for Muon, whose figure depends on which parameters are its matrices."""
    try:
        probe = optimizer_over([[torch.zeros(1)] for _ in range(groups)], probe=True)
        if isinstance(probe, NoOptimizer):  # forward passes only
            return False, 0
        if isinstance(probe, Muon):
            return True, None
        state_bytes = optimizer_state_bytes_per_element(probe, unknown=-1, stand_ins=True)
        if state_bytes < 0:  # an optimizer of its own: step it once to see its state
            probe = probe_optimizer(optimizer_over, probe_stand_ins(groups))
            state_bytes = optimizer_state_bytes_per_element(probe, unknown=8, stand_ins=True)
    except Exception:  # noqa: BLE001 (a builder of the user's that wants real tensors)
        # the check goes on with Adam's figure; building the real optimizer will say what
        # is wrong with it, if anything is
        return False, 8
    return needs_whole_parameters(probe), state_bytes


def _auto_ratio(job: TrainingJob, device: torch.device) -> float:
    """``ratio: "auto"``'s share on the host: what the device's budget does not keep (the
    store decides bucket by bucket, zerotrain/zero/offload.py's fit_on_device)."""
    budget = device_budget(device)
    if budget is None:
        return 1.0
    per_element = device_bytes_per_element(
        job.precision.stored_state_bytes(job.state_bytes), job.precision
    )
    partition = -(-job.trainable_params // job.world_size)
    return min(1.0, max(0.0, 1.0 - budget / max(1, per_element * partition)))


def _rank_memory(job: TrainingJob, model: nn.Module, rank: int, device: torch.device) -> RankMemory:
    """What this rank needs and has, and what it would need with each change offered."""
    on_host = device.type != "cuda"  # CUDA-only below: a device of its own
    stage = job.stages[0]
    (row,) = estimate(job)
    device_need, host_need = rank_needs(job, row, on_host=on_host)
    host = socket.gethostname()
    scopes = {"node": f"node {host}", "process": f"rank {rank}"}
    host_limits = tuple(
        Limit(lim.nbytes, lim.what, scopes.get(lim.scope, f"{lim.scope} {host} {lim.what}"))
        for lim in host_memory_limits()
    )
    device_limits: tuple[Limit, ...] = ()
    if not on_host:  # CUDA-only
        free, _ = torch.cuda.mem_get_info(device)
        device_limits = (Limit(free, f"free on {device}", f"device {host} {device}"),)
    return RankMemory(
        rank=rank,
        device=device_need,
        host=host_need,
        device_limits=device_limits,
        host_limits=host_limits,
        device_held=0.0 if on_host else _held(model, device),
        host_held=_held(model, torch.device("cpu")) if on_host else 0.0,
        options=tuple(memory_options(job, stage, on_host=on_host)),
        more_ranks=more_ranks(job, stage, on_host=on_host) if stage > 0 else (),
    )


def _held(model: nn.Module, device: torch.device) -> float:
    """Bytes the model's parameters and buffers hold on ``device`` now, each storage once."""
    seen: dict[int, int] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.device.type == device.type and tensor.device.index == device.index:
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return float(sum(seen.values()))
