"""A communicator that communicates nothing: what a compression would send, and its own
compute, measured without the network.

Each collective completes at once, as if every other rank held this rank's tensors (an
all-gather repeats this rank's input, a reduce-scatter keeps its own piece, an all-reduce leaves
the tensor as it is), so a codec runs its whole local work on real shapes and sizes, and
:attr:`DryRunCommunicator.messages` lists each collective with the bytes this rank would have
sent, counted as the real communicator counts them ([Note: bytes sent] in communicator.py).
"""

from __future__ import annotations

import math

import torch

from zerotrain.comm.communicator import Communicator, PendingOp, ring_sent


class DryRunCommunicator(Communicator):
    """A stand-in for ``comm`` (its rank and world size) whose collectives do not communicate."""

    def __init__(self, comm: Communicator):
        super().__init__(device=comm.device)
        self.distributed = False
        self.rank, self.world_size = comm.rank, comm.world_size
        self.messages: list[tuple[str, int]] = []  # (collective, bytes this rank would send)

    @classmethod
    def alone(cls, world_size: int, device: torch.device | str = "cpu") -> DryRunCommunicator:
        """Rank 0 of ``world_size`` ranks where there is no group (the planner's)."""
        dry = cls(Communicator(device=device))
        dry.rank, dry.world_size = 0, world_size
        return dry

    def _done(self, op: str, name: str, sent: int) -> PendingOp:
        self.messages.append((op, sent))
        return PendingOp(self, name, 0, None)

    def all_reduce(self, tensor, op="sum", async_op=False, name="all_reduce"):  # type: ignore[override]
        nbytes = tensor.numel() * tensor.element_size()
        done = self._done("all_reduce", name, ring_sent("all_reduce", nbytes, self.world_size))
        return done if async_op else None

    def reduce_scatter(self, output, input, async_op=False):  # type: ignore[override]
        output.copy_(input.view(self.world_size, -1)[self.rank])
        nbytes = input.numel() * input.element_size()
        done = self._done(
            "reduce_scatter", "reduce_scatter", ring_sent("reduce_scatter", nbytes, self.world_size)
        )
        return done if async_op else None

    def all_gather(self, output, input, async_op=False, name="all_gather"):  # type: ignore[override]
        mine = input.clone()
        output.view(self.world_size, -1).copy_(mine.view(1, -1))
        nbytes = output.numel() * output.element_size()
        done = self._done("all_gather", name, ring_sent("all_gather", nbytes, self.world_size))
        return done if async_op else None

    def all_to_all(  # type: ignore[override]
        self,
        output,
        input,
        output_splits=None,
        input_splits=None,
        *,
        async_op=False,
        name="all_to_all",
    ):
        if output.shape == input.shape:
            output.copy_(input)
        else:  # a partial exchange (gTop-k's rounds): what arrives is left zero
            output.zero_()
        row = math.prod(input.shape[1:]) * input.element_size()
        own = input_splits[self.rank] if input_splits else len(input) // self.world_size
        done = self._done("all_to_all", name, (len(input) - own) * row)
        return done if async_op else None
