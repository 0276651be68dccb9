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


MODELS = {"blocks": layer_specs, "tuples": tuple_specs}


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


def check(runs: list[tuple[str, str]]) -> None:
    """Each (model, schedule) of ``runs`` at pp 2: losses and weights as one process's."""
    wants = {model: single_process(model) for model in {model for model, _ in runs}}
    for per_run in run_distributed(train, 2, runs):
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
    is None) under ZBV, where a rank also hands its two stages' tuples over directly."""
    check([("blocks", "1f1b"), ("tuples", "zbv")])


@pytest.mark.slow
def test_batches_of_changing_shape_under_every_schedule():
    """The same under GPipe, and tuples under 1F1B and interleaved 1F1B."""
    check([("blocks", "gpipe"), ("tuples", "1f1b"), ("tuples", "interleaved_1f1b")])


def test_headers_describe_every_tensor():
    """dtypes, shapes (0-d, empty), requires_grad and None survive the header, and the tensors
    a packed message; a descriptor longer than the header's room is continued; anything else is
    refused."""
    from zerotrain.comm.stage_messages import (
        HEADER_SLOTS,
        Header,
        MessageKey,
        TensorSpec,
        decode,
        encode,
        header_slots,
        pack,
        packed_layout,
        specs_of,
        unpack,
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
    header = encode(Header(11, key, specs, True))
    assert len(header) == header_slots(header[:HEADER_SLOTS]) == 49 > HEADER_SLOTS
    assert decode(header.tolist()) == Header(11, key, specs, True)
    short = Header(0, key, specs_of(key, [torch.zeros(4)]), False)
    assert len(encode(short)) == HEADER_SLOTS and decode(encode(short).tolist()) == short
    packed = pack(header, tensors, packed_layout(specs)[1])
    assert packed_layout(specs)[0][:4] == [HEADER_SLOTS * 8, -1, HEADER_SLOTS * 8 + 64, -1]
    assert torch.equal(packed[: HEADER_SLOTS * 8].view(torch.int64), header[:HEADER_SLOTS])
    unpacked = unpack(packed, specs)
    assert specs_of(key, unpacked) == specs
    assert all(t is None or torch.equal(t, u) for t, u in zip(tensors, unpacked, strict=True))
    assert not any(t._is_view() for t in unpacked if t is not None)  # torch detaches in place
    with pytest.raises(ValueError, match="not a stage message header"):
        decode([0] * HEADER_SLOTS)
    with pytest.raises(ValueError, match="malformed"):
        decode([*header[:7].tolist(), 3, 0, 2] + [0] * 22)  # 2 dims announced, none given
    with pytest.raises(TypeError, match="torch.uint16, which stage messages do not carry"):
        specs_of(key, [torch.zeros(2, dtype=torch.uint16)])
    with pytest.raises(TypeError, match="item 1 of .* is a int; stages pass tensors"):
        specs_of(key, [torch.zeros(2), 3])


RUN = [(2, 3)] * 3 + [(4,)] * 3  # shapes of a run of messages: receives posted ahead from the 3rd
LONG = [(1, 2, 1, 3)] * 9  # a message whose header continues past its first slots


def exchange() -> dict:
    """Rank 0 sends two messages (one with a long header, an empty tensor and a None) which
    rank 1 takes in the other order, and rank 1 a gradient back; then runs of equal shapes,
    taken last first; then rank 1 waits for a message that never comes while another does."""
    from zerotrain.comm import CollectiveError, Communicator
    from zerotrain.comm.stage_messages import MessageKey, StageMessages

    comm = Communicator()
    messages = StageMessages(comm, torch.device("cpu"))
    first, second = MessageKey("activations", 1, 0), MessageKey("activations", 1, 1)
    back = MessageKey("gradients", 0, 1)
    many = [torch.full(shape, float(i)) for i, shape in enumerate(LONG)]
    runs = [*([shape] for shape in RUN), *[LONG] * 3]  # each message's tensors' shapes
    keys = [MessageKey("activations", 1, 10 + i) for i in range(len(runs))]
    out: dict = {}
    if comm.rank == 0:
        messages.send(1, first, [*many, None, torch.zeros(0, 5)])
        messages.send(1, second, [torch.arange(6.0).view(2, 3).requires_grad_()])
        out["back"] = messages.receive(1, back)
        messages.finish()
        for index, (key, shapes) in enumerate(zip(keys, runs, strict=True)):
            messages.send(1, key, [torch.full(shape, float(index)) for shape in shapes])
        messages.finish()
        messages.send(1, MessageKey("activations", 1, 2), [torch.ones(3)])
        messages.finish()
        out["fillers"] = comm.stats["send_filler"].calls
        return out
    messages.expect(0, first)
    out["second"] = messages.receive(0, second)  # announced late: arrives after the first
    out["first"] = messages.receive(0, first)
    messages.send(0, back, [torch.ones(4)])
    messages.finish()
    for key in keys:
        messages.expect(0, key)
    out["runs"] = [messages.receive(0, key) for key in reversed(keys)][::-1]
    messages.finish()
    try:
        messages.receive(0, MessageKey("activations", 1, 3))
    except CollectiveError as error:
        out["timeout"] = str(error)
    try:
        messages.finish()
    except RuntimeError as error:
        out["left"] = str(error)
    return out


def test_messages_pair_up_in_any_order_and_waits_time_out():
    """Also the receives posted ahead after two messages of the same shapes: every message
    arrives whole, with fillers where the shapes changed after such a run."""
    sender, receiver = run_distributed(exchange, 2, collective_timeout_s=3)
    assert [t.tolist() for t in sender["back"]] == [[1.0] * 4]
    *many, none, empty = receiver["first"]
    assert [t.tolist() for t in many] == [[[[[float(i)] * 3], [[float(i)] * 3]]] for i in range(9)]
    assert none is None and empty.shape == (0, 5)
    (second,) = receiver["second"]
    assert second.requires_grad and second.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    runs = [*([shape] for shape in RUN), *[LONG] * 3]
    for index, (got, shapes) in enumerate(zip(receiver["runs"], runs, strict=True)):
        assert [t.shape for t in got] == list(shapes), index
        assert all(bool((t == index).all()) for t in got), index
    # a filler where the shapes changed after a run: the (2, 3) run, the (4,) run and the long
    # one (before the last message)
    assert sender["fillers"] == 3
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
    with pytest.raises(RuntimeError, match="an earlier step failed midway .*ValueError"):
        schedule.eval([torch.zeros(1)] * 2, None, [])
