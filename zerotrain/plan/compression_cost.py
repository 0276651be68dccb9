"""What communication compression costs a step and keeps in memory, for the planner.

[Note: compression in the plan]
A base config's ``comm_compression`` (its gradients' codec, its parameters' quantized gather,
or ``auto``'s policies) is priced as the runtime's tuner prices it ([Note: choosing a
compression] in zerotrain/compression/auto.py): each codec and gather runs here on buckets
of the model's own parameter shapes, over a communicator that sends nothing, timed on the
threads a rank trains with; the bytes it would send go on the probed link of their kind, and
the state its codecs keep between steps (error feedback, low-rank factors) is added to the
peak. Buckets are packed as stages 0-2 pack them (the trainable parameters in reverse,
closed at ``reduce_bucket_size`` elements); at stage 3 the same buckets stand for its units'.
One reduction of every bucket and one gather of every shard is measured per collective and
group size, then scaled: by how often the stage reduces and gathers in a step
(:func:`compressed_seconds`), and by a rank's elements over the measured ones, for a
tensor-parallel share, a pipeline stage or the experts' group. A model of more than
``SAMPLE_ELEMENTS`` trainable elements is measured on its last ones (as packed) and scaled
the same way. ``auto`` is priced as the policy that costs least on the candidate's link, the
one its tuner settles on (it switches only for a gain of 5% of the step: near a tie it may
stay uncompressed).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from zerotrain.comm.dry_run import DryRunCommunicator
from zerotrain.compression.auto import Cost, Policy, Traffic, policy_costs
from zerotrain.compression.codec import BucketShape
from zerotrain.plan.model_probe import probe_device
from zerotrain.plan.probe import torch_threads

__all__ = ["CompressionProfile", "compressed_seconds", "compression_profile"]

SAMPLE_ELEMENTS = 1 << 26
"""The most trainable elements whose codecs are run (256 MB in fp32): a larger model's cost is
scaled from its last ones."""


@dataclass
class CompressionProfile:
    """The policies a config may send with and the buckets they are measured on; each
    (collective, group size)'s costs are measured when first asked (:meth:`costs`)."""

    policies: tuple[Policy, ...]
    buckets: list[BucketShape]
    """Unpadded (``numel_padded`` is the elements held): each group size pads its own."""
    measured_elements: int
    """Trainable elements in ``buckets``: all the model's, or its last ``SAMPLE_ELEMENTS``."""
    dtype: torch.dtype
    threads: int
    device: torch.device
    _measured: dict[tuple[str, int], list[tuple[Cost, Cost]]] = field(default_factory=dict)

    def costs(self, collective: str, world: int) -> list[tuple[Cost, Cost]]:
        """Per policy, (one ``collective`` of every bucket's gradient, one gather of every
        bucket's shard) over ``world`` ranks."""
        key = (collective, world)
        if key not in self._measured:
            # padded to a multiple of the ranks, as the engine pads them
            buckets = [
                replace(b, numel_padded=-(-b.numel_padded // world) * world) for b in self.buckets
            ]
            shards = Counter(b.numel_padded // world for b in buckets)
            every = {i: 1.0 for i in range(len(buckets))}
            reduced = Traffic(collective, every, {}, self.dtype, self.dtype)
            gathered = Traffic(
                collective, {}, {n: float(k) for n, k in shards.items()}, self.dtype, self.dtype
            )
            dry = DryRunCommunicator.alone(world, self.device)
            with torch_threads(self.threads):
                grads = policy_costs(self.policies, reduced, dry, buckets, counted=True)
                params = policy_costs(self.policies, gathered, dry, buckets)
            self._measured[key] = list(zip(grads, params, strict=True))
        return self._measured[key]


def compression_profile(
    model: nn.Module,
    policies: tuple[Policy, ...],
    *,
    bucket_elements: int,
    dtype: torch.dtype,
    threads: int,
) -> CompressionProfile | None:
    """``policies`` to be measured on ``model``'s trainable parameters (on the meta device is
    enough) in buckets of at most ``bucket_elements``, to be run where the model probe runs
    (see [Note: compression in the plan]); None where none compresses anything."""
    if not any(p.gradients is not None or p.parameters is not None for p in policies):
        return None
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    params = [p for p in model.parameters() if p.requires_grad]
    buckets: list[BucketShape] = []
    current: list[tuple[int, tuple[int, ...]]] = []
    embeddings: set[int] = set()
    size = measured = 0
    for param in reversed(params):  # the engine packs in reverse (backward's order)
        if measured >= SAMPLE_ELEMENTS:
            break
        if current and size + param.numel() > bucket_elements:
            buckets.append(BucketShape(size, current, frozenset(embeddings)))
            current, embeddings, size = [], set(), 0
        if id(param) in tables:
            embeddings.add(size)
        current.append((size, tuple(param.shape)))
        size += param.numel()
        measured += param.numel()
    if current:
        buckets.append(BucketShape(size, current, frozenset(embeddings)))
    return CompressionProfile(policies, buckets, measured, dtype, threads, probe_device())


def compressed_seconds(
    profile: CompressionProfile,
    counts: dict[str, int],
    groups: list[tuple[int, int]],
    links: dict,
) -> tuple[float, int, Policy]:
    """A step's collectives, ``counts`` per kind (the gradients' ``all_reduce`` or
    ``reduce_scatter``, the parameters' ``all_gather``), over ``groups`` (a rank's elements in
    each shard group and the ranks it shards over) under the cheapest of the profile's
    policies on ``links`` (the probed link of each kind; none: compute alone): its seconds,
    the bytes its codecs keep, and the policy."""
    (collective,) = (op for op in counts if op != "all_gather")
    priced = []
    for index, policy in enumerate(profile.policies):
        seconds, state = 0.0, 0
        for elements, world in groups:
            if world == 1:
                continue
            grads, params = profile.costs(collective, world)[index]
            scale = elements / profile.measured_elements
            seconds += counts[collective] * _seconds(grads, scale, links, world)
            seconds += counts["all_gather"] * _seconds(params, scale, links, world)
            state += int(grads.state_bytes * scale)
        priced.append((seconds, state, policy))
    return min(priced, key=lambda p: p[0])


def _seconds(cost: Cost, scale: float, links: dict, world: int) -> float:
    """``cost`` for ``scale`` times its elements: its compute, and each message on its link
    (none where no link was probed)."""
    wire = sum(
        n * links[op].seconds(op, int(sent * scale), world)
        for op, sent, n in cost.messages
        if op in links
    )
    return cost.compute * scale + wire
