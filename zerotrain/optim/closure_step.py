"""The part every torch optimizer's ``step`` shares: the optional closure, then the update."""

from __future__ import annotations

from collections.abc import Callable
from typing import overload

import torch


class ClosureStep(torch.optim.Optimizer):
    """A torch optimizer whose ``step(closure)`` evaluates the closure (with gradients on)
    and then runs :meth:`update` without autograd; subclasses write only :meth:`update`."""

    @overload
    def step(self, closure: None = None) -> None: ...
    @overload
    def step(self, closure: Callable[[], float]) -> float: ...
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.update()
        return loss

    def update(self) -> None:
        """One optimizer step over the groups' parameters that have a gradient."""
        raise NotImplementedError
