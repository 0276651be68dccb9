"""The model's own forward and backward, timed and its activations counted, at each micro-batch
the planner weighs: what its compute and activation terms use when the model can be built on
this machine (the FLOP count and Korthikanti's formula otherwise).

[Note: the model probe]
A FLOP count priced at the probed square matmul's rate missed this CPU's step times of the
GPTs of examples/gpt by 26-46% (their forward and backward reach 0.54-0.74 of that rate, less
at smaller micro-batches), and the formula's activations say nothing of a model that is not a
textbook transformer. So where the model fits in this process (its parameters and gradients
in fp32, twice over, within half the host memory available), the planner builds it for real,
in the training dtype, and times a plain autograd forward-plus-backward at each micro-batch,
with the threads one rank gets, the median of a few runs after a warm-up (a trial reports its
median step, and on this shared VM one run varies from the next by 15-25%: bench/README.md);
with activation checkpointing too (the blocks wrapped as a trial wraps them: the backward then
includes the recomputation). The bytes autograd saves in the forward are counted as
``zerotrain.checkpointing.count_saved_activations`` counts them.
A run of the real engine adds its own work per step (bucket copies, hooks, the reduction's
bookkeeping): the cost model's ``engine_seconds_per_parameter``.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from zerotrain.plan.probe import timed_runs, torch_threads

__all__ = [
    "AloneInGroup",
    "MicroBatchProfile",
    "ModelProfile",
    "is_hf_causal_lm",
    "probe_device",
    "loss_of",
    "profile_model",
]


@dataclass(frozen=True)
class MicroBatchProfile:
    """One micro-batch size, without and with activation checkpointing."""

    forward_backward_s: float
    saved_bytes: int
    checkpointed_forward_backward_s: float
    checkpointed_saved_bytes: int
    largest_block_bytes: int = 0
    """What the largest checkpointed block saves (0: not counted): the activations a
    checkpointed backward holds while recomputing it (an MoE block's, its experts on k times
    the tokens, are several times a dense block's)."""


@dataclass(frozen=True)
class ModelProfile:
    """Per micro-batch size, the model's measured compute and activations."""

    micro_batches: dict[int, MicroBatchProfile]
    layers: int
    """Blocks that checkpointing wraps (one is recomputed at a time)."""


class _Done:
    """An asynchronous collective of :class:`AloneInGroup`, complete when started."""

    def wait(self) -> None:
        return None


class AloneInGroup:
    """Rank 0 of a group of ``world_size`` ranks that is this process alone: what the model
    probe runs a rank's share of a parallel layout over. Its all-to-all hands every rank's rows
    back to the sender (each piece stays where it is: the shapes and copies of a real rank, and
    nothing sent), its all-reduce leaves the tensor as it is, its gathers hear only this rank;
    the cost model prices the wire ([Note: a tensor-parallel rank's share] in tensor_share.py,
    [Note: a sequence-parallel rank's share] in sequence_share.py, [Note: an expert-parallel
    rank's share] in expert_share.py)."""

    rank = 0

    def __init__(self, world_size: int):
        self.world_size = world_size

    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, *_splits, async_op: bool = False, **_kw
    ) -> _Done | None:
        output.copy_(input)
        return _Done() if async_op else None

    def all_reduce(self, *_args, **_kwargs) -> None:
        return None

    def all_gather_object(self, obj: object) -> list[object]:
        return [obj]

    def members(self) -> list[int]:
        return [0]


def probe_device() -> torch.device:
    """Where the planner runs the model and the codecs: the GPU where there is one."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def is_hf_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face model (it has an HF config), called
    ``model(input_ids=..., labels=...)``; the planner's other models are ``model(ids, targets)``."""
    config = getattr(model, "config", None)
    return config is not None and hasattr(config, "model_type")


def loss_of(
    forward, ids: torch.Tensor, hf: bool, sequence: tuple[int, int] | None = None
) -> torch.Tensor:
    """The language-model loss of ``forward`` (the model, or an engine over it) on ``ids``, as
    its own target, in the calling convention ``hf`` says (:func:`is_hf_causal_lm`); with
    ``sequence`` (rank, ranks) of a sequence-parallel group, on that rank's share of the tokens
    (``shard_batch``'s)."""
    if sequence is not None:
        from zerotrain.sequence import shard_batch

        return forward(**shard_batch({"input_ids": ids, "labels": ids}, *sequence)).loss
    return forward(input_ids=ids, labels=ids).loss if hf else forward(ids, ids)


def profile_model(
    factory,
    *,
    micro_batches: list[int],
    seq_len: int,
    vocab_size: int,
    dtype: torch.dtype,
    threads: int,
    prepare: Callable[[nn.Module], object] | None = None,
    sequence_parallel: int = 1,
) -> ModelProfile:
    """Time and count ``factory()``'s forward and backward at each of ``micro_batches`` (see
    [Note: the model probe]), the model first passed to ``prepare`` (which splits it into one
    tensor-parallel rank's share: [Note: a tensor-parallel rank's share] in
    zerotrain/plan/tensor_share.py, or applies Ulysses for one rank of ``sequence_parallel``,
    which is fed rank 0's share of the tokens: [Note: a sequence-parallel rank's share] in
    zerotrain/plan/sequence_share.py)."""
    from zerotrain.activation_checkpointing import count_saved_activations, wrap
    from zerotrain.zero.units import find_unit_modules

    device = probe_device()
    with torch_threads(threads):
        profiles: dict[int, list] = {m: [] for m in micro_batches}
        largest = dict.fromkeys(micro_batches, 0)
        layers = 0
        for checkpointing in (False, True):
            torch.manual_seed(0)
            model = factory().to(device=device, dtype=dtype)
            if prepare is not None:
                prepare(model)
            blocks = find_unit_modules(model)
            if checkpointing:
                layers = len(blocks)
                wrap(model)
                blocks = []  # what a checkpointed block saves is its inputs: not counted
            hf = is_hf_causal_lm(model)
            sequence = (0, sequence_parallel) if sequence_parallel > 1 else None
            params = list(model.parameters())
            for micro in micro_batches:
                ids = torch.randint(0, vocab_size, (micro, seq_len), device=device)
                saved = [0]

                def step(
                    model=model, ids=ids, hf=hf, saved=saved, params=params, sequence=sequence,
                    blocks=blocks, micro=micro,
                ) -> None:  # fmt: skip
                    with count_saved_activations(exclude=params) as counted:
                        with _per_block(blocks, counted) as sizes:
                            loss = loss_of(model, ids, hf, sequence)
                    saved[0] = counted.nbytes
                    if sizes:
                        largest[micro] = max(sizes)
                    loss.backward()
                    for p in params:
                        p.grad = None

                profiles[micro] += [statistics.median(timed_runs(step)), saved[0]]
            del model, params
    return ModelProfile(
        {
            m: MicroBatchProfile(*values, largest_block_bytes=largest[m])
            for m, values in profiles.items()
        },
        layers,
    )


@contextlib.contextmanager
def _per_block(blocks: list[nn.Module], counted) -> Iterator[list[int]]:
    """The bytes ``counted`` (a running count of saved activations) grows by in each forward of
    each of ``blocks``."""
    sizes: list[int] = []
    before: list[int] = []
    handles = []
    for block in blocks:
        handles.append(block.register_forward_pre_hook(lambda *_: before.append(counted.nbytes)))
        handles.append(
            block.register_forward_hook(lambda *_: sizes.append(counted.nbytes - before.pop()))
        )
    try:
        yield sizes
    finally:
        for handle in handles:
            handle.remove()
