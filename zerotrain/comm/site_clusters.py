"""Clusters of sites joined by fast links, and the two tiers an outer exchange takes over them.

[Note: clusters of sites]
With three or more sites the links between them are rarely alike: two sites in one region
may share a 1 Gb/s link while a third is 10 Mb/s away. One codec for every site would be the
slowest link's, and compress the fast links' traffic for nothing. Sites are therefore grouped
into clusters, sites joined by fast links (directly or through another site of the cluster),
and an outer exchange of a rank's shard takes two tiers: summed whole over the ranks holding
that shard at the cluster's sites (``inside``), then between one such rank of each cluster
(the cluster's first site's: ``leaders``) in the sites' codec, then sent back whole inside
each cluster from its leader. Every site ends with the same values (one codec's result,
broadcast), as the outer step needs; the slow links carry one compressed message per
cluster, and the fast ones no compression error. With ``sites.clusters`` auto the links are
measured at the start (:func:`probe_site_links`: the alpha-beta probe between the first ranks
of every pair of sites, one pair at a time) and a link at least ``FAST_LINK_RATIO`` times the
slowest one's bandwidth joins its sites (:func:`cluster_sites`).

The tiers' collectives run on a worker thread of their own (:class:`SiteTiers`), one job at a
time in the order the training thread submits them, which is the same on every rank: so the
three collectives of an exchange follow one another while the inner steps go on (streaming's
overlap), and the tiers' process groups are used by that thread alone. They are gloo groups,
the change copied to the host and back: NCCL's kernels issued from a second thread would
queue on the device beside the training's (which would wait for the slow link), and the links
between sites are slow enough that the host's copies cost nothing beside them.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TypeVar

from zerotrain.comm.communicator import CollectiveError, Communicator
from zerotrain.comm.link import Link, probe_link
from zerotrain.comm.setup import DEFAULT_TIMEOUT

__all__ = [
    "FAST_LINK_RATIO",
    "SiteTiers",
    "cluster_sites",
    "describe_links",
    "probe_site_links",
]

# a link this many times the slowest one's bandwidth joins its sites into a cluster: int8,
# the codec auto would choose on the slow links, sends a quarter of the bytes
FAST_LINK_RATIO = 4.0

Clusters = tuple[tuple[int, ...], ...]
T = TypeVar("T")
DEFAULT_TIMEOUT_S = DEFAULT_TIMEOUT.total_seconds()
# the most collectives one job of the tiers issues, each within its group's timeout: the
# leaders' choice of a codec (auto), its link probe's all-reduces and the times' maxima
JOB_COLLECTIVES = 16


def probe_site_links(
    world: Communicator, firsts: list[int], timeout: timedelta | None = None
) -> dict[tuple[int, int], Link]:
    """The link between every pair of sites ``(i, j)``, i < j, probed between their first ranks
    (``firsts``: each site's first default-group rank), one pair at a time; the same on every
    rank. Collective over the default group (every rank makes every pair's group, gloo's:
    the tiers' exchanges run on gloo too)."""
    pairs = list(itertools.combinations(range(len(firsts)), 2))
    groups = [
        world.subgroups([[firsts[i], firsts[j]]], backend="gloo", timeout=timeout) for i, j in pairs
    ]
    mine = {}
    for pair, group in zip(pairs, groups, strict=True):
        if group is not None:
            mine[pair] = probe_link(group)
        world.barrier()  # the next pair once this one is done: no two share the links
    links: dict[tuple[int, int], Link] = {}
    for probed in world.all_gather_object(mine):
        links.update(probed)
    return links


def cluster_sites(links: Mapping[tuple[int, int], Link], sites: int) -> Clusters:
    """The sites (0 to ``sites`` - 1) joined into clusters by fast links (see [Note: clusters
    of sites]): each cluster ascending, ordered by its first site."""
    slowest = min((link.beta for link in links.values() if link.resolved), default=None)
    parent = list(range(sites))

    def root(site: int) -> int:
        while parent[site] != site:
            site = parent[site]
        return site

    for (i, j), link in links.items():
        if slowest is None or not link.resolved or link.beta >= FAST_LINK_RATIO * slowest:
            parent[max(root(i), root(j))] = min(root(i), root(j))
    clusters: dict[int, list[int]] = {}
    for site in range(sites):
        clusters.setdefault(root(site), []).append(site)
    return tuple(tuple(members) for _, members in sorted(clusters.items()))


def describe_links(links: Mapping[tuple[int, int], Link]) -> str:
    """Each pair of sites and its link's bandwidth: ``0-1 94.2 Mb/s, ...``."""
    return ", ".join(f"{i}-{j} {links[i, j].rate()}" for i, j in sorted(links))


@dataclass
class SiteTiers:
    """The two tiers of this rank's outer exchanges (see [Note: clusters of sites]):
    ``inside``, the ranks holding its part at its cluster's sites, the cluster's first site's
    rank first; ``leaders``, that rank of each cluster (None where this rank is not its
    cluster's); both gloo groups, on the host. Each tier keeps its own account of bytes sent.
    ``how``: how the clusters were found, for the step line."""

    clusters: Clusters
    inside: Communicator
    leaders: Communicator | None
    how: str
    _worker: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="zerotrain-sites")
    )
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _queued: int = 0  # jobs submitted and not finished
    _failed: BaseException | None = None  # the first job that raised

    def submit(self, job: Callable[[], T]) -> Future[T]:
        """Run ``job`` on the tiers' thread, after every job submitted before it."""
        with self._lock:
            self._queued += 1
        return self._worker.submit(self._run, job)

    def _run(self, job: Callable[[], T]) -> T:
        try:
            return job()
        except BaseException as error:
            self._failed = self._failed or error
            raise
        finally:
            with self._lock:
                self._queued -= 1

    def result(self, future: Future[T]) -> T:
        """What ``future``'s job returned, waiting at most what the jobs queued before it may
        take (each job's collectives are bounded by their groups' timeout); any job that
        raised, this one or one before it, raises here, and the jobs still queued are
        dropped (they would each wait for their timeouts at the process's exit)."""
        self._raise_failed()
        timeout = self.inside.timeout
        seconds = timeout.total_seconds() if timeout is not None else DEFAULT_TIMEOUT_S
        with self._lock:
            bound = JOB_COLLECTIVES * seconds * max(self._queued, 1)
        try:
            value = future.result(timeout=bound)
        except concurrent.futures.TimeoutError:
            self._worker.shutdown(wait=False, cancel_futures=True)
            raise CollectiveError(
                f"sites: the clusters' outer exchanges did not finish in {bound:g} s (their "
                "collectives' timeouts); a site is lost or cut off"
            ) from None
        except BaseException:
            self._worker.shutdown(wait=False, cancel_futures=True)
            raise
        self._raise_failed()  # a job nobody waits for (a codec's end of step)
        return value

    def _raise_failed(self) -> None:
        if self._failed is not None:
            self._worker.shutdown(wait=False, cancel_futures=True)
            raise CollectiveError(f"sites: a job of the clusters' exchanges failed: {self._failed}")

    def call(self, job: Callable[[], T]) -> T:
        """Run ``job`` on the tiers' thread and return what it returns."""
        return self.result(self.submit(job))

    def describe(self) -> str:
        clusters = " ".join("[" + ", ".join(map(str, c)) + "]" for c in self.clusters)
        return f"clusters {clusters} ({self.how})"
