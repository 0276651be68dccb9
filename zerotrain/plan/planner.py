"""``zerotrain plan``'s decision: every candidate config priced (zerotrain/plan/cost.py), those
that do not fit dropped, the fastest chosen, and each loser's reason.

[Note: the plan's choice]
A candidate fits when its predicted peak per rank is at most ``margin`` (0.9) of the memory a
rank has: the device's, or on a CPU-only machine the host's shared by the node's ranks; on a
GPU, what its offload holds in host memory also within ``margin`` of the host's share, and
with NVMe offload its working files within ``margin`` of the free space under ``nvme_path``,
shared by the node's ranks. All
candidates train the same global batch, so the fastest step is the fastest per token (an
``autotuning`` section's ``metric: flops`` ranks by FLOPs a second instead, recomputation
included: [Note: DeepSpeed's autotuning section] in zerotrain/plan/autotuning.py). A loser
is named by what it lost on: memory (by how much), or time, with what dominates its step
(compute, the link, the optimizer step), against the choice's.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TypeVar

from torch import nn

from zerotrain.compression.auto import Policy
from zerotrain.config import ConfigError, ZeroTrainConfig, check_config
from zerotrain.config.schema import TiledComputeConfig
from zerotrain.errors import ZeroTrainError
from zerotrain.estimate.stages import NOT_ON_NVME
from zerotrain.fmt import quantity
from zerotrain.plan.autotuning import read_autotuning
from zerotrain.plan.candidates import Candidate, enumerate_candidates, fixed_keys, section
from zerotrain.plan.cost import Corrections, ModelFacts, Prediction, predict, unpriced
from zerotrain.plan.model_probe import ModelProfile, profile_model
from zerotrain.plan.optimizer_cost import ADAMW, optimizer_cost
from zerotrain.plan.pipeline_share import pipeline_share
from zerotrain.plan.probe import Machine, cache_dir
from zerotrain.plan.sequence_share import SequenceShare, profile_sequence_share
from zerotrain.precision import DTYPES

__all__ = [
    "Plan",
    "PlanError",
    "Planned",
    "WHOLE_MODEL",
    "buildable_sizes",
    "Checked",
    "check_candidates",
    "load_corrections",
    "make_plan",
    "model_facts",
    "profile_if_fits",
    "rank_budget",
    "refine",
    "sequence_profile",
    "tensor_degrees",
    "with_optimizer",
    "with_profiles",
]

MARGIN = 0.9
UNBOUNDED = 2**62  # an off-device budget where nothing bounds it (bytes)
WHOLE_MODEL = "the whole model"
MOE_ALONE = (
    "the model's MoE layers (zerotrain.moe) train with data and expert parallelism: "
    "initialize refuses them with tensor parallelism or pipeline stages, and Ulysses with "
    "experts spread over ranks"
)
"""What :func:`with_profiles` tells ``failed`` when the undivided model's probe fails."""
_T = TypeVar("_T")


class PlanError(ZeroTrainError, ValueError):
    """No candidate can train the job here (the message names the nearest one)."""


@dataclass
class Planned:
    """One candidate with its config, prediction and verdict."""

    candidate: Candidate
    config: dict
    predicted: Prediction
    fits: bool
    reason: str = ""
    measured: dict | None = None

    def as_json(self) -> dict:
        out = {
            "label": self.candidate.label(),
            "config": self.config,
            "activation_checkpointing": self.candidate.activation_checkpointing,
            "pipeline": self.pipeline(),
            **self.predicted.as_dict(),
            "bound": self.predicted.bound,
            "fits": self.fits,
            "reason": self.reason,
        }
        if self.measured is not None:
            out["measured"] = self.measured
        return out

    def pipeline(self) -> dict | None:
        """How a pipeline candidate's model is cut (``split_model``'s split points), or None."""
        candidate = self.candidate
        if candidate.pp == 1:
            return None
        return {"stages": candidate.pp, "split_points": list(candidate.split_points)}


@dataclass
class Plan:
    """Every candidate considered, losers included, and the index of the chosen one."""

    candidates: list[Planned]
    chosen: int
    budget: int
    """Memory per rank a candidate may use (the margin applied)."""
    corrections: Corrections = field(default_factory=Corrections)
    metric: str = "throughput"
    """What "fastest" means: an ``autotuning`` section's metric."""
    unpriced: list[str] = field(default_factory=list)
    """What the base config turns on that the predictions leave out (cost.unpriced)."""
    refused: list[tuple[str, str]] = field(default_factory=list)
    """Candidates left out, which ``initialize`` would refuse: their labels and why."""

    @property
    def best(self) -> Planned:
        return self.candidates[self.chosen]

    def ranked(self) -> list[Planned]:
        """The candidates that fit, fastest first."""
        fitting = [p for p in self.candidates if p.fits]
        return sorted(fitting, key=lambda p: _rank(p, self.metric))

    def as_json(self) -> dict:
        return {
            "candidates": [p.as_json() for p in self.candidates],
            "chosen": self.chosen,
            "unpriced": self.unpriced,
            "refused": [{"label": label, "reason": why} for label, why in self.refused],
        }


def model_facts(
    model: nn.Module,
    *,
    seq_len: int,
    dtype: str,
    tp_degrees: tuple[int, ...] = (),
    sp_degrees: tuple[int, ...] = (),
    skipped: Callable[[str, str], object] | None = None,
) -> ModelFacts:
    """What the cost model needs of ``model`` (built on the meta device is enough), with rank
    0's share at each tensor-parallel degree of ``tp_degrees`` that splits it and at each
    sequence-parallel degree of ``sp_degrees`` at which Ulysses can share its attention
    (``skipped`` hears of the others, by name, with the reason); measured profiles are added
    by :func:`with_profiles`."""
    from zerotrain.config import ZERO_DEFAULTS
    from zerotrain.estimate import count_parameters
    from zerotrain.plan.expert_share import expert_share
    from zerotrain.plan.sequence_share import sequence_shares
    from zerotrain.plan.tensor_share import tensor_shares

    def skipped_at(kind: str) -> Callable[[int, str], object] | None:
        if skipped is None:
            return None
        return lambda degree, why: skipped(f"{kind} parallelism at degree {degree}", why)

    count = count_parameters(
        model, persistence_threshold=ZERO_DEFAULTS.stage3_param_persistence_threshold
    )
    config = getattr(model, "config", None)
    eager = getattr(config, "_attn_implementation", None) == "eager"
    dropout = any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())
    experts = expert_share(model)
    if experts is not None:  # initialize refuses MoE layers with either (zerotrain/moe)
        for kind, degrees in (("tensor", tp_degrees), ("sequence", sp_degrees)):
            for degree in (d for d in degrees if d > 1):
                if skipped is not None:
                    skipped(f"{kind} parallelism at degree {degree}", MOE_ALONE)
        tp_degrees = sp_degrees = ()
    return ModelFacts(
        experts=experts,
        count=count,
        seq_len=seq_len,
        dtype=dtype,
        attention="eager" if eager else "flash",
        dropout=dropout,
        shares=tensor_shares(model, [d for d in tp_degrees if d > 1], skipped_at("tensor")),
        sequences=sequence_shares(
            model, [d for d in sp_degrees if d > 1], seq_len, skipped_at("sequence")
        ),
    )


def with_optimizer(facts: ModelFacts, base: dict, threads: int | None) -> ModelFacts:
    """``facts`` pricing the optimizer the configs planned over ``base`` (a ds_config) train
    with: its ``optimizer`` section's, else AdamW, which a candidate's config then names ([Note:
    the optimizer's cost] in zerotrain/plan/optimizer_cost.py), its step timed against AdamW's
    on ``threads`` threads (None: not timed; memory alone). ValueError where the section names
    no optimizer zerotrain builds."""
    section = base.get("optimizer")
    typed = check_config({"optimizer": section}, unfilled=True).optimizer if section else None
    if typed is None:
        return replace(facts, optimizer=ADAMW)
    # its typed section: HF's "auto" values left out, as initialize will have them filled
    priced = optimizer_cost({"type": typed.type, "params": typed.params}, facts.count, threads)
    return replace(facts, optimizer=priced)


def with_compression(
    facts: ModelFacts, model: nn.Module, base: dict, machine: Machine
) -> ModelFacts:
    """``facts`` pricing the communication compression ``base`` (a ds_config) turns on, its
    codecs to be run on ``model``'s parameter shapes (on the meta device is enough) with the
    threads of a rank of ``machine`` ([Note: compression in the plan] in
    zerotrain/plan/compression_cost.py). ``auto`` with no method named offers the methods it
    offers at stages 1-3 (at stage 0 the parameters' are never priced: nothing is gathered)."""
    from zerotrain.plan.compression_cost import compression_profile
    from zerotrain.zero.compression_options import compression_policies

    wanted = section(base, "comm_compression")
    zero = section(base, "zero_optimization")
    # a stage its keys work at (hpZ: 3; the parameters' gather: 1-3), unless base fixes one
    stage = zero.get("stage", 3 if wanted.get("hierarchical_partition") else 1)
    sizes = {k: v for k, v in zero.items() if k == "reduce_bucket_size"}
    cfg = check_config(
        {"comm_compression": wanted, "zero_optimization": {"stage": stage, **sizes}},
        unfilled=True,
    )
    policies = compression_policies(cfg)
    if not facts.optimizer.catches_up:  # as the engine sends for it (zerotrain/zero/group.py)
        policies = tuple(_without_catch_up(p) for p in policies)
    profile = compression_profile(
        model,
        policies,
        bucket_elements=cfg.zero_optimization.reduce_bucket_size,
        dtype=DTYPES[facts.dtype],
        threads=machine.threads,
    )
    return replace(facts, compression=profile)


def _without_catch_up(policy: Policy) -> Policy:
    gradients = policy.gradients
    return (
        policy
        if gradients is None
        else replace(policy, gradients=replace(gradients, catch_up=False))
    )


def tensor_degrees(ranks_per_node: int) -> tuple[int, ...]:
    """The tensor-parallel degrees the planner weighs: those that divide a node's ranks (its
    peers exchange activations every layer: they stay on one node)."""
    return tuple(d for d in range(1, ranks_per_node + 1) if ranks_per_node % d == 0)


def with_profiles(
    factory,
    facts: ModelFacts,
    machine: Machine,
    *,
    sizes: Callable[[int, int, int], list[int]],
    vocab: int,
    failed: Callable[[str, str], object] | None = None,
    whole: bool = True,
    pipeline_degrees: tuple[int, ...] = (),
    tiles: TiledComputeConfig | None = None,
) -> ModelFacts:
    """``facts`` with the model probe's profile ([Note: the model probe]) of the whole model
    (unless not ``whole``: no candidate trains it undivided), of each tensor-parallel share,
    of the model cut into each of ``pipeline_degrees`` stages ([Note: a pipeline stage's
    share]) and of each sequence-parallel share ([Note: a sequence-parallel rank's share]), at
    the micro-batches ``sizes(tp, pp, sp)``, the MLPs and the loss tiled as ``tiles`` (a
    config's ``tiled_compute``) asks. Where the probe of a layout raises (the user's
    model), ``failed`` hears its name and why: the whole model is then priced by its FLOPs,
    and a tensor-parallel share, a pipeline or a sequence-parallel degree is dropped (training
    would split it the same way)."""

    def probe(what: str, run: Callable[[], _T]) -> tuple[_T | None, bool]:
        try:
            return run(), True
        except Exception as error:  # noqa: BLE001 (the user's model, on a real device)
            if failed is not None:
                plain = isinstance(error, ValueError)
                failed(what, str(error) if plain else f"{type(error).__name__}: {error}")
            return None, False

    def profiled(tp: int) -> Callable[[], ModelProfile | None]:
        return lambda: profile_if_fits(
            factory, facts, machine, sizes=sizes(tp, 1, 1), vocab=vocab, tp=tp, tiles=tiles
        )

    profile, _ = probe(WHOLE_MODEL, profiled(1)) if whole else (None, False)
    shares = {}
    for tp, share in facts.shares.items():
        measured, ran = probe(f"tensor parallelism at degree {tp}", profiled(tp))
        if ran:
            shares[tp] = replace(share, profile=measured)
    pipelines = {}
    for pp in pipeline_degrees:
        what = f"pipeline parallelism at degree {pp}"
        buildable = buildable_sizes(facts, machine, sizes(1, pp, 1))
        if not buildable and failed is not None:
            failed(
                what,
                "the model is too large to cut and time here"
                if sizes(1, pp, 1)
                else f"no micro-batch leaves {pp} or more micro-batches a step, as 1F1B needs",
            )
        if not buildable:
            continue
        cut, _ = probe(
            what,
            functools.partial(
                pipeline_share,
                factory,
                pp,
                micro_batches=buildable,
                **_probe_options(facts, machine, vocab),
            ),
        )
        if cut is not None:
            pipelines[pp] = cut
    sequences = {}
    for sp, share in facts.sequences.items():
        timed, _ = probe(
            f"sequence parallelism at degree {sp}",
            functools.partial(
                sequence_profile, factory, facts, share, machine, sizes(1, 1, sp), vocab, tiles
            ),
        )
        if timed is not None:
            sequences[sp] = timed
        elif failed is not None and sizes(1, 1, sp):
            failed(f"sequence parallelism at degree {sp}", "the model is too large to time here")
    return replace(facts, profile=profile, shares=shares, pipelines=pipelines, sequences=sequences)


def sequence_profile(
    factory,
    facts: ModelFacts,
    share: SequenceShare,
    machine: Machine,
    sizes: list[int],
    vocab: int,
    tiles: TiledComputeConfig | None = None,
) -> SequenceShare | None:
    """``share`` with the model probe's profile of a rank's share ([Note: a sequence-parallel
    rank's share]) at the micro-batches of ``sizes`` it can run at here; None where it can at
    none."""
    sizes = buildable_sizes(replace(facts, seq_len=share.tokens), machine, sizes)
    if not sizes:
        return None
    return profile_sequence_share(
        factory, share, micro_batches=sizes, tiles=tiles, **_probe_options(facts, machine, vocab)
    )


def profile_if_fits(
    factory,
    facts: ModelFacts,
    machine: Machine,
    *,
    sizes: list[int],
    vocab: int,
    tp: int = 1,
    tiles: TiledComputeConfig | None = None,
) -> ModelProfile | None:
    """The model probe ([Note: the model probe]), split to a tensor-parallel rank's share at
    degree ``tp`` (or with its experts placed: [Note: an expert-parallel rank's share]), tiled
    as ``tiles`` asks, at the micro-batches of ``sizes`` it can run at here
    (:func:`buildable_sizes`); None where it can at none (the cost model then counts FLOPs)."""
    from zerotrain.plan.expert_share import place_alone
    from zerotrain.plan.sequence_share import tile_alone
    from zerotrain.plan.tensor_share import split_alone

    sizes = buildable_sizes(facts, machine, sizes, tp)
    if not sizes:
        return None
    steps: list[Callable[[nn.Module], object]] = []
    if tp > 1:
        steps.append(functools.partial(split_alone, degree=tp))
    elif facts.experts is not None and facts.experts.degree > 1:
        steps.append(functools.partial(place_alone, degree=facts.experts.degree))
    if tiles is not None:
        steps.append(functools.partial(tile_alone, tiles=tiles))

    def prepare(model: nn.Module) -> None:
        for step in steps:
            step(model)

    return profile_model(
        factory, micro_batches=sizes, prepare=prepare, **_probe_options(facts, machine, vocab)
    )


def _probe_options(facts: ModelFacts, machine: Machine, vocab: int) -> dict:
    """What every model probe of the job runs at: the samples' tokens, the token ids, the
    training dtype and a rank's threads."""
    return {
        "seq_len": facts.seq_len,
        "vocab_size": vocab,
        "dtype": DTYPES[machine.dtype],
        "threads": machine.threads,
    }


def buildable_sizes(
    facts: ModelFacts, machine: Machine, sizes: list[int], tp: int = 1
) -> list[int]:
    """The micro-batches of ``sizes`` at which the model probe can run the model here: the
    model, its gradients and their temporaries (on a CPU-only machine 16 bytes a parameter:
    it is built whole in fp32, then split to a tensor-parallel rank's share at degree ``tp``;
    on a GPU, which gets the model as built on the host in the training dtype, twice the model
    and its gradients in it) and the micro-batch's activations (Korthikanti's formula, where
    the model's shape is known) within half the memory it runs in."""
    from zerotrain.estimate import activation_bytes

    if machine.device == "cpu":
        memory, weights = machine.host_memory, 16 * facts.count.trainable
    else:
        element = DTYPES[facts.dtype].itemsize
        memory, weights = machine.device_memory, 4 * element * facts.count.trainable

    def fits(micro: int) -> bool:
        shape = facts.shape(micro, tp)
        activations = activation_bytes(shape).without_checkpointing if shape else 0
        return weights + activations <= memory // 2

    return [m for m in sizes if fits(m)]


@dataclass
class Checked:
    """Candidates' configs as ``initialize``'s config check reads them."""

    accepted: list[tuple[Candidate, dict]]
    """Each candidate it accepts, with its config."""
    refused: list[tuple[Candidate, str]]
    """Each candidate it refuses, with its message (a key a base fixes may rule out a stage,
    an offload device: OneBitAdam at stage 3)."""
    typed: ZeroTrainConfig
    """The first accepted config, typed: the base's keys as training reads them."""


def check_candidates(candidates: list[Candidate], base: dict, nvme_path: str | None) -> Checked:
    """Each of ``candidates``' configs over ``base`` checked as ``initialize`` checks a config
    (HF's "auto" values left to be filled); PlanError where none is left."""
    accepted, refused, typed = [], [], None
    for candidate in candidates:
        config = candidate.config(base, nvme_path)
        try:
            checked = check_config(config, unfilled=True)
        except ConfigError as error:
            refused.append((candidate, str(error)))
            continue
        typed = typed or checked
        accepted.append((candidate, config))
    if typed is None and refused:
        candidate, why = refused[0]
        raise PlanError(
            f"--config: initialize would refuse every candidate config; {candidate.label()}: {why}"
        )
    if typed is None:
        try:  # a value no candidate takes (stage 7) is the base's own error
            check_config(base, unfilled=True)
        except ConfigError as error:
            raise PlanError(f"--config: {error}") from error
        raise PlanError(
            "no candidate config: --config fixes keys (or its autotuning section limits the "
            "micro-batch so) that leave none"
        )
    return Checked(accepted, refused, typed)


def make_plan(
    facts: ModelFacts,
    machine: Machine,
    *,
    world: int,
    ranks_per_node: int,
    global_batch: int,
    base: dict,
    nvme_path: str | None = None,
    corrections: Corrections | None = None,
) -> Plan:
    """Price every candidate and choose (see [Note: the plan's choice]); :class:`PlanError`
    when none fits."""
    corrections = corrections or Corrections()
    try:
        metric = read_autotuning(base).metric
    except ValueError as error:
        raise PlanError(str(error)) from error
    budget = rank_budget(machine, ranks_per_node)
    host_budget = host_budget_per_rank(machine, ranks_per_node)
    disk_budget = disk_budget_per_rank(nvme_path, ranks_per_node)
    planned = []
    # tensor-parallel peers stay on one node
    degrees = (1, *sorted(d for d in facts.shares if ranks_per_node % d == 0))
    fixed_tp = fixed_keys(base).get("tp", 1)
    if fixed_tp not in degrees:
        raise PlanError(
            f"tensor-parallel degree {fixed_tp} (tensor_parallel.autotp_size or "
            "autotuning.mp_size): the automatic plan does not split this model into that "
            f"many pieces on a node of {ranks_per_node} ranks (degrees it can: {list(degrees)})"
        )
    # sequence-parallel peers exchange activations every layer too; priced where timed
    sequences = tuple(
        sp
        for sp, share in sorted(facts.sequences.items())
        if ranks_per_node % sp == 0 and share.profile is not None
    )
    fixed_sp = fixed_keys(base).get("sp", 1)
    if fixed_sp > 1 and fixed_sp not in sequences:
        raise PlanError(
            f"sequence_parallel_size {fixed_sp}: not planned for this model on a node of "
            f"{ranks_per_node} ranks (degrees it can: {[1, *sequences]}); Ulysses is planned "
            "for transformers causal LMs whose attention heads the degree divides, on one node"
        )
    candidates = enumerate_candidates(
        world=world,
        global_batch=global_batch,
        base=base,
        # NVMe offload steps sub-group by sub-group: not an optimizer that needs whole tensors
        nvme=nvme_path is not None and facts.optimizer.kind not in NOT_ON_NVME,
        tp_degrees=degrees,
        pipelines=facts.pipelines,
        sp_degrees=sequences,
    )
    checked = check_candidates(candidates, base, nvme_path)
    experts = facts.experts
    for candidate, config in checked.accepted:
        if experts is not None and candidate.dp % experts.degree:
            checked.refused.append((candidate, _expert_ranks_refusal(candidate, experts.degree)))
            continue
        prediction = predict(candidate, facts, machine, corrections, config)
        fits = prediction.peak_memory_bytes <= budget
        fits = fits and not _off_device_over(prediction, host_budget, disk_budget)
        planned.append(Planned(candidate, config, prediction, fits))
    if not planned:  # every one refused for the model's experts
        raise PlanError(f"initialize would refuse every candidate config: {checked.refused[0][1]}")
    fitting = [p for p in planned if p.fits]
    if not fitting:
        on_device = [p for p in planned if p.predicted.peak_memory_bytes <= budget]
        if on_device:  # each fits its device, none the host or the disk its offload needs
            nearest = min(
                on_device, key=lambda p: _off_device_ratio(p.predicted, host_budget, disk_budget)
            )
            over = _off_device_over(nearest.predicted, host_budget, disk_budget)
            raise PlanError(
                f"no config fits: the nearest, {nearest.candidate.label()}, fits the device but "
                f"{over} (each of the node's {ranks_per_node} rank(s) may use {MARGIN:.0%} "
                "of its share); more nodes, a larger disk or a smaller model would fit"
            )
        nearest = min(planned, key=lambda p: p.predicted.peak_memory_bytes)
        need = nearest.predicted.peak_memory_bytes
        per_rank = _rank_memory(machine, ranks_per_node)
        raise PlanError(
            f"no config fits: the nearest, {nearest.candidate.label()}, needs "
            f"{_bytes(need)} per rank, {_bytes(need - budget)} more than the "
            f"{_bytes(budget)} a rank may use ({MARGIN:.0%} of {_bytes(per_rank)}); "
            "more ranks, shorter sequences or a smaller model would fit"
        )
    best = min(fitting, key=lambda p: _rank(p, metric))
    for p in planned:
        p.reason = _reason(
            p, best, budget, _off_device_over(p.predicted, host_budget, disk_budget), metric
        )
    return Plan(
        planned,
        planned.index(best),
        budget,
        corrections,
        metric,
        unpriced(checked.typed, facts, machine.device),
        [(c.label(), why) for c, why in checked.refused],
    )


def _expert_ranks_refusal(candidate: Candidate, degree: int) -> str:
    """Why ``initialize`` refuses ``candidate`` for a model whose MoE layers spread their
    experts over ``degree`` ranks: its data-parallel ranks, which the experts' groups are
    carved from, are not a multiple of it."""
    return (
        f"MoE: ep_size {degree} spreads the experts over {degree} data-parallel ranks, and "
        f"{candidate.label()} has {candidate.dp}; launch a multiple of {degree} ranks"
    )


def _rank(planned: Planned, metric: str) -> tuple[float, int]:
    """The choice's order: the cost, then fewer micro-batches a step (priced by FLOPs alone,
    every micro-batch of the same step costs the same; a larger one is not slower)."""
    return _cost(planned, metric), planned.candidate.accumulation


def _cost(planned: Planned, metric: str) -> float:
    """What the choice minimises: the step time, or with ``metric: flops`` the step time per
    pass over the model (a checkpointed step does a forward more: 4 passes, not 3), the
    inverse of the FLOPs a second."""
    step = planned.predicted.step_time_s
    if metric != "flops":
        return step
    return step / (4 if planned.candidate.activation_checkpointing else 3)


def rank_budget(machine: Machine, ranks_per_node: int) -> int:
    """The memory a candidate may use on a rank: :data:`MARGIN` of what the rank has."""
    return int(_rank_memory(machine, ranks_per_node) * MARGIN)


def host_budget_per_rank(machine: Machine, ranks_per_node: int) -> int:
    """The host memory a rank's offload may hold beside a device: :data:`MARGIN` of the host's,
    shared by the node's ranks (unbounded on a CPU-only machine, whose device is the host:
    the rank budget counts it there)."""
    if machine.device == "cpu":
        return UNBOUNDED
    return int(machine.host_memory * MARGIN) // ranks_per_node


def disk_budget_per_rank(nvme_path: str | None, ranks_per_node: int) -> int:
    """The bytes of NVMe working files a rank may write: :data:`MARGIN` of the space free now
    under ``nvme_path`` (or the nearest folder of it that exists), shared by the node's ranks;
    unbounded without one."""
    if nvme_path is None:
        return UNBOUNDED
    folder = Path(nvme_path).resolve()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return int(shutil.disk_usage(folder).free * MARGIN) // ranks_per_node


def _off_device_over(predicted: Prediction, host_budget: int, disk_budget: int) -> str | None:
    """What a prediction's offload needs beyond the host's or the disk's budget, in words;
    None where both hold it."""
    for what, need, budget in (
        ("host memory", predicted.host_memory_bytes, host_budget),
        ("NVMe space", predicted.disk_bytes, disk_budget),
    ):
        if need > budget:
            return (
                f"needs {_bytes(need)} of {what} per rank, {_bytes(need - budget)} more than "
                f"the {_bytes(budget)} a rank may use"
            )
    return None


def _off_device_ratio(predicted: Prediction, host_budget: int, disk_budget: int) -> float:
    """How far over its off-device budgets a prediction is (its worse ratio of the two)."""
    return max(
        predicted.host_memory_bytes / max(1, host_budget),
        predicted.disk_bytes / max(1, disk_budget),
    )


def _rank_memory(machine: Machine, ranks_per_node: int) -> int:
    """The device's memory, or on a CPU-only machine the host's share of each of its ranks."""
    return machine.device_memory // (ranks_per_node if machine.device == "cpu" else 1)


def _bytes(value: float) -> str:
    return quantity(value, "B")


def _reason(
    planned: Planned, best: Planned, budget: int, off_device: str | None, metric: str
) -> str:
    predicted = planned.predicted
    if planned is best:
        return "chosen: the fastest that fits"
    if predicted.peak_memory_bytes > budget:
        over = predicted.peak_memory_bytes - budget
        return f"does not fit: {_bytes(over)} over the budget"
    if off_device:
        return f"does not fit: {off_device}"
    if metric == "flops":
        rate = _cost(best, metric) / _cost(planned, metric)
        return f"{rate:.2f}x the chosen FLOPs a second, {predicted.bound}-bound"
    ratio = predicted.step_time_s / best.predicted.step_time_s
    return f"{ratio:.2f}x the chosen step, {predicted.bound}-bound"


# -- the corrections, kept per machine ----------------------------------------------------------
def _corrections_path(machine: Machine):
    return cache_dir() / "corrections" / f"{machine.key}.json"


def load_corrections(machine: Machine) -> Corrections:
    """The corrections ``--verify`` left for this machine (defaults if none)."""
    path = _corrections_path(machine)
    try:
        return Corrections(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return Corrections()


def save_corrections(machine: Machine, corrections: Corrections) -> None:
    path = _corrections_path(machine)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(asdict(corrections)))
    partial.replace(path)


def refine(corrections: Corrections, pairs: list[tuple[Prediction, dict]]) -> Corrections:
    """The corrections moved to what trials measured: ``pairs`` of a prediction made with
    ``corrections`` and the trial's ``measured`` dict (peak_memory_bytes, step_time_s).
    Each constant becomes the median of the values that would have predicted each trial
    exactly, averaged with the old one by the trials' weight."""
    if not pairs:
        return corrections
    scales, overheads = [], []
    for predicted, measured in pairs:
        rest = predicted.engine_s + predicted.comm_s + predicted.optimizer_s
        compute = measured["step_time_s"] - rest
        if compute > 0 and predicted.compute_s > 0:
            scales.append(corrections.compute_scale * compute / predicted.compute_s)
        overheads.append(
            corrections.memory_overhead
            + measured["peak_memory_bytes"]
            - predicted.peak_memory_bytes
        )
    old, new = corrections.verified, len(pairs)

    def blend(current: float, found: list[float]) -> float:
        if not found:
            return current
        return (current * old + statistics.median(found) * new) / (old + new)

    return Corrections(
        compute_scale=blend(corrections.compute_scale, scales),
        memory_overhead=max(0.0, blend(corrections.memory_overhead, overheads)),
        engine_seconds_per_parameter=corrections.engine_seconds_per_parameter,
        verified=old + new,
    )
