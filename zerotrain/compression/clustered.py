"""The sites' all-reduce in two tiers: whole inside clusters of fast-linked sites, a codec
between them (see [Note: clusters of sites] in zerotrain/comm/site_clusters.py)."""

from __future__ import annotations

import torch

from zerotrain.comm.site_clusters import SiteTiers
from zerotrain.compression.codec import BucketShape, Chain, GradientCodec

__all__ = ["ClusteredCodec"]


class ClusteredCodec:
    """The sum over every site of a bucket's ``flat``: over ``tiers.inside`` whole, over
    ``tiers.leaders`` by ``between`` (the sites' codec; None on a rank that is not its
    cluster's leader), then back over ``tiers.inside`` from the leader. Its jobs, and what
    sets ``between``'s state or reads it whole (a checkpoint's), run on the tiers' thread in
    the order given; the training thread reads its counters and its state's tensors' sizes.
    ``sent_inside``, ``sent_between``: bytes this rank sent on each tier."""

    def __init__(self, tiers: SiteTiers, between: GradientCodec | None, buckets: list[BucketShape]):
        self.tiers = tiers
        self.between = between
        self.buckets = buckets
        self.method = "none" if between is None else between.method
        self.sent_inside = 0
        self.sent_between = 0
        self.steps = 0 if between is None else between.steps  # outer steps ended, every rank

    def all_reduce(self, index: int, flat: torch.Tensor) -> Chain:
        """Sum bucket ``index``'s ``flat`` over every site, in place (asynchronous: it runs on
        the tiers' thread, and its wait waits for that)."""
        running = self.tiers.submit(lambda: self._exchange(index, flat))
        return Chain([], lambda: self.tiers.result(running))

    def _exchange(self, index: int, flat: torch.Tensor) -> None:
        inside, leaders = self.tiers.inside, self.tiers.leaders
        sent = inside.sent, 0 if leaders is None else leaders.sent
        # the tiers are gloo's: a device's change is copied to the host and back (on the
        # device's default stream: after the kernels that made it, before those that read it)
        host = flat.to("cpu")
        inside.all_reduce(host)
        if self.between is not None:
            self.between.all_reduce(index, host).wait()
        inside.broadcast(host, src=inside.root)
        if host is not flat:
            flat.copy_(host)
        self.sent_inside += inside.sent - sent[0]
        self.sent_between += 0 if leaders is None else leaders.sent - sent[1]

    def end_step(self) -> None:
        self.steps += 1
        if self.between is not None:
            self.tiers.submit(self.between.end_step)

    def state_tensors(self) -> list[torch.Tensor]:
        return [] if self.between is None else self.between.state_tensors()

    def state_dict(self) -> dict:
        between = self.between
        if between is None:  # the steps counted all the same: a leader after a resume needs them
            return {"method": "none", "steps": self.steps}
        return self.tiers.call(between.state_dict)

    def load_state_dict(self, state: dict | None, steps: int) -> str | None:
        """Continue from ``state`` (saved by this rank, a leader or not: a leader now that was
        not then starts its codec's state afresh at the steps saved)."""
        self.steps = steps if state is None else state.get("steps", steps)
        between = self.between
        if between is None:
            return None
        saved = self.steps
        return self.tiers.call(lambda: between.load_state_dict(state, saved))
