"""Step metrics: one record per optimizer step, for the throughput line and the monitors.

The engine feeds :class:`StepMetrics` as it runs (the loss each ``backward`` saw, the input of
each forward, the times of forward, backward and step); at each accumulation boundary
:meth:`StepMetrics.finish_step` closes the step and, on a step that is reported, returns a
:class:`StepRecord`.

[Note: what a step record costs]
On a step that neither prints nor is monitored, the metrics cost a few ``perf_counter`` calls
and a list append per micro-step: the loss tensors are kept, never read, so no device sync and
no collective is added. On a reported step the losses are summed on the device and one
all-reduce of two float64 numbers (sum, count) gives the mean over micro-steps and ranks; that
``.item()`` is the only sync; memory is read from host-side counters.

[Note: model FLOPs]
TFLOP/s counts model FLOPs, as MFU does (PaLM, arXiv:2204.02311, App. B): 3 x the forward
FLOPs of the step's micro-batches (backward costs two matmuls per forward matmul), without the
forwards that activation checkpointing recomputes. The forward FLOPs of one micro-batch are
counted once, on rank 0, in the first micro-step of the first step that prints or is monitored,
with torch's FLOP formulas (see [Note: what is counted] in flops_profiler.py), or taken from
the flops profiler if it ran first; every micro-batch is assumed to have that one's shape. The
counter's one-time start-up is left out of that step's time; its per-operator overhead (small
next to real matmuls) is not.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from zerotrain.accelerator import current_rss, peak_rss
from zerotrain.comm import Communicator
from zerotrain.comm.link import PROBE
from zerotrain.fmt import GB, MB, clock, quantity
from zerotrain.observability.flops_profiler import FlopCounter, warm_up

__all__ = ["MemoryUse", "StepMetrics", "StepRecord", "memory_use", "sequence_length"]

_PHASES = ("forward", "backward", "step")


@dataclass(frozen=True)
class MemoryUse:
    """This rank's memory. On CUDA (``kind="cuda"``) the bytes allocated by tensors now and at
    their peak (``max_memory_allocated``); on CPU (``kind="rss"``) the process's resident set
    now and at its peak (:func:`zerotrain.accelerator.peak_rss`)."""

    kind: str
    current_bytes: int | None  # None where the platform does not say
    peak_bytes: int | None


def memory_use(device: torch.device) -> MemoryUse:
    """This rank's memory on ``device`` (see :class:`MemoryUse`); reads counters, no sync."""
    if device.type == "cuda":
        return MemoryUse(
            "cuda", torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
        )
    return MemoryUse("rss", current_rss(), peak_rss())


def sequence_length(args: tuple, kwargs: dict) -> int | None:
    """The sequence length of a forward's input: dim 1 of its first tensor argument (or of the
    ``input_ids`` keyword) when that is an integer tensor with at least 2 dims (token ids);
    None otherwise."""
    tensor = next((a for a in args if isinstance(a, torch.Tensor)), kwargs.get("input_ids"))
    if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2:
        return None
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        return None
    return tensor.shape[1]


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step as the throughput line and the monitors report it."""

    step: int  # engine.global_steps after the step, from 1
    loss: float | None  # mean over the step's micro-steps and all ranks; None without backward
    lr: tuple[float, ...]  # per parameter group, as used by this step's update
    grad_norm: float | None  # global, before clipping
    loss_scale: float
    skipped_steps: int  # so far (fp16 overflow)
    seconds: float  # wall time from the end of the previous step to the end of this one
    samples: int  # over all ranks
    tokens: int | None  # over all ranks; None: the input has no sequence dimension
    model_flops: float | None  # fwd+bwd over all ranks (see [Note: model FLOPs])
    world_size: int
    memory: MemoryUse
    times: dict[str, float] = field(default_factory=dict)  # forward/backward/step seconds

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds

    @property
    def tokens_per_second(self) -> float | None:
        return None if self.tokens is None else self.tokens / self.seconds

    @property
    def tflops_per_rank(self) -> float | None:
        if self.model_flops is None:
            return None
        return self.model_flops / self.world_size / self.seconds / 1e12

    def scalars(self, with_times: bool = False) -> dict[str, float]:
        """The values the monitors write, by name (docs/monitoring.md); ``with_times`` adds
        the forward/backward/step milliseconds."""
        out: dict[str, float] = {}
        if self.loss is not None:
            out["Train/loss"] = self.loss
        out["Train/lr"] = self.lr[0]
        out.update({f"Train/lr_group{i}": lr for i, lr in enumerate(self.lr) if i > 0})
        if self.grad_norm is not None:
            out["Train/grad_norm"] = self.grad_norm
        out["Train/loss_scale"] = self.loss_scale
        out["Train/samples_per_second"] = self.samples_per_second
        if self.tokens_per_second is not None:
            out["Train/tokens_per_second"] = self.tokens_per_second
        if self.tflops_per_rank is not None:
            out["Train/tflops_per_rank"] = self.tflops_per_rank
        kind = "cuda_allocated" if self.memory.kind == "cuda" else "rss"
        if self.memory.current_bytes is not None:
            out[f"Train/memory_{kind}_gb"] = self.memory.current_bytes / GB
        if self.memory.peak_bytes is not None:
            out[f"Train/memory_peak_{kind}_gb"] = self.memory.peak_bytes / GB
        if with_times:
            out.update({f"Train/{name}_ms": s * 1e3 for name, s in self.times.items()})
        return out


@dataclass
class _Window:
    """Sums over the steps since the last printed line."""

    steps: int = 0
    seconds: float = 0.0
    samples: int = 0
    tokens: int | None = 0  # None once a step had no sequence dimension
    times: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_PHASES, 0.0))


class StepMetrics:
    """Collects what each optimizer step did (see [Note: what a step record costs])."""

    def __init__(
        self,
        comm: Communicator,
        device: torch.device,
        *,
        train_batch_size: int,
        micro_steps: int,
        count_flops: bool = True,
        sequence_shares: int = 1,
    ):
        """``sequence_shares``: how many ranks hold shares of each sample (the sequence-parallel
        degree): a forward's input is one share, the tokens of a step are that many times
        it."""
        self.comm = comm
        self.sequence_shares = sequence_shares
        self.device = device
        self.train_batch_size = train_batch_size
        self.micro_steps = micro_steps  # per optimizer step
        # only rank 0 reports, so only rank 0 counts
        self.count_flops = count_flops and comm.rank == 0
        self.forward_flops: int | None = None  # one micro-batch, see [Note: model FLOPs]
        self.last_step_seconds: float | None = None
        self._losses: list[torch.Tensor] = []
        self._seq_len: int | None = None
        self._step_start: float | None = None
        self._excluded = 0.0  # one-time set-up inside the current step, left out of its time
        self._times = dict.fromkeys(_PHASES, 0.0)
        self._window = _Window()
        self._comm_mark = self._comm_totals()

    # -- fed by the engine every micro-step ------------------------------------------------------
    def start_micro_step(self, now: float) -> None:
        """A forward begins; the first one after construction starts the first step's clock."""
        if self._step_start is None:
            self._step_start = now

    def observe_forward(self, args: tuple, kwargs: dict, seconds: float) -> None:
        """A training forward ran on ``args``/``kwargs`` in ``seconds``."""
        self._seq_len = sequence_length(args, kwargs)
        self._times["forward"] += seconds

    def observe_loss(self, loss: torch.Tensor) -> None:
        """The loss ``backward`` got (kept on the device; read only on reported steps)."""
        self._losses.append(loss.detach())

    def add_time(self, phase: str, seconds: float) -> None:
        """Seconds spent in ``phase`` ("backward", "step") during this step."""
        self._times[phase] += seconds

    def exclude(self, seconds: float, phase: str | None = None) -> None:
        """Leave ``seconds`` of one-time work out of the current step's time (and out of
        ``phase``'s time, if it was spent inside that phase)."""
        self._excluded += seconds
        if phase is not None:
            self._times[phase] -= seconds

    def wants_flops(self) -> bool:
        """Whether the next reported step should count the forward FLOPs."""
        return self.count_flops and self.forward_flops is None

    @contextlib.contextmanager
    def counting_flops(self) -> Iterator[None]:
        """Count the FLOPs of the forward run inside (see [Note: model FLOPs])."""
        self.exclude(warm_up(), "forward")
        with FlopCounter() as counter:
            yield
        self.forward_flops = counter.flops

    # -- at each accumulation boundary ---------------------------------------------------------
    def finish_step(
        self,
        *,
        step: int,
        lr: list[float],
        grad_norm: float | None,
        loss_scale: float,
        skipped_steps: int,
        report: bool,
    ) -> StepRecord | None:
        """Close the step that just ended. With ``report`` (every rank passes the same value:
        it all-reduces the loss) returns its record; otherwise None, having read nothing from
        the device."""
        now = time.perf_counter()
        start = now if self._step_start is None else self._step_start
        seconds = max(now - start - self._excluded, 1e-9)
        tokens = (
            None
            if self._seq_len is None
            else self.train_batch_size * self._seq_len * self.sequence_shares
        )
        window = self._window
        window.steps += 1
        window.seconds += seconds
        window.samples += self.train_batch_size
        window.tokens = None if tokens is None or window.tokens is None else window.tokens + tokens
        for phase, value in self._times.items():
            window.times[phase] += value
        record = None
        if report:
            record = StepRecord(
                step=step,
                loss=self._global_mean_loss(),
                lr=tuple(lr),
                grad_norm=grad_norm,
                loss_scale=loss_scale,
                skipped_steps=skipped_steps,
                seconds=seconds,
                samples=self.train_batch_size,
                tokens=tokens,
                model_flops=self._model_flops(1),
                world_size=self.comm.world_size,
                memory=memory_use(self.device),
                times=dict(self._times),
            )
        self.last_step_seconds = seconds
        self._losses.clear()
        self._step_start = now
        self._excluded = 0.0
        self._times = dict.fromkeys(_PHASES, 0.0)
        return record

    def _global_mean_loss(self) -> float | None:
        if self._losses:
            local = torch.stack([loss.to(torch.float64) for loss in self._losses]).sum()
        else:
            local = torch.zeros((), dtype=torch.float64, device=self.device)
        # (sum, count): ranks may have seen different numbers of losses
        totals = torch.stack([local, local.new_tensor(float(len(self._losses)))])
        totals = totals.to(self.comm.device)
        self.comm.all_reduce(totals)
        total, count = totals.tolist()
        return total / count if count else None

    def _model_flops(self, steps: int) -> float | None:
        if self.forward_flops is None:
            return None
        return 3.0 * self.forward_flops * self.micro_steps * self.comm.world_size * steps

    def _comm_totals(self) -> tuple[float, int]:
        # comm_compression.auto's link probes are not the step's traffic
        stats = [s for name, s in self.comm.stats.items() if name != PROBE]
        return sum(s.seconds for s in stats), sum(s.sent for s in stats)

    def throughput_line(
        self,
        record: StepRecord,
        wall_clock_breakdown: bool = False,
        total_steps: int | None = None,
    ) -> str:
        """The line printed every ``steps_per_print`` steps: ``record``'s values, with rates
        averaged over the steps since the previous line; starts the next window (call it on
        every rank). With ``total_steps``: ``step N/total`` and the time left at the window's
        rate."""
        window, self._window = self._window, _Window()
        comm_now = self._comm_totals()
        comm_seconds = comm_now[0] - self._comm_mark[0]
        comm_sent = comm_now[1] - self._comm_mark[1]
        self._comm_mark = comm_now
        if total_steps is None or total_steps < record.step:  # past a schedule's end: no ETA
            parts = [f"[zerotrain] step {record.step}"]
        else:
            left = max(0, total_steps - record.step) * window.seconds / window.steps
            parts = [f"[zerotrain] step {record.step}/{total_steps}", f"ETA {clock(left)}"]
        parts.append("loss -" if record.loss is None else f"loss {record.loss:.4g}")
        lrs = [f"{lr:.3g}" for lr in record.lr]
        parts.append(f"lr {lrs[0]}" if len(lrs) == 1 else f"lr [{', '.join(lrs)}]")
        parts.append(f"{quantity(window.samples / window.seconds)} samples/s")
        if window.tokens is not None:
            parts.append(f"{quantity(window.tokens / window.seconds)} tokens/s")
        flops = self._model_flops(window.steps)
        if flops is not None:
            tflops = flops / self.comm.world_size / window.seconds / 1e12
            parts.append(f"{tflops:.3g} TFLOP/s per rank")
        parts.append(_memory_text(record.memory))
        parts.append(f"grad norm {record.grad_norm or 0:.4g}")
        parts.append(f"loss scale {record.loss_scale:g}")
        parts.append(f"skipped {record.skipped_steps}")
        parts.append(f"{window.seconds / window.steps:.3f} s/step")
        if wall_clock_breakdown:
            n = window.steps
            parts.append(
                ", ".join(
                    f"{name} {value / n * 1e3:.1f} ms" for name, value in window.times.items()
                )
            )
            # the time the training thread waited for collectives: what overlap did not hide
            parts.append(
                f"communication: {comm_seconds / n * 1e3:.1f} ms exposed, "
                f"{comm_sent / n / MB:.2f} MB sent per step"
            )
        return " | ".join(parts)


def _memory_text(memory: MemoryUse) -> str:
    label = "CUDA allocated" if memory.kind == "cuda" else "RSS"
    # one prefix, so that the lines of a run compare at a glance
    current = (
        "?" if memory.current_bytes is None else quantity(memory.current_bytes, "B", prefix="G")
    )
    peak = (
        ""
        if memory.peak_bytes is None
        else f" (peak {quantity(memory.peak_bytes, 'B', prefix='G')})"
    )
    return f"{label} {current}{peak}"
