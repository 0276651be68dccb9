"""0/1 Adam's local steps (Lu et al., arXiv:2202.06009, Algorithm 1): after the variance
freezes, each rank steps its own replica with its own gradients, and only every few steps do
the ranks synchronize, in 1 bit.

[Note: 0/1 Adam's local steps]
After ``var_freeze_step`` a synchronization comes every ``interval`` steps: 1 at first,
doubling every ``local_step_scaler`` steps up to ``local_step_clipper`` (DeepSpeed's schedule;
a step syncs when its number is a multiple of the interval). Between them a rank sends only a
one-element flag, which makes a non-finite gradient on any rank skip the step on all.
From the last synchronization s (parameters x_s, momentum m_s, frozen denominator d), a local
step τ takes this rank's gradient g_τ into its momentum deviation
D_τ = β1·D_{τ-1} + (1-β1)·g_τ (D_s = 0), so its momentum is β1^(τ-s)·m_s + D_τ, and its
parameters are

    x_τ = x_s·(1 - wd·L) - (B·m_s + S)/d,
    L = Σ lr_k,  B = Σ lr_k·β1^(k-s),  S = Σ lr_k·D_k

(k from s+1 to τ): the sum of the Adam updates it took, with weight decay on x_s rather than
on each step's parameters (DeepSpeed's; they differ by O(lr²·wd)). Written in closed form,
every rank and a resumed run compute the same x_τ from the same (x_s, m_s, S, B, L), and only
S differs between ranks. A synchronization at step t averages S_t: each rank sends
S_t / (L_t·(1 - β1)) = (lr_t·g_t + (S_{t-1} + lr_t·β1·D_{t-1}) / (1 - β1)) / L_t, an
lr-weighted mean of its gradients (with one step since s, the gradient itself). So the
gradient codec (1-bit signs, error feedback kept in gradient units) carries it as it carries
gradients, and every rank then sets m = (B·m_s + S̄)/L and x from the formula with S̄: the
replicas are equal again. A window of one step takes DeepSpeed's ordinary update.

The window's state (D, S and the scalars, and x_s) is this rank's own. A checkpoint saves x_s
as the parameters (the same on every rank) and each rank's D, S and scalars with its rank
state; a resumed rank rebuilds its replica from them, and at another world size training goes
on from x_s. Only stage 0, where every rank holds the whole model and optimizer state, can
step a replica on its own. A layer with copies on several model-parallel ranks that sum their
gradients (tied across pipeline stages, a sequence-parallel norm) steps alike on each, with
the summed gradient; its messages are summed over the copies too, so each sends its share of
the window's part, S_{t-1} + lr_t·β1·D_{t-1} over the number of copies.

An MoE expert's gradient on a rank already sums the tokens of its whole expert-parallel group
(ep ranks, which share one replica of each expert), so that rank's estimate of the average is
the gradient over ep: a local step takes that (:meth:`LocalSteps.own_estimate`, before the
gradient's norm is taken for clipping). A synchronization's gradient is still the sum, and its
ep-group's share of the average is ep times one rank's: the carry is multiplied by ep.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Moments = Callable[[torch.Tensor, dict], tuple[torch.Tensor, torch.Tensor]]
"""A master's momentum and frozen denominator (the optimizer's state), given its group."""


@dataclass(frozen=True)
class LocalStepSchedule:
    """Which optimizer steps (1-based) synchronize: every step before ``frozen_from`` (the
    first step after the freeze), then the multiples of an interval that starts at 1 and
    doubles every ``scaler`` steps, up to ``clipper``."""

    frozen_from: int
    scaler: int
    clipper: int

    def interval(self, step: int) -> int:
        if step < self.frozen_from:
            return 1
        doublings = (step - self.frozen_from) // self.scaler
        if doublings >= self.clipper.bit_length():
            return self.clipper
        return min(self.clipper, 2**doublings)

    def syncs(self, step: int) -> bool:
        return step % self.interval(step) == 0


@dataclass
class Window:
    """One bucket's state since the last synchronization (see [Note: 0/1 Adam's local
    steps])."""

    synced: torch.Tensor  # x_s
    deviation: torch.Tensor  # D
    progress: torch.Tensor  # S
    local: int = 0  # local steps taken in it
    lrs: float = 0.0  # L
    momentum_weight: float = 0.0  # B
    decay: float = 1.0  # β1^(τ-s)
    message_lr: float = 0.0  # lr_t of the synchronization's message

    SCALARS = ("local", "lrs", "momentum_weight", "decay")

    def tensors(self) -> list[torch.Tensor]:
        return [self.synced, self.deviation, self.progress]

    def close(self) -> None:
        self.deviation.zero_()
        self.progress.zero_()
        self.local, self.lrs, self.momentum_weight, self.decay = 0, 0.0, 0.0, 1.0


class LocalSteps:
    """This rank's local-step windows, one per bucket master, and the schedule. The gradient
    reduction asks :meth:`keeps_local` and writes :meth:`message`; the optimizer steps through
    :meth:`local_step` and :meth:`synchronize`, and counts its steps (:meth:`end_step`)."""

    def __init__(
        self,
        schedule: LocalStepSchedule,
        moments: Moments,
        param_groups: Callable[[], list[dict]],
    ):
        self.schedule = schedule
        self.moments = moments
        # the optimizer's groups, read at each use: its load_state_dict replaces them
        self.param_groups = param_groups
        self.steps = 0  # optimizer steps taken (a skip is decided on every rank alike)
        # the loss scale in this step's gradients (fp16's; the engine sets it): a message's
        # carry, unscaled, takes it too
        self.loss_scale: Callable[[], float] = lambda: 1.0
        self.masters: list[torch.Tensor] = []  # bucket order
        self.windows: list[Window | None] = []
        self._group_of: list[int] = []  # each master's optimizer group, by position
        self._index: dict[int, int] = {}  # id(master) -> its bucket
        self._copies: dict[int, int] = {}  # bucket -> its copies whose messages are summed
        self.sums = 1  # the data-parallel ranks whose tokens each gradient sums (experts: ep)

    def bind(
        self, masters: list[torch.Tensor], copies: dict[int, int] | None = None, sums: int = 1
    ) -> None:
        """The bucket masters, in bucket order (each a parameter of the optimizer); ``copies``:
        per bucket held by several model-parallel ranks that sum their gradients (a layer tied
        across pipeline stages, a sequence-parallel norm), how many; ``sums``: how many
        data-parallel ranks' tokens each of this rank's gradients sums (an MoE expert's: its
        expert-parallel group's)."""
        position = {id(p): i for i, g in enumerate(self.param_groups()) for p in g["params"]}
        self._copies = dict(copies or {})
        self.sums = sums
        self.masters = list(masters)
        self._group_of = [position[id(m)] for m in masters]
        self.windows = [None for _ in masters]
        self._index = {id(m): i for i, m in enumerate(masters)}

    def hyper(self, index: int) -> dict:
        """Bucket ``index``'s optimizer group (lr, betas, weight_decay)."""
        return self.param_groups()[self._group_of[index]]

    def forget(self) -> None:
        """The masters were set from outside (the same values on every rank: a module-only
        load, a broadcast from one rank): they are the new synchronization point."""
        self.windows = [None for _ in self.masters]

    def index(self, master: torch.Tensor) -> int:
        return self._index[id(master)]

    def _open(self, index: int) -> Window:
        window = self.windows[index]
        assert window is not None, f"bucket {index} has no local-step window"
        return window

    def keeps_local(self) -> bool:
        """Whether this step's gradients stay on this rank."""
        return not self.schedule.syncs(self.steps + 1)

    def own_estimate(self, grad: torch.Tensor) -> None:
        """A local step's ``grad`` (this rank's, unreduced) becomes this rank's estimate of the
        average gradient, in place: an expert's, summed over its expert-parallel group, over
        the group's size."""
        if self.sums != 1:
            grad.div_(self.sums)

    def open_window(self, index: int) -> bool:
        """Whether bucket ``index`` stepped locally since the last synchronization."""
        window = self.windows[index]
        return window is not None and window.local > 0

    def message(self, index: int, wire: torch.Tensor) -> None:
        """At a synchronization: bucket ``index``'s ``wire``, this rank's gradient (times the
        loss scale), becomes the message S_t / (L_t·(1 - β1)) (times the loss scale) when the
        bucket stepped locally since the last one."""
        if not self.open_window(index):
            return
        window, hyper = self._open(index), self.hyper(index)
        beta1, lr = hyper["betas"][0], hyper["lr"]
        window.message_lr = lr
        lrs = window.lrs + lr
        if lrs == 0:  # no step of the window moved the parameters: nothing to average
            return
        carry = window.progress + lr * beta1 * window.deviation
        # a summed bucket's copies stepped alike, each with the sum of their gradients: the sum
        # of their messages must count the carry once; an expert's gradient in the message
        # sums its expert-parallel group's tokens, and the carry must weigh as much
        copies = self._copies.get(index, 1)
        carry.mul_(self.loss_scale() * self.sums / (lrs * (1 - beta1) * copies))
        wire.mul_(lr / lrs).add_(carry.to(wire.dtype))

    def local_step(self, index: int, grad: torch.Tensor) -> None:
        """Bucket ``index``'s master takes a local step with this rank's ``grad``."""
        master, hyper = self.masters[index], self.hyper(index)
        window = self.windows[index]
        if window is None:
            window = self.windows[index] = Window(
                master.clone(), torch.zeros_like(master), torch.zeros_like(master)
            )
        elif window.local == 0:
            window.synced.copy_(master)
        beta1, lr = hyper["betas"][0], hyper["lr"]
        window.deviation.mul_(beta1).add_(grad, alpha=1 - beta1)
        window.progress.add_(window.deviation, alpha=lr)
        window.local += 1
        self._advance(window, beta1, lr)
        self._place(index, window.progress)

    def synchronize(self, index: int, averaged: torch.Tensor, momentum: torch.Tensor) -> None:
        """Bucket ``index``'s window closes with the ``averaged`` messages: the momentum and
        master become the ranks' average (equal on every rank)."""
        window, beta1 = self._open(index), self.hyper(index)["betas"][0]
        self._advance(window, beta1, window.message_lr)
        progress = averaged.mul(window.lrs * (1 - beta1))  # the average of S_t
        self._place(index, progress)
        if window.lrs > 0:
            momentum.mul_(window.momentum_weight).add_(progress).div_(window.lrs)
        window.close()

    @staticmethod
    def _advance(window: Window, beta1: float, lr: float) -> None:
        window.decay *= beta1
        window.momentum_weight += lr * window.decay
        window.lrs += lr

    def _place(self, index: int, progress: torch.Tensor) -> None:
        """x = x_s·(1 - wd·L) - (B·m_s + S)/d into bucket ``index``'s master."""
        window, master, hyper = self._open(index), self.masters[index], self.hyper(index)
        momentum, denominator = self.moments(master, hyper)
        update = torch.add(progress, momentum, alpha=window.momentum_weight).div_(denominator)
        master.copy_(window.synced).mul_(1 - hyper["weight_decay"] * window.lrs).sub_(update)

    def end_step(self) -> None:
        self.steps += 1

    def synced_master(self, index: int) -> torch.Tensor:
        """Bucket ``index``'s parameters at the last synchronization: what a checkpoint saves
        (every rank's alike; a resumed rank rebuilds its replica from its window)."""
        if self.open_window(index):
            return self._open(index).synced
        return self.masters[index]

    def tensors(self) -> list[torch.Tensor]:
        """The windows' tensors (for memory accounting)."""
        return [t for w in self.windows if w is not None for t in w.tensors()]

    # -- checkpoints: this rank's open windows (x_s is the checkpoint's parameters) ------------
    def state_dict(self) -> dict:
        windows = [
            {
                "deviation": w.deviation,
                "progress": w.progress,
                **{key: getattr(w, key) for key in Window.SCALARS},
            }
            if w is not None and w.local > 0
            else None
            for w in self.windows
        ]
        return {"steps": self.steps, "windows": windows}

    def load_state_dict(self, state: dict | None, steps: int, same_world: bool = True) -> bool:
        """Continue from ``state`` (this rank's), the masters holding the checkpoint's
        parameters, and rebuild each replica from its window. None, or state saved at another
        world size (not ``same_world``) or for other buckets, starts afresh at ``steps`` from
        those parameters. Returns whether that lost a window open in the checkpoint."""
        saved = state["windows"] if state is not None else []
        fits = len(saved) == len(self.masters) and all(
            w is None or w["progress"].numel() == m.numel()
            for w, m in zip(saved, self.masters, strict=False)
        )
        if state is None or not same_world or not fits:
            self.steps = steps
            self.windows = [None for _ in self.masters]
            return any(w is not None for w in saved)
        self.steps = state["steps"]
        self.windows = []
        for index, (window_state, master) in enumerate(zip(saved, self.masters, strict=True)):
            window = None
            if window_state is not None:
                window = Window(
                    master.clone(),
                    window_state["deviation"].to(master.device),
                    window_state["progress"].to(master.device),
                    **{key: window_state[key] for key in Window.SCALARS},
                )
            self.windows.append(window)
            if window is not None:
                self._place(index, window.progress)
        return False
