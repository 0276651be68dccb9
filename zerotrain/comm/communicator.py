"""Collectives over one process group, with timeouts, clear failures and byte counts."""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, TypeVar, overload

import torch
import torch.distributed as dist

from zerotrain.comm import pairwise, progress
from zerotrain.comm.log import CommsLog
from zerotrain.comm.setup import collective_timeout
from zerotrain.errors import ZeroTrainError

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}

T = TypeVar("T")


class CollectiveError(ZeroTrainError, RuntimeError):
    """A collective failed or timed out, usually because a peer rank died or stalled."""


@dataclass
class OpStats:
    """What one kind of collective cost on this rank."""

    calls: int = 0
    bytes: int = 0  # payload: the tensor reduced or gathered, as the caller sees it
    sent: int = 0  # bytes this rank put on the wire (see [Note: bytes sent])
    seconds: float = 0.0  # time spent waiting for completion on the calling thread


# [Note: bytes sent]
# ``OpStats.sent`` counts what this rank transmits. For the pairwise reduce-scatter and
# all-gather (gloo) that is exact: (N-1) pieces of B/N bytes. For the backend's own collectives
# it is the bandwidth-optimal ring's count, which NCCL's large-message algorithms and gloo's ring
# all-reduce follow: all-reduce 2(N-1)/N B, reduce-scatter and all-gather (N-1)/N B (B: the full
# buffer), broadcast (N-1)/N B (scatter + all-gather). These are the volumes ZeRO
# (arXiv:1910.02054 §7) reasons with: 2Ψ per step for stages 0-2, 3Ψ for stage 3.
def ring_sent(op: str, nbytes: int, world: int) -> int:
    factor = 2 if op == "all_reduce" else 1
    return factor * nbytes * (world - 1) // world


class PendingOp:
    """An asynchronous collective in flight; :meth:`wait` completes it (or raises)."""

    def __init__(
        self,
        comm: Communicator,
        name: str,
        nbytes: int,
        work,
        message: tuple | None = None,
        seq: int = 0,
    ):
        self._comm = comm
        self._name = name
        self._nbytes = nbytes
        self._work = work
        self._seq = seq  # its sequence number on the group ([Note: roll call])
        self._message = message  # its comms-log line, if logged
        self._on_done: Callable[[], object] | None = None
        self._done = False

    def then(self, callback: Callable[[], object]) -> PendingOp:
        """Run ``callback`` on this rank once the collective has completed (inside :meth:`wait`)."""
        self._on_done = callback
        return self

    def wait(self) -> None:
        if self._done:
            return
        start = time.perf_counter()
        if self._work is not None:
            self._comm._complete(self._name, self._nbytes, self._work.wait, self._seq)
        waited = time.perf_counter() - start
        self._comm._record(self._name, 0, waited, calls=0, sent=0, message=self._message)
        self._done = True
        if self._on_done is not None:
            self._on_done()


class Communicator:
    """Collectives over one process group; ``group=None`` means the default group.

    Without an initialized process group (a plain single-process run) it acts as a group of one:
    every collective is a local copy or a no-op, so the engine has one code path.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
        stats: dict[str, OpStats] | None = None,
        log: CommsLog | None = None,
        tracked: bool = True,
        timeout: timedelta | None = None,
    ):
        """``tracked=False``: its collectives stay out of the progress records (a background
        thread's, which would stand for the training's place; see progress.py). ``timeout``:
        the one ``group`` was made with, where it is not the collective timeout."""
        self.group = group
        self._timeout = timeout
        self.device = torch.device(device)  # where scalars for control collectives live (NCCL: GPU)
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        # shared with the groups made by new_group(): one account per engine
        self.stats: dict[str, OpStats] = stats if stats is not None else {}
        self.log = log  # comms_logger: per message size (shared with new_group() too)
        # gloo lacks an efficient reduce-scatter / all-gather: see [Note: why pairwise exchange
        # on gloo] in pairwise.py
        self._pairwise = self.distributed and dist.get_backend(group) == "gloo"
        # how the progress records name this group ([Note: naming the silent peer])
        self._group_name = ""
        self._tracked = tracked  # the groups it makes are tracked alike
        self._progress = progress.PROGRESS if tracked else progress.Progress()
        if self.distributed:
            self._group_name = (group or dist.distributed_c10d._get_default_group()).group_name
            seconds = self.timeout.total_seconds() if self.timeout else 600.0
            progress.watch(seconds / 4)

    @property
    def timeout(self) -> timedelta | None:
        """How long this group's collectives may take (None: not known)."""
        if self._timeout is not None:
            return self._timeout
        timeout = _group_timeout(self.group, default=None)
        return timeout if isinstance(timeout, timedelta) else None

    # -- bookkeeping -------------------------------------------------------------------------
    def _record(
        self,
        name: str,
        nbytes: int,
        seconds: float,
        calls: int = 1,
        sent: int | None = None,
        message: tuple[str, int] | None = None,
        done: bool = True,
    ) -> None:
        """Count a collective's launch, or (``calls=0``, ``sent=0``) the time waited for it to
        complete. ``message``: its comms-log line, (label, message bytes), when logging."""
        sent = ring_sent(name, nbytes, self.world_size) if sent is None else sent
        stats = self.stats.setdefault(name, OpStats())
        stats.calls += calls
        stats.bytes += nbytes
        stats.sent += sent
        stats.seconds += seconds
        if message is not None:
            assert self.log is not None  # a message is only made when logging (_message)
            self.log.record(*message, calls, sent, seconds, done)

    def count(self, name: str, nbytes: int, sent: int, calls: int = 1) -> None:
        """Count traffic on this group that another library issues itself (the pipeline
        schedule's sends between stages): ``nbytes`` payload, ``sent`` on the wire."""
        self._record(name, nbytes, 0.0, calls=calls, sent=sent, message=self._message(name, nbytes))

    def _message(self, name: str, nbytes: int) -> tuple[str, int] | None:
        """The comms-log line of a collective about to be launched (None: not logged)."""
        if self.log is None or not self.log.wants(name):
            return None
        return self.log.label(name), nbytes

    def _complete(self, name: str, nbytes: int, run: Callable[[], object], seq: int) -> object:
        """``run()``, this group's collective ``name`` #``seq`` (or its wait), recorded in the
        progress records; a failure raised as a :class:`CollectiveError` that says where the
        peers are that did not arrive ([Note: naming the silent peer])."""
        record = self._progress
        record.wait(self._group_name, name, seq)
        began = time.time()
        try:
            return run()
        except (RuntimeError, dist.DistBackendError) as err:
            failed = (
                f"{name} of {nbytes} bytes failed on rank {self.rank} of {self.world_size} "
                f"(collective timeout {self.timeout or 'unknown'})"
            )
            ranks = dist.get_process_group_ranks(
                self.group or dist.distributed_c10d._get_default_group()
            )
            where = ""
            if self._progress is progress.PROGRESS:
                where = progress.silent_peers(self._group_name, ranks, name, seq, began)
            if isinstance(err, pairwise.PeerWaitError):  # the peer is known: name it
                raise CollectiveError(
                    f"{failed}: rank {self.rank} {err}. Rank {err.peer} probably died or "
                    f"stalled; check its log.{where}"
                ) from err
            raise CollectiveError(
                f"{failed}: {err}. A peer rank probably died or stalled; "
                f"check the other ranks' logs.{where}"
            ) from err
        finally:
            record.done(self._group_name)

    @overload
    def issue(
        self,
        name: str,
        nbytes: int,
        launch: Callable[[bool], object],
        async_op: Literal[True],
        sent: int | None = None,
    ) -> PendingOp: ...
    @overload
    def issue(
        self,
        name: str,
        nbytes: int,
        launch: Callable[[bool], object],
        async_op: bool,
        sent: int | None = None,
    ) -> object: ...
    def issue(
        self,
        name: str,
        nbytes: int,
        launch: Callable[[bool], object],
        async_op: bool,
        sent: int | None = None,
    ) -> object:
        """Run ``launch(async_op)``, a ``torch.distributed`` call on this group, as the
        collective ``name`` of ``nbytes`` payload (``sent``: bytes this rank transmits, by
        default the ring's count): counted, logged, and a failure or timeout raised as a
        :class:`CollectiveError`. With ``async_op`` returns its :class:`PendingOp`."""
        message = self._message(name, nbytes)
        start = time.perf_counter()
        seq = self._progress.issue(self._group_name, name)
        work = self._complete(name, nbytes, lambda: launch(async_op), seq)
        self._record(
            name, nbytes, time.perf_counter() - start, sent=sent, message=message, done=not async_op
        )
        if async_op:
            return PendingOp(self, name, nbytes, work, message, seq)
        return work  # what a synchronous call returns (recv: the sender's rank)

    def _collective(
        self,
        name: str,
        nbytes: int,
        launch: Callable[[bool], object],
        async_op: bool,
        sent: int | None = None,
    ) -> PendingOp | None:
        """:meth:`issue` for a collective, whose synchronous form returns nothing (see
        [Note: typed collectives])."""
        if async_op:
            return self.issue(name, nbytes, launch, True, sent=sent)
        self.issue(name, nbytes, launch, False, sent=sent)
        return None

    def new_group(self, ranks: list[int] | None = None, backend: str | None = None) -> Communicator:
        """A communicator over a new process group of ``ranks`` (default-group ranks; None:
        the same ranks as this group), with this group's timeout; ``backend``: another backend
        than the default group's ("gloo" beside NCCL: its collectives run on the CPU, its
        communicator's tensors live there). Collective: every rank of the default group calls
        it, in the same order. Collectives on different groups are ordered independently."""
        if not self.distributed:
            return Communicator(
                device=self.device, stats=self.stats, log=self.log, tracked=self._tracked
            )
        if ranks is None and self.group is not None:
            return self._duplicate(backend)
        group = dist.new_group(ranks=ranks, timeout=self.timeout, backend=backend)
        if not isinstance(group, dist.ProcessGroup):  # torch's marker for a rank not in ranks
            raise ValueError(
                f"new_group: rank {self.global_rank} is not in ranks {ranks}; every rank makes "
                "the group, only its members get a communicator (split() gives every rank one)"
            )
        return self._made(group, backend, self._timeout)

    def _made(
        self, group: dist.ProcessGroup, backend: str | None, timeout: timedelta | None
    ) -> Communicator:
        """The communicator of ``group``, a group this one made: its account, log and tracking,
        on the CPU for a gloo group beside NCCL; ``timeout``: its own, if any."""
        device = "cpu" if backend == "gloo" else self.device
        return Communicator(
            group,
            device=device,
            stats=self.stats,
            log=self.log,
            tracked=self._tracked,
            timeout=timeout,
        )

    def _duplicate(self, backend: str | None = None) -> Communicator:
        """A second group over this group's ranks. Making a group is collective over the
        default group, and the other ranks are in groups of their own (a mesh axis): each rank
        learns every rank's group, and all of them are made again, in one order."""
        world = Communicator(device=self.device, stats=self.stats, log=self.log)
        everyone = world.all_gather_object(dist.get_process_group_ranks(self.group))
        lists = sorted({tuple(ranks) for ranks in everyone})
        return self.split([list(ranks) for ranks in lists], backend)

    def split(
        self,
        rank_lists: list[list[int]],
        backend: str | None = None,
        timeout: timedelta | None = None,
    ) -> Communicator:
        """Make a process group for each list of default-group ranks (collective: every rank
        makes every group, in order) and return the communicator of the one holding this rank.
        ``timeout``: its collectives' (None: this group's)."""
        chosen = self.subgroups(rank_lists, backend, timeout)
        if chosen is None:
            raise ValueError(f"split: rank {self.global_rank} is in none of {rank_lists}")
        return chosen

    def subgroups(
        self,
        rank_lists: list[list[int]],
        backend: str | None = None,
        timeout: timedelta | None = None,
    ) -> Communicator | None:
        """:meth:`split` where a rank may be in none of the lists (None for it); ``backend``
        as :meth:`new_group`'s, ``timeout`` as :meth:`split`'s."""
        mine = [ranks for ranks in rank_lists if self.global_rank in ranks]
        if len(mine) > 1:
            raise ValueError(
                f"split: rank {self.global_rank} must be in at most one of {rank_lists}"
            )
        if not self.distributed:
            return self.new_group() if mine else None
        chosen = None
        own = timeout if timeout is not None else self._timeout  # the new groups' own, if any
        for ranks in rank_lists:
            group = dist.new_group(ranks=ranks, timeout=own or self.timeout, backend=backend)
            if mine and ranks is mine[0]:
                chosen = group
        if not mine:
            return None
        if not isinstance(chosen, dist.ProcessGroup):  # torch made the group of mine[0] here
            raise RuntimeError(f"split: torch made no process group for ranks {mine[0]}")
        return self._made(chosen, backend, own)

    def within_nodes(self, ranks_per_node: int) -> Communicator:
        """A communicator over this group's ranks on this rank's node (torchrun numbers the
        ranks of a node consecutively: node = default-group rank // ``ranks_per_node``).
        Collective over the default group; every node must hold as many of this group's ranks.
        """
        return self._split_by(self._on_node(ranks_per_node)[self.global_rank // ranks_per_node])

    def across_nodes(self, ranks_per_node: int) -> Communicator:
        """A communicator over the ranks of this group that hold this rank's place on their
        node (the i-th of the group's ranks on each node), for exchanges that first reduce
        inside each node (collective over the default group, as :meth:`within_nodes`)."""
        on_node = self._on_node(ranks_per_node)
        place = on_node[self.global_rank // ranks_per_node].index(self.global_rank)
        return self._split_by([on_node[node][place] for node in sorted(on_node)])

    def _on_node(self, ranks_per_node: int) -> dict[int, list[int]]:
        """Per node, this group's default-group ranks on it, ascending."""
        members = self.members()
        on_node: dict[int, list[int]] = {}
        for rank in sorted(members):
            on_node.setdefault(rank // ranks_per_node, []).append(rank)
        sizes = {len(ranks) for ranks in on_node.values()}
        if len(sizes) > 1:
            raise ValueError(
                f"ranks {members} hold {sorted(sizes)} ranks on different nodes of "
                f"{ranks_per_node} ranks each; a partition inside each node needs as many on each"
            )
        return on_node

    def _split_by(self, mine: list[int]) -> Communicator:
        """:meth:`split` into the lists of default-group ranks that every rank names as its
        own ``mine`` (collective over the default group)."""
        world = Communicator(device=self.device, stats=self.stats, log=self.log)
        lists = sorted({tuple(ranks) for ranks in world.all_gather_object(mine)})
        return self.split([list(ranks) for ranks in lists])

    @property
    def global_rank(self) -> int:
        """This process's rank in the default group."""
        return dist.get_rank() if self.distributed else 0

    @property
    def root(self) -> int:
        """The default-group rank of this group's first rank: ``broadcast``'s ``src`` for "from
        the group's rank 0"."""
        return self.global_rank_of(0)

    def members(self) -> list[int]:
        """This group's ranks in the default group, in group-rank order."""
        return [self.global_rank_of(r) for r in range(self.world_size)]

    def global_rank_of(self, group_rank: int) -> int:
        """The default-group rank of this group's rank ``group_rank``."""
        if not self.distributed or self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    @property
    def sent(self) -> int:
        """Bytes this communicator's account (shared by the groups it made) holds as sent."""
        return sum(stats.sent for stats in self.stats.values())

    def reset_stats(self) -> None:
        """Start counting afresh (the comms log too)."""
        self.stats.clear()
        if self.log is not None:
            self.log.lines.clear()

    # -- collectives ---------------------------------------------------------------------------
    # [Note: typed collectives] Each collective returns its PendingOp with async_op=True and
    # None otherwise; the overloads say so, so callers of the asynchronous form need no check.
    @overload
    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: str | dist.ReduceOp = ...,
        *,
        async_op: Literal[True],
        name: str = ...,
    ) -> PendingOp: ...
    @overload
    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: str | dist.ReduceOp = ...,
        async_op: bool = ...,
        name: str = ...,
    ) -> PendingOp | None: ...
    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: str | dist.ReduceOp = "sum",
        async_op: bool = False,
        name: str = "all_reduce",
    ) -> PendingOp | None:
        """Reduce ``tensor`` in place across ranks (``op``: sum or max, or a ``ReduceOp``).
        Counted as ``name`` (a compressed gradient's factors: their own line)."""
        if self.world_size == 1:
            return PendingOp(self, name, 0, None) if async_op else None
        reduce_op = _REDUCE_OPS.get(op, op) if isinstance(op, str) else op
        nbytes = tensor.numel() * tensor.element_size()
        return self._collective(
            name,
            nbytes,
            lambda a: dist.all_reduce(tensor, op=reduce_op, group=self.group, async_op=a),
            async_op,
            sent=ring_sent("all_reduce", nbytes, self.world_size),
        )

    @overload
    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, async_op: Literal[True]
    ) -> PendingOp: ...
    @overload
    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = ...
    ) -> PendingOp | None: ...
    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False
    ) -> PendingOp | None:
        """Sum ``input`` (world_size equal pieces) across ranks; this rank's piece to ``output``."""
        if self.world_size == 1:
            output.copy_(input)
            return PendingOp(self, "reduce_scatter", 0, None) if async_op else None
        if self._pairwise:
            return self._issue_pairwise(pairwise.reduce_scatter, output, input, async_op)
        return self._collective(
            "reduce_scatter",
            input.numel() * input.element_size(),
            lambda a: _reduce_scatter_single(output, input, group=self.group, async_op=a),
            async_op,
        )

    @overload
    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: Literal[True], name: str = ...
    ) -> PendingOp: ...
    @overload
    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = ..., name: str = ...
    ) -> PendingOp | None: ...
    def all_gather(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        async_op: bool = False,
        name: str = "all_gather",
    ) -> PendingOp | None:
        """Concatenate every rank's ``input`` into ``output``; ``input`` may be ``output``'s own
        slice for this rank (an in-place gather). Counted as ``name``."""
        if self.world_size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return PendingOp(self, name, 0, None) if async_op else None
        if self._pairwise:
            return self._issue_pairwise(pairwise.all_gather, output, input, async_op, name)
        nbytes = output.numel() * output.element_size()
        return self._collective(
            name,
            nbytes,
            lambda a: _all_gather_single(output, input, group=self.group, async_op=a),
            async_op,
            sent=ring_sent("all_gather", nbytes, self.world_size),
        )

    @overload
    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: list[int] | None = ...,
        input_splits: list[int] | None = ...,
        *,
        async_op: Literal[True],
        name: str = ...,
    ) -> PendingOp: ...
    @overload
    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: list[int] | None = ...,
        input_splits: list[int] | None = ...,
        *,
        async_op: bool = ...,
        name: str = ...,
    ) -> PendingOp | None: ...
    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: list[int] | None = None,
        input_splits: list[int] | None = None,
        *,
        async_op: bool = False,
        name: str = "all_to_all",
    ) -> PendingOp | None:
        """Send rows ``input_splits[r]`` of ``input`` (dimension 0; None: equal pieces) to rank
        r and receive rank r's into rows ``output_splits[r]`` of ``output``. Counted as
        ``name``: the payload is ``input``, what this rank sends the rows for other ranks."""
        row = math.prod(input.shape[1:]) * input.element_size()
        nbytes = len(input) * row
        if self.world_size == 1:
            output.copy_(input)
            return PendingOp(self, name, 0, None) if async_op else None
        own = (input_splits[self.rank] if input_splits else len(input) // self.world_size) * row
        if self._pairwise and input_splits is None and output_splits is None:
            return self._issue_pairwise(
                pairwise.all_to_all, output, input, async_op, name, sent=nbytes - own
            )

        def launch(a: bool):
            return dist.all_to_all_single(
                output, input, output_splits, input_splits, group=self.group, async_op=a
            )

        if async_op:
            return self.issue(name, nbytes, launch, True, sent=nbytes - own)
        self.issue(name, nbytes, launch, False, sent=nbytes - own)
        return None

    def _issue_pairwise(
        self,
        operation,
        output: torch.Tensor,
        input: torch.Tensor,
        async_op: bool,
        name: str | None = None,
        sent: int | None = None,
    ) -> PendingOp | None:
        full = input if operation.__name__ in ("reduce_scatter", "all_to_all") else output
        name = name or operation.__name__
        nbytes = full.numel() * full.element_size()
        tag = pairwise.next_tag(self.group)
        timeout = self.timeout

        def launch(_async: bool):
            return operation(
                output,
                input,
                group=self.group,
                rank=self.rank,
                world=self.world_size,
                tag=tag,
                timeout=timeout,
            )

        op = self.issue(name, nbytes, launch, async_op=True, sent=sent)
        pairwise.complete_if_dropped(op, op._work)
        if not async_op:
            op.wait()
            return None
        return op

    @overload
    def broadcast(
        self, tensor: torch.Tensor, src: int = ..., *, async_op: Literal[True]
    ) -> PendingOp: ...
    @overload
    def broadcast(
        self, tensor: torch.Tensor, src: int = ..., async_op: bool = ...
    ) -> PendingOp | None: ...
    def broadcast(
        self, tensor: torch.Tensor, src: int = 0, async_op: bool = False
    ) -> PendingOp | None:
        """Copy ``tensor`` from rank ``src`` (a rank of the default group) to every rank of
        this group, in place."""
        if self.world_size == 1:
            return PendingOp(self, "broadcast", 0, None) if async_op else None
        return self._collective(
            "broadcast",
            tensor.numel() * tensor.element_size(),
            lambda a: dist.broadcast(tensor, src=src, group=self.group, async_op=a),
            async_op,
        )

    def barrier(self) -> None:
        """Wait until every rank arrives (bounded by the group's timeout)."""
        if self.world_size == 1:
            return
        # A zero-byte all-reduce rather than dist.barrier: gloo's barrier ignores the timeout
        # in some versions, and this one is bounded like every other collective.
        self.all_reduce(torch.zeros(1, device=self.device))

    def all_gather_object(self, obj: T) -> list[T]:
        """Every rank's picklable ``obj``, in rank order (every rank passes the same kind)."""
        if self.world_size == 1:
            return [obj]
        out: list = [None] * self.world_size
        seq = self._progress.issue(self._group_name, "all_gather_object")
        self._complete(
            "all_gather_object", 0, lambda: dist.all_gather_object(out, obj, group=self.group), seq
        )
        self._record("all_gather_object", 0, 0.0)
        return out


def _group_timeout(group: dist.ProcessGroup | None, default="unknown") -> timedelta | str | None:
    """The timeout of ``group``'s collectives: the one init_distributed applied, else what the
    group's backend reports."""
    if collective_timeout() is not None:
        return collective_timeout()
    try:
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        return pg._get_backend(torch.device("cpu")).options._timeout
    except Exception:
        return default


def nothing_inside_nodes(
    comm: Communicator, node: Communicator, ranks_per_node: int, key: str, instead: str
) -> bool:
    """Whether ``node`` (``comm.within_nodes(ranks_per_node)``) leaves a hierarchy by node
    nothing to do, ``comm`` sitting on one node or one rank per node; if so, a warning that
    names the config ``key`` and what runs ``instead``."""
    if 1 < node.world_size < comm.world_size:
        return False
    where = "one node" if node.world_size == comm.world_size else "one rank per node"
    warnings.warn(
        f"{key}: the {comm.world_size} data-parallel ranks sit on {where} ({ranks_per_node} "
        f"ranks per node): {instead}",
        stacklevel=3,
    )
    return True
