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
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from zerotrain.comm import Communicator
from zerotrain.comm.link import PROBE, probe_link
from zerotrain.compression import BucketShape, GradientCompression, make_codec
from zerotrain.compression.auto import Policy, Traffic, policy_costs
from zerotrain.fmt import quantity
from zerotrain.zero.extension import Resume, StepExtension

__all__ = ["OuterStep", "SiteOptions"]


@dataclass(frozen=True, kw_only=True)
class SiteOptions:
    """The ``sites`` section as a shard group takes it; ``comm``: the ranks holding the same
    shard at each site (set by the parallel layout)."""

    inner_steps: int
    lr: float | None  # None: no outer optimizer, the average is taken
    momentum: float = 0.0
    nesterov: bool = False
    compression: GradientCompression | None = None  # how the change travels (None: whole)
    # ``sites.compression.method`` auto: the ways it may travel, the cheapest on the measured
    # link chosen at the first outer step (``compression`` then unused)
    choices: tuple[GradientCompression | None, ...] = ()
    comm: Communicator | None = None


class OuterStep(StepExtension):
    """Outer steps over ``masters`` (the store's, one per bucket; see [Note: outer steps over
    shards])."""

    name = "outer_step"
    memory_kind = "sites"

    def __init__(self, options: SiteOptions, masters: list[torch.Tensor], optimizer):
        assert options.comm is not None, "the parallel layout sets the sites' communicator"
        self.options = options
        self.comm = options.comm
        self.masters = masters
        self.optimizer = optimizer  # the inner one, stepping ``masters``
        self.anchors = [m.detach().to(torch.float32, copy=True) for m in masters]
        self.momenta: list[torch.Tensor | None] = [None] * len(masters)
        self.inner = 0  # applied steps since the last outer step
        world = self.comm.world_size
        # each master's change as a bucket of one run of elements, padded to the sites
        self.shapes = [
            BucketShape(-(-m.numel() // world) * world, [(0, (m.numel(),))]) for m in masters
        ]
        self.codec = make_codec(options.compression, self.comm, self.shapes)
        self.decision = ""  # what auto chose, and why (auto: made at the first outer step)
        self.loaded_codec: dict | None = None  # a checkpoint's, for the codec auto chooses
        self.sent = 0  # bytes this rank sent in outer exchanges
        self.busy = 0.0  # seconds it spent in them
        self.rounds = 0  # outer steps taken by this process

    @property
    def undecided(self) -> bool:
        """``sites.compression`` auto, before the outer step that chooses the codec."""
        return bool(self.options.choices) and not self.decision

    def wants_masters_now(self) -> bool:
        return self.inner + 1 == self.options.inner_steps

    def step_applied(self) -> bool:
        self.inner += 1
        if self.inner < self.options.inner_steps:
            return False
        self.inner = 0
        sent, started = _sent(self.comm), time.perf_counter()
        if self.undecided:
            self._choose_codec()
        sites = self.comm.world_size
        for index, (master, anchor) in enumerate(zip(self.masters, self.anchors, strict=True)):
            padded = anchor.new_zeros(self.codec.buckets[index].numel_padded)
            delta = padded[: anchor.numel()]
            torch.sub(anchor, master.to(torch.float32), out=delta)
            self.codec.all_reduce(index, padded).wait()
            delta.div_(sites)
            anchor.sub_(self._update(index, delta))
            master.copy_(anchor)
        self.codec.end_step()
        self.sent += _sent(self.comm) - sent
        self.busy += time.perf_counter() - started
        self.rounds += 1
        return True

    def _choose_codec(self) -> None:
        """``sites.compression`` auto: the way the change travels that costs least on the
        sites' link, measured now (its alpha and beta, and each codec run on this rank's
        shards over a communicator that sends nothing: compression/auto.py's
        ``policy_costs``), the same on every rank of the group (the slowest rank's costs)."""
        link = probe_link(self.comm)
        policies = tuple(Policy(gradients=choice) for choice in self.options.choices)
        every = dict.fromkeys(range(len(self.shapes)), 1.0)
        traffic = Traffic("all_reduce", every, {}, torch.float32, torch.float32)
        costs = policy_costs(policies, traffic, self.comm, self.shapes)
        world = self.comm.world_size
        seconds = torch.tensor([c.seconds(link, world) for c in costs], dtype=torch.float64)
        self.comm.all_reduce(seconds, op="max", name=PROBE)
        best = int(seconds.argmin())
        self.codec = make_codec(self.options.choices[best], self.comm, self.shapes)
        if self.loaded_codec is not None:
            self.codec.load_state_dict(self.loaded_codec, steps=0)
        priced = zip(policies, seconds.tolist(), strict=True)
        predicted = ", ".join(f"{policy.name} {t:.2f} s" for policy, t in priced)
        self.decision = f"outer exchange {policies[best].name} ({predicted}; {link.describe()})"

    def progress(self) -> str:
        """The round and the outer exchanges so far (this rank's bytes sent and time in them:
        the slow link's busy time)."""
        text = f"sites: step {self.inner}/{self.options.inner_steps} of the round"
        if self.rounds:
            sent = quantity(self.sent / self.rounds, "B")
            text += f", {self.rounds} outer steps ({sent} sent each, {self.busy:.2f} s in them)"
        return f"{text}, {self.decision}" if self.decision else text

    def _update(self, index: int, delta: torch.Tensor) -> torch.Tensor:
        """What the anchor moves by: torch.optim.SGD's step for the gradient ``delta``."""
        lr, momentum = self.options.lr, self.options.momentum
        if lr is None:
            return delta
        if momentum:
            buffer = self.momenta[index]
            if buffer is None:
                buffer = self.momenta[index] = delta.clone()
            else:
                buffer.mul_(momentum).add_(delta)
            delta = delta.add(buffer, alpha=momentum) if self.options.nesterov else buffer
        return delta.mul(lr)

    def masters_set(self) -> None:
        """A load or a broadcast set the masters: the round starts again from them."""
        for master, anchor in zip(self.masters, self.anchors, strict=True):
            anchor.copy_(master)
        self.inner = 0

    def tensors(self) -> list[torch.Tensor]:
        kept = self.codec.state_tensors()
        return self.anchors + [m for m in self.momenta if m is not None] + kept

    def state_dict(self) -> dict:
        """The round's state; at the sites but the first, the site's own masters and inner
        optimizer state too (see [Note: a round in a checkpoint])."""
        state: dict[str, Any] = {
            "anchors": [a.clone() for a in self.anchors],
            "momenta": [None if m is None else m.clone() for m in self.momenta],
            "inner": self.inner,
            "codec": self.codec.state_dict(),
        }
        if self.comm.rank != 0:
            state["masters"] = [m.detach().clone() for m in self.masters]
            state["optimizer"] = [_copied(self.optimizer.state.get(m, {})) for m in self.masters]
        return state

    def load_state_dict(self, state: Any, *, resume: Resume) -> str | None:
        laid_out = state is not None and [tuple(a.shape) for a in state["anchors"]] == [
            tuple(a.shape) for a in self.anchors
        ]  # another split into sites (or none) at the same world size lays the shards out anew
        if not (laid_out and resume.same_world and resume.optimizer_loaded):
            self.masters_set()
            return None if state is None else _restarted_round(resume)
        for anchor, saved in zip(self.anchors, state["anchors"], strict=True):
            anchor.copy_(saved)
        device = self.anchors[0].device if self.anchors else None
        self.momenta = [None if m is None else m.to(device) for m in state["momenta"]]
        self.inner = int(state["inner"])
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
        if state is None or not state.get("inner"):
            return None
        return "the sites' round was under way when saved, and this run trains without sites"


def _sent(comm: Communicator) -> int:
    """Bytes ``comm``'s engine has sent so far (its account, shared by its groups)."""
    return sum(stats.sent for stats in comm.stats.values())


def _copied(state: dict, device: torch.device | None = None) -> dict:
    """An optimizer's state for one tensor, its tensors copied (to ``device``)."""
    return {
        key: value.to(device, copy=True) if torch.is_tensor(value) else value
        for key, value in state.items()
    }


def _restarted_round(resume: Resume) -> str:
    return (
        f"the sites' outer state was saved at world size {resume.saved_world_size}, and this "
        f"run has {resume.world_size} ranks (or other sites, or loads no optimizer state): the "
        "round starts again from the loaded parameters, the first site's (the outer momentum "
        "is lost)"
    )
