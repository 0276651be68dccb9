"""Messages between pipeline stages that say what they carry: a header with each tensor's dtype
and shape, then the tensors, so every batch may have its own shapes.

[Note: self-describing stage messages]
torch's pipeline stages receive into buffers shaped once, from the first batch, and gloo accepts a
shorter message into a longer buffer: a batch of another sequence length was read as the first
batch's shape (a wrong loss, or torch's shape errors in backward). Data collators pad each batch
to its own longest sequence, so shapes change every step. Here every message between stages on
different ranks (a stage's output to the next stage, its input's gradient to the previous one)
is a fixed-size int64 header, then the tensors it describes:

    magic | number on the link | kind | stage | micro-batch | tensors | posted ahead |
    descriptor slots | per tensor: -1 (None), or dtype code x 2 + requires_grad, ndim, shape...

A descriptor longer than the header's room follows as a second header message. On each link (a
pair of ranks, one direction) the receiver has one header receive in flight at a time, posted
when the schedule would post the data's receive, and posts the tensors' receives once it has the
header, before the next header's: both ends post header, tensors, header, tensors..., so the
messages pair up by order alone, as NCCL (which has no tags) needs; headers and tensors also
travel under tags of their own, so on gloo neither can be read as the other. A header says which
message it carries (kind, stage, micro-batch) and its number on the link: a message that comes
before the one wanted is kept until asked for (a rank with two stages takes its links' messages
in its own order), one out of step is an error naming both ends, never data read as another
shape. Sends are posted as soon as the tensors exist and completed at the end of the step
(:meth:`StageMessages.finish`), which keeps each message's tensors until then: waiting for one
earlier could wait for a receiver that first needs a later message of this rank. Every wait is
bounded by the group's timeout.

[Note: receives posted ahead]
A tensor's receive posted only once its header is in costs a round trip on the critical path (a
rendezvous: gloo and NCCL move the bytes once both ends have posted), leaves no overlap of the
transfer with the receiver's work, and adds a message. So when the last two messages on a link
had the same tensors (dtypes, shapes, requires_grad), the receiver posts the next header's
receive as one message of the header and those tensors packed after it (each at a 64-byte
boundary): the sender copies its tensors in, the receiver uses them in place, and with shapes
that do not change every message after the second is one message, its receive posted ahead as
torch's fixed buffers are. Both ends know the last two messages, so both know when a packed
message is due (its header says so too, checked). A message whose tensors differ is sent as that
packed message holding its header alone (a filler, op ``send_filler``), then its tensors: one
wasted transfer where the shapes change after a run of equal ones.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from zerotrain.comm.communicator import CollectiveError, Communicator, _group_timeout

MAGIC = 0x7A7450495045_01  # "ztPIPE", protocol version 1
HEADER_SLOTS = 32
HEADER_BYTES = HEADER_SLOTS * 8
_FIXED = 8  # the header's slots before the descriptor
_ALIGN = 64  # bytes: where each tensor of a packed message starts
# p2p tags of their own on the stage group (gloo matches by peer and tag; pairwise.py's tags
# count up from 1)
HEADER_TAG = 0x7A740001
TENSOR_TAG = 0x7A740002
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
    """A message's header: its ``number`` on the link, which message it is, its tensors, and
    whether the receiver had posted their receives ahead ([Note: receives posted ahead])."""

    number: int
    key: MessageKey
    specs: list[TensorSpec | None]
    ahead: bool


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
    slots = [*fixed, len(header.specs), int(header.ahead), len(descriptor), *descriptor]
    slots += [0] * max(0, HEADER_SLOTS - len(slots))
    return torch.tensor(slots, dtype=torch.int64)


def decode(slots: Sequence[int]) -> Header:
    """The header in ``slots`` (and its descriptor's continuation, if any); ValueError if they
    are not one."""
    if len(slots) < _FIXED or slots[0] != MAGIC:
        raise ValueError("not a stage message header (another protocol version or a stray message)")
    number, kind, stage, micro_batch, count, ahead, length = slots[1:_FIXED]
    if not 0 <= kind < len(KINDS) or count < 0 or ahead not in (0, 1):
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
    return Header(number, MessageKey(KINDS[kind], stage, micro_batch), specs, bool(ahead))


def header_slots(first: torch.Tensor) -> int:
    """How many slots a whole header takes, from its first HEADER_SLOTS (the rest follow)."""
    return max(HEADER_SLOTS, _FIXED + int(first[_FIXED - 1]))


def packed_layout(specs: Sequence[TensorSpec | None]) -> tuple[list[int], int]:
    """Where each tensor of ``specs`` starts in a packed message (after the header's first
    HEADER_SLOTS; -1 for None and empty ones), and the message's bytes."""
    offsets, at = [], HEADER_BYTES
    for spec in specs:
        nbytes = 0 if spec is None else math.prod(spec.shape) * spec.dtype.itemsize
        offsets.append(at if nbytes else -1)
        at += -(-nbytes // _ALIGN) * _ALIGN
    return offsets, at


def pack(header: torch.Tensor, tensors: Sequence[torch.Tensor | None], size: int) -> torch.Tensor:
    """One uint8 message of ``size`` bytes: ``header``'s first HEADER_SLOTS, then ``tensors``
    where :func:`packed_layout` places them (none: a filler that carries the header alone)."""
    packed = torch.empty(size, dtype=torch.uint8, device=header.device)
    packed[:HEADER_BYTES].copy_(header[:HEADER_SLOTS].view(torch.uint8))
    specs = [None if t is None else TensorSpec(t.dtype, tuple(t.shape), False) for t in tensors]
    for tensor, at in zip(tensors, packed_layout(specs)[0], strict=True):
        if tensor is not None and at >= 0:
            flat = tensor.detach().reshape(-1).view(torch.uint8)
            packed[at : at + flat.numel()].copy_(flat)
    return packed


def unpack(packed: torch.Tensor, specs: Sequence[TensorSpec | None]) -> list[torch.Tensor | None]:
    """The tensors of a packed message, in its memory. Not autograd views of it: torch's stages
    detach their outputs in place, and a stage may return its input."""
    tensors: list[torch.Tensor | None] = []
    for spec, at in zip(specs, packed_layout(specs)[0], strict=True):
        if spec is None:
            tensors.append(None)
            continue
        if at < 0:  # empty: all in the header
            tensor = torch.empty(spec.shape, dtype=spec.dtype, device=packed.device)
        else:
            strides = [math.prod(spec.shape[d + 1 :]) for d in range(len(spec.shape))]
            tensor = torch.empty(0, dtype=spec.dtype, device=packed.device).set_(
                packed.untyped_storage(), at // spec.dtype.itemsize, spec.shape, strides
            )
        tensors.append(tensor.requires_grad_(spec.requires_grad))
    return tensors


@dataclass
class _Recent:
    """The tensors of the last two messages on a link, as both of its ends saw them."""

    last: list[TensorSpec | None] | None = None
    before: list[TensorSpec | None] | None = None

    def repeated(self) -> list[TensorSpec | None] | None:
        """The last message's tensors if the one before had the same: the next message's
        receives are posted ahead for them ([Note: receives posted ahead])."""
        return self.last if self.last is not None and self.last == self.before else None

    def push(self, specs: list[TensorSpec | None]) -> None:
        self.before, self.last = self.last, specs


@dataclass
class _Arrived:
    """A message whose header arrived: its tensors, their receives posted."""

    tensors: list[torch.Tensor | None]
    works: list[dist.Work]


@dataclass
class _Link:
    """What this rank receives from one peer rank of the stage group."""

    peer: int
    due: list[MessageKey] = field(default_factory=list)  # announced, not yet arrived
    early: set[MessageKey] = field(default_factory=set)  # arrived, not yet announced
    # the header's receive in flight: the header alone, or packed with the tensors expected,
    # which it holds too ([Note: receives posted ahead])
    header: tuple[dist.Work, torch.Tensor, list[TensorSpec | None] | None] | None = None
    received: int = 0  # headers taken: the next one's number on the link
    recent: _Recent = field(default_factory=_Recent)
    arrived: dict[MessageKey, _Arrived] = field(default_factory=dict)


class StageMessages:
    """This rank's messages to and from the stages on other ranks of ``comm`` (the stage
    group), on ``device`` (see [Note: self-describing stage messages]). Peers are ranks of
    ``comm``."""

    def __init__(self, comm: Communicator, device: torch.device):
        self.comm = comm
        self.device = device
        timeout = _group_timeout(comm.group, default=None)
        self.timeout = timeout if isinstance(timeout, timedelta) else _DEFAULT_TIMEOUT
        self._links: dict[int, _Link] = {}
        self._sent: dict[int, tuple[int, _Recent]] = {}  # peer -> messages sent, their tensors
        self._sends: list[tuple[dist.Work, int, MessageKey]] = []

    # -- sending --------------------------------------------------------------------------------
    def send(self, peer: int, key: MessageKey, tensors: Sequence[torch.Tensor | None]) -> None:
        """Post ``key``'s message of ``tensors`` (None: a gradient autograd did not produce) to
        ``peer``; completed by :meth:`finish`."""
        number, recent = self._sent.get(peer, (0, _Recent()))
        specs = specs_of(key, tensors)
        ahead = recent.repeated()  # what the receiver expects, packed after the header
        header = encode(Header(number, key, specs, ahead is not None)).to(self.device)
        payload = [t.detach().contiguous() if t is not None else None for t in tensors]
        filler = 0
        if ahead is None:
            self._post(header[:HEADER_SLOTS], peer, HEADER_TAG, key)
        else:  # a filler that carries the header alone if the tensors are not the ones expected
            size = packed_layout(ahead)[1]
            hit = ahead == specs
            self._post(pack(header, payload if hit else [], size), peer, HEADER_TAG, key)
            filler = 0 if hit else size - HEADER_BYTES
        if len(header) > HEADER_SLOTS:  # the rest of a long header
            self._post(header[HEADER_SLOTS:], peer, HEADER_TAG, key)
        if ahead != specs:
            for tensor in payload:
                if tensor is not None and tensor.numel():  # an empty one is all in its header
                    self._post(tensor, peer, TENSOR_TAG, key)
        recent.push(specs)
        self._sent[peer] = (number + 1, recent)
        sent = [t for t in payload if t is not None]
        data = sum(t.numel() * t.element_size() for t in sent)
        self.comm.count("send", data, sent=data, calls=len(sent))
        self.comm.count("send_header", header.numel() * 8, sent=header.numel() * 8)
        if filler:
            self.comm.count("send_filler", filler, sent=filler)

    def _post(self, tensor: torch.Tensor, peer: int, tag: int, key: MessageKey) -> None:
        self._sends.append((self._p2p(dist.isend, tensor, peer, tag), peer, key))

    def _p2p(self, op, tensor: torch.Tensor, peer: int, tag: int) -> dist.Work:
        """``op`` (isend or irecv) of ``tensor`` with ``peer`` under ``tag``."""
        if op is dist.isend:
            work = dist.isend(tensor, group=self.comm.group, group_dst=peer, tag=tag)
        else:
            work = dist.irecv(tensor, group=self.comm.group, group_src=peer, tag=tag)
        if work is None:  # torch's answer to a rank outside the group
            raise RuntimeError(f"pipeline: rank {peer} is not in the stage group")
        return work

    # -- receiving ------------------------------------------------------------------------------
    def expect(self, peer: int, key: MessageKey) -> None:
        """``key``'s message will come from ``peer``: post a header receive for it (the
        schedule's receive, posted ahead)."""
        link = self._links.setdefault(peer, _Link(peer))
        if key in link.early:  # its header came first, for another message's receive
            link.early.remove(key)
            return
        if key in link.due or key in link.arrived:
            raise RuntimeError(f"pipeline: {key.describe()} was expected twice from rank {peer}")
        link.due.append(key)
        self._post_header(link)

    def receive(self, peer: int, key: MessageKey) -> list[torch.Tensor | None]:
        """``key``'s tensors from ``peer`` (each ``requires_grad`` as the sender's was), taking
        the headers before it on the link as they come."""
        link = self._links.setdefault(peer, _Link(peer))
        if key not in link.due and key not in link.arrived or key in link.early:
            self.expect(peer, key)
        while key not in link.arrived:
            self._take_header(link, key)
        arrived = link.arrived.pop(key)
        for work in arrived.works:
            self._wait(work, peer, key, receiving=True)
        return arrived.tensors

    def _post_header(self, link: _Link) -> None:
        """Post the next header's receive on ``link`` if a message is due and none is in
        flight: packed with the tensors of the last message if the one before had the same."""
        if link.header is not None or not link.due:
            return  # one at a time: its tensors' receives go before the next header's
        ahead = link.recent.repeated()
        if ahead is None:
            buffer = torch.empty(HEADER_SLOTS, dtype=torch.int64, device=self.device)
        else:
            buffer = torch.empty(packed_layout(ahead)[1], dtype=torch.uint8, device=self.device)
        link.header = (self._p2p(dist.irecv, buffer, link.peer, HEADER_TAG), buffer, ahead)

    def _receive_tensors(self, link: _Link, specs: list[TensorSpec | None]) -> _Arrived:
        tensors: list[torch.Tensor | None] = []
        works = []
        for spec in specs:
            if spec is None:
                tensors.append(None)
                continue
            tensor = torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
            if tensor.numel():  # an empty tensor is all in its header
                works.append(self._p2p(dist.irecv, tensor, link.peer, TENSOR_TAG))
            tensors.append(tensor.requires_grad_(spec.requires_grad))
        return _Arrived(tensors, works)

    def _take_header(self, link: _Link, wanted: MessageKey) -> None:
        """Complete the header in flight on ``link``, post its tensors' receives (or take them
        from the packed message), and post the next header's receive if more messages are
        due."""
        if link.header is None:
            raise RuntimeError(f"pipeline: no message is due from rank {link.peer}")
        work, buffer, ahead = link.header
        self._wait(work, link.peer, wanted, receiving=True, header=True)
        link.header = None
        first = buffer if ahead is None else buffer[:HEADER_BYTES].view(torch.int64)
        slots = header_slots(first)
        if slots > HEADER_SLOTS:  # the rest of a long header
            rest = torch.empty(slots - HEADER_SLOTS, dtype=torch.int64, device=self.device)
            more = self._p2p(dist.irecv, rest, link.peer, HEADER_TAG)
            self._wait(more, link.peer, wanted, receiving=True, header=True)
            first = torch.cat([first, rest])
        try:
            header = decode(first.tolist())
        except ValueError as error:
            raise RuntimeError(
                f"pipeline: rank {self.comm.rank} of the stage group got {error} from rank "
                f"{link.peer} while waiting for {wanted.describe()}"
            ) from None
        key = header.key
        if header.number != link.received or header.ahead != (ahead is not None):
            raise RuntimeError(
                f"pipeline: message {header.number} from rank {link.peer} ({key.describe()}) "
                f"arrived where message {link.received} was due, or not as expected: the stages "
                "are out of step (a step that failed midway?); build the engine again"
            )
        link.received += 1
        if key in link.arrived or key in link.early:
            raise RuntimeError(f"pipeline: {key.describe()} arrived twice from rank {link.peer}")
        if key in link.due:
            link.due.remove(key)
        else:  # the schedule announces it later (another message's header is still to come)
            link.early.add(key)
        if ahead is not None and ahead == header.specs:
            link.arrived[key] = _Arrived(unpack(buffer, header.specs), [])
        else:
            link.arrived[key] = self._receive_tensors(link, header.specs)
        link.recent.push(header.specs)
        self._post_header(link)

    def _wait(
        self, work: dist.Work, peer: int, key: MessageKey, receiving: bool, header: bool = False
    ) -> None:
        start = time.monotonic()
        try:
            work.wait(self.timeout)
        except (RuntimeError, dist.DistBackendError) as error:
            what = ("the header of " if header else "") + key.describe()
            action = "send" if receiving else "receive"
            raise CollectiveError(
                f"pipeline: rank {self.comm.rank} of the stage group waited "
                f"{time.monotonic() - start:.1f} s (timeout {self.timeout}) for rank {peer} to "
                f"{action} {what}: {error}. Rank {peer} probably died or stalled; check its log."
            ) from error

    # -- the end of a step ----------------------------------------------------------------------
    def finish(self) -> None:
        """Complete this step's sends and check that every message due arrived and was taken:
        the links are then empty, as at the start."""
        sends, self._sends = self._sends, []
        for work, peer, key in sends:
            self._wait(work, peer, key, receiving=False)
        for link in self._links.values():
            left = [*link.due, *link.arrived]  # (early ones are in arrived)
            if left or link.header is not None:
                raise RuntimeError(
                    f"pipeline: the step ended with messages from rank {link.peer} not taken: "
                    f"{', '.join(k.describe() for k in left) or 'a header receive in flight'}"
                )
