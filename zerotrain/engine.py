"""The training engine: forward, backward with accumulation and loss scaling, ZeRO step."""

from __future__ import annotations

import time

import torch
from torch import nn

from zerotrain.comm import Communicator, local_rank
from zerotrain.config import ZeroTrainConfig
from zerotrain.zero import ZeroOptimizer


class ZeroTrainEngine(nn.Module):
    """Wraps a model for ZeRO data-parallel training; DeepSpeed's engine method names.

    ``engine(*args)`` runs the model, ``engine.backward(loss)`` accumulates (and, per the ZeRO
    stage, reduces) gradients, ``engine.step()`` updates at each accumulation boundary.
    Built by :func:`zerotrain.initialize`.
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
    ):
        super().__init__()
        self.module = module
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.config = config
        self.comm = comm
        self.device = device
        self.training_dataloader = training_dataloader
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self._step_applied = False
        self._timers = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        self._last_print = time.perf_counter()

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

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def zero_optimization_stage(self) -> int:
        return self.optimizer.policy.stage

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    # -- training ----------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        start = time.perf_counter()
        out = self.module(*args, **kwargs)
        self._timers["forward"] += time.perf_counter() - start
        return out

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-step ends an accumulation (the next step() updates)."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Backpropagate ``loss`` (divided by the accumulation steps, times the fp16 loss scale)
        and reduce gradients as the ZeRO stage requires. Returns ``loss``."""
        if not torch.is_tensor(loss) or loss.dim() != 0:
            raise ValueError(
                "engine.backward expects a scalar loss tensor; reduce it first (e.g. loss.mean())"
            )
        if not loss.requires_grad:
            raise ValueError(
                "engine.backward got a loss that does not require grad: was it computed under "
                "torch.no_grad() or with engine.eval()-only code?"
            )
        start = time.perf_counter()
        scale = self.optimizer.loss_scale
        if scale_wrt_gas:
            scale /= self.gradient_accumulation_steps()
        (loss.float() * scale).backward(retain_graph=retain_graph)
        self.optimizer.backward_epilogue(self.is_gradient_accumulation_boundary())
        self._timers["backward"] += time.perf_counter() - start
        return loss

    def step(self) -> None:
        """Update the model at an accumulation boundary; otherwise only count the micro-step."""
        start = time.perf_counter()
        self._step_applied = False
        if self.is_gradient_accumulation_boundary():
            self._step_applied = self.optimizer.step()
            if self._step_applied and self.lr_scheduler is not None:
                self.lr_scheduler.step()
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
            self._timers["step"] += time.perf_counter() - start
            if self.config.steps_per_print and self.global_steps % self.config.steps_per_print == 0:
                self._report()
        self.micro_steps += 1

    def zero_grad(self) -> None:
        """Drop accumulated gradients (step() already does this at each boundary)."""
        self.optimizer.zero_grad()

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
        return self.optimizer.memory_breakdown()

    def consolidated_state_dict(
        self, dtype: torch.dtype = torch.float32
    ) -> dict[str, torch.Tensor]:
        """The full model state dict from the fp32 master weights, on every rank (collective).

        Same keys as ``module.state_dict()``; floating-point entries are cast to ``dtype``.
        """
        masters = self.optimizer.full_master_params()
        out = {}
        for key, value in self.module.state_dict(keep_vars=True).items():
            tensor = masters.get(id(value), value).detach()
            out[key] = tensor.to(dtype).clone() if tensor.is_floating_point() else tensor.clone()
        return out

    def _report(self) -> None:
        if self.global_rank != 0:
            return
        now = time.perf_counter()
        lrs = ", ".join(f"{lr:.3g}" for lr in self.get_lr())
        line = (
            f"[zerotrain] step {self.global_steps}: lr [{lrs}], skipped {self.skipped_steps}, "
            f"loss scale {self.loss_scale:g}, grad norm {self.get_global_grad_norm() or 0:.4g}, "
            f"{(now - self._last_print) / self.config.steps_per_print:.3f} s/step"
        )
        if self.config.wall_clock_breakdown:
            n = self.config.steps_per_print
            line += " | " + ", ".join(f"{k} {v / n * 1e3:.1f} ms" for k, v in self._timers.items())
        print(line, flush=True)
        self._timers = dict.fromkeys(self._timers, 0.0)
        self._last_print = now
