"""Where each rank is in its collectives, so that a failed collective can name the silent peer.

[Note: naming the silent peer]
A collective that times out (or whose connection breaks) knows only that some peer did not
arrive; gloo's pairwise exchanges name their one peer, NCCL's and gloo's own collectives cannot.
So every process keeps a record of its collectives, per process group: the sequence number of
the last one issued (ranks issue the same collectives on a group in the same order, so numbers
agree across ranks) and the one it is waiting in, since when; updating it costs a few
assignments per collective. A daemon thread per process looks at that record, locally, a few
times per stall threshold (a quarter of the collective timeout, at most 30 s): when the process
has been outside every collective, or inside one, for longer than the threshold, it publishes
the record once (host, pid, time) to the rendezvous store, the default group's TCPStore, over a
connection of its own. A process in a healthy loop never touches the store, so the job's store
carries nothing and a job's end, when the process holding the store exits first, cannot catch
a thread talking to it.

The rank whose collective failed reads its group's records (waiting up to a second for the
stalled ones to appear) and its :class:`~zerotrain.comm.CollectiveError` says, per peer that has
not reached the collective: its last collective on the group and how long ago, and either the
collective it is waiting in elsewhere (a deadlock) or that it is in its own code (stalled or
slow); a peer with no record newer than the failed wait did not publish: its process is dead,
or hung without releasing Python's interpreter lock. This works on every backend: the store is
torch's, not the backend's. Without a TCPStore (a FileStore, one process) the error says what it
said before.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

_PREFIX = "zerotrain/progress/"
_POINT_TO_POINT = frozenset({"send", "recv"})
_MAX_THRESHOLD_S = 30.0
_READ_WAIT_S = 1.0  # how long a failed rank waits for the records of the stalled ones


@dataclass
class _Group:
    issued: int = 0  # sequence number of the last collective issued on the group
    last_op: str = ""
    last_time: float = 0.0
    waiting: tuple[str, int, float] | None = None  # (operation, sequence number, since)


class Progress:
    """This process's collectives, per process group (by name)."""

    def __init__(self):
        self.groups: dict[str, _Group] = {}
        self.last_activity = time.time()  # a collective issued or finished

    def issue(self, group: str, op: str) -> int:
        """A collective is issued on ``group``: its sequence number there. A point-to-point
        message involves two of the group's ranks: it is recorded, not numbered."""
        record = self.groups.get(group)
        if record is None:
            record = self.groups[group] = _Group()
        record.issued += op not in _POINT_TO_POINT
        record.last_op = op
        record.last_time = self.last_activity = time.time()
        return record.issued

    def wait(self, group: str, op: str, seq: int) -> None:
        self.groups[group].waiting = (op, seq, time.time())

    def done(self, group: str) -> None:
        self.groups[group].waiting = None
        self.last_activity = time.time()

    def stuck_since(self) -> float:
        """Since when this process is in one place: the oldest wait, else its last activity."""
        waits = [g.waiting[2] for g in list(self.groups.values()) if g.waiting is not None]
        return min(waits) if waits else self.last_activity

    def record(self) -> dict:
        groups = {
            name: {
                "issued": g.issued,
                "last_op": g.last_op,
                "last_time": g.last_time,
                "waiting": g.waiting,
            }
            for name, g in list(self.groups.items())
        }
        return {
            "who": f"{socket.gethostname()} pid {os.getpid()}",
            "time": time.time(),
            "groups": groups,
        }


PROGRESS = Progress()
_watched: tuple[tuple[str, int], int] | None = None  # the store's address and this rank
# The failing rank's connection, made with the thread's while the store surely exists: a
# failure is often the moment the process holding the store ends, when connecting would wait.
_reader: dist.TCPStore | None = None
_reading = threading.Lock()


def watch(threshold_s: float) -> None:
    """Start the thread that publishes this process's record when it is stuck, once per default
    group (a no-op without a TCPStore); ``threshold_s``: the collective timeout's quarter."""
    global _watched, _reader
    address = _store_address()
    rank = dist.get_rank()
    if address is None or _watched == (address, rank):
        return
    _watched = (address, rank)  # tried once per group, reachable or not
    try:
        _reader, publisher = _connect(address), _connect(address)
    except (RuntimeError, OSError):  # no store to reach: errors stay as they were
        _reader = None
        return
    threshold = min(_MAX_THRESHOLD_S, threshold_s)
    thread = threading.Thread(
        target=_publish_when_stuck,
        args=(publisher, address, rank, threshold),
        name="zerotrain-progress",
        daemon=True,
    )
    thread.start()


def _store_address() -> tuple[str, int] | None:
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        return None
    return store.host, store.port


def _connect(address: tuple[str, int]) -> dist.TCPStore:
    host, port = address
    return dist.TCPStore(
        host, port, is_master=False, timeout=timedelta(seconds=10), wait_for_workers=False
    )


def _publish_when_stuck(
    store: dist.TCPStore, address: tuple[str, int], rank: int, threshold: float
) -> None:
    published = None  # the episode last published: its start time
    while _watched == (address, rank):
        time.sleep(threshold / 4)
        since = PROGRESS.stuck_since()
        if time.time() - since < threshold or published == since:
            continue
        try:
            store.set(f"{_PREFIX}{rank}", json.dumps(PROGRESS.record()))
        except (RuntimeError, OSError):
            return  # the store is gone: the job is ending
        published = since


def silent_peers(group: str, ranks: list[int], op: str, seq: int, waited_since: float) -> str:
    """Where the ranks of ``group`` (default-group ``ranks``) that have not reached ``op``
    #``seq`` are, for this rank's error (``waited_since``: when its wait began); "" without a
    store."""
    if _reader is None:
        return ""
    me = dist.get_rank()
    others = [r for r in ranks if r != me]
    try:
        with _reading:
            records = _read(_reader, others, waited_since)
    except (RuntimeError, OSError) as err:  # the store failed: keep the original error
        return f"\n  (where the other ranks are could not be read: {err})"
    lines = [_describe(r, records.get(r), group, seq) for r in others]
    behind = [line for line in lines if line is not None]
    if not behind:
        return ""
    reached = len(others) - len(behind)
    tail = f"\n    {reached} other rank(s) reached it" if reached else ""
    return (
        f"\n  where the ranks are that have not reached {op} #{seq}:\n    "
        + "\n    ".join(behind)
        + tail
    )


def _read(store: dist.Store, ranks: list[int], since: float) -> dict[int, dict]:
    """The records published after ``since``, waiting a little for the stalled ranks' (their
    thread looks a few times per threshold)."""
    deadline = time.monotonic() + _READ_WAIT_S
    records: dict[int, dict] = {}
    while True:
        for rank in ranks:
            key = f"{_PREFIX}{rank}"
            if rank not in records and store.check([key]):
                record = json.loads(store.get(key))
                if record["time"] >= since:
                    records[rank] = record
        if len(records) == len(ranks) or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


def _describe(rank: int, record: dict | None, group: str, seq: int) -> str | None:
    """One peer's line, None when it has reached ``seq``."""
    if record is None:
        return (
            f"rank {rank}: no record since this wait began: its process is dead, or hung "
            "without releasing Python's interpreter lock (or it arrived within the last "
            "quarter of the timeout)"
        )
    here = record["groups"].get(group)
    issued = here["issued"] if here else 0
    if issued >= seq:
        return None
    now = time.time()
    last = (
        f"its last collective on this group is {here['last_op']} #{issued}, "
        f"{now - here['last_time']:.1f} s ago"
        if here
        else "it has issued no collective on this group"
    )
    elsewhere = [
        f"{w[0]} #{w[1]} on group {name} for {now - w[2]:.1f} s"
        for name, g in record["groups"].items()
        if (w := g["waiting"]) is not None
    ]
    state = (
        f"it is waiting in {', '.join(elsewhere)}"
        if elsewhere
        else "it is in its own code, not in a collective: stalled or slow"
    )
    return f"rank {rank} ({record['who']}): {last}; {state}"
