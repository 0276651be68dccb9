"""Pipeline batches whose shapes change: every batch, and every micro-batch of one, may have its
own sequence length (data collators pad each batch to its own longest sequence), with every
schedule, against one process on the same micro-batches; and the self-describing messages
between stages that make it so (zerotrain/comm/stage_messages.py)."""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from models import relative_error
from test_pipeline import CLIP, LR, SEED, VOCAB, WIDTH, config, layer_specs, loss_fn
from torch import nn

# each micro-batch's (rows, sequence length); 4 micro-batches a step, as test_pipeline's ACCUM
EVAL_BEFORE = [(2, 6)] * 4
STEPS = [[(2, 8)] * 4, [(2, 5)] * 4, [(2, 3), (1, 7), (2, 5), (2, 8)]]
EVAL_AFTER = [(2, 4), (2, 8), (1, 2), (2, 6)]


def micro_batches(shapes: list[tuple[int, int]], seed: int) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(seed)
    windows = [
        torch.randint(0, VOCAB, (rows, length + 1), generator=gen) for rows, length in shapes
    ]
    return [(w[:, :-1], w[:, 1:]) for w in windows]


def data() -> list[list[tuple[torch.Tensor, ...]]]:
    """The evaluation before training, the training steps, the evaluation after."""
    shapes = [EVAL_BEFORE, *STEPS, EVAL_AFTER]
    return [micro_batches(step, seed) for seed, step in enumerate(shapes)]


class Masked(nn.Module):
    """A layer that passes a tuple on: (hidden states, token ids), the ids (int64, no gradient)
    masking the block's output; the first one embeds the ids."""

    def __init__(self, first: bool = False):
        from gpt.model import Block, GPTConfig

        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH) if first else None
        self.block = Block(GPTConfig(block_size=8, vocab_size=VOCAB, n_head=5, n_embd=WIDTH))

    def forward(self, x):
        hidden, ids = (self.embed(x), x) if self.embed is not None else x
        keep = (ids % 5 != 0).unsqueeze(-1).to(hidden.dtype)
        return self.block(hidden) * keep, ids


class Hidden(nn.Module):
    def forward(self, x: tuple) -> torch.Tensor:
        return x[0]


def tuple_specs() -> list:
    """7 layers: at 2 stages a tuple crosses the cut; at 4 (two per rank) tuples cross from
    rank 0 to 1 and between rank 1's stages, a tensor from rank 1 back to 0 (ZBV's V)."""
    from zerotrain.pipe import LayerSpec

    return [
        LayerSpec(Masked, True),
        *(LayerSpec(Masked) for _ in range(3)),
        LayerSpec(Hidden),
        LayerSpec(nn.LayerNorm, WIDTH),
        LayerSpec(nn.Linear, WIDTH, VOCAB),
    ]


def linear_specs() -> list:
    """Linear layers on 3-D inputs: every stage's output is a view (nn.Linear reshapes), which
    torch's zero-bubble backward would detach in place."""
    from zerotrain.pipe import LayerSpec

    return [
        LayerSpec(nn.Embedding, VOCAB, WIDTH),
        *(LayerSpec(nn.Linear, WIDTH, WIDTH) for _ in range(3)),
        LayerSpec(nn.Linear, WIDTH, VOCAB),
    ]


MODELS = {"blocks": layer_specs, "tuples": tuple_specs, "linears": linear_specs}


def single_process(model: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The evaluations' and steps' mean micro-batch losses and the final weights, one process."""
    layers = []
    for index, spec in enumerate(MODELS[model]()):
        torch.manual_seed(SEED + index)  # as PipelineModule(seed_layers=True) builds them
        layers.append(spec.build())
    net = nn.Sequential(*layers)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, eps=1e-5, weight_decay=0.01)
    before, *steps, after = data()
    losses = []
    with torch.no_grad():
        losses.append(sum(loss_fn(net(x), y).item() for x, y in before) / len(before))
    for step in steps:
        total = 0.0
        for x, y in step:
            loss = loss_fn(net(x), y)
            (loss / len(step)).backward()
            total += loss.item() / len(step)
        torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    with torch.no_grad():
        losses.append(sum(loss_fn(net(x), y).item() for x, y in after) / len(after))
    return net.state_dict(), losses


def train(runs: list[tuple[str, str]]) -> dict:
    """Each (model, schedule) at pp 2: evaluate, train STEPS, evaluate."""
    import zerotrain
    from zerotrain.pipe import PipelineModule, stage_options

    out = {}
    for model, schedule in runs:
        pipe = PipelineModule(
            MODELS[model](),
            num_stages=2,
            loss_fn=loss_fn,
            seed_layers=True,
            base_seed=SEED,
            partition_method="uniform",
            **stage_options(schedule),
        )
        engine, *_ = zerotrain.initialize(model=pipe, config=config(1, schedule))
        before, *steps, after = data()
        losses = [engine.eval_batch(iter(before)).item()]
        losses += [engine.train_batch(iter(step)).item() for step in steps]
        losses.append(engine.eval_batch(iter(after)).item())
        out[model, schedule] = (engine.consolidated_state_dict(), losses)
    return out


def check(runs: list[tuple[str, str]], trainer=train) -> None:
    """Each (model, schedule) of ``runs`` at pp 2 (``trainer``: :func:`train` or one like it):
    losses and weights as one process's."""
    wants = {model: single_process(model) for model in {model for model, _ in runs}}
    for per_run in run_distributed(trainer, 2, runs):
        for (model, schedule), (state, losses) in per_run.items():
            want, want_losses = wants[model]
            assert losses == pytest.approx(want_losses, rel=1e-5), (model, schedule)
            assert state.keys() == want.keys()
            for key, value in want.items():
                assert relative_error(state[key], value) < 1e-5, (model, schedule, key)


def test_batches_of_changing_shape_match_single_process():
    """Evaluation at one length, three steps at others (the last with a different length and
    size per micro-batch), evaluation again: losses and weights as one process's (1e-5) under
    1F1B, and with tuple activations (an int64 tensor beside the hidden states, whose gradient
    is None) under ZBV, where a rank also hands its two stages' tuples over directly; and
    under ZBV stages whose outputs are views (torch's backward detached them in place: "Can't
    detach views in-place")."""
    check([("blocks", "1f1b"), ("tuples", "zbv"), ("linears", "zbv")])


@pytest.mark.slow
def test_batches_of_changing_shape_under_every_schedule():
    """The same under GPipe, and tuples under 1F1B and interleaved 1F1B."""
    check([("blocks", "gpipe"), ("tuples", "1f1b"), ("tuples", "interleaved_1f1b")])


def test_headers_describe_every_tensor():
    """dtypes, shapes (0-d, empty), requires_grad and None survive the header; a descriptor
    longer than the header's room is continued; anything else is refused, a stray message
    before its length is believed."""
    from zerotrain.comm.stage_messages import (
        HEADER_SLOTS,
        Header,
        MessageKey,
        TensorSpec,
        decode,
        encode,
        header_slots,
        specs_of,
    )

    key = MessageKey("gradients", 3, 7)
    tensors = [
        torch.zeros(2, 3, requires_grad=True),
        None,
        torch.tensor(True),
        torch.zeros(0, 5, dtype=torch.bfloat16),
        *(torch.zeros(1, 2, 3, 4, dtype=torch.int64) for _ in range(5)),
    ]
    specs = specs_of(key, tensors)
    assert specs[:4] == [
        TensorSpec(torch.float32, (2, 3), True),
        None,
        TensorSpec(torch.bool, (), False),
        TensorSpec(torch.bfloat16, (0, 5), False),
    ]
    assert specs[4:] == [TensorSpec(torch.int64, (1, 2, 3, 4), False)] * 5
    header = encode(Header(11, key, specs))
    assert len(header) == header_slots(header[:HEADER_SLOTS]) == 48 > HEADER_SLOTS
    assert decode(header.tolist()) == Header(11, key, specs)
    short = Header(0, key, specs_of(key, [torch.zeros(4)]))
    assert len(encode(short)) == HEADER_SLOTS and decode(encode(short).tolist()) == short
    with pytest.raises(ValueError, match="not a stage message header"):
        decode([0] * HEADER_SLOTS)
    stray = torch.full((HEADER_SLOTS,), 2**40, dtype=torch.int64)  # its length slot: 2**40
    with pytest.raises(ValueError, match="not a stage message header"):
        header_slots(stray)
    stray[0] = header[0]
    with pytest.raises(ValueError, match="announcing 1099511627776 descriptor slots"):
        header_slots(stray)
    with pytest.raises(ValueError, match="malformed"):
        decode([*header[:6].tolist(), 3, 0, 2] + [0] * 23)  # 2 dims announced, none given
    with pytest.raises(TypeError, match="torch.uint16, which stage messages do not carry"):
        specs_of(key, [torch.zeros(2, dtype=torch.uint16)])
    with pytest.raises(TypeError, match="item 1 of .* is a int; stages pass tensors"):
        specs_of(key, [torch.zeros(2), 3])


LONG = [(1, 2, 1, 3)] * 9  # a message whose header continues past its first slots


def post(ops: list, wait: bool = True) -> list:
    """What the schedule does with the operations a stage returns: post them together, wait
    for them (or return their works)."""
    import torch.distributed as dist

    works = dist.batch_isend_irecv(ops) if ops else []
    for work in works if wait else []:
        work.wait()
    return works


def exchange() -> dict:
    """Rank 0 sends two messages (one with a long header, an empty tensor and a None) whose
    receives rank 1 asks for in the other order, then, as 1F1B does, each rank posts a send and
    the opposite receive as one group; then rank 1 waits for a message that never comes while
    another does."""
    import torch.distributed as dist

    from zerotrain.comm import CollectiveError, Communicator
    from zerotrain.comm.stage_messages import MessageKey, StageMessages

    comm = Communicator()
    messages = StageMessages(comm, torch.device("cpu"))
    first, second = MessageKey("activations", 1, 0), MessageKey("activations", 1, 1)
    there, back = MessageKey("activations", 1, 2), MessageKey("gradients", 0, 1)
    many = [torch.full(shape, float(i)) for i, shape in enumerate(LONG)]
    out: dict = {}
    if comm.rank == 0:
        works = post(messages.send_ops(1, first, [*many, None, torch.zeros(0, 5)]), wait=False)
        x = torch.arange(6.0).view(2, 3).requires_grad_()
        works += post(messages.send_ops(1, second, [x]), wait=False)
        sends = messages.send_ops(1, there, [torch.ones(2, 2)])
        out["back"], receives = messages.recv_ops(1, back)
        out["ops"] = [(op.op is dist.isend, op.group_peer) for op in sends + receives]
        post(sends + receives)
        for work in works:
            work.wait()
        messages.finish()
        messages.send_ops(1, MessageKey("activations", 1, 2), [torch.ones(3)])
        messages.finish()
        return out
    out["second"], second_ops = messages.recv_ops(0, second)  # after the first's header
    out["first"], first_ops = messages.recv_ops(0, first)
    post(first_ops)  # the tensors' receives in the order they were sent (torch's order)
    post(second_ops)
    sends = messages.send_ops(0, back, [torch.full((4,), 7.0)])
    out["there"], receives = messages.recv_ops(0, there)
    post(sends + receives)
    messages.finish()
    try:
        messages.recv_ops(0, MessageKey("activations", 1, 3))
    except CollectiveError as error:
        out["timeout"] = str(error)
    try:
        messages.finish()
    except RuntimeError as error:
        out["left"] = str(error)
    return out


def test_messages_pair_up_in_any_order_and_waits_time_out():
    """The tensors travel as the schedule's own operations (P2POps, which it groups), sized
    from headers that come ahead and are taken in any order."""
    sender, receiver = run_distributed(exchange, 2, collective_timeout_s=3)
    assert sender["ops"] == [(True, 1), (False, 1)]  # a send and a receive, one group
    assert [t.tolist() for t in sender["back"]] == [[7.0] * 4]
    assert [t.tolist() for t in receiver["there"]] == [[[1.0, 1.0], [1.0, 1.0]]]
    *many, none, empty = receiver["first"]
    assert [t.tolist() for t in many] == [[[[[float(i)] * 3], [[float(i)] * 3]]] for i in range(9)]
    assert none is None and empty.shape == (0, 5)
    (second,) = receiver["second"]
    assert second.requires_grad and second.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert "waited" in receiver["timeout"] and "for rank 0 to send" in receiver["timeout"]
    assert "micro-batch 3 for stage 1" in receiver["timeout"]
    assert "micro-batch 2 for stage 1" in receiver["left"]


def test_a_step_that_failed_midway_refuses_the_next():
    """Its messages may be half sent: a later step would pair the wrong ones."""
    from zerotrain.comm.pipeline import PipelineSchedule

    class Failing:
        _n_microbatches, _has_backward = 2, True

        def _step_microbatches(self, *args, **kwargs):
            raise ValueError("the loss function failed")

    schedule = PipelineSchedule(Failing(), [], messages=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="the loss function failed"):
        schedule.step([torch.zeros(1)] * 2, None, [])
    with pytest.raises(RuntimeError, match="failed midway .*ValueError.*restart the processes"):
        schedule.eval([torch.zeros(1)] * 2, None, [])
