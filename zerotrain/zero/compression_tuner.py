"""``comm_compression.auto``: a shard group's compression chosen while it trains, from the
measured link, steps and codecs (see [Note: choosing a compression] in
zerotrain/compression/auto.py).

The tuner starts uncompressed. After ``window`` steps (and any warm-up of the configured
compression) it probes the link, costs every policy, predicts each one's step, prints the
prediction and switches if one is predicted faster by ``margin``; it then measures the new
policy's steps and reverts if they are slower than the old ones by more than ``tolerance``.
Every ``recheck_steps`` it decides again from the policy in use. The inputs that differ between
ranks (times) are taken as the slowest rank's, so every rank of the group decides alike, and
decisions fall on the same step on every rank (they count steps, not seconds), so the
collectives of the probe and of the policies stay matched.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from zerotrain.comm import Communicator
from zerotrain.comm.link import Link, probe_link
from zerotrain.compression import make_codec
from zerotrain.compression.auto import (
    AutoOptions,
    Cost,
    Policy,
    Traffic,
    policy_costs,
    predict,
)
from zerotrain.zero.extension import Resume, StepExtension
from zerotrain.zero.gather import ParamResidency
from zerotrain.zero.reduce import GradientReduction


@dataclass(frozen=True)
class Decision:
    """One decision of the tuner, and the numbers it was made from."""

    step: int
    outcome: str  # "chose" (switched), "kept", "confirmed" or "reverted" (after a switch)
    policy: str  # in use after the decision
    measured: dict[str, float]  # policy -> seconds per step measured
    predicted: dict[str, float]  # policy -> seconds per step predicted (empty: a check)
    sent: dict[str, float]  # policy -> bytes this rank sends per step (costed policies)
    link: Link | None = None
    seconds: float = 0.0  # the decision's own time (probe and costing)

    def line(self, world: int) -> str:
        head = f"zerotrain: comm_compression.auto, step {self.step}, {world} ranks"
        measured = ", ".join(f"{name} {s:.4g} s" for name, s in self.measured.items())
        if not self.predicted:
            return f"{head}: measured per step {measured}: {self.outcome} {self.policy}"
        assert self.link is not None  # a prediction probes the link
        predicted = ", ".join(
            f"{name} {s:.4g} s ({self.sent[name] / 1e6:.3g} MB)"
            for name, s in self.predicted.items()
        )
        return (
            f"{head}: link {self.link.describe()}; measured per step {measured}; predicted "
            f"{predicted}: {self.outcome} {self.policy} (decided in {self.seconds:.2f} s)"
        )


class CompressionTuner(StepExtension):
    """Chooses a shard group's compression among ``options.policies`` as it trains (see the
    module docstring): the codec of its ``reduction`` and whether its ``residency`` quantizes
    gathers; ``dtype``: its parameters'. ``counts_arrivals``: an Adam catching up reads the
    counts a sparse codec keeps. ``clock`` and ``probe`` are the time and link measurements
    (tests replace them). A step extension: it times the group's steps."""

    name = "auto"

    def __init__(
        self,
        reduction: GradientReduction,
        residency: ParamResidency,
        dtype: torch.dtype,
        options: AutoOptions,
        *,
        counts_arrivals: bool,
        clock: Callable[[], float] = time.perf_counter,
        probe: Callable[[Communicator], Link] = probe_link,
    ):
        self.reduction = reduction
        self.residency = residency
        self.dtype = dtype
        self.options = options
        self.counts_arrivals = counts_arrivals
        self.clock = clock
        self.probe = probe
        self.comm = reduction.comm
        self.decisions: list[Decision] = []
        self.steps = 0
        self._durations: list[float] = []
        self._last: float | None = None
        self._skip = 0  # steps not measured after a switch (their first costs more)
        self._before: tuple[Policy, float] | None = None  # a switch's old policy, its step
        # the reductions and gathers counted when the policy in use started, and the step
        self._counted = self._counts()
        self._counted_at = 0
        warmup = max((p.gradients.warmup_steps for p in options.policies if p.gradients), default=0)
        self._due: float = max(options.window + 1, warmup)
        # uncompressed, as the group was built; its gathers are built able to quantize
        self.policy = options.policies[0]
        residency.param_gather.quantize(False)

    @property
    def policy_names(self) -> list[str]:
        return [p.name for p in self.options.policies]

    def use(self, policy: Policy) -> None:
        """Send with ``policy`` from the next step on (every rank of the group calls it at the
        same step). The gradient codec starts afresh: what it kept is dropped."""
        reduction = self.reduction
        steps = reduction.codec.steps
        gradients = policy.gradients
        if gradients is not None and not self.counts_arrivals:  # nothing reads the counts
            gradients = replace(gradients, catch_up=False)
        reduction.codec = make_codec(gradients, reduction.comm, reduction.shapes)
        reduction.codec.steps = steps
        self.residency.param_gather.quantize(policy.parameters is not None)
        self.policy = policy
        self._durations.clear()
        self._skip = 1
        self._counted = self._counts()
        self._counted_at = self.steps

    def _counts(self) -> tuple[list[int], dict[int, int]]:
        """The reductions per bucket and gathers per shard size so far."""
        return list(self.reduction.launches), dict(self.residency.param_gather.gathered)

    def state_dict(self) -> dict:
        """Where the tuner stands, for a checkpoint: its policy, its steps, when it decides
        next, and a switch not yet checked (the old policy and its step time). The step times
        it measured are not kept: a resumed run measures its own."""
        before = None if self._before is None else [self._before[0].name, self._before[1]]
        return {"policy": self.policy.name, "steps": self.steps, "due": self._due, "before": before}

    def load_state_dict(self, state: Any, *, resume: Resume) -> str | None:
        """Continue from ``state``, the optimizer's state loaded or not (a step extension's
        load)."""
        if state is None or self.resume(state):
            return None
        return (
            "comm_compression.auto had chosen among policies that are not all among this run's "
            f"{self.policy_names} ({state}); it decides afresh"
        )

    def resume(self, state: dict | str) -> bool:
        """Continue from ``state`` (:meth:`state_dict`'s, or a policy's name alone, as
        checkpoints before 2026-11-25 kept it: deciding again after ``recheck_steps``); False
        if a policy it names is not among this run's."""
        if isinstance(state, str):
            state = {"policy": state}
        policies = {p.name: p for p in self.options.policies}
        before = state.get("before")
        if state["policy"] not in policies or (before and before[0] not in policies):
            return False
        self.use(policies[state["policy"]])
        if "steps" not in state:
            self._before, self._due = None, self._next_check()
            return True
        self.steps = self._counted_at = state["steps"]
        self._due = state["due"]
        self._before = None if before is None else (policies[before[0]], before[1])
        return True

    def step_ended(self, applied: bool) -> None:
        """After each optimizer step of the group, taken or skipped."""
        now = self.clock()
        self.steps += 1
        if self._last is not None:
            if self._skip:
                self._skip -= 1
            else:
                self._durations = [*self._durations, now - self._last][-self.options.window :]
        self._last = now
        if len(self._durations) < self.options.window:
            return
        if self._before is not None:
            self._check_switch()
        elif self.steps >= self._due:
            self._decide()
        else:
            return
        self._last = self.clock()  # the decision's own time is no step's

    def _next_check(self) -> float:
        recheck = self.options.recheck_steps
        return self.steps + recheck if recheck > 0 else math.inf

    def _traffic(self) -> Traffic:
        launches, gathered = self._counted
        steps = max(1, self.steps - self._counted_at)
        now_launches = self.reduction.launches
        now_gathered = self.residency.param_gather.gathered
        reductions = {
            i: (n - launches[i]) / steps for i, n in enumerate(now_launches) if n > launches[i]
        }
        gathers = {
            numel: (n - gathered.get(numel, 0)) / steps
            for numel, n in now_gathered.items()
            if n > gathered.get(numel, 0)
        }
        reduction, dtype = self.reduction, self.dtype
        wire = {i: reduction.wire_dtype(reduction.buckets[i]) for i in reductions}
        return Traffic(
            reduction.collective, reductions, gathers, reduction.comm_dtype or dtype, dtype, wire
        )

    def _slowest(self, values: list[float]) -> list[float]:
        """``values`` as the slowest rank of the group measured them."""
        agreed = torch.tensor(values, dtype=torch.float64, device=self.comm.device)
        self.comm.all_reduce(agreed, op="max", name="auto_compression")
        return agreed.tolist()

    def _decide(self) -> None:
        policies = self.options.policies
        started = time.perf_counter()
        link = self.probe(self.comm)
        traffic = self._traffic()
        costs = policy_costs(policies, traffic, self.comm, self.reduction.shapes)
        step, *computes = self._slowest(
            [statistics.median(self._durations)] + [c.compute for c in costs]
        )
        costs = [Cost(seconds, c.messages) for c, seconds in zip(costs, computes, strict=True)]
        current = costs[policies.index(self.policy)]
        world = self.comm.world_size
        predicted = {
            p.name: predict(step, current, c, link, world)
            for p, c in zip(policies, costs, strict=True)
        }
        best = min(policies, key=lambda p: predicted[p.name])
        switch = best != self.policy and predicted[best.name] <= step * (1 - self.options.margin)
        outcome = "chose" if switch else "kept"
        before = self.policy
        if switch:
            self.use(best)
            self._before = (before, step)
        else:
            self._durations.clear()
            self._due = self._next_check()
        self._record(
            Decision(
                self.steps,
                outcome,
                self.policy.name,
                {before.name: step},
                predicted,
                {p.name: c.sent for p, c in zip(policies, costs, strict=True)},
                link,
                time.perf_counter() - started,
            )
        )

    def _check_switch(self) -> None:
        assert self._before is not None
        before, before_step = self._before
        (step,) = self._slowest([statistics.median(self._durations)])
        measured = {before.name: before_step, self.policy.name: step}
        self._before = None
        if step > before_step * (1 + self.options.tolerance):
            self.use(before)
            outcome = "reverted to"
        else:
            self._durations.clear()
            outcome = "confirmed"
        self._due = self._next_check()
        self._record(Decision(self.steps, outcome, self.policy.name, measured, {}, {}))

    def _record(self, decision: Decision) -> None:
        self.decisions.append(decision)
        if self.comm.global_rank == 0:
            print(decision.line(self.comm.world_size), flush=True)
