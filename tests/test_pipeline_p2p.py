"""The pipeline's point-to-point traffic under NCCL's rules, how long sends keep their tensors,
and an engine built again after a step that failed midway (zerotrain/comm/stage_messages.py,
[Note: headers apart from the tensors] and [Note: a schedule built again])."""

from __future__ import annotations

import queue
import threading
import weakref
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from test_pipeline import SEED, VOCAB, config, layer_specs, loss_fn
from test_pipeline_shapes import check, micro_batches, train

LIMIT_S = 30  # an operation that waits longer is a deadlock (a step here takes well under 1 s)


class _Unit:
    """Operations posted together (one, or a batch_isend_irecv group)."""

    def __init__(self, ops: list[tuple]):
        self.ops = ops
        self.done = threading.Event()
        self.error: str | None = None


class _Work:
    def __init__(self, unit: _Unit):
        self.unit = unit

    def wait(self, timeout=None) -> bool:
        if not self.unit.done.wait(2 * LIMIT_S):
            raise RuntimeError("NCCL order: an operation never started (a deadlock)")
        if self.unit.error is not None:
            raise RuntimeError(self.unit.error)
        return True

    def is_completed(self) -> bool:
        return self.unit.done.is_set()


class NcclOrder:
    """NCCL's rules for the point-to-point operations on the default group (the stage group at
    pp 2 of 2 ranks), over gloo: the operations between two ranks run in the order posted, one
    after the other (NCCL's one stream per pair of ranks), those of one batch_isend_irecv
    together; gloo's send completes only once its receive is posted, as NCCL's does beyond its
    buffers. Other groups (the headers') pass through."""

    def __init__(self) -> None:
        from torch.distributed import distributed_c10d

        self.c10d = distributed_c10d
        self.isend, self.irecv = distributed_c10d.isend, distributed_c10d.irecv
        self.batch = dist.batch_isend_irecv
        self.queues: dict[int, queue.Queue] = {}

        def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
            if not self.ordered(group):
                return self.isend(tensor, dst=dst, group=group, tag=tag, group_dst=group_dst)
            return self.submit([(self.isend, tensor, dst if group_dst is None else group_dst, tag)])

        def irecv(tensor, src=None, group=None, tag=0, group_src=None):
            if not self.ordered(group):
                return self.irecv(tensor, src=src, group=group, tag=tag, group_src=group_src)
            return self.submit([(self.irecv, tensor, src if group_src is None else group_src, tag)])

        def batch_isend_irecv(p2p_ops):
            if not self.ordered(p2p_ops[0].group):
                return self.batch(p2p_ops)
            plain = {isend: self.isend, irecv: self.irecv}
            ops = [(plain[p.op], p.tensor, p.group_peer, p.tag) for p in p2p_ops]
            return [self.submit(ops)] * len(p2p_ops)

        isend.__name__, irecv.__name__ = "isend", "irecv"  # P2POp names its op
        # both modules' names: P2POp checks its op against distributed_c10d's
        dist.isend = distributed_c10d.isend = isend
        dist.irecv = distributed_c10d.irecv = irecv
        dist.batch_isend_irecv = batch_isend_irecv

    def ordered(self, group) -> bool:
        return group is None or group is self.c10d._get_default_group()

    def submit(self, ops: list[tuple]) -> _Work:
        (peer,) = {op[2] for op in ops}  # torch's schedules group one pair of ranks
        if peer not in self.queues:
            self.queues[peer] = queue.Queue()
            threading.Thread(target=self._run, args=(self.queues[peer],), daemon=True).start()
        unit = _Unit(ops)
        self.queues[peer].put(unit)
        return _Work(unit)

    def _run(self, units: queue.Queue) -> None:
        while True:
            unit = units.get()
            try:
                works = []
                for op, tensor, peer, tag in unit.ops:
                    kind = "group_dst" if op is self.isend else "group_src"
                    works.append(op(tensor, tag=tag, **{kind: peer}))
                for work in works:
                    work.wait(timedelta(seconds=LIMIT_S))
            except RuntimeError as error:
                unit.error = f"NCCL order: {unit.ops[0][0].__name__} waited {LIMIT_S} s: {error}"
            unit.done.set()


def train_in_nccl_order(runs: list[tuple[str, str]]) -> dict:
    """:func:`train` with the stage group's operations in NCCL's order, the headers on a group
    of their own (as they are beside NCCL)."""
    from zerotrain.comm import stage_messages

    NcclOrder()
    stage_messages._is_gloo = lambda comm: False  # a gloo group of their own for the headers
    return train(runs)


def test_every_schedule_holds_under_nccl_order():
    """Evaluation, three steps of changing shapes and another evaluation at pp 2 with each
    pair of ranks' operations run in order, as NCCL does: losses and weights as one process's.
    Posting the sends as soon as the tensors existed deadlocked in 1F1B's first step (rank 0:
    send act 0, send act 1, receive grad 0; rank 1: receive act 0, send grad 0, receive act 1)."""
    check([("blocks", "1f1b"), ("tuples", "zbv")], trainer=train_in_nccl_order)


@pytest.mark.slow
def test_every_schedule_holds_under_nccl_order_slow():
    """The same under GPipe and interleaved 1F1B."""
    check([("blocks", "gpipe"), ("tuples", "interleaved_1f1b")], trainer=train_in_nccl_order)


def held_by_sends(accumulation: int) -> list[int]:
    """At pp 2 under 1F1B, after each backward of the last stage (rank 1, which sends only
    gradients): how many of the gradients it sent are still alive (nothing but a send holds
    them)."""
    import zerotrain
    from zerotrain.comm import pipeline
    from zerotrain.pipe import PipelineModule

    sent: list[weakref.ref] = []
    original = dist.isend

    def isend(tensor, *args, **kwargs):
        if tensor.dtype != torch.int64:  # not a header (a header packed with tensors: uint8)
            sent.append(weakref.ref(tensor))
        return original(tensor, *args, **kwargs)

    isend.__name__ = "isend"
    dist.isend = dist.distributed_c10d.isend = isend
    alive: list[int] = []
    record = pipeline._Stage._record

    def sampled(stage, kind, *args):
        if kind == "B":
            alive.append(sum(ref() is not None for ref in sent))
        return record(stage, kind, *args)

    pipeline._Stage._record = sampled
    pipe = PipelineModule(layer_specs(), num_stages=2, loss_fn=loss_fn, partition_method="uniform")
    settings = {**config(1, "1f1b"), "gradient_accumulation_steps": accumulation}
    engine, *_ = zerotrain.initialize(model=pipe, config=settings)
    engine.train_batch(iter(micro_batches([(2, 8)] * accumulation, seed=0)))
    return alive


def test_sends_complete_as_the_schedule_goes():
    """1F1B waits for each send as it goes: at 8 micro-batches the last stage holds at most one
    sent gradient after each backward (every one until the end of the step before)."""
    _, alive = run_distributed(held_by_sends, 2, 8)
    assert len(alive) == 8 and max(alive) <= 1, alive


failed: list[BaseException] = []


def failing_then_rebuilt() -> dict:
    """A GPipe step that fails midway on both ranks, no wait timing out (rank 1's loss of the
    second micro-batch: labels out of range; rank 0's fourth forward: a token id out of range,
    after its third micro-batch went out, which rank 1 never takes), then a new engine on each
    rank and two steps."""
    import zerotrain
    from zerotrain.pipe import PipelineModule

    def engine():
        pipe = PipelineModule(
            layer_specs(),
            num_stages=2,
            loss_fn=loss_fn,
            seed_layers=True,
            base_seed=SEED,
            partition_method="uniform",
        )
        return zerotrain.initialize(model=pipe, config=config(1, "gpipe"))[0]

    bad = micro_batches([(2, 8)] * 4, seed=5)
    bad[1] = (bad[1][0], torch.full_like(bad[1][1], VOCAB + 3))
    bad[3] = (torch.full_like(bad[3][0], VOCAB + 3), bad[3][1])
    out: dict = {}
    try:
        engine().train_batch(iter(bad))
    except (IndexError, RuntimeError) as error:  # torch's "failed to run forward"
        out["failed"] = str(error).strip().splitlines()[0]
        # its traceback holds the operations the step posted: gloo may close a connection
        # whose operations are dropped ([Note: a schedule built again])
        failed.append(error)
    dist.monitored_barrier(timeout=timedelta(seconds=60))  # both failed: go on together
    rebuilt = engine()
    out["losses"] = [rebuilt.train_batch(iter(step)).item() for step in steps()]
    return out


def steps() -> list[list[tuple[torch.Tensor, ...]]]:
    return [micro_batches([(2, 8)] * 4, seed=seed) for seed in (6, 7)]


def test_an_engine_built_again_after_a_failed_step_trains():
    """The failed step leaves sends posted that nobody receives (rank 0's third micro-batch):
    the new engine's messages take tags of their own, and its steps' losses are one process's
    (before, its first receive took the old message: "arrived where message 0 was due"). The
    error says to restart the processes, which is what works in general."""
    from test_pipeline import CLIP, LR, reference_model

    net = reference_model()
    opt = torch.optim.AdamW(net.parameters(), lr=LR, eps=1e-5, weight_decay=0.01)
    want = []
    for step in steps():
        want.append(sum(loss_fn(net(x), y).item() for x, y in step) / len(step))
        for x, y in step:
            (loss_fn(net(x), y) / len(step)).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    results = run_distributed(failing_then_rebuilt, 2, timeout=120)
    assert "[Stage 0] failed to run forward" in results[0]["failed"]
    assert "out of bounds" in results[1]["failed"]
    for result in results:
        assert result["losses"] == pytest.approx(want, rel=1e-5)
