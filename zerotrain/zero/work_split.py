"""The work split of training across sites: each site's share of a step's global batch.

[Note: a site's share of the batch]
Sites on unequal machines take unequal times for a step, and the outer steps pair their
steps: every site would wait for the slowest at each one. With ``sites.work_split`` the
sites' ranks take micro-batches of different sizes instead (FusionLLM's workload estimator,
arXiv:2410.12707, as a share of the batch): a step's global batch, ``G`` samples (the
configured micro-batch on every data-parallel rank of every site), is shared out site by
site, the ``d`` data-parallel ranks of site s taking ``micro[s]`` samples each, with
``sum(d * micro[s]) == G``; every site still takes one optimizer step a step. "measured":
every ``window`` steps at the same shares each site's median step time (its slowest rank's,
the time spent waiting in outer exchanges left out; the median leaves out what runs now and
then between steps, an evaluation or a checkpoint that waits for every site) gives its speed
in samples a second, and the shares follow the speeds; the sites' times cross the slow link
in an all-reduce that travels during the next step. A list of relative speeds fixes the
shares from the start.

A change of the shares is decided by every rank at the same step and applies ``lead`` steps
later, so that batches a loader fetched ahead (its workers' prefetch) were already sized by
it: the schedule holds each change and the first step it applies to. The steps count every
optimizer step, applied or skipped, as a loader's batches do. An outer step weighs each
site's change by the samples the site trained since the fragment's last outer step, against
every site's (DiLoCo's average weighted by tokens; with equal shares the plain average).
"""

from __future__ import annotations

import statistics
import time
from bisect import bisect_right
from typing import Any

import torch

from zerotrain.comm import Communicator, PendingOp

__all__ = ["WorkSplit", "apportion"]


class WorkSplit:
    """The sites' shares of each step's batch (see [Note: a site's share of the batch]).

    ``site``: this rank's site of ``sites``, each of ``data_ranks`` data-parallel ranks;
    ``micro``: the configured micro-batch; ``speeds``: fixed relative speeds, one per site
    (None: measured every ``window`` steps, over ``in_site``, this site's ranks, and
    ``across``, the ranks holding the same place at each site)."""

    def __init__(
        self,
        *,
        sites: int,
        site: int,
        data_ranks: int,
        micro: int,
        speeds: tuple[float, ...] | None,
        window: int,
        in_site: Communicator,
        across: Communicator,
    ):
        self.sites, self.site, self.micro = sites, site, micro
        self.data_ranks = data_ranks
        self.window = window
        self.in_site, self.across = in_site, across
        self.measured = speeds is None
        first = (micro,) * sites if speeds is None else apportion(speeds, micro)
        self.schedule: list[tuple[int, tuple[int, ...]]] = [(0, first)]
        self.lead = 1  # steps between a decision and the step it applies to (loaders raise it)
        self.steps = 0  # optimizer steps taken, applied or skipped
        self.times: list[float] = []  # each timed step's seconds in this window
        self._timed: tuple[int, ...] | None = None  # the shares of the steps in ``times``
        self._last: float | None = None  # when the last step ended
        self._waited = 0.0  # this step's seconds in outer exchanges, every shard group's
        # the sites' step times on their way (an all-reduce in flight), and the shares they
        # were timed at
        self._pending: tuple[PendingOp, torch.Tensor, tuple[int, ...]] | None = None

    def micros(self, step: int) -> tuple[int, ...]:
        """Every site's micro-batch per data-parallel rank at optimizer step ``step``."""
        starts = [first for first, _ in self.schedule]
        return self.schedule[bisect_right(starts, step) - 1][1]

    def micro_batch(self, step: int | None = None) -> int:
        """This site's micro-batch at ``step`` (None: the next step)."""
        return self.micros(self.steps if step is None else step)[self.site]

    def positions(self, step: int, data_rank: int) -> tuple[int, int]:
        """Where in a micro-step's global batch (its positions in the epoch's order, ``G``
        from the step's first) this site's ``data_rank``-th rank takes its samples."""
        micros = self.micros(step)
        first = self.data_ranks * sum(micros[: self.site]) + data_rank * micros[self.site]
        return first, first + micros[self.site]

    @property
    def global_batch(self) -> int:
        """Samples a micro-step takes over every rank, whatever the shares."""
        return self.data_ranks * self.micro * self.sites

    def weight(self, first: int, end: int) -> float | None:
        """What this site's change is multiplied by before the sites' changes are summed and
        divided by the sites: its samples over steps ``[first, end)`` against every site's,
        times the sites (None: 1 exactly, the shares equal over those steps)."""
        mine = total = 0
        for micros, steps in self._segments(first, end):
            mine += steps * micros[self.site]
            total += steps * sum(micros)
        if total == 0 or mine * self.sites == total:
            return None
        return mine * self.sites / total

    def _segments(self, first: int, end: int):
        """``(micros, steps)`` for each stretch of one schedule entry in ``[first, end)``."""
        for i, (start, micros) in enumerate(self.schedule):
            stop = self.schedule[i + 1][0] if i + 1 < len(self.schedule) else end
            if max(first, start) < min(end, stop):
                yield micros, min(end, stop) - max(first, start)

    def waited(self, seconds: float) -> None:
        """A shard group's outer exchanges took ``seconds`` of this step."""
        self._waited += seconds

    def step_ended(self) -> None:
        """An optimizer step ended, applied or skipped; measured: every ``window`` timed
        steps of the same shares, this site's slowest rank's median step goes to the other
        sites (an all-reduce across them, in flight during the next step), and at the end of
        that step every rank decides the new shares alike."""
        now = time.perf_counter()
        waited, self._waited = self._waited, 0.0
        self.steps += 1
        if not self.measured:
            return
        if self._pending is not None:
            self._decide()
        shares = self.micros(self.steps - 1)
        if shares != self._timed:  # the first step at these shares (or at all) is not timed
            self.times, self._timed = [], shares
        elif self._last is not None:
            self.times.append(max(0.0, now - self._last - waited))
        self._last = now
        if len(self.times) >= self.window:
            self._send_times(shares)
            self._last = time.perf_counter()  # the site's own collective is left out

    def _send_times(self, shares: tuple[int, ...]) -> None:
        mine = torch.tensor([statistics.median(self.times)], dtype=torch.float64)
        self.in_site.all_reduce(mine, op="max")
        every = torch.zeros(self.sites, dtype=torch.float64)
        every[self.site] = mine
        self._pending = (self.across.all_reduce(every, async_op=True), every, shares)
        self.times = []

    def _decide(self) -> None:
        assert self._pending is not None
        op, every, shares = self._pending
        op.wait()
        self._pending = None
        speeds = [m / max(s, 1e-9) for m, s in zip(shares, every.tolist(), strict=True)]
        chosen = apportion(speeds, self.micro)
        if chosen != self.schedule[-1][1]:
            self.schedule.append((self.steps + self.lead, chosen))

    def describe(self) -> str:
        """The shares now, for the step line."""
        micros = self.micros(self.steps)
        return "shares " + ":".join(str(m) for m in micros)

    def state_dict(self) -> dict[str, Any]:
        return {"schedule": list(self.schedule), "steps": self.steps}

    def load_state_dict(self, state: dict | None) -> None:
        """Go on from ``state`` (None: start again from the first shares)."""
        if self._pending is not None:  # every rank's collective completes alike
            self._pending[0].wait()
        self.times, self._timed, self._last, self._pending = [], None, None, None
        if state is None or len(state["schedule"][0][1]) != self.sites:
            self.schedule, self.steps = self.schedule[:1], 0
            return
        self.schedule = [(int(first), tuple(m)) for first, m in state["schedule"]]
        self.steps = int(state["steps"])


def apportion(speeds, micro: int) -> tuple[int, ...]:
    """The configured micro-batch ``micro`` of every site, ``micro`` times the sites samples
    per data-parallel rank, shared out over the sites in proportion to ``speeds``, each at
    least 1 and at most twice ``micro`` (a site's activations grow with its share), whole
    numbers (largest remainders first)."""
    speeds = [float(s) for s in speeds]
    total, low, high = micro * len(speeds), 1, 2 * micro
    ideal = [total * s / sum(speeds) for s in speeds]
    chosen = [min(high, max(low, int(x))) for x in ideal]
    order = sorted(range(len(speeds)), key=lambda i: chosen[i] - ideal[i])
    while sum(chosen) < total:  # to those furthest below their ideal
        i = next(i for i in order if chosen[i] < high)
        chosen[i] += 1
        order.sort(key=lambda i: chosen[i] - ideal[i])
    while sum(chosen) > total:  # from those furthest above it
        i = next(i for i in reversed(order) if chosen[i] > low)
        chosen[i] -= 1
        order.sort(key=lambda i: chosen[i] - ideal[i])
    return tuple(chosen)
