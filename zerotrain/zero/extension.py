"""Step extensions: what runs around a shard group's step besides the store's update.

[Note: step extensions]
A shard group steps in phases (group.py): its backward hands each bucket's gradient to the
reduction, ``begin_step`` attaches the reduced gradients to the store, the optimizer takes the
global norm and steps the store (or skips the step), ``end_step`` publishes. Some optimizers
and compressions need a word at these phases: 0/1 Adam's local steps keep a step's gradients
on the rank and rewrite the message of a synchronization; an Adam catching up on sparse
gradients needs the counts that arrived; ``comm_compression.auto``'s tuner times each step and
switches codecs; training across sites takes an outer step every few steps (outer_step.py).
Each is a :class:`StepExtension`: the hooks below, every one a no-op unless it
overrides it, and its own state, which the group saves under the extension's name. They are
chosen once, in ``_step_extensions`` (group.py), from what the optimizer, the store and the
options declare; nothing else asks which are present. A new one is a class (here, or beside
its feature, as the tuner in compression_tuner.py) and its choice there, with its name in
``EXTENSIONS``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from zerotrain.optim.catch_up import Arrivals, CatchUp
from zerotrain.optim.local_steps import LocalSteps


@dataclass(frozen=True)
class Resume:
    """What a checkpoint load tells the parts of a shard group's state it restores."""

    steps: int  # the optimizer steps taken (0 where the optimizer's state is not loaded)
    saved_world_size: int  # the ranks that saved the checkpoint
    world_size: int  # this run's
    optimizer_loaded: bool  # the optimizer's state is loaded (else what goes with it is not)

    @property
    def same_world(self) -> bool:
        """Saved at this run's world size: the buckets are laid out alike."""
        return self.saved_world_size == self.world_size


class StepExtension:
    """The hooks of a shard group's step (see [Note: step extensions]); each does nothing
    unless a subclass overrides it."""

    name: ClassVar[str]  # the key of its state in the group's state_dict
    # the key of memory_breakdown() its tensors count under
    memory_kind: ClassVar[str] = "compression"

    def keeps_gradient(self, index: int, wire: torch.Tensor) -> bool:
        """Bucket ``index``'s gradient ``wire`` is ready; True: it stays on this rank (it is
        this rank's step's, not sent), and the extension may have rewritten it."""
        return False

    def sending(self, index: int, wire: torch.Tensor) -> None:
        """Bucket ``index``'s gradient ``wire`` is about to be sent (in its wire dtype, before
        the average's division); the extension may rewrite it in place."""

    def grads_attached(self, arrivals: Callable[[int], Arrivals | None]) -> None:
        """The reduced gradients were given to the store, before the norm is taken;
        ``arrivals(index)``: where in this rank's part of bucket ``index`` gradients arrived
        and the steps each carries (None: all, with this step's)."""

    def shares_overflow(self) -> bool:
        """Whether the ranks hold different gradients this step, so that a non-finite norm on
        one must reach the others (one all-reduce of a flag)."""
        return False

    def wants_masters_now(self) -> bool:
        """Whether this step must step every master before it ends (not deferred to each
        bucket's next use), for :meth:`step_applied` to read them."""
        return False

    def step_applied(self) -> bool:
        """The store's step was applied (every master stepped, unless deferred: see
        :meth:`wants_masters_now`), and the parameters are about to be published; True: the
        extension changed the masters, and the parameters are written from them again."""
        return False

    def step_ended(self, applied: bool) -> None:
        """The store stepped (``applied``) or the step was skipped."""

    def masters_set(self) -> None:
        """The masters were set from outside a step, alike on every rank (a load, a
        broadcast)."""

    def shared_master(self, index: int) -> torch.Tensor | None:
        """Bucket ``index``'s master as every rank holds it alike, where that is not the
        store's (what a checkpoint saves); None: the store's."""
        return None

    def tensors(self) -> list[torch.Tensor]:
        """The tensors it keeps (for memory accounting)."""
        return []

    def progress(self) -> str | None:
        """What it adds to the throughput line (None: nothing)."""
        return None

    def state_dict(self) -> Any:
        return None

    def load_state_dict(self, state: Any, *, resume: Resume) -> str | None:
        """Continue from ``state``, this rank's as :meth:`state_dict` gave it (None: not
        saved). Returns a warning when it could not, and started afresh losing what it kept."""
        return None

    @classmethod
    def orphaned(cls, state: Any, resume: Resume) -> str | None:
        """A warning for ``state``, saved by this extension where this run has none (None:
        nothing is lost)."""
        return None


class LocalStepsExtension(StepExtension):
    """0/1 Adam's local steps (zerotrain/optim/local_steps.py), bound to the group's buckets:
    a local step's gradients stay on the rank, a synchronization's message carries the
    window's progress, and the saved master is the last synchronization's."""

    name = "local_steps"

    def __init__(self, local_steps: LocalSteps):
        self.local_steps = local_steps

    def keeps_gradient(self, index: int, wire: torch.Tensor) -> bool:
        if not self.local_steps.keeps_local():
            return False
        self.local_steps.own_estimate(wire)
        return True

    def sending(self, index: int, wire: torch.Tensor) -> None:
        self.local_steps.message(index, wire)

    def shares_overflow(self) -> bool:
        return self.local_steps.keeps_local()  # each rank steps with its own gradients

    def masters_set(self) -> None:
        self.local_steps.forget()

    def shared_master(self, index: int) -> torch.Tensor | None:
        return self.local_steps.synced_master(index)

    def tensors(self) -> list[torch.Tensor]:
        return self.local_steps.tensors()

    def state_dict(self) -> dict:
        return self.local_steps.state_dict()

    def load_state_dict(self, state: Any, *, resume: Resume) -> str | None:
        # the windows go with the optimizer's state: without it, its step count starts again
        state = state if resume.optimizer_loaded else None
        lost = self.local_steps.load_state_dict(state, resume.steps, resume.same_world)
        return _lost_window(resume) if lost else None

    @classmethod
    def orphaned(cls, state: Any, resume: Resume) -> str | None:
        if state is None or not resume.optimizer_loaded:  # the windows go with the optimizer
            return None
        open_window = any(w is not None for w in state["windows"])
        return _lost_window(resume) if open_window else None


def _lost_window(resume: Resume) -> str:
    return (
        "0/1 Adam's ranks were stepping alone when it was saved (local steps, at world size "
        f"{resume.saved_world_size}), and this run cannot take their steps since the last "
        "synchronization over (another world size, layout or no local steps): it goes on from "
        "that synchronization"
    )


class CatchUpExtension(StepExtension):
    """An Adam catching up on sparse gradients (zerotrain/optim/catch_up.py): it takes the
    counts that arrived with each step's gradients."""

    name = "catch_up"

    def __init__(self, catch_up: CatchUp, buckets: int):
        self.catch_up = catch_up
        self.buckets = buckets

    def grads_attached(self, arrivals: Callable[[int], Arrivals | None]) -> None:
        self.catch_up.arrive([arrivals(i) for i in range(self.buckets)])
