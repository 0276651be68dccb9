"""FLOPs profiler: forward FLOPs, MACs, parameters and latency per module, with DeepSpeed's API.

``FlopsProfiler(model).start_profile()`` before a forward, ``stop_profile()`` after it, then
``print_model_profile()`` / ``get_total_flops()`` / ``get_total_macs()`` /
``get_total_params()`` / ``get_total_duration()`` and ``end_profile()``, as with
``deepspeed.profiling.flops_profiler.FlopsProfiler``; the engine drives it from the
`flops_profiler` config section. It works without the engine too.

[Note: what is counted]
FLOPs are counted with torch's formulas (``torch.utils.flop_counter``'s registry, the one
``FlopCounterMode`` uses): matrix multiplications (``mm``, ``addmm``, ``bmm``, ``baddbmm``),
convolutions and attention, each as 2 x multiply-accumulates (a matmul of (m, k) by (k, n) is
2·m·n·k). Torch registers no formula for the CPU attention kernel
(``_scaled_dot_product_flash_attention_for_cpu``); :class:`FlopCounter` applies torch's
attention formula to it. Element-wise operators (activations, norms, softmax, additions) are
not counted: on transformers they are a few percent. So MACs are exactly FLOPs / 2. Causal
attention is counted as full attention, as torch does. A module's FLOPs are those of every
counted operator that ran between its forward pre-hook and its forward hook (its submodules
included); a module called several times adds up.

[Note: cost and numerics]
A TorchDispatchMode sees every operator in Python: it changes no value (each operator runs
unchanged), but it costs time per operator. ``FlopCounterMode`` also tracks the module
hierarchy (global module hooks, and gradient hooks on every module's inputs); the profiler's
own hooks attribute FLOPs to modules, so :class:`FlopCounter` is a bare mode over torch's
formulas. Measured (best of 7 forwards of 8 sequences, 1 CPU thread): the demo GPT's "tiny"
preset 7.3 ms plain, 10.8 ms under FlopCounter, 19.6 ms under FlopCounterMode; its "demo"
preset 144.5 ms, 152.0 ms (+5%) and 166.3 ms. The first mode entered in a process imports
``torch._dynamo`` (about 1.6 s on a small CPU): :func:`warm_up` pays that outside any timed
region and returns its duration, so that callers leave it out of their timings. Latencies are
wall times between a module's hooks, under the counter; on CUDA the device is synchronized at
each hook, only while profiling.
"""

from __future__ import annotations

import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_flop_count

from zerotrain.fmt import duration, quantity

__all__ = [
    "FlopCounter",
    "FlopsProfiler",
    "ModuleProfile",
    "StepContext",
    "logical_numel",
    "measure_peak_tflops",
    "warm_up",
]


def _cpu_attention_flop(query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _formulas() -> dict:
    formulas = dict(flop_registry)  # overload packet -> formula(*args, out_val=..., **kwargs)
    cpu_attention = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if cpu_attention is not None:
        formulas.setdefault(cpu_attention, _cpu_attention_flop)
    return formulas


class FlopCounter(TorchDispatchMode):
    """Counts the FLOPs of the operators that run inside it (``with FlopCounter() as c:``;
    ``c.flops``), with torch's formulas; see [Note: what is counted] and [Note: cost and
    numerics]."""

    _FORMULAS: dict | None = None

    def __init__(self):
        super().__init__()
        self.flops = 0
        if FlopCounter._FORMULAS is None:
            FlopCounter._FORMULAS = _formulas()
        self._formulas = FlopCounter._FORMULAS

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = self._formulas.get(func._overloadpacket)
        if formula is not None:
            self.flops += formula(*args, **kwargs, out_val=out)
        return out


_warmed_up = False


def warm_up() -> float:
    """Dispatch one operator in a mode once per process, so that the mode's one-time imports
    fall outside any timed region; returns the seconds it took (0 after the first call)."""
    global _warmed_up
    if _warmed_up:
        return 0.0
    start = time.perf_counter()
    with FlopCounter():
        # the imports happen at the first operator dispatched in a mode, not at its entry
        torch.ones(1).add_(1)
    _warmed_up = True
    return time.perf_counter() - start


def logical_numel(param: nn.Parameter) -> int:
    """Elements of ``param``'s logical (full) shape. A partitioned parameter (a ``zero.Init``
    chunk, or at stage 3 an empty placeholder outside its unit's forward) carries DeepSpeed's
    ``ds_numel``, which zerotrain sets for libraries that count parameters
    (``mark_partitioned`` in zerotrain/zero/init.py), as DeepSpeed's own profiler reads it."""
    numel = getattr(param, "ds_numel", None)
    return param.numel() if numel is None else numel


@dataclass
class ModuleProfile:
    """The profile of one module: its subtree's parameters, and the FLOPs and latency of its
    forward calls while profiling."""

    name: str  # "" for the model itself
    type_name: str
    depth: int  # 0 for the model itself
    params: int = 0
    flops: int = 0
    seconds: float = 0.0
    calls: int = 0

    @property
    def macs(self) -> int:
        """Multiply-accumulates: FLOPs / 2 (every counted operator is a matmul-like one)."""
        return self.flops // 2


@dataclass(frozen=True)
class StepContext:
    """What the engine adds to a profile: the step it belongs to and the peak to compare with."""

    step: int  # the optimizer step profiled, counted from 1
    profile_step: int  # the config value (DeepSpeed's meaning: global_steps when it started)
    world_size: int
    micro_batch_size: int
    micro_steps: int  # forward/backward passes per optimizer step
    step_seconds: float  # wall time of the profiled step
    peak_tflops: float  # one device
    peak_source: str  # "given" or how it was measured


@dataclass
class _Open:
    profile: ModuleProfile
    flops: int
    start: float


@dataclass
class _Hooks:
    handles: list = field(default_factory=list)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


class FlopsProfiler:
    """Measures forward FLOPs, MACs, latency and parameters of every module of ``model``
    (DeepSpeed's ``FlopsProfiler`` API; see [Note: what is counted]).

    ``recompute_fwd_factor``: forwards recomputed in backward per forward (activation
    checkpointing), for the hardware FLOPs per step, (3 + factor) x forward.
    """

    def __init__(self, model: nn.Module, *, recompute_fwd_factor: float = 0.0):
        self.model = model
        self.recompute_fwd_factor = recompute_fwd_factor
        self.started = False
        self.profiles: dict[int, ModuleProfile] = {}
        self.warm_up_seconds = 0.0  # the dispatch mode's one-time start-up, not profiled
        self._counter: FlopCounter | None = None
        self._total_flops = 0
        self._hooks = _Hooks()
        self._open: list[_Open] = []
        self._sync = False

    # -- profiling -----------------------------------------------------------------------------
    def start_profile(self, ignore_list: list[type[nn.Module]] | None = None) -> None:
        """Start counting: hooks on every module (except those of a type in ``ignore_list``)
        and a FLOP counter over everything that runs until :meth:`stop_profile`."""
        if self._counter is not None:
            raise RuntimeError("FlopsProfiler.start_profile: already profiling; stop_profile first")
        self.reset_profile()
        self.warm_up_seconds = warm_up()
        self._sync = torch.cuda.is_available() and any(p.is_cuda for p in self.model.parameters())
        ignored = tuple(ignore_list or ())
        for module in self.model.modules():
            if ignored and isinstance(module, ignored):
                continue
            profile = self.profiles[id(module)]
            # prepend: the timing starts before other pre-hooks (stage 3's gather), so a
            # module's latency is what its forward costs, gathering its parameters included
            self._hooks.handles.append(
                module.register_forward_pre_hook(
                    lambda m, args, p=profile: self._enter(p), prepend=True
                )
            )
            self._hooks.handles.append(
                module.register_forward_hook(
                    lambda m, args, out, p=profile: self._exit(p), always_call=True
                )
            )
        self._counter = FlopCounter()
        self._counter.__enter__()
        self.started = True

    def stop_profile(self) -> None:
        """Stop counting; the profile stays readable until :meth:`end_profile`."""
        if self._counter is not None:
            self._total_flops += self._counter.flops
            self._counter.__exit__(None, None, None)
            self._counter = None
        self._hooks.remove()
        self._open.clear()

    def reset_profile(self) -> None:
        """Zero every module's counts (parameters are counted afresh)."""
        self.profiles = {}
        for name, module in self.model.named_modules():
            params = sum(logical_numel(p) for p in module.parameters())
            depth = 0 if not name else name.count(".") + 1
            self.profiles[id(module)] = ModuleProfile(name, type(module).__name__, depth, params)
        self._total_flops = 0
        self._open.clear()

    def end_profile(self) -> None:
        """Stop profiling and drop the profile."""
        self.stop_profile()
        self.profiles = {}
        self._total_flops = 0
        self.started = False

    def _now(self) -> float:
        if self._sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _enter(self, profile: ModuleProfile) -> None:
        if self._counter is not None:
            self._open.append(_Open(profile, self._counter.flops, self._now()))

    def _exit(self, profile: ModuleProfile) -> None:
        if self._counter is None or not self._open or self._open[-1].profile is not profile:
            return  # a forward that raised left its entries: the stack is cleared on stop
        opened = self._open.pop()
        profile.seconds += self._now() - opened.start
        profile.flops += self._counter.flops - opened.flops
        profile.calls += 1

    # -- totals (DeepSpeed's names) ------------------------------------------------------------
    def _root(self) -> ModuleProfile:
        if not self.profiles:
            raise RuntimeError("FlopsProfiler: nothing profiled; call start_profile first")
        return self.profiles[id(self.model)]

    def get_total_flops(self, as_string: bool = False) -> int | str:
        """Forward FLOPs counted while profiling (see [Note: what is counted])."""
        total = self._total_flops + (self._counter.flops if self._counter else 0)
        return quantity(total) if as_string else total

    def get_total_macs(self, as_string: bool = False) -> int | str:
        """Forward multiply-accumulates: FLOPs / 2."""
        total = int(self.get_total_flops()) // 2
        return quantity(total) if as_string else total

    def get_total_params(self, as_string: bool = False) -> int | str:
        """Parameters of the model, at their logical shapes (whole, also at stage 3)."""
        total = self._root().params
        return quantity(total) if as_string else total

    def get_total_duration(self, as_string: bool = False) -> float | str:
        """Seconds spent in the model's forward while profiling."""
        total = self._root().seconds
        return duration(total) if as_string else total

    # -- output --------------------------------------------------------------------------------
    def print_model_profile(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | os.PathLike[str] | None = None,
        step: StepContext | None = None,
    ) -> None:
        """Print the profile (DeepSpeed's arguments): totals, the ``top_modules`` per depth by
        MACs, parameters and latency, and with ``detailed`` the module tree to
        ``module_depth`` (-1: all). ``output_file`` writes it there instead of stdout.
        ``step`` (the engine passes it) adds the per-step FLOPs, TFLOP/s and utilisation."""
        text = self.model_profile_text(profile_step, module_depth, top_modules, detailed, step)
        if output_file:
            path = Path(output_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        else:
            sys.stdout.write(text)
            sys.stdout.flush()

    def model_profile_text(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        step: StepContext | None = None,
    ) -> str:
        """The text :meth:`print_model_profile` prints."""
        root = self._root()
        flops = int(self.get_total_flops())
        title = (
            f"optimizer step {step.step} (flops_profiler.profile_step {step.profile_step}), "
            "forward of its first micro-batch on rank 0"
            if step is not None
            else f"step {profile_step}"
        )
        lines = [
            "",
            "-" * 30 + " zerotrain flops profiler " + "-" * 30,
            f"Profile of {title}",
            "Counted: matrix multiplications, convolutions and attention "
            "(torch.utils.flop_counter's formulas); MACs = FLOPs / 2; element-wise operations "
            "not counted.",
            "",
        ]
        rows: list[tuple[str, str]] = []
        if step is not None:
            rows += [
                ("world size", str(step.world_size)),
                ("micro-batch size per rank", str(step.micro_batch_size)),
                ("micro-batches per step per rank", str(step.micro_steps)),
            ]
        rows += [
            ("params (whole model)", quantity(root.params)),
            ("fwd MACs per micro-batch", quantity(flops // 2)),
            ("fwd FLOPs per micro-batch", quantity(flops)),
            ("fwd latency", duration(root.seconds)),
            ("fwd FLOP/s = fwd FLOPs / fwd latency", _rate(flops, root.seconds)),
        ]
        if step is not None:
            factor = 3 + self.recompute_fwd_factor
            per_step = factor * flops * step.micro_steps * step.world_size
            achieved = per_step / step.world_size / step.step_seconds
            rows += [
                (
                    f"fwd+bwd FLOPs per step = {factor:g} x fwd FLOPs x {step.micro_steps} "
                    f"micro-batches x {step.world_size} ranks",
                    quantity(per_step),
                ),
                ("step latency", duration(step.step_seconds)),
                ("achieved per rank = FLOPs per step / ranks / step latency", _rate(achieved, 1)),
                (f"peak per device ({step.peak_source})", f"{step.peak_tflops:.3g} TFLOP/s"),
                (
                    "utilisation = achieved / peak",
                    f"{100 * achieved / 1e12 / step.peak_tflops:.1f}%",
                ),
            ]
        width = max(len(name) for name, _ in rows) + 2
        lines += [f"{name:<{width}}{value}" for name, value in rows]
        lines += ["", *self._top_modules_lines(module_depth, top_modules)]
        if detailed:
            lines += ["", *self._tree_lines(module_depth, root, flops)]
        lines += ["-" * 86, ""]
        return "\n".join(lines)

    def _top_modules_lines(self, module_depth: int, top_modules: int) -> list[str]:
        # DeepSpeed's aggregated profile: per depth, modules summed by type
        by_depth: dict[int, dict[str, list[float]]] = defaultdict(
            lambda: defaultdict(lambda: [0, 0, 0.0])
        )
        for profile in self.profiles.values():
            if module_depth == -1 or profile.depth <= module_depth:
                totals = by_depth[profile.depth][profile.type_name]
                totals[0] += profile.macs
                totals[1] += profile.params
                totals[2] += profile.seconds
        lines = [
            f"Top {top_modules} module type(s) per depth by fwd MACs, params and fwd latency "
            "(summed over the modules of that type at that depth):"
        ]
        for depth in sorted(by_depth):
            types = by_depth[depth]
            lines.append(f"depth {depth}:")
            for label, index, show in (
                ("MACs", 0, quantity),
                ("params", 1, quantity),
                ("fwd latency", 2, duration),
            ):
                top = sorted(types.items(), key=lambda kv, i=index: -kv[1][i])[:top_modules]
                shown = ", ".join(f"{name} {show(values[index])}" for name, values in top)
                lines.append(f"    {label:<12}{shown}")
        return lines

    def _tree_lines(self, module_depth: int, root: ModuleProfile, flops: int) -> list[str]:
        lines = [
            "Per module (indented by depth): params, fwd MACs, fwd latency (share of the "
            "model's), fwd FLOP/s"
        ]
        for profile in self.profiles.values():
            if module_depth != -1 and profile.depth > module_depth:
                continue
            label = profile.name.rsplit(".", 1)[-1] if profile.name else "(model)"
            line = (
                f"{'  ' * profile.depth}{label} {profile.type_name}: "
                f"{quantity(profile.params)} params ({_share(profile.params, root.params)}), "
            )
            if profile.calls:
                line += (
                    f"{quantity(profile.macs)} MACs ({_share(profile.flops, flops)}), "
                    f"{duration(profile.seconds)} ({_share(profile.seconds, root.seconds)}), "
                    f"{_rate(profile.flops, profile.seconds)}"
                )
            else:  # a container (ModuleList) or a module the forward did not call
                line += "forward not called"
            lines.append(line)
        return lines


def measure_peak_tflops(
    dtype: torch.dtype, device: torch.device, seconds: float = 0.25
) -> tuple[float, str]:
    """Peak TFLOP/s of ``device`` in ``dtype``, measured by square matmuls for about
    ``seconds``; returns (TFLOP/s, a description). Draws no random numbers (the training's
    generators are left alone)."""
    n = 4096 if device.type == "cuda" else 1024
    a = torch.full((n, n), 0.5, dtype=dtype, device=device)
    b = torch.full((n, n), 0.25, dtype=dtype, device=device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(2):
        torch.mm(a, b)
    sync()
    reps, start = 0, time.perf_counter()
    while True:
        torch.mm(a, b)
        reps += 1
        if reps % 4 == 0:
            sync()
            if time.perf_counter() - start >= seconds:
                break
    elapsed = time.perf_counter() - start
    tflops = 2 * n**3 * reps / elapsed / 1e12
    dtype_name = str(dtype).removeprefix("torch.")
    return tflops, f"measured: {n}x{n} {dtype_name} matmul"


# -- formatting -----------------------------------------------------------------------------
def _rate(flops: float, seconds: float) -> str:
    return quantity(flops / seconds, "FLOP/s") if seconds > 0 else "-"


def _share(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"
