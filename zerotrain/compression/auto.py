"""Which compression pays on these links: each policy's cost per step, measured without the
network, and the step time it predicts.

[Note: choosing a compression]
Compression trades bytes on the wire for compute of its own (factors, top-k, quantization),
and on a fast link the compute costs more than the bytes save (the ACP-SGD study,
arXiv:2306.08881, found this often). ``comm_compression.auto`` decides from measurements:
* the link: alpha and beta of the group's links, probed (zerotrain/comm/link.py);
* the step: the median time of a few steps under the policy in use, uncompressed at first;
* each policy's cost per step (:func:`policy_costs`): its codec and parameter gather run on
  buckets of the real sizes, as many times per step as the last steps reduced and gathered,
  over a communicator that communicates nothing (zerotrain/comm/dry_run.py). That gives the
  policy's own compute, timed, and the bytes and collectives it would send.
A policy's predicted step is the measured step less the policy in use's cost, plus its own
(:func:`predict`): compute that does not change stays, the wire and codec time are replaced.
The tuner (zerotrain/zero/compression_tuner.py) switches only for a predicted gain of at least
``margin``, then measures the new policy's steps and goes back if they are slower than the old
ones by more than ``tolerance``: the prediction proposes, the measurement decides.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

import torch

from zerotrain.comm import Communicator
from zerotrain.comm.dry_run import DryRunCommunicator
from zerotrain.comm.link import Link, settle
from zerotrain.compression import make_codec
from zerotrain.compression.codec import BucketShape, GradientCompression, Pending
from zerotrain.compression.gather import ParameterCompression, ParameterGather


@dataclass(frozen=True)
class Policy:
    """How both directions travel: ``None`` is the backend's uncompressed collective."""

    gradients: GradientCompression | None = None
    parameters: ParameterCompression | None = None

    @property
    def name(self) -> str:
        parts = []
        if self.gradients is not None:
            parts.append(self.gradients.method)
        if self.parameters is not None:
            parts.append(f"{self.parameters.method} params")
        return " + ".join(parts) or "uncompressed"


def candidate_policies(
    gradients: GradientCompression | None, parameters: ParameterCompression | None
) -> tuple[Policy, ...]:
    """Uncompressed first, then each direction's compression alone and both together."""
    grads = [None] + ([gradients] if gradients is not None else [])
    params = [None] + ([parameters] if parameters is not None else [])
    return tuple(Policy(g, p) for p in params for g in grads)


@dataclass(frozen=True, kw_only=True)
class AutoOptions:
    """``comm_compression.auto``: the policies to choose from (the first uncompressed) and how
    the tuner measures and decides (see [Note: choosing a compression])."""

    policies: tuple[Policy, ...]
    recheck_steps: int = 1000  # measure and decide again this often (0: once)
    window: int = 5  # steps measured per decision (their median)
    margin: float = 0.05  # the predicted gain a switch needs, of the measured step
    tolerance: float = 0.01  # the measured slowdown after a switch that reverts it

    @property
    def parameters(self) -> ParameterCompression | None:
        """The parameter compression some policy uses (the gathers are built able to)."""
        return next((p.parameters for p in self.policies if p.parameters is not None), None)


@dataclass
class Traffic:
    """What one step sends in a shard group: how often each bucket's gradient is reduced (by
    ``collective``, all_reduce or reduce_scatter, in ``grad_dtype``, or the bucket's own in
    ``bucket_dtypes``) and how often shards of each size are gathered (in ``param_dtype``)."""

    collective: str
    reductions: dict[int, float] = field(default_factory=dict)  # bucket index -> per step
    gathers: dict[int, float] = field(default_factory=dict)  # shard numel -> per step
    grad_dtype: torch.dtype = torch.float32
    param_dtype: torch.dtype = torch.float32
    # bucket index -> its wire dtype where it has its own (torch_autocast's safe modules)
    bucket_dtypes: dict[int, torch.dtype] = field(default_factory=dict)


@dataclass
class Cost:
    """A policy's work per step: its own compute (timed) and the collectives it sends."""

    compute: float  # seconds
    messages: list[tuple[str, int, float]]  # (collective, bytes sent, times per step)
    state_bytes: int = 0  # what its codecs keep between steps (error feedback, factors)

    def wire_seconds(self, link: Link, world: int) -> float:
        return sum(n * link.seconds(op, sent, world) for op, sent, n in self.messages)

    def seconds(self, link: Link, world: int) -> float:
        return self.compute + self.wire_seconds(link, world)

    def __add__(self, other: Cost) -> Cost:
        return Cost(
            self.compute + other.compute,
            self.messages + other.messages,
            self.state_bytes + other.state_bytes,
        )

    @property
    def sent(self) -> float:
        """Bytes this rank sends per step."""
        return sum(sent * n for _, sent, n in self.messages)


# the most elements a dry run puts in one bucket: larger buckets run in pieces of whole
# parameters, so that costing never holds more than a few copies of this many (128 MB in fp32)
DRY_RUN_NUMEL = 1 << 25


def policy_costs(
    policies: tuple[Policy, ...],
    traffic: Traffic,
    comm: Communicator,
    buckets: list[BucketShape],
    *,
    counted: bool = False,
) -> list[Cost]:
    """Each policy's cost per step: its gradient codec and its parameter gather run on random
    buckets and shards of the real sizes (in pieces of at most ``DRY_RUN_NUMEL`` elements, the
    gathered whole too), as often as
    ``traffic`` says, over a dry-run stand-in for ``comm``, and the state its codecs keep
    after (with ``counted``, the counts top-k keeps for an Adam that catches up too: the
    planner's). Each direction's choices run once on the same input (a policy's cost is the
    sum of its two directions'), one bucket at a time, so that only one bucket's input and
    codec state exist at once."""
    world = comm.world_size
    dry = DryRunCommunicator(comm)
    by_gradients = {p.gradients: Cost(0.0, []) for p in policies}
    by_parameters = {p.parameters: Cost(0.0, []) for p in policies}
    for index, per_step in traffic.reductions.items():
        dtype = traffic.bucket_dtypes.get(index, traffic.grad_dtype)
        for piece in _pieces(buckets[index], world):
            flat = torch.randn(piece.numel_padded, device=comm.device).to(dtype)
            shard = flat.new_empty(flat.numel() // world)
            for gradients in by_gradients:
                options = replace(gradients, warmup_steps=0) if gradients else None
                codec = make_codec(options, dry, [piece])
                if traffic.collective == "all_reduce":
                    run = partial(codec.all_reduce, 0)
                else:
                    run = partial(codec.reduce_scatter, 0, shard)
                timed = _timed(dry, per_step, run, flat)
                if counted and options is not None and options.counts_arrivals:
                    codec.catch_up(0)  # as the step does: its counts are state too
                timed.state_bytes = sum(t.nbytes for t in codec.state_tensors())
                by_gradients[gradients] += timed
    for numel, per_step in traffic.gathers.items():
        chunk = min(numel, DRY_RUN_NUMEL // world)  # the gathered whole: at most DRY_RUN_NUMEL
        for size, times in ((chunk, numel // chunk), (numel % chunk, 1)):
            if size == 0 or times == 0:
                continue
            values = torch.randn(size, device=comm.device).to(traffic.param_dtype)
            output = values.new_empty(size * world)
            for parameters in by_parameters:
                gather = ParameterGather(dry, parameters)
                run = partial(gather.all_gather, output)
                by_parameters[parameters] += _timed(dry, per_step * times, run, values)
    return [by_gradients[p.gradients] + by_parameters[p.parameters] for p in policies]


def _pieces(bucket: BucketShape, world: int) -> list[BucketShape]:
    """``bucket`` as buckets of whole parameters of at most ``DRY_RUN_NUMEL`` elements each (a
    larger parameter alone), each padded to a multiple of ``world``."""
    groups: list[list[tuple[int, tuple[int, ...]]]] = []
    size = 0
    for offset, shape in bucket.params:
        numel = math.prod(shape)
        if not groups or size + numel > DRY_RUN_NUMEL:
            groups.append([])
            size = 0
        groups[-1].append((offset, shape))
        size += numel
    if len(groups) <= 1:
        return [bucket]
    pieces = []
    for params in groups:
        start = params[0][0]
        end = params[-1][0] + math.prod(params[-1][1])
        padded = -(-(end - start) // world) * world
        shifted = [(offset - start, shape) for offset, shape in params]
        embeddings = frozenset(o - start for o, _ in params if o in bucket.embeddings)
        pieces.append(BucketShape(padded, shifted, embeddings))
    return pieces


def _timed(
    dry: DryRunCommunicator, per_step: float, run: Callable[..., Pending], values: torch.Tensor
) -> Cost:
    """``run(values)`` twice (codecs may write their input: a copy each time): the faster
    one's time, and the messages of both at half the rate each (ACP-SGD alternates)."""
    dry.messages.clear()
    seconds = []
    for _ in range(2):
        fresh = values.clone()
        settle(values.device)
        start = time.perf_counter()
        run(fresh).wait()
        settle(values.device)
        seconds.append(time.perf_counter() - start)
    return Cost(per_step * min(seconds), [(op, n, per_step / 2) for op, n in dry.messages])


def predict(measured_step: float, current: Cost, cost: Cost, link: Link, world: int) -> float:
    """The step time of the policy costing ``cost``, from the measured step of the policy in
    use, costing ``current`` (see [Note: choosing a compression])."""
    return measured_step - current.seconds(link, world) + cost.seconds(link, world)
