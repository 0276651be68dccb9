"""A pipeline stage's share of a model, as the planner prices it: where the model is cut, each
stage's parameters, and each stage's measured forward, backward and saved activations.

[Note: a pipeline stage's share]
The planner cuts the model as ``zerotrain.pipe.split_model`` would be told to: before the
blocks (the items of its outermost ``nn.ModuleList``) that start each of ``degree`` even runs
of them, so a model of 6 blocks at degree 2 is cut before ``blocks.3``. It traces the model
once, with torch's pipeline front end as training does (``trace_stages``), and counts each
stage's parameters as a stage's engine will hold them: a parameter two stages use (the example
GPT's embedding, also its output projection) is held, and trained, by both, its gradient
summed over them every step. The model probe's plain forward and backward of the whole model,
with hooks at the cuts, gives each stage's share: its forward time up to the cut, its backward
from the gradient reaching the cut, the bytes autograd saved in between, and the activation
that crosses the cut (what a stage sends the next per token, and its gradient back).
The cost model then runs 1F1B over those shares ([Note: the planner's cost model]).
Limits: one tensor crosses each cut (split_model's), the model traces as one graph and returns
its logits from ``model(ids)`` (examples/gpt's GPT does; transformers' GPT-2 does not
trace), and it is built here for real.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from zerotrain.estimate.model import ParameterCount
from zerotrain.plan.model_probe import is_hf_causal_lm, loss_of, probe_device
from zerotrain.plan.probe import torch_threads

__all__ = ["PipelineShare", "StageProfile", "cut_points", "median_run", "pipeline_share"]

REPEATS = 3
"""Timed runs per micro-batch after a warm-up; the median one is kept, as the model probe
keeps its median run ([Note: the model probe] in zerotrain/plan/model_probe.py)."""


@dataclass(frozen=True)
class StageProfile:
    """One stage's share of a micro-batch's forward and backward."""

    forward_s: float
    backward_s: float
    saved_bytes: int


@dataclass(frozen=True)
class PipelineShare:
    """The model cut into ``degree`` stages (see [Note: a pipeline stage's share])."""

    degree: int
    split_points: tuple[str, ...]
    """The modules each stage after the first starts at (``split_model``'s argument)."""
    counts: tuple[ParameterCount, ...]
    """Each stage's parameters."""
    shared_elements: int
    """Elements of the parameters several stages hold (tied): all-reduced over them a step."""
    boundary_elements: int
    """Elements per token that cross a cut (the largest cut's): sent forward, and back as a
    gradient, per micro-batch."""
    blocks: int
    """The blocks the model is cut between (a stage holds ``blocks / degree``)."""
    stages: dict[int, tuple[StageProfile, ...]]
    """Per micro-batch size, each stage's measured share."""


def cut_points(model: nn.Module, degree: int) -> tuple[tuple[str, ...], int]:
    """Where ``degree`` stages of ``model`` start (but the first): the blocks that begin each
    of ``degree`` even runs of its outermost ``nn.ModuleList``'s items; and how many blocks
    that list holds. ValueError where it has fewer blocks than stages."""
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no list of blocks to cut into stages")
    name, blocks = min(lists, key=lambda item: item[0].count("."))
    if len(blocks) < degree:
        raise ValueError(f"its {len(blocks)} blocks ({name}) are fewer than {degree} stages")
    return tuple(f"{name}.{len(blocks) * k // degree}" for k in range(1, degree)), len(blocks)


def pipeline_share(
    factory: Callable[[], nn.Module],
    degree: int,
    *,
    micro_batches: list[int],
    seq_len: int,
    vocab_size: int,
    dtype: torch.dtype,
    threads: int,
) -> PipelineShare:
    """``factory()``'s model cut into ``degree`` stages, counted and profiled at each of
    ``micro_batches`` (see [Note: a pipeline stage's share]). ValueError where it cannot be
    cut (no blocks, a model that does not trace, several tensors crossing a cut)."""
    from zerotrain.config import ZERO_DEFAULTS
    from zerotrain.estimate import count_parameters
    from zerotrain.pipe.split import shared_parameters

    torch.manual_seed(0)
    model = factory()
    if is_hf_causal_lm(model):
        raise ValueError("a Hugging Face model does not trace as one graph")
    points, blocks = cut_points(model, degree)
    stages = _traced_stages(model, points, seq_len, vocab_size)
    threshold = ZERO_DEFAULTS.stage3_param_persistence_threshold
    counts = tuple(count_parameters(s, persistence_threshold=threshold) for s in stages)
    shared = sum(param.numel() for param, _ in shared_parameters(stages).values())
    del stages, model
    gc.collect()  # the stages and the tracer's objects are reference cycles holding the model
    profiles, boundary = _profile(
        factory, points, micro_batches, seq_len, vocab_size, dtype, threads
    )
    return PipelineShare(degree, points, counts, shared, boundary, blocks, profiles)


def _traced_stages(
    model: nn.Module, points: tuple[str, ...], seq_len: int, vocab_size: int
) -> list[nn.Module]:
    """``model`` cut before ``points`` as split_model cuts it (traced with one sample)."""
    from zerotrain.config import ConfigError
    from zerotrain.pipe.split import cut_model

    example = torch.randint(0, vocab_size, (1, seq_len))
    try:
        return cut_model(model, (example,), points)
    except ConfigError as error:
        raise ValueError(str(error).removeprefix("split_model: ")) from error


def _profile(
    factory: Callable[[], nn.Module],
    points: tuple[str, ...],
    micro_batches: list[int],
    seq_len: int,
    vocab_size: int,
    dtype: torch.dtype,
    threads: int,
) -> tuple[dict[int, tuple[StageProfile, ...]], int]:
    """Each stage's share of the whole model's forward and backward at each micro-batch, read
    by hooks at the cuts (the median of :data:`REPEATS` runs after a warm-up), and the
    elements per token that cross a cut."""
    from zerotrain.activation_checkpointing import count_saved_activations

    device = probe_device()
    with torch_threads(threads):
        torch.manual_seed(0)
        model = factory().to(device=device, dtype=dtype)
        params = list(model.parameters())
        modules = dict(model.named_modules())
        cuts = _Cuts(device)
        handles = [modules[p].register_forward_pre_hook(cuts.reached) for p in points]
        crossing = 0
        try:
            out: dict[int, tuple[StageProfile, ...]] = {}
            for micro in micro_batches:
                ids = torch.randint(0, vocab_size, (micro, seq_len), device=device)
                runs = []
                for repeat in range(REPEATS + 1):  # the first warms: kernels chosen, memory held
                    cuts.clear()
                    started = _now(device)
                    with count_saved_activations(exclude=params) as saved:
                        cuts.saved = saved
                        loss = loss_of(model, ids, hf=False)  # HF models were refused
                        forward_end = (_now(device), saved.nbytes)
                    cuts.saved = None
                    loss.backward()
                    ended = _now(device)
                    for p in params:
                        p.grad = None
                    if len(cuts.forward) != len(points) or len(cuts.backward) != len(points):
                        raise ValueError(
                            f"the forward did not pass each cut {list(points)} once with a tensor "
                            "that needs a gradient"
                        )
                    crossing = max(crossing, cuts.largest // ids.numel())
                    if repeat == 0:
                        continue
                    stages = _stage_profiles(
                        started, cuts.forward, forward_end, cuts.backward[::-1], ended
                    )
                    runs.append(stages)
                out[micro] = median_run(runs)
        finally:
            for handle in handles:
                handle.remove()
        return out, crossing


def median_run(runs: list[tuple[StageProfile, ...]]) -> tuple[StageProfile, ...]:
    """Of several runs' stage profiles, the run whose whole forward and backward is the median
    (the slower middle one of an even count: a run that happened, its stages' shares kept)."""
    return sorted(runs, key=lambda stages: sum(s.forward_s + s.backward_s for s in stages))[
        len(runs) // 2
    ]


class _Cuts:
    """What the hooks at the cuts saw in one run: when (and after how many saved bytes) each
    cut's forward began, when its gradient arrived (last cut first), the largest tensor that
    crossed."""

    def __init__(self, device: torch.device):
        self.device = device
        self.saved = None  # the forward's count of saved activations, while it runs
        self.clear()

    def clear(self) -> None:
        self.forward: list[tuple[float, int]] = []
        self.backward: list[float] = []
        self.largest = 0

    def reached(self, _module: nn.Module, args: tuple) -> None:
        saved = self.saved.nbytes if self.saved is not None else 0
        self.forward.append((_now(self.device), saved))
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if len(tensors) == 1 and tensors[0].requires_grad:
            self.largest = max(self.largest, tensors[0].numel())
            tensors[0].register_hook(self._gradient_arrived)

    def _gradient_arrived(self, _grad: torch.Tensor) -> None:
        self.backward.append(_now(self.device))


def _stage_profiles(
    started: float,
    forward_marks: list[tuple[float, int]],
    forward_end: tuple[float, int],
    backward_marks: list[float],
    ended: float,
) -> tuple[StageProfile, ...]:
    """Each stage's times and saved bytes from one run's marks: the forward marks in stage
    order, the backward marks (each cut's gradient arriving) in stage order too."""
    starts = [(started, 0), *forward_marks, forward_end]
    # stage k's backward ends when the gradient reaches its own start (the cut before it), the
    # first stage's with the backward; the last stage's begins with the backward
    backward_ends = [ended, *backward_marks]
    backward_starts = [*backward_marks, forward_end[0]]
    return tuple(
        StageProfile(
            forward_s=starts[k + 1][0] - starts[k][0],
            backward_s=backward_ends[k] - backward_starts[k],
            saved_bytes=starts[k + 1][1] - starts[k][1],
        )
        for k in range(len(forward_marks) + 1)
    )


def _now(device: torch.device) -> float:
    """The time, the device's queued work done."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()
