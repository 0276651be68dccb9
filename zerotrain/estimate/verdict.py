"""The memory preflight's verdict: what each rank needs against what it has, and one message
for every rank.

Pure arithmetic over numbers the ranks have gathered (zerotrain/estimate/preflight.py), or that
``zerotrain estimate --host-memory`` supplies for the ranks of one node, so that every rank
computes the same verdict and raises the same error. A rank's share of a limit is the limit
divided by the ranks that share it: the node's ``MemAvailable`` by the ranks on that host, a
cgroup's headroom by the ranks in that cgroup, ``RLIMIT_AS`` by none. Memory the rank's model
already holds there (its parameters as built, which the buckets replace) counts as available.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from zerotrain.zero.host import gib

__all__ = ["Limit", "Need", "Option", "RankMemory", "gib", "shortfall"]


@dataclass(frozen=True)
class Need:
    """Bytes one rank needs in one kind of memory: ``parts`` held together, plus the largest of
    ``peaks`` (transients at different moments of a step)."""

    parts: tuple[tuple[str, float], ...]
    peaks: tuple[tuple[str, float], ...] = ()

    @property
    def total(self) -> float:
        return sum(b for _, b in self.parts) + max((b for _, b in self.peaks), default=0.0)

    def describe(self) -> str:
        parts = [f"{name} {gib(b)}" for name, b in self.parts if b > 0]
        peaks = sorted(((b, name) for name, b in self.peaks if b > 0), reverse=True)
        if peaks:
            parts.append(f"at peak {peaks[0][1]} {gib(peaks[0][0])}")
        return ", ".join(parts)


@dataclass(frozen=True)
class Limit:
    """One bound on a kind of memory, as one rank sees it; the ranks with the same
    ``shared_by`` divide it."""

    nbytes: float
    what: str  # "MemAvailable", "cgroup /sys/fs/cgroup/...", "free on cuda:0", ...
    shared_by: str  # "node <host>", "cgroup <host> <dir>", "rank 3", ...


@dataclass(frozen=True)
class Option:
    """A change of the config and what the rank would need with it (device, host)."""

    changes: tuple[str, ...]  # one entry per changed key, e.g. 'stage 3'
    cost: int  # how large a change it is: the smaller first
    device: float
    host: float
    note: str = ""  # e.g. the disk it needs
    family: str = ""  # of one value to tune (e.g. "ratio"): only its first that fits is offered


@dataclass(frozen=True)
class RankMemory:
    """What one rank needs and has (built by the preflight on each rank, then gathered)."""

    rank: int
    device: Need | None  # None: it trains on the host (the host holds the model states)
    host: Need
    device_limits: tuple[Limit, ...] = ()
    host_limits: tuple[Limit, ...] = ()
    device_held: float = 0.0
    host_held: float = 0.0
    options: tuple[Option, ...] = ()
    more_ranks: tuple[tuple[int, int, float, float], ...] = ()  # (stage, ranks, device, host)


def _available(limits: tuple[Limit, ...], held: float, sharing: Counter) -> tuple[float, str]:
    """The rank's share of its tightest limit plus ``held``, and how that was found."""
    if not limits:
        return float("inf"), ""
    limit = min(limits, key=lambda lim: lim.nbytes // sharing[lim.shared_by])
    share = limit.nbytes // sharing[limit.shared_by]
    ranks = sharing[limit.shared_by]
    how = f"{limit.what}: {gib(limit.nbytes)}"
    if ranks > 1:
        how = f"1/{ranks} of {how}, shared by {ranks} ranks"
    if held > 0:
        how += f", plus {gib(held)} that the model's tensors hold there now"
    return share + held, how


def _ranks(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 0-3``, ``ranks 0, 2``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def shortfall(ranks: list[RankMemory], *, per_node: str = "as many per node as now") -> str | None:
    """None when every rank has what it needs; else one message for all: which ranks and
    which memory fall short, with the numbers, and the smallest changes of the config that
    fit on every rank (evaluated, never guessed)."""
    sharing = Counter(lim.shared_by for r in ranks for lim in {*r.device_limits, *r.host_limits})
    budgets = {}
    short: dict[tuple, list[int]] = {}
    for r in ranks:
        device_has, device_how = _available(r.device_limits, r.device_held, sharing)
        host_has, host_how = _available(r.host_limits, r.host_held, sharing)
        budgets[r.rank] = (device_has, host_has)
        kinds = [("host memory", r.host, host_has, host_how)]
        if r.device is not None:
            kinds.insert(0, ("device memory", r.device, device_has, device_how))
        for kind, need, has, how in kinds:
            if need.total > has:
                key = (kind, need.total, need.describe(), has, how)
                short.setdefault(key, []).append(r.rank)
    if not short:
        return None
    found = []
    for (kind, total, parts, has, how), members in short.items():
        need, have = ("each need", "each have") if len(members) > 1 else ("needs", "has")
        found.append(
            f"{_ranks(members)} {need} {gib(total)} of {kind} ({parts}) but {have} {gib(has)} "
            f"({how}), {gib(total - has)} short"
        )

    def fits(rank: RankMemory, device: float, host: float) -> bool:
        device_has, host_has = budgets[rank.rank]
        return (rank.device is None or device <= device_has) and host <= host_has

    chosen: list[Option] = []
    by_changes = [{o.changes: o for o in r.options} for r in ranks]
    for option in sorted(ranks[0].options, key=lambda o: o.cost):  # stable: the list's order
        if any(
            set(shown.changes) <= set(option.changes)
            or (shown.family and shown.family == option.family)
            for shown in chosen
        ):
            continue  # a smaller change that fits is already offered
        if all(
            option.changes in mine
            and fits(r, mine[option.changes].device, mine[option.changes].host)
            for r, mine in zip(ranks, by_changes, strict=True)
        ):
            chosen.append(option)
    offers = [" with ".join(o.changes) + (f" ({o.note})" if o.note else "") for o in chosen]
    # more ranks, as many per node (each rank's share of the node stays): at the stage of the
    # run, or at stage 3 where that needs fewer
    fewest: dict[int, int] = {}  # stage -> the fewest ranks that fit on every rank
    for stage, count, *_ in ranks[0].more_ranks:
        if stage not in fewest and all(
            any((s, n) == (stage, count) and fits(r, d, h) for s, n, d, h in r.more_ranks)
            for r in ranks
        ):
            fewest[stage] = count
    current = ranks[0].more_ranks[0][0] if ranks[0].more_ranks else None
    at_current = fewest.get(current) if current is not None else None
    for stage, count in sorted(fewest.items(), key=lambda item: item[0] != current):
        if stage == current or at_current is None or count < at_current:
            with_stage = "" if stage == current else f"stage {stage} with "
            offers.append(f"{with_stage}{count} data-parallel ranks or more, {per_node}")
    options = (
        "Options that fit: " + "; ".join(offers)
        if offers
        else "No change of ZeRO stage, offload or rank count fits alone"
    )
    return (
        "zero_optimization: this run does not fit in memory (found before allocating it): "
        + "; ".join(found)
        + f". {options}. A smaller train_micro_batch_size_per_gpu does not help: model states "
        "do not depend on it."
    )
