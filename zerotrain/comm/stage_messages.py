"""Messages between pipeline stages that say what they carry: a header with each tensor's dtype
and shape, then the tensors, so every batch may have its own shapes.

[Note: self-describing stage messages]
torch's pipeline stages receive into buffers shaped once, from the first batch, and gloo accepts a
shorter message into a longer buffer: a batch of another sequence length was read as the first
batch's shape (a wrong loss, or torch's shape errors in backward). Data collators pad each batch
to its own longest sequence, so shapes change every step. Here every message between stages on
different ranks (a stage's output to the next stage, its input's gradient to the previous one)
is a fixed-size int64 header, then the tensors it describes:

    magic | number on the link | kind | stage | micro-batch | tensors | descriptor slots |
    per tensor: -1 (None), or dtype code x 2 + requires_grad, ndim, shape...

A descriptor longer than the header's room follows as a second header message. The headers
travel on a channel of their own ([Note: headers apart from the tensors]); the tensors go as the
schedule's own point-to-point operations, sized from the header. A header says which message it
carries (kind, stage, micro-batch) and its number on the link (a pair of ranks, one direction):
a message that comes before the one wanted is kept until asked for, one out of step is an error
naming both ends, never data read as another shape. Every wait for a header is bounded by the
group's timeout.

[Note: headers apart from the tensors]
NCCL has no tags: it pairs the sends and receives between two ranks by their order, on one
stream per pair of ranks, where an operation waits for the one before it; a send larger than
NCCL's buffers completes only once its receive runs. torch's schedules are written for that.
1F1B posts a send and the opposite receive as one group (batch_isend_irecv: they run together);
the multi-stage runtime (interleaved 1F1B, ZBV) places each receive in the receiver's list where
its send falls in one simulated run of every rank (``_add_send_recv``), so both ends of a pair
post in one order. Posting our own sends as soon as the tensors exist and the receives only once
their header is in breaks both (at pp 2, 1F1B, rank 0 posts send act 0, send act 1, receive
grad 0, while rank 1 posts receive act 0, send grad 0, receive act 1: a circular wait).

So the tensors go exactly as torch's stages send them: ``get_*_send_ops`` and ``get_*_recv_ops``
return one ``P2POp`` per tensor (:meth:`StageMessages.send_ops`, :meth:`StageMessages.recv_ops`)
and the schedule posts, groups and waits them where it posts, groups and waits its own; the
operations on the stage group are torch's, one for one, in its order, only their sizes come from
the header. Whatever the schedule guarantees on NCCL holds unchanged, and sends complete where
torch waits for them (as it goes in 1F1B, at the end of the forwards in GPipe, at the end of the
step in the runtime).

The receiver must know the shapes before it returns its receives, so the header travels ahead,
on a gloo group over the same ranks (CPU tensors, no stream; on a gloo stage group, the group
itself, under a tag of its own): posted, never waited for until the end of the step, where the
schedule asks for the send ops; waited for where it asks for the receive ops. That wait is the
only one added, and it closes no cycle:

- GPipe asks for a receive's ops right before it waits for them: the same wait.
- 1F1B waits for the group of a held send and a receive (send act k with receive grad b, send
  grad b with receive act k'); we wait for the receive's header before the held send is posted.
  At stage s of S the warm-up is w = S - s forwards, and k = b + w - 1. Stage s+1 sends grad
  b's header after its backward b, which needs this rank's activations up to b + w - 2 = k - 1
  only; stage s-1 sends act k' = b + w's header after its forward k', which needs this rank's
  gradients up to b - 1 only (its warm-up is w + 1). Those were all posted before.
- The runtime: lowering runs every rank's actions in one order and appends a receive to the
  receiver's list where its sender sends; each rank's list follows that order (``defer_pp_recv``
  only moves receives later), and the runtime waits for its sends only at the end of the step.
  The first action in that order not yet done waits, if at all, for a header or tensors that its
  sender posted earlier in that order: so some rank always proceeds.

Headers and tensors never share a tag, and each schedule built takes tags of its own
([Note: a schedule built again]). ``tests/test_pipeline_p2p.py`` runs every schedule with
NCCL's order imposed on gloo (each pair of ranks one queue of rendezvous operations, a group's
run together), where the design before (our own sends posted at once) deadlocked in 1F1B's
first step; ``tests/test_cuda.py`` runs them over NCCL where there are two GPUs.

What it costs against torch's fixed buffers: a receive is posted once its header is in, not ahead,
and the header is a message of its own (no longer packed with the tensors, which spared a message
while shapes repeated but sent fillers of the old size where they changed, and kept a packed copy
of each tensor until the end of the step). On NCCL the hosts run ahead of the GPU, so the header
mostly arrives before the tensors are computed; on gloo it adds a transfer per message: a few
milliseconds a step, not measurable in the demo GPT's pp 2 steps (bench/pipeline_messages.py).

[Note: a schedule built again]
A step that fails midway leaves operations posted: header receives, sends nobody receives, the
schedule's tensor receives. gloo matches by peer and tag, and these would take a later schedule's
messages (a hang, an out-of-step error, or a size mismatch that aborts the process). Each
StageMessages therefore takes tags of its own, from a build number all ranks of the stage group
agree on (the largest of theirs): an engine built again in the same processes never reads an
older one's messages. It still cannot go on in general: gloo closes a connection whose wait timed
out (the ranks that waited for a failed one), and may close one whose posted operations are
dropped, and NCCL cannot take back what was posted and pairs by order (its watchdog ends the
processes once the timeout passes). So the error after a failed step says to restart the
processes; ``tests/test_pipeline_p2p.py`` builds an engine again after a step where every rank
failed, nothing timed out and the failed operations stay referenced, and trains it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from zerotrain.comm.communicator import CollectiveError, Communicator

MAGIC = 0x7A7450495045_02  # "ztPIPE", protocol version 2
HEADER_SLOTS = 32
HEADER_BYTES = HEADER_SLOTS * 8
_FIXED = 7  # the header's slots before the descriptor
_LONGEST = 1 << 16  # descriptor slots: more is a stray message, not a header
# p2p tags on the stage group (gloo matches by peer and tag; pairwise.py's tags count up from
# 1): two per schedule built ([Note: a schedule built again]), below 2**31 (gloo's int)
_TAG_BASE = 0x7A740000
_BUILDS = (2**31 - _TAG_BASE) // 2
KINDS = ("activations", "gradients")
# the dtype codes: both ends run the same zerotrain, so the same table
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
    *(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)),
)
_DEFAULT_TIMEOUT = timedelta(minutes=30)  # torch's, where the group's is unknown
_builds = itertools.count()  # this process's schedules, agreed with the other ranks' (max)


class MessageKey(NamedTuple):
    """Which message: ``kind`` ("activations" for ``stage``'s input, "gradients" for the
    gradient of its output) of ``micro_batch``, for the receiving ``stage``."""

    kind: str
    stage: int
    micro_batch: int

    def describe(self) -> str:
        return f"the {self.kind} of micro-batch {self.micro_batch} for stage {self.stage}"


class TensorSpec(NamedTuple):
    """One tensor of a message as its header describes it (None: no tensor, a gradient that
    autograd did not produce)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool


def specs_of(key: MessageKey, tensors: Sequence[torch.Tensor | None]) -> list[TensorSpec | None]:
    """What a header says of ``tensors``, the items of ``key``'s message (TypeError for what
    a message cannot carry)."""
    specs: list[TensorSpec | None] = []
    for index, tensor in enumerate(tensors):
        if tensor is None:
            specs.append(None)
        elif not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"pipeline: item {index} of {key.describe()} is a {type(tensor).__name__}; "
                "stages pass tensors, or tuples of tensors, to each other"
            )
        elif tensor.dtype not in DTYPES:
            raise TypeError(
                f"pipeline: tensor {index} of {key.describe()} is {tensor.dtype}, which stage "
                f"messages do not carry; use one of {', '.join(str(d) for d in DTYPES)}"
            )
        else:
            specs.append(TensorSpec(tensor.dtype, tuple(tensor.shape), tensor.requires_grad))
    return specs


class Header(NamedTuple):
    """A message's header: its ``number`` on the link, which message it is, its tensors."""

    number: int
    key: MessageKey
    specs: list[TensorSpec | None]


def encode(header: Header) -> torch.Tensor:
    """``header`` as int64 slots, at least HEADER_SLOTS (a longer descriptor continues past
    them)."""
    descriptor: list[int] = []
    for spec in header.specs:
        if spec is None:
            descriptor.append(-1)
        else:
            code = DTYPES.index(spec.dtype) * 2 + int(spec.requires_grad)
            descriptor += [code, len(spec.shape), *spec.shape]
    key = header.key
    fixed = [MAGIC, header.number, KINDS.index(key.kind), key.stage, key.micro_batch]
    slots = [*fixed, len(header.specs), len(descriptor), *descriptor]
    slots += [0] * max(0, HEADER_SLOTS - len(slots))
    return torch.tensor(slots, dtype=torch.int64)


def decode(slots: Sequence[int]) -> Header:
    """The header in ``slots`` (and its descriptor's continuation, if any); ValueError if they
    are not one."""
    if len(slots) < _FIXED or slots[0] != MAGIC:
        raise ValueError("not a stage message header (another protocol version or a stray message)")
    number, kind, stage, micro_batch, count, length = slots[1:_FIXED]
    if not 0 <= kind < len(KINDS) or count < 0:
        raise ValueError(f"a malformed stage message header {list(slots[:_FIXED])}")
    descriptor = list(slots[_FIXED : _FIXED + length])
    specs: list[TensorSpec | None] = []
    at = 0
    try:
        for _ in range(count):
            code = descriptor[at]
            if code == -1:
                specs.append(None)
                at += 1
                continue
            ndim = descriptor[at + 1]
            shape = tuple(descriptor[at + 2 : at + 2 + ndim])
            if ndim < 0 or len(shape) != ndim or min(shape, default=0) < 0 or code < 0:
                raise ValueError
            specs.append(TensorSpec(DTYPES[code // 2], shape, bool(code % 2)))
            at += 2 + ndim
    except (IndexError, ValueError):
        raise ValueError(f"a malformed stage message descriptor {descriptor}") from None
    if at != length:
        raise ValueError(f"a stage message descriptor of {length} slots holds {at}")
    return Header(number, MessageKey(KINDS[kind], stage, micro_batch), specs)


def header_slots(first: torch.Tensor) -> int:
    """How many slots a whole header takes, from its first HEADER_SLOTS (the rest follow);
    ValueError if they are not a header's (checked before its length is believed)."""
    if int(first[0]) != MAGIC:
        raise ValueError("not a stage message header (another protocol version or a stray message)")
    length = int(first[_FIXED - 1])
    if not 0 <= length <= _LONGEST:
        raise ValueError(f"a stage message header announcing {length} descriptor slots")
    return max(HEADER_SLOTS, _FIXED + length)


def agreed_build(headers: Communicator) -> int:
    """This schedule's build number, the same on every rank of ``headers``: the largest of
    theirs ([Note: a schedule built again])."""
    global _builds
    build = torch.tensor([next(_builds)], dtype=torch.int64, device=headers.device)
    headers.all_reduce(build, op="max", name="pipeline_build")
    agreed = int(build.item())
    _builds = itertools.count(agreed + 1)
    return agreed % _BUILDS


@dataclass
class _Link:
    """What this rank receives from one peer rank of the stage group."""

    peer: int
    received: int = 0  # headers taken: the next one's number on the link
    early: dict[MessageKey, list[TensorSpec | None]] = field(default_factory=dict)


class StageMessages:
    """This rank's messages to and from the stages on other ranks of ``comm`` (the stage
    group), their tensors on ``device`` (see [Note: self-describing stage messages]). Peers
    are ranks of ``comm``. Collective over the default group where ``comm`` is not gloo (it
    makes the headers' gloo group), over ``comm`` otherwise."""

    def __init__(self, comm: Communicator, device: torch.device):
        self.comm = comm
        self.device = device
        self.timeout = comm.timeout or _DEFAULT_TIMEOUT
        self.headers = comm if _is_gloo(comm) else comm.new_group(backend="gloo")
        build = agreed_build(self.headers)
        self.header_tag, self.tensor_tag = _TAG_BASE + 2 * build, _TAG_BASE + 2 * build + 1
        self._links: dict[int, _Link] = {}
        self._sent: dict[int, int] = {}  # peer -> messages sent to it
        self._header_sends: list[tuple[dist.Work, int, MessageKey]] = []

    # -- sending --------------------------------------------------------------------------------
    def send_ops(
        self, peer: int, key: MessageKey, tensors: Sequence[torch.Tensor | None]
    ) -> list[dist.P2POp]:
        """Post the header of ``key``'s message of ``tensors`` (None: a gradient autograd did
        not produce) to ``peer``, and return the sends of its tensors for the schedule to post
        ([Note: headers apart from the tensors])."""
        number = self._sent.get(peer, 0)
        specs = specs_of(key, tensors)
        header = encode(Header(number, key, specs))
        for part in (header[:HEADER_SLOTS], header[HEADER_SLOTS:]):  # the rest of a long one
            if part.numel():
                work = self._p2p(dist.isend, part, peer, self.headers, self.header_tag)
                self._header_sends.append((work, peer, key))
        self._sent[peer] = number + 1
        sent = [t.detach().contiguous() for t in tensors if t is not None and t.numel()]
        data = sum(t.numel() * t.element_size() for t in sent)
        self.comm.count("send", data, sent=data, calls=len(sent))
        self.comm.count("send_header", header.numel() * 8, sent=header.numel() * 8)
        return [self._op(dist.isend, t, peer) for t in sent]  # an empty one is all in its header

    def _op(self, op, tensor: torch.Tensor, peer: int) -> dist.P2POp:
        return dist.P2POp(op, tensor, group=self.comm.group, tag=self.tensor_tag, group_peer=peer)

    def _p2p(self, op, tensor: torch.Tensor, peer: int, comm: Communicator, tag: int) -> dist.Work:
        """``op`` (isend or irecv) of ``tensor`` with ``peer`` of ``comm`` under ``tag``."""
        if op is dist.isend:
            work = dist.isend(tensor, group=comm.group, group_dst=peer, tag=tag)
        else:
            work = dist.irecv(tensor, group=comm.group, group_src=peer, tag=tag)
        if work is None:  # torch's answer to a rank outside the group
            raise RuntimeError(f"pipeline: rank {peer} is not in the stage group")
        return work

    # -- receiving ------------------------------------------------------------------------------
    def recv_ops(
        self, peer: int, key: MessageKey
    ) -> tuple[list[torch.Tensor | None], list[dist.P2POp]]:
        """``key``'s tensors from ``peer`` (each ``requires_grad`` as the sender's was), filled
        once the schedule has posted and waited for the receives returned with them; waits for
        the message's header, taking the ones before it on the link as they come."""
        link = self._links.setdefault(peer, _Link(peer))
        specs = link.early.pop(key, None)
        while specs is None:
            header = self._take_header(link, key)
            if header.key == key:
                specs = header.specs
            elif header.key in link.early:
                raise RuntimeError(
                    f"pipeline: {header.key.describe()} arrived twice from rank {peer}"
                )
            else:  # the schedule asks for it later
                link.early[header.key] = header.specs
        tensors: list[torch.Tensor | None] = []
        ops = []
        for spec in specs:
            if spec is None:
                tensors.append(None)
                continue
            tensor = torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
            if tensor.numel():  # an empty tensor is all in its header
                ops.append(self._op(dist.irecv, tensor, peer))
            tensors.append(tensor.requires_grad_(spec.requires_grad))
        return tensors, ops

    def _take_header(self, link: _Link, wanted: MessageKey) -> Header:
        """The next header on ``link`` (its number checked), waited for."""
        first = torch.empty(HEADER_SLOTS, dtype=torch.int64)
        self._wait_header(first, link.peer, wanted)
        try:
            slots = header_slots(first)
            if slots > HEADER_SLOTS:  # the rest of a long header
                rest = torch.empty(slots - HEADER_SLOTS, dtype=torch.int64)
                self._wait_header(rest, link.peer, wanted)
                first = torch.cat([first, rest])
            header = decode(first.tolist())
        except ValueError as error:
            raise RuntimeError(
                f"pipeline: rank {self.comm.rank} of the stage group got {error} from rank "
                f"{link.peer} while waiting for {wanted.describe()}"
            ) from None
        if header.number != link.received:
            raise RuntimeError(
                f"pipeline: message {header.number} from rank {link.peer} "
                f"({header.key.describe()}) arrived where message {link.received} was due: the "
                "stages are out of step (a step that failed midway?); " + restart_advice()
            )
        link.received += 1
        return header

    def _wait_header(self, into: torch.Tensor, peer: int, wanted: MessageKey) -> None:
        work = self._p2p(dist.irecv, into, peer, self.headers, self.header_tag)
        self._wait(work, peer, wanted, receiving=True)

    def _wait(self, work: dist.Work, peer: int, key: MessageKey, receiving: bool) -> None:
        start = time.monotonic()
        try:
            work.wait(self.timeout)
        except (RuntimeError, dist.DistBackendError) as error:
            action = "send" if receiving else "receive"
            raise CollectiveError(
                f"pipeline: rank {self.comm.rank} of the stage group waited "
                f"{time.monotonic() - start:.1f} s (timeout {self.timeout}) for rank {peer} to "
                f"{action} the header of {key.describe()}: {error}. Rank {peer} probably died or "
                "stalled; check its log."
            ) from error

    # -- the end of a step ----------------------------------------------------------------------
    def finish(self) -> None:
        """Complete this step's header sends and check that every header that came was taken:
        the links are then empty, as at the start."""
        sends, self._header_sends = self._header_sends, []
        for work, peer, key in sends:
            self._wait(work, peer, key, receiving=False)
        for link in self._links.values():
            if link.early:
                raise RuntimeError(
                    f"pipeline: the step ended with messages from rank {link.peer} not taken: "
                    f"{', '.join(k.describe() for k in link.early)}"
                )


def _is_gloo(comm: Communicator) -> bool:
    return dist.get_backend(comm.group) == "gloo"


def restart_advice() -> str:
    """What to do after a step failed midway ([Note: a schedule built again])."""
    return (
        "restart the processes (what the failed step posted cannot be taken back, and gloo "
        "closes a connection whose wait timed out)"
    )
