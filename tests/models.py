"""Small models with the awkward features that break ZeRO implementations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zerotrain.zero import full_shape

VOCAB, DIM, HIDDEN, SEQ = 11, 7, 13, 5


class AwkwardModel(nn.Module):
    """Tied embedding/head, a frozen layer, sizes no world size of 2-4 divides, a buffer.

    Sizes: embedding 11x7=77, hidden 13x7=91 (+13), odd 5x7=35, frozen 13x13, head bias 11.
    """

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.frozen = nn.Linear(HIDDEN, HIDDEN)
        self.frozen.requires_grad_(False)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)
        self.odd = nn.Parameter(torch.randn(SEQ, DIM) * 0.1)  # 35 elements
        self.head = nn.Linear(DIM, VOCAB)
        self.head.weight = self.embed.weight  # tied, GPT-2 style
        self.register_buffer("mix", torch.linspace(0.5, 1.5, DIM))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx) + self.odd * self.mix
        h = h + self.down(torch.tanh(self.frozen(torch.tanh(self.up(h)))))
        logits = self.head(h)
        return F.cross_entropy(logits.float().view(-1, VOCAB), targets.view(-1))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay on matrices, none on biases and 1-D tensors (the usual split). ``full_shape``:
    parameters built under zero.Init are 1-D chunks until initialize."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if len(full_shape(p)) >= 2]
    no_decay = [p for p in trainable if len(full_shape(p)) < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def make_batches(steps: int, global_batch: int, seed: int = 1):
    """``steps`` global batches of (idx, targets), each ``global_batch`` x SEQ tokens."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (steps, global_batch, SEQ), generator=gen)
    targets = torch.randint(0, VOCAB, (steps, global_batch, SEQ), generator=gen)
    return idx, targets


def micro_batch(batch: torch.Tensor, micro: int, rank: int, world: int, size: int) -> torch.Tensor:
    """Rows of a global batch that ``rank`` sees in micro-step ``micro``."""
    chunk = micro * world + rank
    return batch[chunk * size : (chunk + 1) * size]


def run_steps(
    engine, idx, tgt, micro_size, accum, world, rank, after_step=None, backward=None
) -> None:
    """Feed each global batch of ``idx``/``tgt`` to ``engine`` as this rank's micro-batches
    (``accum`` per optimizer step); ``after_step(step)`` runs after each optimizer step.
    ``backward(output)`` runs each micro-step's backward (default: ``engine.backward``)."""
    backward = backward if backward is not None else engine.backward
    for step in range(len(idx)):
        for micro in range(accum):
            x = micro_batch(idx[step], micro, rank, world, micro_size)
            y = micro_batch(tgt[step], micro, rank, world, micro_size)
            backward(engine(x, y))
            engine.step()
        if after_step is not None:
            after_step(step)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(DIM))
        self.up = nn.Linear(DIM, hidden)
        self.down = nn.Linear(hidden, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.tanh(self.up(h * self.scale)))


class BlockModel(nn.Module):
    """Stage-3 stress: blocks in a ModuleList (gather units) of odd sizes; block 1 runs twice and
    holds a frozen bias; block 3 never runs; blocks 0 and 2 share ``scale``; the embedding is
    also the output projection, read with ``F.linear`` in the root's own forward; a buffer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(13), Block(11), Block(5), Block(9)])
        self.blocks[1].up.bias.requires_grad_(False)
        self.blocks[2].scale = self.blocks[0].scale
        self.head_bias = nn.Parameter(torch.zeros(VOCAB))
        self.register_buffer("mix", torch.linspace(0.5, 1.5, DIM))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx) * self.mix
        h = self.blocks[1](self.blocks[1](self.blocks[0](h)))
        h = self.blocks[2](h)
        logits = F.linear(h, self.embed.weight, self.head_bias)
        return F.cross_entropy(logits.float().view(-1, VOCAB), targets.view(-1))


class DropoutModel(nn.Module):
    """Blocks (stage-3 gather units) with dropout between them, a frozen scale and a buffer:
    for checkpoints, where a resumed run must redraw the same dropout masks."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(13), Block(6)])
        self.drop = nn.Dropout(0.2)
        self.frozen_scale = nn.Parameter(torch.linspace(0.9, 1.1, DIM), requires_grad=False)
        self.head = nn.Linear(DIM, VOCAB)
        self.register_buffer("mix", torch.linspace(0.5, 1.5, DIM))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.embed(idx) * self.mix)
        for block in self.blocks:
            h = self.drop(block(h)) * self.frozen_scale
        return F.cross_entropy(self.head(h).float().view(-1, VOCAB), targets.view(-1))


def tiny_hf_gpt2() -> nn.Module:
    """A 2-layer HuggingFace GPT-2 built from a config, no download (for ``zerotrain estimate
    --model tests.models:tiny_hf_gpt2``): tied embedding and head, an HF ``.config``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2,
        n_embd=48,
        n_head=4,
        vocab_size=101,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)
