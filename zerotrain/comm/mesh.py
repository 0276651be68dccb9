"""The ranks as a grid of parallel axes: site, data, tensor, pipeline, expert, sequence.

[Note: mesh layout]
A mesh of shape (site, pp, dp, ep, sp, tp) numbers ranks row-major with ``tp`` innermost, so
tensor-parallel peers (the most traffic) are neighbours, on one node when they fit, as Megatron and
torchtitan place them; sequence-parallel peers (an all-to-all per attention layer) come next,
consecutive ranks as DeepSpeed's Ulysses groups are. The ranks along one axis, the others
fixed, form that axis's group: the data-parallel group (a site's) sees different data and
averages gradients, and ZeRO shards over it and the sequence axis together (the
sequence-parallel ranks hold the same parameters: :attr:`Mesh.zero`). The tensor-parallel
and pipeline axes are sized by the config and the model (zerotrain/tensor_parallel,
zerotrain/pipe), the expert axis by the model's MoE layers (zerotrain/moe), the sequence axis
by the config (zerotrain/sequence). The expert axis sits inside the data-parallel ranks, as
DeepSpeed's expert groups do (ranks 0-1 and 2-3 hold the experts at ep 2 of 4 ranks; 0 and 2
hold the same ones). The site axis is outermost: a site's ranks are consecutive, as
torchrun numbers a node's, and everything above is a site's own (the data-parallel group that
averages gradients, ZeRO's shards); the ranks along the site axis hold the same part of the
model at each site, and exchange it at the outer steps (zerotrain/zero/outer_step.py). The data
is split over the sites too (:attr:`Mesh.data`). A group is made the first time an axis is
asked for (every rank must ask, in the same order: making process groups is collective); an
axis that spans every rank is the world communicator itself.
"""

from __future__ import annotations

import itertools
import math
from datetime import timedelta

from zerotrain.comm.communicator import Communicator

AXES = ("site", "pp", "dp", "ep", "sp", "tp")  # outermost first; see [Note: mesh layout]


class Mesh:
    """Named parallel axes over the ranks of ``world`` (sizes default to 1; ``dp=None``: the
    rest of the world). ``given``: communicators already made for single axes (a sequence-
    parallel group made before the engine, as DeepSpeed's Ulysses registration makes it),
    used when their ranks are the mesh's for that axis. ``timeouts``: an axis's collectives'
    timeout where it is not the world's (the sites' ``exchange_timeout_s``)."""

    def __init__(
        self,
        world: Communicator,
        *,
        dp: int | None = None,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
        sp: int = 1,
        site: int = 1,
        given: dict[str, Communicator] | None = None,
        timeouts: dict[str, timedelta] | None = None,
    ):
        if world.group is not None:
            raise ValueError("mesh: build it over the default process group (Communicator())")
        others = site * tp * pp * ep * sp
        if dp is None:
            dp = world.world_size // others if world.world_size % others == 0 else 0
        self.world = world
        self.sizes = {"site": site, "pp": pp, "dp": dp, "ep": ep, "sp": sp, "tp": tp}
        bad = {axis: size for axis, size in self.sizes.items() if size < 1}
        if bad or math.prod(self.sizes.values()) != world.world_size:
            raise ValueError(
                f"mesh: axis sizes {self.sizes} multiply to {math.prod(self.sizes.values())}, "
                f"but there are {world.world_size} ranks; choose sizes whose product is the "
                "world size (each at least 1)"
            )
        self._groups: dict[str, Communicator] = {}
        self._timeouts = dict(timeouts or {})
        for axis, comm in (given or {}).items():
            self._adopt(axis, comm)

    def _adopt(self, axis: str, comm: Communicator) -> None:
        """Use ``comm`` as ``axis``'s group: every rank checks its members are the mesh's."""
        theirs = comm.members()
        ours = next(g for g in self.axis_ranks(axis) if self.world.rank in g)
        if theirs != ours:
            raise ValueError(
                f"mesh: the {axis} group given holds ranks {theirs}, but this rank's {axis} "
                f"group in the mesh {self.sizes} is {ours}; make the group over consecutive "
                "ranks, or let the engine make it"
            )
        self._groups[axis] = comm

    def coordinates(self, rank: int) -> dict[str, int]:
        """``rank``'s position along each axis."""
        coords = {}
        for axis in reversed(AXES):
            rank, coords[axis] = divmod(rank, self.sizes[axis])
        return {axis: coords[axis] for axis in AXES}

    def rank_at(self, coords: dict[str, int]) -> int:
        rank = 0
        for axis in AXES:
            rank = rank * self.sizes[axis] + coords[axis]
        return rank

    def axis_ranks(self, *axes: str) -> list[list[int]]:
        """Every group of ranks along ``axes`` (the other coordinates fixed), in a fixed order;
        within a group, rank order follows the mesh (the last axis innermost)."""
        unknown = [a for a in axes if a not in AXES]
        if unknown or not axes:
            named = ", ".join(map(repr, unknown)) or "given"
            raise ValueError(f"mesh: no axis {named}; the axes are {', '.join(AXES)}")
        along = [a for a in AXES if a in axes]
        others = [a for a in AXES if a not in axes]
        groups = []
        for fixed in itertools.product(*(range(self.sizes[a]) for a in others)):
            coords = dict(zip(others, fixed, strict=True))
            groups.append(
                [
                    self.rank_at({**coords, **dict(zip(along, moving, strict=True))})
                    for moving in itertools.product(*(range(self.sizes[a]) for a in along))
                ]
            )
        return groups

    def axis(self, *axes: str) -> Communicator:
        """The communicator of this rank's group along ``axes`` (one, or several together: the
        model-parallel group of "pp" and "tp"); collective the first time."""
        self.axis_ranks(*axes)  # checks the names
        # axes of size 1 change no group: ("dp", "ep") at ep 1 is the "dp" group, made once
        wanted = [a for a in AXES if a in axes and self.sizes[a] > 1] or list(axes)
        key = ",".join(a for a in AXES if a in wanted)
        if key not in self._groups:
            groups = self.axis_ranks(*wanted)
            timeout = self._timeouts.get(key)
            # a group that spans every rank is the world itself (unless it times out apart)
            whole = len(groups) == 1 and timeout is None
            self._groups[key] = self.world if whole else self.world.split(groups, timeout=timeout)
        return self._groups[key]

    @property
    def dp(self) -> Communicator:
        """The data-parallel group: the ranks of a site that see different data (the expert
        axis too: expert parallelism is carved out of data parallelism); what a step's
        gradients are averaged over."""
        return self.axis("dp", "ep")

    @property
    def data(self) -> Communicator:
        """The ranks that see different data: the data-parallel groups of every site; what the
        data is split by."""
        return self.axis("site", "dp", "ep")

    @property
    def sites(self) -> Communicator:
        """The ranks holding the same part of the model at each site, which the outer steps
        exchange it over."""
        return self.axis("site")

    def site_tiers(
        self, clusters: tuple[tuple[int, ...], ...]
    ) -> tuple[Communicator, Communicator | None]:
        """The two tiers of the sites' exchanges for ``clusters`` of sites (see [Note: clusters
        of sites] in site_clusters.py): along each group of the site axis, the ranks at a
        cluster's sites, and the first of them of every cluster (None for the others); each
        tier a gloo group (a worker thread runs them: NCCL's kernels on a second thread could
        wait on the training's), with an account of its own and the sites' timeout, untracked.
        Collective over the default group."""
        lines = self.axis_ranks("site")
        timeout = self._timeouts.get("site")

        def own() -> Communicator:
            return Communicator(device=self.world.device, stats={}, tracked=False)

        inside = [[line[site] for site in cluster] for line in lines for cluster in clusters]
        leaders = [[line[cluster[0]] for cluster in clusters] for line in lines]
        return (
            own().split(inside, backend="gloo", timeout=timeout),
            own().subgroups(leaders, backend="gloo", timeout=timeout),
        )

    @property
    def in_site(self) -> Communicator:
        """The ranks of this rank's site: every axis but the site's."""
        return self.axis(*(axis for axis in AXES if axis != "site"))

    @property
    def zero(self) -> Communicator:
        """The ranks that hold the same dense parameters: the data-parallel group and the
        sequence-parallel peers of each of its ranks; what ZeRO shards dense parameters over
        (the data-parallel group itself without sequence parallelism)."""
        return self.axis("dp", "ep", "sp")

    @property
    def expert_dp(self) -> Communicator:
        """The expert-data-parallel group: the data-parallel ranks that hold the same experts
        (one per expert-parallel group); what ZeRO shards expert parameters over."""
        return self.axis("dp")
