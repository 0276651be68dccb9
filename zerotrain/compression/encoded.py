"""The codecs that reduce-scatter by an all-to-all exchange of encoded pieces: block-wise
int8/int4 (:class:`QuantizedCodec`, optionally by node first: qgZ's hierarchy) and 1-bit
signs (:class:`OneBitCodec`); see [Note: gradient codecs] in codec.py. Also the encoded
all-gather the parameter gathers use (gather.py)."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import ClassVar

import torch

from zerotrain.comm import Communicator
from zerotrain.comm.communicator import nothing_inside_nodes
from zerotrain.compression import quantize
from zerotrain.compression.codec import (
    BucketShape,
    Chain,
    CompressingCodec,
    GradientCompression,
    Pending,
)

Decode = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (payload, scales) -> fp32


def decode_pieces(
    payloads: torch.Tensor, scales: torch.Tensor, pieces: int, decode: Decode | Sequence[Decode]
) -> Iterator[torch.Tensor]:
    """``pieces`` equal encoded pieces, their payloads and scales each concatenated in order
    (what an all-gather or all-to-all of them delivers), decoded one at a time (one piece's
    fp32 values alive, not all of them); ``decode``: one for all, or one per piece."""
    decoders = [decode] * pieces if callable(decode) else decode
    split = zip(
        payloads.view(pieces, len(payloads) // pieces),
        scales.view(pieces, len(scales) // pieces),
        decoders,
        strict=True,
    )
    return (decode(payload, scale) for payload, scale, decode in split)


def all_gather_encoded(
    comm: Communicator,
    output: torch.Tensor,
    payload: torch.Tensor,
    scales: torch.Tensor,
    decode: Decode | Sequence[Decode],
    name: str,
) -> Chain:
    """Every rank's encoded piece, decoded into ``output`` in rank order (asynchronous): the
    second hop of the stage-0 two-hop codecs and the quantized parameter all-gather (which
    decodes each rank's piece by its own layout: one ``decode`` per rank). Every rank, the
    piece's owner too, ends with the decoded values, so the replicas stay equal."""
    world = comm.world_size
    payloads = payload.new_empty(world * len(payload))
    all_scales = scales.new_empty(world * len(scales))
    ops: list[Pending] = [
        comm.all_gather(payloads, payload, async_op=True, name=name),
        comm.all_gather(all_scales, scales, async_op=True, name=name),
    ]

    def finish() -> None:
        pieces = decode_pieces(payloads, all_scales, world, decode)
        for piece, values in zip(output.view(world, -1), pieces, strict=True):
            piece.copy_(values)

    return Chain(ops, finish)


class _EncodedAllToAll(CompressingCodec):
    """A reduce-scatter by an all-to-all exchange of encoded pieces: each rank encodes the N
    pieces of its gradient, an all-to-all (codes, then scales) delivers each to its owner, who
    decodes and sums them in fp32, in rank order. At stage 0 the owner then encodes its sum and
    all-gathers it, and every rank, the owner too, uses the decoded sums. With ``carries_error``
    each rank keeps what its encoding left out and adds it next time, and so does each owner for
    its sum."""

    carries_error: ClassVar[bool] = False

    def __init__(
        self, comm: Communicator, buckets: list[BucketShape], options: GradientCompression
    ):
        super().__init__(comm, buckets, options)
        self.worker_errors: list[torch.Tensor | None] = [None] * len(buckets)
        self.server_errors: list[torch.Tensor | None] = [None] * len(buckets)
        # (the ranks of this node, the ranks of this place on every node): reduce-scatter by
        # node first (QuantizedCodec with ``ranks_per_node``)
        self.by_node: tuple[Communicator, Communicator] | None = None

    @abstractmethod
    def _encode(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(payload, scales) of a 1-D fp32 tensor; equal sizes give equal message sizes."""

    @abstractmethod
    def _decode(self, payload: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
        """The fp32 values of ``numel`` elements that (``payload``, ``scales``) stand for."""

    def _errors(self) -> list[torch.Tensor]:
        return [e for e in self.worker_errors + self.server_errors if e is not None]

    def _with_error(self, values: torch.Tensor, errors: list, index: int) -> torch.Tensor:
        error = errors[index] if self.carries_error else None
        return values if error is None else values + error.to(values.device)

    def _reduce_scatter(self, index: int, shard: torch.Tensor, flat: torch.Tensor) -> Pending:
        x = self._with_error(flat.float(), self.worker_errors, index)
        name = f"{self.method}_reduce_scatter"
        if self.by_node is not None:
            return self._reduce_scatter_by_node(*self.by_node, x, shard, name)
        ops, received, sent = self._exchange(self.comm, x, name)
        if self.carries_error:
            self.worker_errors[index] = x - sent()
        return Chain(ops, lambda: shard.copy_(received()))

    def _reduce_scatter_by_node(
        self,
        node: Communicator,
        across: Communicator,
        x: torch.Tensor,
        shard: torch.Tensor,
        name: str,
    ) -> Pending:
        """qgZ's hierarchy: the ``node``'s ranks first exchange and sum, each the pieces of
        its place on every node; then the ranks of one place exchange those node sums
        ``across`` the nodes. Group rank r is place r % g on node r // g (ranks numbered by
        node)."""
        by_place = x.view(across.world_size, node.world_size, -1).transpose(0, 1).reshape(-1)
        ops, in_node, _ = self._exchange(node, by_place, f"{name}_in_node")

        def across_nodes() -> None:
            ops, received, _ = self._exchange(across, in_node(), f"{name}_across_nodes")
            Chain(ops, lambda: shard.copy_(received())).wait()

        return Chain(ops, across_nodes)

    def _exchange(
        self, comm: Communicator, values: torch.Tensor, name: str
    ) -> tuple[list[Pending], Callable[[], torch.Tensor], Callable[[], torch.Tensor]]:
        """Encode ``values`` as ``comm.world_size`` equal pieces and send piece i to rank i
        (an all-to-all of the payloads and one of the scales, asynchronous). Returns the
        operations, the fp32 sum of the pieces received (once they complete; in rank order)
        and the decoded pieces this rank sent."""
        world = comm.world_size
        numel = values.numel() // world
        encoded = [self._encode(piece) for piece in values.view(world, -1)]
        payloads = torch.cat([payload for payload, _ in encoded])
        scales = torch.cat([scale for _, scale in encoded])
        got_payloads, got_scales = torch.empty_like(payloads), torch.empty_like(scales)
        ops: list[Pending] = [
            comm.all_to_all(got_payloads, payloads, async_op=True, name=name),
            comm.all_to_all(got_scales, scales, async_op=True, name=name),
        ]
        decode = partial(self._decode, numel=numel)

        def received() -> torch.Tensor:
            total = torch.zeros(numel, dtype=torch.float32, device=values.device)
            for piece in decode_pieces(got_payloads, got_scales, world, decode):
                total += piece
            return total

        return ops, received, lambda: torch.cat([decode(p, s) for p, s in encoded])

    def _all_reduce(self, index: int, flat: torch.Tensor) -> Pending:
        world = self.comm.world_size
        numel = flat.numel() // world
        summed = torch.empty(numel, dtype=torch.float32, device=flat.device)

        def gather() -> None:
            y = self._with_error(summed, self.server_errors, index)
            payload, scales = self._encode(y)
            if self.carries_error:
                self.server_errors[index] = y - self._decode(payload, scales, numel)
            decode = partial(self._decode, numel=numel)
            name = f"{self.method}_all_gather"
            all_gather_encoded(self.comm, flat, payload, scales, decode, name).wait()

        return Chain([self._reduce_scatter(index, summed, flat)], gather)


class QuantizedCodec(_EncodedAllToAll):
    """int8 or int4 block-wise, by all-to-all (see [Note: gradient codecs]); the quantization
    error is bounded per block and not carried."""

    def __init__(
        self, comm: Communicator, buckets: list[BucketShape], options: GradientCompression
    ):
        super().__init__(comm, buckets, options)
        self.bits = 8 if options.method == "int8" else 4
        if options.ranks_per_node:
            self.by_node = _node_hierarchy(comm, options.ranks_per_node)

    def _encode(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        quantized = quantize.quantize(values, self.bits, self.options.block_size)
        return quantized.codes, quantized.scales

    def _decode(self, payload: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
        packed = quantize.Quantized(payload, scales, numel, self.bits)
        return quantize.dequantize(packed, self.options.block_size)


def _node_hierarchy(
    comm: Communicator, ranks_per_node: int
) -> tuple[Communicator, Communicator] | None:
    """The communicators of qgZ's hierarchy over ``comm`` (collective over the default group);
    None, with a warning, where the node holds one rank of ``comm`` or all of them."""
    node = comm.within_nodes(ranks_per_node)
    key = "comm_compression.gradients.hierarchical"
    instead = "there is no exchange inside a node to do first, so gradients reduce-scatter in one"
    if nothing_inside_nodes(comm, node, ranks_per_node, key, instead):  # alike on every rank
        return None
    # a group's ranks ascend with their default-group ranks, so node by node: rank r is place
    # r % g on node r // g
    return node, comm.across_nodes(ranks_per_node)


class OneBitCodec(_EncodedAllToAll):
    """1-bit Adam's compressed exchange (arXiv:2102.02888 §3.2, DeepSpeed's compressed
    all-reduce) as an all-to-all reduce-scatter: each piece travels as signs and one scale per
    block of ``block_size`` (the block's root mean square), with each rank's error, and at
    stage 0 each owner's error for its sum, carried to the next step. See [Note: 1-bit
    optimizers under ZeRO] in zerotrain/optim/onebit.py."""

    carries_error = True
    _keeps_state = True

    def _encode(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize.sign_compress(values, self.options.block_size)

    def _decode(self, payload: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
        return quantize.sign_decompress(payload, scales, numel, self.options.block_size)

    def state_tensors(self) -> list[torch.Tensor]:
        return self._errors()

    def _state(self) -> dict:
        return {"worker": list(self.worker_errors), "server": list(self.server_errors)}

    def _load(self, state: dict) -> None:
        worker, server = state["worker"], state["server"]
        sizes = [b.numel_padded for b in self.buckets]
        if len(worker) != len(sizes) or any(
            e is not None and e.numel() != n for e, n in zip(worker, sizes, strict=True)
        ):
            raise ValueError("other buckets")
        self.worker_errors, self.server_errors = list(worker), list(server)

    def _reset(self) -> None:
        self.worker_errors = [None] * len(self.buckets)
        self.server_errors = [None] * len(self.buckets)
