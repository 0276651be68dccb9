"""How a bucket's gradients travel between data-parallel ranks: the backend's collectives, or
compressed ones.

[Note: gradient codecs]
The gradient reductions (zerotrain/zero/reduce.py) hand each bucket's flat gradient, already
scaled by 1/N, to a codec, which either sums it over the ranks in place (``all_reduce``,
stage 0) or leaves this rank's piece of the sum in a shard (``reduce_scatter``, stages 1-3).
:class:`GradientCodec` uses the backend's collectives. The compressing codecs:
* low-rank (:class:`LowRankCodec`, PowerSGD and ACP-SGD, lowrank.py) and sparse
  (:class:`SparseCodec`, top-k and gTop-k, sparse.py) compress a sum that every rank then
  holds whole, so at stages 1-2 they all-reduce and each rank keeps its own piece: they cut the
  bytes of the gradient direction, not its shape. Their error feedback keeps, per rank, what
  the compression left out and adds it to the next gradient (one fp32 copy of the compressed
  parameters' gradients per rank, counted by ``memory_breakdown()["compression"]``).
* quantized (:class:`QuantizedCodec`, int8 and int4, quantize.py) reduce-scatter by an
  all-to-all exchange of quantized pieces (codes and scales, one all-to-all each), the
  exchange of ZeRO++'s qgZ (arXiv:2306.10209 §4.2): each rank quantizes the N pieces of its
  gradient per block, the exchange delivers every piece to its owner, who dequantizes and
  sums them in fp32. The error is one quantization per addend, not one per hop of a ring.
  With ``ranks_per_node`` (``gradients.hierarchical``) the exchange follows qgZ's hierarchy:
  inside each node first, then across the nodes, which sends the bytes between nodes once
  per node rather than once per rank, for a second quantization (of each node's sums).
  At stage 0 the owner then quantizes its summed piece and all-gathers it; every rank,
  the owner too, uses the dequantized values, so the replicas stay equal.
Parameters smaller than ``min_numel`` elements (biases, norms) and vectors travel whole in
the compressed call's own all-reduce (16-bit gradients: in an all-reduce of their own, in
their dtype), and so do embedding tables under the low-rank methods unless
``compress_embeddings``: a batch's gradient of one has nonzero rows for its tokens only,
which few factors represent badly (measured on the demo GPT: PowerSGD at rank 16 ends +1.3%
above uncompressed training with its embeddings whole, +2.9% with them compressed).
The first ``warmup_steps`` optimizer steps are not compressed at all. A compressed reduction
that needs a second collective issues it when the first completes (inside ``wait``): every
rank waits for its buckets in the same order, so the collectives still match.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from zerotrain.comm import Communicator
from zerotrain.compression.lowrank import LowRankMatrix, orthonormalize, worth_compressing
from zerotrain.compression.sparse import pack, top_k, tree_indices, unpack
from zerotrain.optim.onebit import ExactSteps


@dataclass(frozen=True, kw_only=True)
class GradientCompression:
    """The ``comm_compression.gradients`` section, as a policy (see the config's docs)."""

    method: str = "none"
    rank: int = 4
    ratio: float = 0.01
    warmup_steps: int = 0
    error_feedback: bool = True
    min_numel: int = 1024
    block_size: int = 256
    # optimizer steps (1-based) after the warm-up that also travel uncompressed (0/1 Adam's
    # variance updates)
    exact_steps: frozenset[int] = frozenset()
    # topk / gtopk: count the steps each element's gradient carries, for an Adam that catches
    # up ([Note: catching up] in zerotrain/optim/catch_up.py)
    catch_up: bool = True
    # powersgd / acp_sgd: embedding tables as factors too (else whole)
    compress_embeddings: bool = False
    # int8 / int4: reduce inside nodes of this many ranks first, then across them (qgZ's
    # hierarchy); 0: one exchange over the group
    ranks_per_node: int = 0

    @property
    def counts_arrivals(self) -> bool:
        """Whether the codec counts the steps each arrival carries (see ``catch_up``): only
        sparse methods with error feedback carry several steps' gradients."""
        return self.method in ("topk", "gtopk") and self.catch_up and self.error_feedback


@dataclass(frozen=True)
class BucketShape:
    """What a codec needs of a bucket: its padded size, each parameter's (offset, shape), and
    the offsets of those that are embedding tables (an ``nn.Embedding``'s weight, with any
    layer tied to it)."""

    numel_padded: int
    params: list[tuple[int, tuple[int, ...]]]
    embeddings: frozenset[int] = frozenset()


class Pending(Protocol):
    def then(self, callback: Callable[[], object]) -> Pending: ...
    def wait(self) -> None: ...


class Chain:
    """Operations in flight that finish together: :meth:`wait` waits for each, then runs
    ``finish`` (which may issue and wait for more), then the callback given to :meth:`then`."""

    def __init__(self, ops: list[Pending], finish: Callable[[], object]):
        self._ops = ops
        self._finish = finish
        self._then: Callable[[], object] | None = None
        self._done = False

    def then(self, callback: Callable[[], object]) -> Chain:
        self._then = callback
        return self

    def wait(self) -> None:
        if self._done:
            return
        for op in self._ops:
            op.wait()
        self._finish()
        self._done = True
        if self._then is not None:
            self._then()


Ranges = list[tuple[int, int]]


def _take(flat: torch.Tensor, ranges: Ranges, dtype=torch.float32) -> torch.Tensor:
    """The elements of ``ranges`` ([start, end) each) of ``flat``, one vector of ``dtype``."""
    if not ranges:
        return flat.new_zeros(0, dtype=dtype)
    return torch.cat([flat[a:b] for a, b in ranges]).to(dtype)


def _put(flat: torch.Tensor, ranges: Ranges, values: torch.Tensor) -> None:
    at = 0
    for a, b in ranges:
        flat[a:b].copy_(values[at : at + b - a])
        at += b - a


def _complement(ranges: Ranges, numel: int) -> Ranges:
    out, at = [], 0
    for a, b in sorted(ranges):
        if at < a:
            out.append((at, a))
        at = b
    if at < numel:
        out.append((at, numel))
    return out


class GradientCodec:
    """The backend's collectives, uncompressed (see [Note: gradient codecs])."""

    method = "none"

    def __init__(self, comm: Communicator, buckets: list[BucketShape]):
        self.comm = comm
        self.buckets = buckets
        self.steps = 0  # optimizer steps taken (the warm-up counts them)

    def all_reduce(self, index: int, flat: torch.Tensor) -> Pending:
        """Sum bucket ``index``'s ``flat`` over the ranks, in place (asynchronous)."""
        return self.comm.all_reduce(flat, async_op=True)

    def reduce_scatter(self, index: int, shard: torch.Tensor, flat: torch.Tensor) -> Pending:
        """This rank's piece of the sum of ``flat`` over the ranks into ``shard``, which may be
        ``flat``'s own piece (asynchronous)."""
        return self.comm.reduce_scatter(shard, flat, async_op=True)

    def end_step(self) -> None:
        self.steps += 1

    def abort_backward(self) -> None:
        """A backward raised (see ``abort_backward`` in zerotrain/zero/reduce.py): its
        accumulation's reduced gradients are dropped, so nothing arrived this step. What
        error feedback kept from its reductions stays kept (ranks agree on it all the same)."""

    def skip_step(self) -> None:
        """The optimizer skipped this step (a non-finite gradient): the warm-up does not count
        it, and the state kept from it (error feedback) drops the non-finite values it took,
        which would otherwise make every later step non-finite too."""
        for kept in self.state_tensors():
            if kept.is_floating_point():
                torch.nan_to_num_(kept, nan=0.0, posinf=0.0, neginf=0.0)

    def rescale(self, factor: float) -> None:
        """fp16's loss scale changed by ``factor`` for the next step: the error kept in the
        scaled gradients' units follows it, so that it adds to the next step's gradients in
        theirs (a scale halved after an overflow would otherwise double it)."""
        for error in self._errors():
            error.mul_(factor)

    def _errors(self) -> list[torch.Tensor]:
        """The error feedback kept (gradient units)."""
        return []

    def catch_up(self, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For an Adam that catches up (see [Note: catching up]): the positions in bucket
        ``index`` (padded) where a gradient arrived this step, and how many steps' gradients
        each carries. None: the bucket travelled whole, each element carrying this step's."""
        return None

    def state_tensors(self) -> list[torch.Tensor]:
        """What the codec keeps between steps (error feedback, factors), for memory
        accounting."""
        return []

    # -- checkpoints: this rank's state, so that a resumed run continues bit for bit --------------
    def state_dict(self) -> dict:
        return {"method": self.method, "steps": self.steps, **self._state()}

    def _state(self) -> dict:
        return {}

    def load_state_dict(self, state: dict | None, steps: int) -> str | None:
        """Continue from ``state`` (this rank's, saved with the same layout); None, or state
        saved by another method or layout, starts the kept state afresh at ``steps`` optimizer
        steps. Returns why it was started afresh when that loses kept state, else None."""
        if state is not None and state.get("method") == self.method:
            try:
                self._load(state)
            except (KeyError, ValueError) as exc:
                problem = f"saved for another bucket layout ({exc})"
            else:
                self.steps = state["steps"]
                return None
        else:
            saved = "no state" if state is None else f"state of {state.get('method')!r}"
            problem = f"the checkpoint holds {saved} for this rank"
        self._reset()
        self.steps = steps
        return problem if self._keeps_state else None

    _keeps_state = False  # whether a fresh start loses something (error feedback, factors)

    def _load(self, state: dict) -> None:
        pass

    def _reset(self) -> None:
        pass


class CompressingCodec(GradientCodec):
    """Warm-up, then a compressed all-reduce; a reduce-scatter all-reduces and keeps this
    rank's piece (the replicated-state methods)."""

    def __init__(
        self, comm: Communicator, buckets: list[BucketShape], options: GradientCompression
    ):
        super().__init__(comm, buckets)
        self.options = options
        self.method = options.method
        self.exact_steps = ExactSteps(options.warmup_steps, options.exact_steps)

    @property
    def compressing(self) -> bool:
        return self.steps + 1 not in self.exact_steps  # the step whose gradients these are

    def all_reduce(self, index: int, flat: torch.Tensor) -> Pending:
        if not self.compressing:
            return super().all_reduce(index, flat)
        return self._all_reduce(index, flat)

    def reduce_scatter(self, index: int, shard: torch.Tensor, flat: torch.Tensor) -> Pending:
        if not self.compressing:
            return super().reduce_scatter(index, shard, flat)
        return self._reduce_scatter(index, shard, flat)

    def _all_reduce(self, index: int, flat: torch.Tensor) -> Pending:
        raise NotImplementedError

    def _reduce_scatter(self, index: int, shard: torch.Tensor, flat: torch.Tensor) -> Pending:
        piece = flat.view(self.comm.world_size, -1)[self.comm.rank]

        def keep_piece() -> None:
            if shard.data_ptr() != piece.data_ptr():
                shard.copy_(piece)

        return Chain([self._all_reduce(index, flat)], keep_piece)

    def _exact_all_reduce(self, flat: torch.Tensor, exact: Ranges, name: str) -> Pending | None:
        """The parameters that travel whole, summed in place in the gradients' own dtype, as
        uncompressed training sums them (None: there are none)."""
        if not exact:
            return None
        values = _take(flat, exact, flat.dtype)
        op = self.comm.all_reduce(values, async_op=True, name=name)
        return op.then(lambda: _put(flat, exact, values))

    def _all_reduce_with_exact(
        self, payload: torch.Tensor, flat: torch.Tensor, exact: Ranges, name: str
    ) -> tuple[list[Pending], torch.Tensor]:
        """All-reduce the fp32 ``payload`` and the parameters that travel whole (put back into
        ``flat`` as they arrive): fp32 gradients in one collective, 16-bit ones in two, so
        that the whole ones travel at 16 bits. Returns the operations and the summed payload
        (final once they complete)."""
        if flat.dtype != torch.float32:
            ops: list[Pending] = [self.comm.all_reduce(payload, async_op=True, name=name)]
            exact_op = self._exact_all_reduce(flat, exact, name)
            return ops + ([exact_op] if exact_op is not None else []), payload
        n = len(payload)
        wire = torch.cat([payload, _take(flat, exact)])
        op = self.comm.all_reduce(wire, async_op=True, name=name)
        return [op.then(lambda: _put(flat, exact, wire[n:]))], wire[:n]


class LowRankCodec(CompressingCodec):
    """PowerSGD, or ACP-SGD with ``alternating`` (see [Note: PowerSGD and ACP-SGD])."""

    def __init__(
        self, comm: Communicator, buckets: list[BucketShape], options: GradientCompression
    ):
        super().__init__(comm, buckets, options)
        self.alternating = options.method == "acp_sgd"
        self.matrices: list[list[LowRankMatrix]] = []
        self.exact: list[Ranges] = []
        self.sends_p: list[bool] = []  # ACP-SGD: whether the bucket's next step sends P
        for index, bucket in enumerate(buckets):
            mats = []
            for j, (offset, shape) in enumerate(bucket.params):
                numel = math.prod(shape)
                if len(shape) < 2 or numel < options.min_numel:
                    continue
                if offset in bucket.embeddings and not options.compress_embeddings:
                    continue
                rows, cols = shape[0], numel // shape[0]
                if worth_compressing(rows, cols, options.rank, self.alternating):  # rank < both
                    mats.append(LowRankMatrix(offset, rows, cols, options.rank, 1009 * index + j))
            self.matrices.append(mats)
            self.exact.append(
                _complement([(m.offset, m.offset + m.numel) for m in mats], bucket.numel_padded)
            )
            self.sends_p.append(True)

    def _all_reduce(self, index: int, flat: torch.Tensor) -> Pending:
        mats = self.matrices[index]
        if not mats:
            return self.comm.all_reduce(flat, async_op=True)
        for mat in mats:
            mat.p, mat.q = mat.p.to(flat.device), mat.q.to(flat.device)
        feedback = self.options.error_feedback
        ms = [mat.matrix(flat, feedback) for mat in mats]
        if self.alternating:
            sends_p = self.sends_p[index]
            self.sends_p[index] = not sends_p
            bases = [orthonormalize(mat.q if sends_p else mat.p) for mat in mats]
            factors = [m @ b if sends_p else m.T @ b for m, b in zip(ms, bases, strict=True)]
        else:  # Q orthonormalized first, for conditioning (see the note)
            factors = [m @ orthonormalize(mat.q) for m, mat in zip(ms, mats, strict=True)]
        payload = torch.cat([f.reshape(-1) for f in factors])
        ops, summed_payload = self._all_reduce_with_exact(
            payload, flat, self.exact[index], self.method
        )

        def finish() -> None:
            summed = _split(summed_payload, [f.shape for f in factors])
            if self.alternating:
                for mat, m, base, factor in zip(mats, ms, bases, summed, strict=True):
                    if sends_p:
                        mat.p, rebuilt = factor.clone(), factor @ base.T
                    else:
                        mat.q, rebuilt = factor.clone(), base @ factor.T
                    mat.keep_error(m, rebuilt, self.comm.world_size, feedback)
                    mat.write(flat, rebuilt)
                return
            # PowerSGD's second half: Q from the orthonormalized sum of P, all-reduced too
            p_hats = [orthonormalize(p) for p in summed]
            qs = [m.T @ p_hat for m, p_hat in zip(ms, p_hats, strict=True)]
            second = torch.cat([x.reshape(-1) for x in qs])
            self.comm.all_reduce(second, name=self.method)
            for mat, m, p_hat, q_sum in zip(
                mats, ms, p_hats, _split(second, [x.shape for x in qs]), strict=True
            ):
                mat.q = q_sum.clone()
                rebuilt = p_hat @ q_sum.T
                mat.keep_error(m, rebuilt, self.comm.world_size, feedback)
                mat.write(flat, rebuilt)

        return Chain(ops, finish)

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for mats in self.matrices for mat in mats for t in mat.tensors()]

    def _errors(self) -> list[torch.Tensor]:
        return [m.error for mats in self.matrices for m in mats if m.error is not None]

    _keeps_state = True

    def _state(self) -> dict:
        return {
            "sends_p": list(self.sends_p),
            "factors": [[(m.p, m.q, m.error) for m in mats] for mats in self.matrices],
        }

    def _load(self, state: dict) -> None:
        factors = state["factors"]
        shapes = [[(m.p.shape, m.q.shape) for m in mats] for mats in self.matrices]
        if [[(p.shape, q.shape) for p, q, _ in mats] for mats in factors] != shapes:
            raise ValueError("other matrices or ranks")
        for mats, saved in zip(self.matrices, factors, strict=True):
            for mat, (p, q, error) in zip(mats, saved, strict=True):
                mat.p, mat.q, mat.error = p.clone(), q.clone(), error
        self.sends_p = list(state["sends_p"])

    def _reset(self) -> None:
        for mats in self.matrices:
            for mat in mats:
                mat.restart()
                mat.error = None
        self.sends_p = [True] * len(self.sends_p)

    def skip_step(self) -> None:
        for mats in self.matrices:
            for mat in mats:  # all-reduced: non-finite on every rank alike
                if not (mat.p.isfinite().all() and mat.q.isfinite().all()):
                    mat.restart()
        super().skip_step()


def _split(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    out, at = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(flat[at : at + n].view(shape))
        at += n
    return out


class SparseCodec(CompressingCodec):
    """Top-k (every rank's k largest, all-gathered) or gTop-k (k coordinates for all, by a tree
    merge; see [Note: gTop-k with exact sums]), with the rest kept for the next step."""

    def __init__(
        self, comm: Communicator, buckets: list[BucketShape], options: GradientCompression
    ):
        super().__init__(comm, buckets, options)
        self.compressed: list[Ranges] = []
        self.exact: list[Ranges] = []
        for bucket in buckets:
            ranges = [
                (offset, offset + math.prod(shape))
                for offset, shape in bucket.params
                if math.prod(shape) >= options.min_numel
            ]
            self.compressed.append(ranges)
            self.exact.append(_complement(ranges, bucket.numel_padded))
        self.residuals: list[torch.Tensor | None] = [None] * len(buckets)
        # catching up: per compressed element, the first step (counted in ``ticks``, applied or
        # skipped) whose gradient its residual holds, and which elements travelled this step
        self.counting = options.counts_arrivals
        self.ticks = 0
        self.since: list[torch.Tensor | None] = [None] * len(buckets)
        self.arrived: list[torch.Tensor | None] = [None] * len(buckets)
        # per bucket, built at its first count: each compressed range's shift from compressed
        # to bucket positions and their starts, and the positions that travel whole
        self._positions: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = [
            None
        ] * len(buckets)

    def _all_reduce(self, index: int, flat: torch.Tensor) -> Pending:
        ranges, exact = self.compressed[index], self.exact[index]
        if not ranges:
            return self.comm.all_reduce(flat, async_op=True)
        x = _take(flat, ranges)
        residual = self.residuals[index]
        if residual is not None:
            x += residual.to(x.device)
        k = max(1, math.ceil(self.options.ratio * len(x)))
        chosen = top_k(x, k)
        if self.method == "gtopk":
            chosen = tree_indices(self.comm, chosen, x[chosen])
            ops, summed = self._all_reduce_with_exact(x[chosen], flat, exact, "gtopk")
        else:
            message = pack(chosen, x[chosen])
            gathered = torch.empty(self.comm.world_size * len(message), device=x.device)
            ops: list[Pending] = [
                self.comm.all_gather(gathered, message, async_op=True, name="topk")
            ]
            exact_op = self._exact_all_reduce(flat, exact, "topk")
            if exact_op is not None:
                ops.append(exact_op)

        def finish() -> None:
            dense = torch.zeros_like(x)
            if self.method == "gtopk":
                dense[chosen] = summed
                self._arrive(index, chosen, len(x))
            else:
                for piece in gathered.view(self.comm.world_size, -1):
                    where, values = unpack(piece)
                    dense.index_add_(0, where, values)
                    self._arrive(index, where, len(x))
            if self.options.error_feedback:
                x[chosen] = 0
                self.residuals[index] = x
            _put(flat, ranges, dense)

        return Chain(ops, finish)

    def _arrive(self, index: int, where: torch.Tensor, numel: int) -> None:
        if not self.counting:
            return
        arrived = self.arrived[index]
        if arrived is None:
            arrived = self.arrived[index] = torch.zeros(
                numel, dtype=torch.bool, device=where.device
            )
        arrived[where] = True

    def catch_up(self, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        arrived = self.arrived[index]
        if arrived is None:  # an exact step, or a bucket with nothing compressed
            return None
        since = self._since(index, arrived)
        where = arrived.nonzero().squeeze(1)
        counts = (self.ticks + 1 - since[where]).float()
        shift, first, exact = self._bucket_positions(index, where.device)
        # compressed positions into the bucket's, then the elements that travel whole (one step)
        ranges = torch.searchsorted(first, where, right=True) - 1
        positions = torch.cat([where + shift[ranges], exact])
        return positions, torch.cat([counts, counts.new_ones(len(exact))])

    def _bucket_positions(
        self, index: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cached = self._positions[index]
        if cached is None:
            ranges = self.compressed[index]
            starts = torch.tensor([a for a, _ in ranges], device=device)
            lengths = torch.tensor([b - a for a, b in ranges], device=device)
            first = torch.cumsum(lengths, 0) - lengths  # each range's first compressed position
            exact = [torch.arange(a, b, device=device) for a, b in self.exact[index]]
            empty = torch.empty(0, dtype=torch.long, device=device)
            cached = self._positions[index] = (starts - first, first, torch.cat([empty, *exact]))
        return cached

    def end_step(self) -> None:
        super().end_step()
        self._count_waits()

    def skip_step(self) -> None:
        super().skip_step()
        self._count_waits()

    def _count_waits(self) -> None:
        """A step's end, applied or skipped: either way its gradients went into the residuals
        or travelled, so what travelled holds the next step's on. (Stages 2-3 reduce each
        micro-batch: an element sent in the first of two holds the second's gradient, half a
        step's, which its next arrival does not count; the sum it brings is then one step's
        worth a step, as its count says, when it travels in the same micro-batch each time.)"""
        self._forget_arrivals(self.ticks + 1)
        self.ticks += 1

    def abort_backward(self) -> None:
        # what the dropped reductions sent is lost, and with it the residuals they emptied:
        # those elements hold this step's gradients on
        self._forget_arrivals(self.ticks)

    def _forget_arrivals(self, holds_from: int) -> None:
        for index, arrived in enumerate(self.arrived):
            if arrived is not None:
                self._since(index, arrived)[arrived] = holds_from
        self.arrived = [None] * len(self.arrived)

    def _since(self, index: int, arrived: torch.Tensor) -> torch.Tensor:
        since = self.since[index]
        if since is None:  # the first compressed step: each element holds this step's on
            since = self.since[index] = torch.full_like(arrived, self.ticks, dtype=torch.int32)
        elif since.device != arrived.device:  # loaded from a checkpoint, on the host
            since = self.since[index] = since.to(arrived.device)
        return since

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for t in self.residuals + self.since if t is not None]

    def _errors(self) -> list[torch.Tensor]:
        return [r for r in self.residuals if r is not None]

    _keeps_state = True

    def _state(self) -> dict:
        return {"residuals": list(self.residuals), "since": list(self.since), "ticks": self.ticks}

    def _load(self, state: dict) -> None:
        residuals, since = state["residuals"], state["since"]
        sizes = [sum(b - a for a, b in ranges) for ranges in self.compressed]
        for kept in (residuals, since):
            if len(kept) != len(sizes) or any(
                t is not None and t.numel() != n for t, n in zip(kept, sizes, strict=True)
            ):
                raise ValueError("other compressed elements")
        self.residuals, self.since, self.ticks = list(residuals), list(since), state["ticks"]

    def _reset(self) -> None:
        self.residuals = [None] * len(self.residuals)
        self.since = [None] * len(self.since)
