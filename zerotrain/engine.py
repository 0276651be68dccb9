"""The training engine: forward, backward with accumulation and loss scaling, ZeRO step."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from zerotrain.backward import BackwardState, MicroStepBackward
from zerotrain.checkpoint.background import CheckpointWriter
from zerotrain.checkpoint.files import write_state_dict
from zerotrain.checkpoint.load import REQUIRE_RESUME_ENV, LoadOptions
from zerotrain.checkpoint.protocol import ModelLayout
from zerotrain.comm import Communicator, get_world_group, local_rank
from zerotrain.config import OffloadDeviceEnum, OffloadStateTypeEnum, ZeroTrainConfig
from zerotrain.engine_queries import DeepSpeedQueries
from zerotrain.observability.flops_profiler import FlopsProfiler, StepContext, measure_peak_tflops
from zerotrain.observability.metrics import StepMetrics
from zerotrain.observability.monitor import MonitorMaster
from zerotrain.optim import NoOptimizer
from zerotrain.precision import autocast
from zerotrain.zero import ZeroOptimizer
from zerotrain.zero.memory import memory_breakdown
from zerotrain.zero.model_state import frozen_keys, full_masters, untrained_state


class ZeroTrainEngine(DeepSpeedQueries, nn.Module):
    """Wraps a model for ZeRO data-parallel training; DeepSpeed's engine method names.

    ``engine(*args)`` runs the model, ``engine.backward(loss)`` (or ``loss.backward()``)
    accumulates (and, per the ZeRO stage, reduces) gradients, ``engine.step()`` updates at each
    accumulation boundary. Built by :func:`zerotrain.initialize`. Every `steps_per_print` steps
    rank 0 prints a throughput line, and the enabled monitors get every step's scalars
    (docs/monitoring.md). ``engine.config`` is the config as given (a dict, as DeepSpeed keeps
    it); ``engine.zerotrain_config`` the validated one. Attributes the engine does not have are
    looked up on the wrapped model, as in DeepSpeed (``engine.generate(...)``).
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: ZeroOptimizer,
        lr_scheduler,
        config: ZeroTrainConfig,
        comm: Communicator,
        device: torch.device,
        training_dataloader=None,
        *,
        layout: ModelLayout,
        raw_config: dict[str, Any] | None = None,
        client_optimizer_name: str | None = None,
    ):
        super().__init__()
        self.module = module
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.config = raw_config if raw_config is not None else config.model_dump()
        self.zerotrain_config = config
        self._client_optimizer_name = client_optimizer_name
        self.comm = comm
        self.layout = layout  # which ranks hold which parameters (zerotrain/parallel)
        self.device = device
        self.training_dataloader = training_dataloader
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self._step_applied = False
        self._compiled = False
        self._total_steps: int | None = None
        self.metrics = StepMetrics(
            comm,
            device,
            train_batch_size=config.batch_sizes().train_batch_size,
            micro_steps=config.batch_sizes().gradient_accumulation_steps,
            count_flops=config.count_model_flops,
            sequence_shares=layout.sequence_shares,
        )
        self.monitor = MonitorMaster(config, comm.rank)
        profiler = config.flops_profiler
        self.flops_profiler = None  # rank 0 profiles, as in DeepSpeed
        if profiler.enabled and comm.rank == 0:
            self.flops_profiler = FlopsProfiler(
                module, recompute_fwd_factor=profiler.recompute_fwd_factor
            )
        self._profiling_step = False  # the current step's forward was profiled
        self._profiled = False  # once per run
        self._boundary_override: bool | None = None  # set_gradient_accumulation_boundary
        # saves, the asynchronous one in flight, in-memory snapshots
        self._checkpoints = CheckpointWriter(comm, config.checkpoint)
        self._backward = MicroStepBackward(
            optimizer,
            optimizer.trained_params(),
            accumulation_steps=self.gradient_accumulation_steps,
            loss_scaled=lambda: optimizer.loss_scaler.dynamic or optimizer.loss_scale != 1.0,
            at_boundary=self.is_gradient_accumulation_boundary,
            on_finish=lambda seconds: self.metrics.add_time("backward", seconds),
        )

    def __getattr__(self, name: str):
        """Parameters, buffers and submodules as ``nn.Module`` finds them, then the wrapped
        model's attributes (DeepSpeed's engine does the same)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self._modules.get("module")
            if module is None or not hasattr(module, name):
                raise
            return getattr(module, name)

    # -- identity ----------------------------------------------------------------------------
    @property
    def global_rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def local_rank(self) -> int:
        return local_rank()

    @property
    def dp_world_size(self) -> int:
        """The data-parallel ranks (DeepSpeed's attribute): the world over the tensor- and
        sequence-parallel degrees and the pipeline stages."""
        return self.layout.data_parallel_size

    @property
    def mp_world_size(self) -> int:
        """The tensor-parallel degree (DeepSpeed's attribute; 1 without tensor parallelism)."""
        return self.layout.split_degree

    @property
    def data_parallel_group(self):
        """The process group gradients are averaged over (DeepSpeed's attribute)."""
        group = self.optimizer.comm.group
        return group if group is not None else get_world_group()

    # -- training ----------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        cast = self.auto_cast_dtype()
        if cast is not None:
            args, kwargs = pytree.tree_map(functools.partial(_cast, dtype=cast), (args, kwargs))
        precision = autocast(self.optimizer.precision, self.device)  # torch_autocast's
        if not torch.is_grad_enabled():  # evaluation: not part of a training step's metrics
            with self._input_dtype_hint(args, kwargs), precision:
                return self.module(*args, **kwargs)
        start = time.perf_counter()
        self.metrics.start_micro_step(start)
        self.optimizer.begin_forward()
        try:
            with self._instrumented_forward(), self._input_dtype_hint(args, kwargs), precision:
                out = self.module(*args, **kwargs)
        finally:
            self.optimizer.end_forward()
        self._backward.watch(out)  # for loss.backward(): see backward.py
        self.metrics.observe_forward(args, kwargs, time.perf_counter() - start)
        return out

    @contextlib.contextmanager
    def _input_dtype_hint(self, args: tuple, kwargs: dict) -> Iterator[None]:
        """A forward that fails on a dtype mismatch while it was given fp32 tensors and the
        weights are 16-bit gets the fix added to torch's message (which names neither)."""
        try:
            yield
        except RuntimeError as error:
            weights = self.optimizer.precision.param_dtype
            wide = [
                name
                for name, value in [*enumerate(args), *kwargs.items()]
                if torch.is_tensor(value) and value.dtype in (torch.float32, torch.float64)
            ]
            if weights.itemsize != 2 or not wide or not _DTYPE_MISMATCH.search(str(error)):
                raise
            section = "bf16" if weights == torch.bfloat16 else "fp16"
            names = ", ".join(f"argument {n}" if isinstance(n, int) else n for n in wide)
            raise RuntimeError(
                f"{error}\nzerotrain: engine(...) got float32/float64 tensors ({names}) while "
                f"the model's weights are {str(weights).removeprefix('torch.')} "
                f"({section}.enabled): cast them before the call, or set "
                f"{section}.auto_cast: true to have the engine cast floating-point arguments"
            ) from error

    @property
    def total_steps(self) -> int | None:
        """The optimizer steps this run takes, for the throughput line's ``step N/total`` and
        ETA: what was set (``engine.total_steps = N``), else the LR schedule's
        ``total_num_steps`` where it has one (WarmupDecayLR, WarmupCosineLR), else None."""
        if self._total_steps is not None:
            return self._total_steps
        return getattr(self.lr_scheduler, "total_num_steps", None)

    @total_steps.setter
    def total_steps(self, steps: int | None) -> None:
        self._total_steps = steps

    def _reports(self, step: int) -> bool:
        """Whether optimizer step ``step`` (from 1) prints or is monitored."""
        return self.monitor.enabled or self._prints(step)

    def _prints(self, step: int) -> bool:
        every = self.zerotrain_config.steps_per_print
        return every is not None and step % every == 0

    def _instrumented_forward(self):
        """The flops profiler at its step, the FLOP count for the throughput once (see
        [Note: model FLOPs] in metrics.py), or nothing: both on the first micro-step only."""
        if self.micro_steps % self.gradient_accumulation_steps() != 0:
            return contextlib.nullcontext()
        profile_step = self.zerotrain_config.flops_profiler.profile_step
        if self.flops_profiler and not self._profiled and self.global_steps == profile_step:
            return self._profiled_forward(self.flops_profiler)
        if self.metrics.wants_flops() and self._reports(self.global_steps + 1):
            return self.metrics.counting_flops()
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _profiled_forward(self, profiler: FlopsProfiler):
        profiler.start_profile()
        self.metrics.exclude(profiler.warm_up_seconds, "forward")
        try:
            yield
        finally:
            profiler.stop_profile()
        self._profiling_step = self._profiled = True
        if self.metrics.forward_flops is None and self.metrics.count_flops:
            self.metrics.forward_flops = int(profiler.get_total_flops())

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-step ends an accumulation (the next step() updates):
        every `gradient_accumulation_steps`-th micro-step, unless
        :meth:`set_gradient_accumulation_boundary` decided."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Decide yourself whether the current micro-step ends an accumulation, as DeepSpeed
        lets frameworks do (Accelerate); None returns to counting micro-steps. Losses are still
        divided by `gradient_accumulation_steps`."""
        self._boundary_override = None if is_boundary is None else bool(is_boundary)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside do not reduce gradients, even at an accumulation boundary;
        the next boundary backward outside reduces everything accumulated (stages 0-1, whose
        gradients accumulate unreduced until then). At stages 2-3 each backward must
        reduce-scatter its gradients into the partitions, so this raises, as in DeepSpeed."""
        if self.optimizer.every_backward:
            raise RuntimeError(
                f"engine.no_sync(): ZeRO stage {self.zero_optimization_stage()} partitions "
                "gradients, so every "
                "backward reduces them; use it at stage 0 or 1, or leave it out (gradient "
                "accumulation needs no no_sync: only the boundary's step() updates)"
            )
        previous, self._backward.reduce = self._backward.reduce, False
        try:
            yield
        finally:
            self._backward.reduce = previous

    def compile(
        self,
        backend: str = "inductor",
        compile_kwargs: dict[str, Any] | None = None,
        schedule=None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """``torch.compile`` the wrapped model in place (``module.compile``), as DeepSpeed does
        without DeepCompile; a second call does nothing. At stage 3 the gather hooks run
        eagerly between the compiled regions (zerotrain/zero/unit_cycle.py)."""
        if schedule is not None or compiled_autograd_enabled:
            raise ValueError(
                "engine.compile(schedule=..., compiled_autograd_enabled=...): these configure "
                "DeepSpeed's DeepCompile, which zerotrain does not have; leave them out"
            )
        if not self._compiled:
            self.module.compile(backend=backend, **(compile_kwargs or {}))
            self._compiled = True

    @property
    def is_compiled(self) -> bool:
        return self._compiled

    def offload_states(
        self,
        include=None,
        device: OffloadDeviceEnum | str = OffloadDeviceEnum.cpu,
        pin_memory: bool = True,
        non_blocking: bool = False,
    ) -> None:
        """Move the optimizer states, master weights and gradient buffers to CPU memory until
        :meth:`reload_states` (DeepSpeed's name). On a CPU device they are there already, so
        it checks its arguments and does nothing; on CUDA it is not implemented yet."""
        states = [OffloadStateTypeEnum(item) for item in include] if include is not None else []
        del states, pin_memory, non_blocking  # validated above
        device = OffloadDeviceEnum(device)
        if device is OffloadDeviceEnum.nvme:
            raise ValueError("offload_states: NVMe is not supported; use device='cpu'")
        if device is OffloadDeviceEnum.none or self.device.type == "cpu":
            return
        raise NotImplementedError(
            f"engine.offload_states on {self.device.type}: zerotrain does not move states off "
            "the GPU yet"
        )

    def reload_states(self, non_blocking: bool = False) -> None:
        """Undo :meth:`offload_states` (a no-op on a CPU device, where nothing moved)."""
        del non_blocking
        if self.device.type != "cpu":
            raise NotImplementedError(
                f"engine.reload_states on {self.device.type}: zerotrain does not move states off "
                "the GPU yet"
            )

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Backpropagate ``loss`` (divided by the accumulation steps, times the fp16 loss scale)
        and reduce gradients as the ZeRO stage requires. Returns ``loss``.

        ``loss.backward()`` on a loss computed from ``engine(...)``'s outputs does the same
        (see [Note: loss.backward() without engine.backward] in backward.py)."""
        _check_loss(loss, "engine.backward")
        scale = self.optimizer.loss_scale
        if scale_wrt_gas:
            scale /= self.gradient_accumulation_steps()
            self.metrics.observe_loss(loss)
        else:
            # the caller divided by the accumulation steps itself (Lightning's automatic
            # optimization does): report the loss it computed, as DeepSpeed's sum over the
            # micro-steps of what backward got does
            self.metrics.observe_loss(loss.detach() * self.gradient_accumulation_steps())
        with self._backward.managed():
            (loss.float() * scale).backward(retain_graph=retain_graph)
        return loss

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the fp16 loss scale and divided by the accumulation steps, for
        ``engine.scale(loss).backward()`` (DeepSpeed's name): what a PyTorch-style backward
        needs under fp16, and the same factor ``engine.backward`` puts on the loss, so both
        train the same model bit for bit. (DeepSpeed's ``scale`` leaves the division to hooks
        on the outputs; the product is the same.)"""
        _check_loss(loss, "engine.scale")
        self.metrics.observe_loss(loss)
        self._backward.user_scaled = True
        return loss.float() * (self.loss_scale / self.gradient_accumulation_steps())

    def step(self) -> None:
        """Update the model at an accumulation boundary; otherwise only count the micro-step."""
        start = time.perf_counter()
        self._step_applied = False
        if not self.optimizer.trains:
            raise RuntimeError(NoOptimizer.MESSAGE)
        if self.is_gradient_accumulation_boundary():
            self._check_reduced()
            lr = self.get_lr()  # the rates this update uses, before the schedule moves on
            self._step_applied = self.optimizer.step()
            if self._step_applied and self.lr_scheduler is not None:
                self.lr_scheduler.step()
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
            self._checkpoints.after_step(self)
            self.metrics.add_time("step", time.perf_counter() - start)
            self._end_of_step(lr)
        self.micro_steps += 1

    def _check_reduced(self) -> None:
        """Refuse to update from gradients that were never averaged over the ranks."""
        self._backward.user_scaled = False
        if not self._backward.reduced:
            raise RuntimeError(
                f"engine.step() at the accumulation boundary (micro-step {self.micro_steps}) "
                "found no reduced gradients: call engine.backward(loss), or loss.backward() on "
                "a loss computed from engine(...)'s outputs (not from engine.module(...)), "
                "before step(); at stages 0-1 the boundary micro-step's backward reduces, "
                "outside engine.no_sync()"
            )
        self._backward.reduced = False

    def _end_of_step(self, lr: list[float]) -> None:
        """Report the step that just ended: the throughput line, the monitors, the profile."""
        printing = self._prints(self.global_steps)
        record = self.metrics.finish_step(
            step=self.global_steps,
            lr=lr,
            grad_norm=self.get_global_grad_norm(),
            loss_scale=self.loss_scale,
            skipped_steps=self.skipped_steps,
            report=printing or self.monitor.enabled,
        )
        if record is not None:
            self.monitor.write(
                record.step, record.scalars(with_times=self.zerotrain_config.wall_clock_breakdown)
            )
        if printing:
            assert record is not None  # finish_step reports when printing
            line = self.metrics.throughput_line(
                record, self.zerotrain_config.wall_clock_breakdown, self.total_steps
            )
            line = " | ".join([line, *self.optimizer.progress()])  # the step extensions' own
            self.monitor.flush()
            if self.global_rank == 0:
                print(line, flush=True)
        if self._profiling_step:
            self._profiling_step = False
            start = time.perf_counter()
            self._print_profile()
            # the peak benchmark and the printing are not training: keep them out of the next
            # step's time, which starts now
            self.metrics.exclude(time.perf_counter() - start)

    def _print_profile(self) -> None:
        profiler, section = self.flops_profiler, self.zerotrain_config.flops_profiler
        step_seconds = self.metrics.last_step_seconds
        # the profiled step ran on the profiler (rank 0) and finish_step timed it
        assert profiler is not None and step_seconds is not None
        dtype = self.optimizer.precision.param_dtype
        if section.peak_tflops is not None:
            peak, source = section.peak_tflops, "given: flops_profiler.peak_tflops"
        else:
            peak, source = measure_peak_tflops(dtype, self.device)
        step = StepContext(
            step=self.global_steps,
            profile_step=section.profile_step,
            world_size=self.world_size,
            micro_batch_size=self.train_micro_batch_size_per_gpu(),
            micro_steps=self.gradient_accumulation_steps(),
            step_seconds=step_seconds,
            peak_tflops=peak,
            peak_source=source,
        )
        profiler.print_model_profile(
            profile_step=section.profile_step,
            module_depth=section.module_depth,
            top_modules=section.top_modules,
            detailed=section.detailed,
            output_file=section.output_file,
            step=step,
        )
        profiler.end_profile()

    def destroy(self) -> None:
        """Flush and close the monitors (DeepSpeed's name). Also done when the engine is
        garbage-collected and at interpreter exit; call it to be sure before the process ends
        in another way.

        The process group stays: as in DeepSpeed, the engine and the group remain usable after
        ``destroy()`` (a script may evaluate afterwards, another engine may share the group).
        A group zerotrain made (``init_distributed``, or ``initialize`` without one) is
        destroyed at interpreter exit; one the script made is the script's to destroy. See
        [Note: who ends the process group] in zerotrain/comm/setup.py. A checkpoint still
        being written in the background is finished first."""
        self._checkpoints.finish_pending()
        self.monitor.close()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop accumulated gradients (step() already does this at each boundary), also those
        a backward that raised part-way left behind. ``set_to_none`` is accepted, as by
        ``nn.Module.zero_grad``; the gradient buffers are reused either way."""
        del set_to_none
        if self._backward.state is not BackwardState.IDLE:
            self._backward.abort()
        self.optimizer.zero_grad()
        self._backward.reduced = False

    def was_step_applied(self) -> bool:
        """Whether the last step() updated the model (False: not a boundary, or fp16 overflow)."""
        return self._step_applied

    @property
    def skipped_steps(self) -> int:
        return self.optimizer.skipped_steps

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """Norm of the averaged gradient over all ranks' shards at the last step, before clipping."""
        return self.optimizer.global_grad_norm

    @property
    def loss_scale(self) -> float:
        return self.optimizer.loss_scale

    # -- state ---------------------------------------------------------------------------------
    def memory_breakdown(self) -> dict[str, float]:
        """Model-state bytes this rank holds, measured, and the ZeRO formula's figure."""
        zero = self.optimizer
        return memory_breakdown(zero.groups, zero.policy, zero.precision)

    def consolidated_state_dict(
        self, dtype: torch.dtype = torch.float32
    ) -> dict[str, torch.Tensor]:
        """The full model state dict from the fp32 master weights, on every rank (collective).

        Same keys as ``module.state_dict()``, tied keys sharing one tensor as in the model;
        floating-point entries are cast to ``dtype``. Frozen parameters that stage 3
        partitions are gathered unit by unit, onto the host.
        """
        return self._full_state(dtype, exclude_frozen=False)

    def _full_state(
        self, dtype: torch.dtype, exclude_frozen: bool, on_rank: int | None = None
    ) -> dict[str, torch.Tensor]:
        """See :meth:`consolidated_state_dict`; frozen values are kept on ``on_rank`` only (None:
        on every rank), see ``zero.model_state.untrained_state``."""
        groups = self.optimizer.groups
        masters = full_masters(groups)
        if self.layout.frozen_on_every_rank:
            on_rank = None
        untrained = untrained_state(groups, self.module, exclude_frozen, on_rank=on_rank)
        entries = self.module.state_dict(keep_vars=True)
        out = {}
        for key, value in entries.items():
            if id(value) in masters:
                tensor, live = masters[id(value)], True  # it may be the optimizer's own master
            elif key in untrained:
                tensor = untrained[key]
                # a partitioned frozen parameter comes as a host copy of its own: no second copy
                # of the frozen base; buffers and whole frozen parameters are the model's
                live = tensor.untyped_storage().data_ptr() == value.untyped_storage().data_ptr()
            else:
                continue  # a frozen parameter left out
            if tensor.is_floating_point():
                out[key] = tensor.to(dtype, copy=live)
            else:
                out[key] = tensor.clone() if live else tensor
        return self.layout.full_state(out)

    def module_state_dict(
        self,
        destination=None,
        prefix: str = "",
        keep_vars: bool = False,
        exclude_frozen_parameters: bool = False,
    ) -> dict[str, torch.Tensor]:
        """The wrapped model's own ``state_dict`` (DeepSpeed's name): at stage 3 the parameters
        not gathered now are empty placeholders; :meth:`consolidated_state_dict` has the values."""
        if destination is None:  # torch's overloads take no None; its default makes a dict
            state = self.module.state_dict(prefix=prefix, keep_vars=keep_vars)
        else:
            state = self.module.state_dict(
                destination=destination, prefix=prefix, keep_vars=keep_vars
            )
        if exclude_frozen_parameters:
            for key in frozen_keys(self.optimizer.groups, self.module):
                state.pop(prefix + key, None)
        return state

    def _zero3_consolidated_16bit_state_dict(
        self, exclude_frozen_parameters: bool = False
    ) -> dict[str, torch.Tensor] | None:
        """The full state dict in the training dtype, on the CPU of rank 0; None on the other
        ranks (DeepSpeed's name and contract; collective). Only at stage 3, as in DeepSpeed
        (``ValueError`` otherwise); it does not need `stage3_gather_16bit_weights_on_model_save`
        (only :meth:`save_16bit_model` does)."""
        if not self.zero_optimization_partition_weights():
            raise ValueError("this function requires ZeRO-3 mode")
        state = self._training_dtype_state(exclude_frozen_parameters)
        if self.global_rank != 0:
            return None
        on_cpu: dict[int, torch.Tensor] = {}  # a tied tensor is copied once, and stays one
        for value in state.values():
            if id(value) not in on_cpu:
                on_cpu[id(value)] = value.cpu()
        return {key: on_cpu[id(value)] for key, value in state.items()}

    def _training_dtype_state(self, exclude_frozen: bool) -> dict[str, torch.Tensor]:
        """The full state dict in the training dtype (collective; complete on rank 0, which
        alone writes or returns it), less the frozen parameters if asked."""
        return self._full_state(self.optimizer.precision.param_dtype, exclude_frozen, on_rank=0)

    def _consolidated_16bit_state_dict(
        self, exclude_frozen_parameters: bool = False
    ) -> dict[str, torch.Tensor] | None:
        """DeepSpeed's name for :meth:`_zero3_consolidated_16bit_state_dict` where the weights
        are partitioned (stage 3); ``ValueError`` otherwise, as in DeepSpeed."""
        if not self.zero_optimization_partition_weights():
            raise ValueError(
                "consolidated_16bit_state_dict is only applicable to cases where weights are "
                "partitioned (ZeRO stage 3)"
            )
        return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)

    def save_checkpoint(
        self,
        save_dir: str | Path,
        tag: str | None = None,
        client_state: dict | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
        async_save: bool | None = None,
    ) -> Path | None:
        """Save the whole training state under ``save_dir/tag`` (collective: every rank calls
        it, and writes its own shard in parallel); returns the checkpoint's directory.

        Saved: model weights (fp32 masters), optimizer states, LR scheduler, loss scaler,
        engine counters, every rank's RNG states and the position of the engine's dataloader.
        ``tag`` defaults to ``global_step{N}``. ``client_state`` is a dict of your own (pickled:
        load it only from checkpoints you trust) returned by :meth:`load_checkpoint`. The
        checkpoint becomes visible, and ``save_dir/latest`` names it, only once every rank's
        files are on disk and rank 0 committed the manifest; with ``checkpoint.keep_last``
        older checkpoints are deleted after that. Raises ``CheckpointError`` if any rank
        failed to write (nothing is committed then). ``exclude_frozen_parameters`` leaves the
        frozen parameters out (a LoRA checkpoint then holds only what trains); loading such a
        checkpoint keeps the model's own frozen values.

        ``async_save`` (default: the config's ``checkpoint.async_save``) returns once the state
        is copied into host memory; a background thread writes and commits it, and the next
        save, a load or :meth:`wait_for_checkpoint` waits for it and raises its error, if any.
        With ``checkpoint.async_save_pending: skip`` a save while the previous one is still
        being written is skipped (returns None). See docs/checkpoints.md.
        """
        if async_save is None:
            async_save = self.zerotrain_config.checkpoint.async_save
        return self._checkpoints.save(
            self,
            save_dir,
            tag,
            client_state,
            save_latest,
            exclude_frozen_parameters,
            async_save,
        )

    def checkpoint_pending(self) -> bool:
        """Whether an asynchronous save (or an in-memory snapshot) is still being written or
        committed on this rank."""
        return self._checkpoints.pending()

    def wait_for_checkpoint(self) -> Path | None:
        """Wait until the asynchronous save in flight is committed; its directory (None when
        there was none). Raises its ``CheckpointError`` if it failed."""
        return self._checkpoints.wait()

    def load_checkpoint(
        self,
        load_dir: str | Path,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn=None,
    ) -> tuple[str | None, dict | None]:
        """Load a checkpoint saved at any world size and ZeRO stage (collective).

        ``tag=None`` takes the checkpoint ``load_dir/latest`` names, as DeepSpeed does; without
        one (or where it names no complete checkpoint) the newest complete one (incomplete
        saves are ignored), or ``load_dir`` itself if it is one; the HuggingFace Trainer's
        ``checkpoint-N`` folder is a save directory. Returns ``(path, client_state)``, or
        ``(None, None)`` when there is no checkpoint to load: quietly (one line) for an empty
        folder, a first run; with a warning for a path that does not exist, only incomplete
        saves, or a folder holding something else. ``checkpoint.require_resume`` (or
        ``ZEROTRAIN_REQUIRE_RESUME=1``: ``zerotrain run --require-resume``) makes each of those
        a ``CheckpointError`` on every rank. Files are checked (names, shapes, sizes,
        SHA-256) before anything changes: a bad checkpoint raises ``CheckpointError`` naming
        the file and the problem, and leaves the engine as it was. ``load_module_only`` loads
        the weights alone; the other flags leave out the optimizer states or the scheduler.
        RNG states are restored on the ranks that existed when the checkpoint was saved.
        ``custom_load_fn`` (DeepSpeed's hook to load module weights yourself) is not supported:
        pass None.
        """
        if custom_load_fn is not None:
            raise ValueError(
                "load_checkpoint(custom_load_fn=...): zerotrain loads the weights itself, "
                "resharded to this engine's layout; pass None, then change the model with "
                "zerotrain.zero.GatheredParameters(..., modifier_rank=0) if needed"
            )
        options = LoadOptions(
            module_strict=load_module_strict,
            optimizer_states=load_optimizer_states,
            lr_scheduler_states=load_lr_scheduler_states,
            module_only=load_module_only,
            require_resume=self.zerotrain_config.checkpoint.require_resume
            or os.environ.get(REQUIRE_RESUME_ENV, "") not in ("", "0"),
        )
        return self._checkpoints.load(self, load_dir, tag, options)

    def training_counters(self) -> dict[str, Any]:
        """The counters a checkpoint saves (see zerotrain/checkpoint/protocol.py)."""
        return {
            "global_steps": self.global_steps,
            "global_samples": self.global_samples,
            "skipped_steps": self.optimizer.skipped_steps,
            "global_grad_norm": self.optimizer.global_grad_norm,
            "loss_scaler": self.optimizer.loss_scaler.state_dict(),
        }

    def restore_training_counters(self, counters: dict[str, Any], loss_scaler: bool) -> None:
        """Resume :meth:`training_counters`' values; the loss scaler's too if ``loss_scaler``."""
        self.global_steps = counters["global_steps"]
        self.global_samples = counters["global_samples"]
        # resume at an accumulation boundary of *this* run's accumulation steps (they may differ)
        self.micro_steps = self.global_steps * self.gradient_accumulation_steps()
        self.optimizer.skipped_steps = counters["skipped_steps"]
        self.optimizer.global_grad_norm = counters["global_grad_norm"]
        if loss_scaler:
            self.optimizer.loss_scaler.load_state_dict(counters["loss_scaler"])

    def comms_summary(self) -> str:
        """A table of the collectives this rank issued: per operation, calls, payload, bytes
        sent and the time the training thread waited; with the `comms_logger` config section
        enabled, also per message size (and per issuing function with its `debug` key)."""
        header = (
            f"{'operation':<20} {'calls':>7} {'payload MB':>11} {'sent MB':>9} {'waited ms':>10}"
        )
        rows = [header, "-" * len(header)]
        for name, stats in sorted(self.comm.stats.items()):
            rows.append(
                f"{name:<20} {stats.calls:>7} {stats.bytes / 1e6:>11.3f} {stats.sent / 1e6:>9.3f} "
                f"{stats.seconds * 1e3:>10.2f}"
            )
        if self.comm.log is not None:
            rows += ["", self.comm.log.summary()]
        return "\n".join(rows)

    def save_16bit_model(
        self,
        save_dir: str | Path,
        save_filename: str = "pytorch_model.bin",
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Rank 0 writes the full model state dict in the training dtype to
        ``save_dir/save_filename`` (collective): a ``.safetensors`` name writes safetensors (a
        copy per tied key: it cannot share), any other ``torch.save`` (tied keys one tensor);
        written under a temporary name and renamed. At ZeRO stage 3 this needs
        ``zero_optimization.stage3_gather_16bit_weights_on_model_save`` (the full weights are
        gathered); without it nothing is written and False is returned, as in DeepSpeed. For
        resumable training state use :meth:`save_checkpoint`.
        """
        gather = self.zero_gather_16bit_weights_on_model_save()
        if self.optimizer.shards_params and not gather:
            if self.global_rank == 0:
                warnings.warn(
                    "save_16bit_model: nothing saved; at ZeRO stage 3 set "
                    "zero_optimization.stage3_gather_16bit_weights_on_model_save to true",
                    stacklevel=2,
                )
            return False
        state = self._training_dtype_state(exclude_frozen_parameters)
        if self.global_rank == 0:
            write_state_dict(Path(save_dir) / save_filename, state)
        self.comm.barrier()
        return True


def _check_loss(loss: torch.Tensor, caller: str) -> None:
    if not torch.is_tensor(loss) or loss.dim() != 0:
        raise ValueError(
            f"{caller} expects a scalar loss tensor; reduce it first (e.g. loss.mean())"
        )
    if not loss.requires_grad:
        raise ValueError(
            f"{caller} got a loss that does not require grad: was it computed under "
            "torch.no_grad() or with engine.eval()-only code?"
        )


def _cast(value, dtype: torch.dtype):
    """fp16/bf16.auto_cast: floating-point tensors to ``dtype``; everything else unchanged."""
    if torch.is_tensor(value) and value.is_floating_point():
        return value.to(dtype)
    return value


# torch's wordings of an operator given mixed dtypes ("mat1 and mat2 must have the same dtype",
# "expected scalar type BFloat16 but found Float", "Input type (float) and bias type
# (c10::BFloat16) should be the same")
_DTYPE_MISMATCH = re.compile(r"same dtype|scalar type|should be the same", re.IGNORECASE)
