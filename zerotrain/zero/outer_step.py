"""The outer steps of training across sites: every ``inner_steps`` optimizer steps, the sites'
parameters meet again (DiLoCo, arXiv:2311.08105).

[Note: outer steps over shards]
Each site trains as the config says over its own ranks (its shard groups over the site's
data-parallel ranks), starting from the same parameters as every other site. A rank keeps an
anchor: its masters as they were after the last outer step (fp32, the shard it holds). Every
``inner_steps`` applied steps, after the store stepped and before the parameters are
published, each rank takes its shard's change since the anchor (the pseudo-gradient,
anchor - master), averages it over the ranks holding the same shard at the other sites (the
mesh's site axis: one all-reduce of a rank's shard, never a whole model; the change travels
as ``sites.compression`` says: whole, quantized, or its top-k with error feedback, through the
gradients' codecs), and steps the anchor with the outer optimizer: SGD with momentum and
Nesterov's (torch.optim.SGD's update, its momentum buffer sharded as the anchor), or, without
one, the average itself. The masters
take the anchor's value, and the group publishes them as after any step: every site leaves
the outer step with the same parameters. The inner optimizer's state stays each site's own.
A step deferred to each bucket's next use (stage 3, ``overlap_param_gather``) is not
deferred at an outer step: every master must be stepped before its change is taken.

[Note: a round in a checkpoint]
Within a round the sites' masters and inner optimizer states differ. A checkpoint's model
pieces are the first site's (the parallel layout's ``replica`` 0 writes them: one consistent
model that any tool reads); each rank of another site keeps its own masters and inner
optimizer state in this extension's state, beside the anchor, the outer momentum and the
steps into the round. Loaded at the same world size with the optimizer's state, every rank
reads the first site's pieces, and the other sites' ranks then put their own back: the round
goes on exactly. Otherwise the round starts again from the first site's parameters.
An exchange still travelling when the checkpoint is taken is completed first and its result
saved, to land at its step as it would have.

[Note: streaming fragments]
With ``sites.streaming`` (Streaming DiLoCo, arXiv:2501.18512) the parameters, in the model's
order, are split into F runs of about equal size (:func:`fragments_of`, by parameter, so
that a plain one-process version splits the model alike); fragment f takes its outer step at
the steps s with s % H == (f + 1) * H // F (H: ``inner_steps``), so every parameter takes one
outer step a round and the fragments' exchanges are spread over it. On a rank a fragment is
the runs of its shards that hold the fragment's parameters (padding belongs to none), one
vector: its anchor, outer momentum and exchange are that vector's. With ``overlap_steps`` τ
the exchange is launched at its step and lands τ steps later, the inner steps going on
meanwhile: the anchor takes the outer step then, and the fragment's masters become
``mixing`` parts their own value (which moved on for τ steps) and the rest the anchor's.
The exchanges are collectives on the sites' communicator, launched and completed by each
rank's training thread in the same order, so several may be in flight at once.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from zerotrain.comm import CollectiveError, Communicator
from zerotrain.comm.link import PROBE, probe_link
from zerotrain.comm.site_clusters import SiteTiers
from zerotrain.compression import BucketShape, GradientCodec, GradientCompression, make_codec
from zerotrain.compression.auto import Policy, Traffic, policy_costs
from zerotrain.compression.clustered import ClusteredCodec
from zerotrain.compression.codec import Pending
from zerotrain.fmt import quantity
from zerotrain.zero.extension import Resume, StepExtension
from zerotrain.zero.work_split import WorkSplit

__all__ = ["OuterStep", "SiteOptions", "fragments_of"]


@dataclass(frozen=True, kw_only=True)
class SiteOptions:
    """The ``sites`` section as a shard group takes it; ``comm``: the ranks holding the same
    shard at each site, and ``fragment_of``: each trainable parameter's fragment, by id (both
    set by the parallel layout)."""

    inner_steps: int
    lr: float | None  # None: no outer optimizer, the average is taken
    momentum: float = 0.0
    nesterov: bool = False
    compression: GradientCompression | None = None  # how the change travels (None: whole)
    # ``sites.compression.method`` auto: the ways it may travel, the cheapest on the measured
    # link chosen at the first outer step (``compression`` then unused)
    choices: tuple[GradientCompression | None, ...] = ()
    fragments: int = 1  # see [Note: streaming fragments]
    overlap_steps: int = 0
    mixing: float = 0.0  # a site's own parameters' weight when an overlapped exchange lands
    fragment_of: Mapping[int, int] = field(default_factory=dict)
    comm: Communicator | None = None
    # the exchange in two tiers over clusters of sites (None: one over every site; see
    # [Note: clusters of sites] in zerotrain/comm/site_clusters.py)
    tiers: SiteTiers | None = None
    split: WorkSplit | None = None  # the sites' shares of the batch (None: equal)
    times_steps: bool = True  # this group's outer steps time the steps for ``split``


def fragments_of(params: Iterable[torch.Tensor], count: int) -> dict[int, int]:
    """Each parameter's fragment, by id: ``params`` in order, split into ``count`` runs of
    about equal size; a run ends once the parameters so far fill its share of the total, or
    where the parameters left are just enough to give each fragment after it one."""
    params = list(params)
    total = sum(p.numel() for p in params)
    out, fragment, filled = {}, 0, 0
    for i, param in enumerate(params):
        out[id(param)] = fragment
        filled += param.numel()
        left = len(params) - i - 1
        if fragment < count - 1 and (
            filled * count >= (fragment + 1) * total or left <= count - 1 - fragment
        ):
            fragment += 1
    return out


@dataclass(frozen=True)
class Fragment:
    """A fragment's elements on this rank: ``(master, lo, hi)`` runs of the masters."""

    index: int  # its number among the sites' fragments
    runs: tuple[tuple[int, int, int], ...]
    numel: int


@dataclass
class Exchange:
    """A fragment's outer exchange, launched and not landed yet."""

    fragment: int  # its position in ``OuterStep.fragments``
    lands_at: int  # the step count it lands at
    wire: torch.Tensor  # the change, padded: summed over the sites in place
    op: Pending | None  # None: completed
    launched: float  # time.perf_counter() at its launch


class OuterStep(StepExtension):
    """Outer steps over ``masters`` (the store's, one per bucket; see [Note: outer steps over
    shards]); ``runs``: per master, the ``(lo, hi, id(param))`` runs of each parameter it
    holds."""

    name = "outer_step"
    memory_kind = "sites"

    def __init__(
        self,
        options: SiteOptions,
        masters: list[torch.Tensor],
        optimizer,
        runs: list[list[tuple[int, int, int]]],
    ):
        assert options.comm is not None, "the parallel layout sets the sites' communicator"
        self.options = options
        self.comm = options.comm
        self.masters = masters
        self.optimizer = optimizer  # the inner one, stepping ``masters``
        self.fragments = _fragments(runs, options.fragment_of, options.fragments)
        self.anchors = [self._take(f) for f in self.fragments]
        self.momenta: list[torch.Tensor | None] = [None] * len(self.fragments)
        self.count = 0  # applied steps since the sites last started alike
        self.in_flight: list[Exchange] = []
        self.split = options.split
        # the split this group's steps time (the dense group's; None: another's, or none)
        self.timed_split = options.split if options.times_steps else None
        # the work split's step each fragment's change counts samples from (its last launch)
        self.windows = [self._split_steps()] * len(self.fragments)
        self.tiers = options.tiers
        # the ranks a codec runs over: the sites', or the clusters' leaders
        world = self.comm.world_size if self.tiers is None else len(self.tiers.clusters)
        # each fragment's change as a bucket of one run of elements, padded to those ranks
        self.shapes = [
            BucketShape(-(-f.numel // world) * world, [(0, (f.numel,))]) for f in self.fragments
        ]
        self.codec = self._codec(options.compression)
        self.decision = ""  # what auto chose, and why (auto: made at the first outer step)
        self.loaded_codec: dict | None = None  # a checkpoint's, for the codec auto chooses
        self.sent_flat = 0  # bytes this rank sent in outer exchanges over every site
        self.busy = 0.0  # seconds its steps spent in them
        self.travelled = 0.0  # seconds from their launches to their landings
        self.launched = 0  # outer exchanges launched by this process
        self.landed = 0  # and landed
        self.warned_timeout = False  # an exchange came near the sites' timeout

    @property
    def undecided(self) -> bool:
        """``sites.compression`` auto, before the outer step that chooses the codec."""
        return bool(self.options.choices) and not self.decision

    def _leaving(self, count: int) -> set[int]:
        """The fragments whose exchanges leave at step ``count`` (on every rank alike,
        whether or not this rank holds a part of them)."""
        inner, fragments = self.options.inner_steps, self.options.fragments
        return {f for f in range(fragments) if count % inner == _leaves_at(f, inner, fragments)}

    def wants_masters_now(self) -> bool:
        step = self.count + 1
        return bool(self._leaving(step)) or any(e.lands_at == step for e in self.in_flight)

    def step_applied(self) -> bool:
        self.count += 1
        started = time.perf_counter()
        landed = self._land_due()
        leaving = self._leaving(self.count)
        if leaving:
            if self.undecided:
                self._choose_codec()
            for position, fragment in enumerate(self.fragments):
                if fragment.index in leaving:
                    self._launch(position)
            self.codec.end_step()
            landed = self._land_due() or landed  # without overlap_steps: at once
        waited = time.perf_counter() - started
        self.busy += waited
        if self.split is not None:
            self.split.waited(waited)
        return landed

    def step_ended(self, applied: bool) -> None:
        if self.timed_split is not None:
            self.timed_split.step_ended()

    def _split_steps(self) -> int:
        return 0 if self.split is None else self.split.steps

    def _launch(self, position: int) -> None:
        """Send fragment ``position``'s change since its anchor to the other sites."""
        fragment, anchor = self.fragments[position], self.anchors[position]
        wire = anchor.new_zeros(self.codec.buckets[position].numel_padded)
        change = wire[: fragment.numel]
        torch.sub(anchor, self._take(fragment), out=change)
        if self.split is not None:  # weighed by the samples this site trained for it
            steps = self.split.steps + 1  # this step's too
            weight = self.split.weight(self.windows[position], steps)
            self.windows[position] = steps
            if weight is not None:
                change.mul_(weight)
        with self._across_sites():
            op = self.codec.all_reduce(position, wire)
        lands_at = self.count + self.options.overlap_steps
        self.in_flight.append(Exchange(position, lands_at, wire, op, time.perf_counter()))
        self.launched += 1

    def _land_due(self) -> bool:
        """Land the exchanges due at this step, in the order they left; whether any did."""
        due = [e for e in self.in_flight if e.lands_at == self.count]
        for exchange in due:
            self._complete(exchange)
            position = exchange.fragment
            fragment, anchor = self.fragments[position], self.anchors[position]
            delta = exchange.wire[: fragment.numel].div_(self.comm.world_size)
            anchor.sub_(self._update(position, delta))
            if self.options.overlap_steps:  # the inner steps moved on meanwhile: mix
                self._put(fragment, torch.lerp(anchor, self._take(fragment), self.options.mixing))
            else:
                self._put(fragment, anchor)
            self.in_flight.remove(exchange)
            self.landed += 1
        return bool(due)

    def _complete(self, exchange: Exchange) -> None:
        if exchange.op is not None:
            with self._across_sites():
                exchange.op.wait()  # a codec's second collective may leave now (int8's gather)
            exchange.op = None
            took = time.perf_counter() - exchange.launched
            self.travelled += took
            if not self.options.overlap_steps:  # launched and waited for at once: the link's
                self._near_the_timeout(took)

    def _near_the_timeout(self, took: float) -> None:
        """Warn once when an exchange took over half the sites' timeout: a slower one would
        fail as a lost site."""
        timeout = self.comm.timeout
        if self.warned_timeout or timeout is None or took <= timeout.total_seconds() / 2:
            return
        self.warned_timeout = True
        warnings.warn(
            f"sites: an outer exchange took {took:.1f} s, over half the {timeout.total_seconds():g}"
            " s the collectives between the sites may take (sites.exchange_timeout_s, else the "
            "collective timeout): a slower one would fail as if a site were lost; raise it",
            stacklevel=2,
        )

    @contextlib.contextmanager
    def _across_sites(self) -> Iterator[None]:
        """A call of an outer exchange: the bytes it sends counted (with overlap, other traffic
        runs between such calls), and its failure said to be a lost site's, with what goes
        on without it."""
        sent = self.comm.sent
        try:
            yield
        except CollectiveError as error:
            raise CollectiveError(
                "sites: the outer exchange with the other sites failed: a site is lost or cut "
                "off. Launched with torchrun's elastic rendezvous (--nnodes MIN:MAX, "
                "--max-restarts), the others restart without it from the newest checkpoint or "
                f"in-memory snapshot (docs/sites.md). {error}"
            ) from error
        finally:
            self.sent_flat += self.comm.sent - sent

    def _take(self, fragment: Fragment) -> torch.Tensor:
        """Fragment's elements of the masters, one fp32 vector."""
        pieces = [self.masters[m][lo:hi] for m, lo, hi in fragment.runs]
        return torch.cat(pieces).to(torch.float32)

    def _put(self, fragment: Fragment, values: torch.Tensor) -> None:
        at = 0
        for m, lo, hi in fragment.runs:
            self.masters[m][lo:hi].copy_(values[at : at + hi - lo])
            at += hi - lo

    def _codec(self, choice: GradientCompression | None) -> GradientCodec | ClusteredCodec:
        """The codec the change travels in: ``choice``'s over the sites, or over the clusters'
        leaders in the tiers' exchange."""
        if self.tiers is None:
            return make_codec(choice, self.comm, self.shapes)
        leaders = self.tiers.leaders
        between = None if leaders is None else make_codec(choice, leaders, self.shapes)
        return ClusteredCodec(self.tiers, between, self.shapes)

    def _choose_codec(self) -> None:
        """``sites.compression`` auto: the way the change travels that costs least on the
        sites' link (with clusters: the links between their leaders), measured now (its alpha
        and beta, and each codec run on this rank's fragments over a communicator that sends
        nothing: compression/auto.py's ``policy_costs``), the same on every rank of the group
        (the slowest rank's costs)."""
        if self.tiers is None:
            best, self.decision = self._cheapest(self.comm)
        elif self.tiers.leaders is not None:
            best, self.decision = self.tiers.call(lambda: self._cheapest(self.tiers.leaders))
        else:  # the cluster's leader chooses; this rank sends its change whole inside
            best, self.decision = 0, "outer exchange whole inside the cluster"
        self.codec = self._codec(self.options.choices[best])
        if self.loaded_codec is not None:
            self.codec.load_state_dict(self.loaded_codec, steps=0)

    def _cheapest(self, comm: Communicator) -> tuple[int, str]:
        """The choice that costs least over ``comm``, and the decision's text."""
        link = probe_link(comm)
        policies = tuple(Policy(gradients=choice) for choice in self.options.choices)
        every = dict.fromkeys(range(len(self.shapes)), 1.0)
        traffic = Traffic("all_reduce", every, {}, torch.float32, torch.float32)
        costs = policy_costs(policies, traffic, comm, self.shapes)
        world = comm.world_size
        seconds = torch.tensor([c.seconds(link, world) for c in costs], dtype=torch.float64)
        comm.all_reduce(seconds, op="max", name=PROBE)
        best = int(seconds.argmin())
        priced = zip(policies, seconds.tolist(), strict=True)
        predicted = ", ".join(f"{policy.name} {t:.2f} s" for policy, t in priced)
        between = "" if self.tiers is None else " between the clusters"
        return (
            best,
            f"outer exchange{between} {policies[best].name} ({predicted}; {link.describe()})",
        )

    def progress(self) -> str:
        """The round and the outer exchanges so far (this rank's bytes sent, the time its
        steps spent in them and, overlapped, the time they travelled: the slow link's busy
        time)."""
        inner = self.options.inner_steps
        text = f"sites: step {self.count % inner}/{inner} of the round"
        if self.launched:
            sent = f"{quantity(self.sent / self.launched, 'B')} sent each"
            if isinstance(self.codec, ClusteredCodec):  # by tier
                inside = quantity(self.codec.sent_inside / self.launched, "B")
                between = quantity(self.codec.sent_between / self.launched, "B")
                sent += f": {inside} inside the cluster, {between} between clusters"
            kind = "outer steps" if self.options.fragments == 1 else "outer steps of fragments"
            spent = f"{self.busy:.2f} s in them"
            if self.options.overlap_steps:
                spent = f"{self.busy:.2f} s waited, {self.travelled:.2f} s travelling"
            text += f", {self.landed} {kind} ({sent}, {spent})"
        if self.split is not None:
            text += f", {self.split.describe()}"
        if self.tiers is not None:
            text += f", {self.tiers.describe()}"
        return f"{text}, {self.decision}" if self.decision else text

    @property
    def sent(self) -> int:
        """Bytes this rank sent in outer exchanges (on both tiers, with clusters)."""
        codec = self.codec
        tiers = codec.sent_inside + codec.sent_between if isinstance(codec, ClusteredCodec) else 0
        return self.sent_flat + tiers

    def _update(self, position: int, delta: torch.Tensor) -> torch.Tensor:
        """What fragment ``position``'s anchor moves by: torch.optim.SGD's step for the
        gradient ``delta``."""
        lr, momentum = self.options.lr, self.options.momentum
        if lr is None:
            return delta
        if momentum:
            buffer = self.momenta[position]
            if buffer is None:
                buffer = self.momenta[position] = delta.clone()
            else:
                buffer.mul_(momentum).add_(delta)
            delta = delta.add(buffer, alpha=momentum) if self.options.nesterov else buffer
        return delta.mul(lr)

    def settle(self) -> None:
        """Complete the exchanges in flight (collective: every rank calls it at the same step);
        each still lands at its step."""
        for exchange in self.in_flight:
            self._complete(exchange)

    def masters_set(self) -> None:
        """A load or a broadcast set the masters: the round starts again from them."""
        self.settle()  # every rank's collectives complete alike
        self.in_flight = []
        self.anchors = [self._take(f) for f in self.fragments]
        self.count = 0
        self.windows = [self._split_steps()] * len(self.fragments)

    @property
    def mid_round(self) -> bool:
        """Whether some fragment moved since its last outer step (or one is travelling)."""
        inner, count = self.options.inner_steps, self.options.fragments
        moved = [(self.count - _leaves_at(f, inner, count)) % inner for f in range(count)]
        return bool(self.in_flight) or (self.count > 0 and any(moved))

    def tensors(self) -> list[torch.Tensor]:
        kept = self.codec.state_tensors() + [e.wire for e in self.in_flight]
        return self.anchors + [m for m in self.momenta if m is not None] + kept

    def state_dict(self) -> dict:
        """The round's state, the exchanges in flight completed (see [Note: a round in a
        checkpoint]); at the sites but the first, the site's own masters and inner optimizer
        state too."""
        self.settle()
        state: dict[str, Any] = {
            "anchors": [a.clone() for a in self.anchors],
            "momenta": [None if m is None else m.clone() for m in self.momenta],
            "count": self.count,
            "in_flight": [(e.fragment, e.lands_at, e.wire.clone()) for e in self.in_flight],
            "mid_round": self.mid_round,
            "codec": self.codec.state_dict(),
            "windows": list(self.windows),
        }
        if self.timed_split is not None:
            state["work_split"] = self.timed_split.state_dict()
        if self.comm.rank != 0:
            state["masters"] = [m.detach().clone() for m in self.masters]
            state["optimizer"] = [_copied(self.optimizer.state.get(m, {})) for m in self.masters]
        return state

    def load_state_dict(self, state: Any, *, resume: Resume) -> str | None:
        laid_out = (
            state is not None
            and "count" in state
            and [tuple(a.shape) for a in state["anchors"]] == [tuple(a.shape) for a in self.anchors]
        )  # another split into sites or fragments (or none) lays the shards out anew
        if not (laid_out and resume.same_world and resume.optimizer_loaded):
            if self.timed_split is not None:
                self.timed_split.load_state_dict(None)  # measured again
            self.masters_set()
            if state is None:
                return None
            if laid_out and resume.optimizer_loaded:  # other sites of the same size
                device = self.anchors[0].device if self.anchors else None
                self.momenta = [None if m is None else m.to(device) for m in state["momenta"]]
                return _restarted_round(resume, kept=True)
            return _restarted_round(resume, kept=False)
        if self.timed_split is not None:
            self.timed_split.load_state_dict(state.get("work_split"))
        self.windows = list(state.get("windows", self.windows))
        for anchor, saved in zip(self.anchors, state["anchors"], strict=True):
            anchor.copy_(saved)
        device = self.anchors[0].device if self.anchors else None
        self.momenta = [None if m is None else m.to(device) for m in state["momenta"]]
        self.count = int(state["count"])
        self.in_flight = [
            Exchange(position, lands_at, wire.to(device), None, time.perf_counter())
            for position, lands_at, wire in state["in_flight"]
        ]
        if self.undecided:  # auto chooses again at the next outer step, then takes it
            self.loaded_codec = state["codec"]
        else:
            self.codec.load_state_dict(state["codec"], steps=self.codec.steps)
        if "masters" in state:  # this site's own, in place of the first site's just loaded
            for master, saved, kept in zip(
                self.masters, state["masters"], state["optimizer"], strict=True
            ):
                master.copy_(saved)
                self.optimizer.state[master] = _copied(kept, master.device)
        return None

    @classmethod
    def orphaned(cls, state: Any, resume: Resume) -> str | None:
        if state is None or not state.get("mid_round", state.get("inner")):
            return None
        return "the sites' round was under way when saved, and this run trains without sites"


def _leaves_at(fragment: int, inner_steps: int, fragments: int) -> int:
    """The step of the round (count % inner_steps) fragment ``fragment``'s exchange leaves at
    (see [Note: streaming fragments]); one fragment: the round's end."""
    return (fragment + 1) * inner_steps // fragments % inner_steps


def _fragments(
    runs: list[list[tuple[int, int, int]]], fragment_of: Mapping[int, int], count: int
) -> list[Fragment]:
    """The fragments this rank holds a part of, in order: each the masters' runs of its
    parameters (adjacent runs joined)."""
    held: list[list[tuple[int, int, int]]] = [[] for _ in range(count)]
    for master, pieces in enumerate(runs):
        for lo, hi, param in pieces:
            mine = held[fragment_of.get(param, 0)]
            if mine and mine[-1][0] == master and mine[-1][2] == lo:
                mine[-1] = (master, mine[-1][1], hi)
            else:
                mine.append((master, lo, hi))
    return [
        Fragment(index, tuple(pieces), sum(hi - lo for _, lo, hi in pieces))
        for index, pieces in enumerate(held)
        if pieces
    ]


def _copied(state: dict, device: torch.device | None = None) -> dict:
    """An optimizer's state for one tensor, its tensors copied (to ``device``)."""
    return {
        key: value.to(device, copy=True) if torch.is_tensor(value) else value
        for key, value in state.items()
    }


def _restarted_round(resume: Resume, kept: bool) -> str:
    if kept:  # sites of the same size joined or left (the parallel layout's state_source)
        return (
            f"the sites' round was saved by {resume.saved_world_size} ranks, and this run has "
            f"{resume.world_size} in sites of the same size: the round starts again from the "
            "loaded parameters, the first site's, with the outer momentum the sites shared "
            "(where the outer optimizer keeps one)"
        )
    return (
        f"the sites' outer state was saved at world size {resume.saved_world_size}, and this "
        f"run has {resume.world_size} ranks (or other sites, or loads no optimizer state): the "
        "round starts again from the loaded parameters, the first site's (the outer momentum "
        "is lost)"
    )
