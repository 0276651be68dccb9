"""The configs the planner weighs: each a tensor-, pipeline- or sequence-parallel degree, a ZeRO
stage, an offload device, activation checkpointing on or off and a micro-batch, over the
launch's ranks; the keys a user fixed in ``--config`` hold in every one."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from zerotrain.plan.autotuning import read_autotuning

if TYPE_CHECKING:
    from zerotrain.plan.pipeline_share import PipelineShare

__all__ = [
    "Candidate",
    "batch_per_rank",
    "batch_sharing_degrees",
    "enumerate_candidates",
    "fixed_keys",
    "micro_batches",
    "training_dtype",
    "without_choices",
]

OFFLOADS = (None, "cpu", "nvme")


@dataclass(frozen=True)
class Candidate:
    """One config: ``micro_batch`` samples per data-parallel rank and ``accumulation``
    micro-batches per optimizer step, over ``world`` ranks in groups of ``tp`` tensor-parallel
    peers (neighbours), which read the same samples, and ``pp`` pipeline stages (the model cut
    by ``split_points``, run under 1F1B: each stage's ranks train its share), or groups of
    ``sp`` sequence-parallel peers (neighbours), which hold shares of the same samples' tokens
    (Ulysses)."""

    stage: int
    offload: str | None
    activation_checkpointing: bool
    micro_batch: int
    accumulation: int
    world: int
    tp: int = 1
    pp: int = 1
    split_points: tuple[str, ...] = ()
    """Where the pipeline's stages after the first start (modules of the model)."""
    sp: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel ranks: what the batch is split over."""
        return self.world // (self.tp * self.pp * self.sp)

    @property
    def shards(self) -> int:
        """The ranks ZeRO shards over: the data-parallel ones and their sequence-parallel
        peers, which hold the same parameters."""
        return self.dp * self.sp

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulation * self.dp

    def label(self) -> str:
        parts = [f"tp {self.tp}"] if self.tp > 1 else []
        parts += [f"pp {self.pp}"] if self.pp > 1 else []
        parts += [f"sp {self.sp}"] if self.sp > 1 else []
        parts.append(f"stage {self.stage}")
        if self.offload:
            parts.append(f"offload {self.offload}")
        if self.activation_checkpointing:
            parts.append("checkpointing")
        parts.append(f"micro-batch {self.micro_batch} x {self.accumulation}")
        return ", ".join(parts)

    def config(self, base: dict, nvme_path: str | None = None) -> dict:
        """The ds_config: ``base`` (the user's, kept) with this candidate's keys."""
        out = copy.deepcopy(base)
        out.pop("autotuning", None)  # the plan is the tuning's result: training never reads it
        # a base without an optimizer gets DeepSpeed's usual one, which the cost model then
        # prices (a script that passes its own optimizer to initialize overrides it)
        out.setdefault("optimizer", {"type": "AdamW", "params": {"lr": 1e-3}})
        out["train_micro_batch_size_per_gpu"] = self.micro_batch
        out["gradient_accumulation_steps"] = self.accumulation
        out["train_batch_size"] = self.global_batch
        zero = out["zero_optimization"] = section(out, "zero_optimization")
        zero["stage"] = self.stage
        if self.offload:
            offload = zero["offload_optimizer"] = section(zero, "offload_optimizer")
            offload["device"] = self.offload
            if self.offload == "nvme" and nvme_path:  # the disk the probe measured
                offload["nvme_path"] = nvme_path
        else:
            zero.pop("offload_optimizer", None)
        if self.activation_checkpointing:
            out.setdefault("activation_checkpointing", {})
        else:
            out.pop("activation_checkpointing", None)
        tensor = section(out, "tensor_parallel")
        if self.tp > 1 or "autotp_size" in tensor:
            out["tensor_parallel"] = {**tensor, "autotp_size": self.tp}
        if self.pp > 1:  # the schedule the cost model prices; the stages are the model's
            out["pipeline"] = {**section(out, "pipeline"), "schedule": "1f1b"}
        if self.sp > 1 or "sequence_parallel_size" in out:
            out["sequence_parallel_size"] = self.sp
        return out


def section(config: dict, key: str) -> dict:
    """``config[key]`` where it is a section (a dict), else empty (absent, null, a flag)."""
    value = config.get(key)
    return value if isinstance(value, dict) else {}


def fixed_keys(base: dict) -> dict:
    """What ``base`` (the user's --config) fixes, by candidate field."""
    zero = section(base, "zero_optimization")
    fixed: dict = {}
    if "stage" in zero:
        fixed["stage"] = int(zero["stage"])
    offload = section(zero, "offload_optimizer").get("device")
    if offload is not None:
        fixed["offload"] = None if offload == "none" else offload
    for key, field in (
        ("train_micro_batch_size_per_gpu", "micro_batch"),
        ("gradient_accumulation_steps", "accumulation"),
    ):
        if isinstance(base.get(key), int):
            fixed[field] = base[key]
    if "activation_checkpointing" in base:
        fixed["activation_checkpointing"] = True
    # the tensor-parallel degree: the section's, else DeepSpeed autotuning's mp_size
    for degree in (
        section(base, "tensor_parallel").get("autotp_size"),
        section(base, "autotuning").get("mp_size"),
    ):
        if isinstance(degree, int) and not isinstance(degree, bool):
            fixed["tp"] = degree
            break
    sequence = base.get("sequence_parallel_size")
    if isinstance(sequence, int) and not isinstance(sequence, bool):
        fixed["sp"] = sequence
    return fixed


def without_choices(config: dict) -> dict:
    """``config`` without the keys a candidate chooses (the tensor- and sequence-parallel
    degrees, the stage, the offload device, the micro-batch, the accumulation steps, activation
    checkpointing): the base a plan for the same job weighs every candidate over, the config's
    other keys kept."""
    out = copy.deepcopy(config)
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        out.pop(key, None)
    out.pop("activation_checkpointing", None)
    zero = section(out, "zero_optimization")
    zero.pop("stage", None)
    section(zero, "offload_optimizer").pop("device", None)
    section(out, "tensor_parallel").pop("autotp_size", None)
    out.pop("sequence_parallel_size", None)
    return out


def training_dtype(config: dict) -> str:
    """The dtype ``config``'s precision sections train in: ``bf16``, ``fp16`` or ``fp32``."""
    if section(config, "bf16").get("enabled"):
        return "bf16"
    if section(config, "fp16").get("enabled"):
        return "fp16"
    return "fp32"


def batch_per_rank(global_batch: int, world: int) -> int:
    """Samples per rank and step; ValueError where the ranks cannot share the batch evenly."""
    if global_batch % world:
        raise ValueError(
            f"--global-batch {global_batch} is not a multiple of the {world} data-parallel ranks"
        )
    return global_batch // world


def micro_batches(
    *, world: int, global_batch: int, base: dict, pipeline_stages: int = 1
) -> list[int]:
    """The micro-batches candidates take: every divisor of the batch per rank within the
    ``autotuning`` section's limits, or the one ``base`` fixes; in a pipeline of
    ``pipeline_stages``, those that leave at least as many micro-batches a step, as 1F1B
    needs."""
    per_rank = batch_per_rank(global_batch, world)
    fixed = fixed_keys(base).get("micro_batch")
    limits = read_autotuning(base)
    return [
        m
        for m in range(1, per_rank + 1)
        if per_rank % m == 0
        and per_rank // m >= pipeline_stages
        and fixed in (None, m)
        and limits.allows_micro_batch(m)
    ]


def batch_sharing_degrees(
    degrees: tuple[int, ...], *, world: int, global_batch: int
) -> tuple[int, ...]:
    """The tensor-parallel degrees of ``degrees`` whose data-parallel ranks share
    ``global_batch`` (:func:`shares_batch`)."""
    return tuple(d for d in degrees if shares_batch(d, world=world, global_batch=global_batch))


def shares_batch(model_parallel: int, *, world: int, global_batch: int) -> bool:
    """Whether ``model_parallel`` ranks (the tensor-, pipeline- and sequence-parallel degrees
    multiplied) divide ``world``, and the data-parallel ranks left (``world`` / it) share
    ``global_batch`` evenly."""
    return world % model_parallel == 0 and global_batch % (world // model_parallel) == 0


def enumerate_candidates(
    *,
    world: int,
    global_batch: int,
    base: dict,
    nvme: bool,
    tp_degrees: tuple[int, ...] = (1,),
    pipelines: Mapping[int, PipelineShare] | None = None,
    sp_degrees: tuple[int, ...] = (),
) -> list[Candidate]:
    """Every candidate over ``world`` ranks that trains ``global_batch`` samples a step: each
    tensor-parallel degree of ``tp_degrees``, each pipeline of ``pipelines`` (by degree) and
    each sequence-parallel degree of ``sp_degrees`` whose data-parallel ranks share the batch
    evenly, stages 0-3 (0-2 in a pipeline, which refuses 3), offload none / cpu / nvme
    (``nvme``: a path is given; offload needs stage 1-3, and a pipeline whose stages share no
    parameter), checkpointing off / on (off in a pipeline: not priced yet), and every
    micro-batch that divides the batch per data-parallel rank (in a pipeline, one its stages
    were timed at, in at least as many micro-batches as stages, as 1F1B needs); what ``base``
    fixes is held."""
    fixed = fixed_keys(base)
    layouts = [(tp, None, 1) for tp in tp_degrees]
    layouts += [(1, share, 1) for _, share in sorted((pipelines or {}).items())]
    layouts += [(1, None, sp) for sp in sp_degrees if sp > 1]
    out = []
    for tp, share, sp in layouts:
        pp = share.degree if share is not None else 1
        if not shares_batch(tp * pp * sp, world=world, global_batch=global_batch):
            continue
        dp = world // (tp * pp * sp)
        per_rank = global_batch // dp
        sizes = micro_batches(world=dp, global_batch=global_batch, base=base, pipeline_stages=pp)
        for stage in (0, 1, 2) if share else (0, 1, 2, 3):
            for offload in OFFLOADS:
                if offload and (stage == 0 or share and share.shared_elements):
                    continue
                if offload == "nvme" and not nvme:
                    continue
                for checkpointing in (False,) if share else (False, True):
                    for micro in sizes:
                        if share and micro not in share.stages:
                            continue
                        candidate = Candidate(
                            stage,
                            offload,
                            checkpointing,
                            micro,
                            per_rank // micro,
                            world,
                            tp,
                            pp,
                            share.split_points if share else (),
                            sp,
                        )
                        if all(getattr(candidate, k) == v for k, v in fixed.items()):
                            out.append(candidate)
    return out
