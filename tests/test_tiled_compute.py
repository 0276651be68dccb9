"""Tiled compute (zerotrain/sequence/tiled.py) equals the untiled computation, holds only a
tile's intermediate at a time, and hands each parameter one gradient per backward."""

from __future__ import annotations

import weakref
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from zerotrain.sequence import TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute
from zerotrain.sequence.hf import tile_loss, tile_mlps

transformers = pytest.importorskip("transformers")


class LiveBytes(TorchDispatchMode):
    """The peak, over a region, of the bytes held by tensors its operations made (a storage
    counted once, released when the tensor that brought it is freed)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.largest = 0  # elements of the largest tensor made
        self._storages: set[int] = set()

    def _release(self, key: int, nbytes: int) -> None:
        self._storages.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in pytree.tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            self.largest = max(self.largest, tensor.numel())
            key, nbytes = tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()
            if key in self._storages or nbytes == 0:
                continue
            self._storages.add(key)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(tensor, self._release, key, nbytes)
        return out


def llama(**overrides) -> torch.nn.Module:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=16, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa",
        **overrides,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def grads_of(params) -> list[torch.Tensor]:
    """The gradients, taken (reset to None)."""
    params = list(params)
    out = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return out


def test_tiled_mlp_equals_the_mlp_and_holds_one_tile_of_its_intermediate():
    mlp = llama().model.layers[0].mlp
    x = torch.randn(2, 23, 16, requires_grad=True)
    hooks = []
    for p in mlp.parameters():  # one gradient per parameter and backward
        hooks.append(p.register_post_accumulate_grad_hook(lambda p: hooks.append(p)))
    plain = mlp(x)
    plain.square().sum().backward()
    expected = [x.grad.clone(), *grads_of(mlp.parameters())]
    x.grad = None
    hooks[3:] = []

    def forward(module, tile):
        return module.down_proj(module.act_fn(module.gate_proj(tile)) * module.up_proj(tile))

    with LiveBytes() as seen:
        tiled = TiledMLP.apply(forward, mlp, x, 4, None)  # tiles of 6 tokens
        tiled.square().sum().backward()
    assert torch.allclose(tiled, plain, atol=1e-6)
    for got, want in zip([x.grad, *grads_of(mlp.parameters())], expected, strict=True):
        assert torch.allclose(got, want, atol=1e-5)
    assert len(hooks) == 3 + 3  # the three projections, once each
    # the largest tensors are the input and output (2 x 23 x 16): of the 40-wide intermediate
    # only a tile (2 x 6 x 40) exists, never all 2 x 23 x 40
    assert seen.largest == 2 * 23 * 16


def test_tiled_fused_loss_equals_the_loss_and_holds_one_tile_of_logits():
    torch.manual_seed(1)
    tokens, hidden, vocab, tile = 512, 8, 1000, 64
    head = torch.nn.Linear(hidden, vocab, bias=False)
    x = torch.randn(1, tokens, hidden, requires_grad=True)
    y = torch.randint(0, vocab, (1, tokens))
    y[0, ::7] = -100

    def loss_sum(module, xs, ys):
        return F.cross_entropy(module(xs).float(), ys, ignore_index=-100, reduction="sum")

    with LiveBytes() as untiled:
        loss_sum(head, x[0], y[0]).backward()
    expected = [x.grad.clone(), *grads_of(head.parameters())]
    x.grad = None
    with LiveBytes() as tiled:
        loss = TiledFusedLogitsLoss.apply(loss_sum, head, x, y, None, tokens // tile, None, "sum")
        loss.backward()
    want = F.cross_entropy(head(x[0]), y[0], ignore_index=-100, reduction="sum")
    assert torch.allclose(loss, want, rtol=1e-6)
    for got, reference in zip([x.grad, *grads_of(head.parameters())], expected, strict=True):
        assert torch.allclose(got, reference, atol=1e-5)
    logits_bytes = tokens * vocab * 4
    assert untiled.peak >= 2 * logits_bytes  # logits and their softmax, whole
    weight_and_activations = 2 * vocab * hidden * 4 + 4 * tokens * hidden * 4
    assert tiled.peak <= 4 * tile * vocab * 4 + weight_and_activations
    assert tiled.largest <= tile * vocab


def test_tiled_fused_loss_keeps_no_tile_s_graph_for_the_step():
    """The saved-tensor hooks around a step (activation offload, the planner's model probe)
    see nothing of a tile's graph, which the fused loss builds and frees in its forward: the
    probe counted every tile's logits as kept (the tiled Llama rows of bench/plan.py read 17-29%
    over)."""
    from zerotrain.activation_checkpointing import count_saved_activations

    tokens, hidden, vocab, tile = 512, 8, 1000, 64
    head = torch.nn.Linear(hidden, vocab, bias=False)
    x = torch.randn(1, tokens, hidden, requires_grad=True)
    y = torch.randint(0, vocab, (1, tokens))

    def loss_sum(module, xs, ys):
        return F.cross_entropy(module(xs).float(), ys, reduction="sum")

    with count_saved_activations(exclude=head.parameters()) as saved:
        loss = TiledFusedLogitsLoss.apply(loss_sum, head, x, y, None, tokens // tile, None, "sum")
    assert saved.nbytes == 0
    loss.backward()
    assert x.grad is not None and head.weight.grad is not None


def test_tiled_fused_loss_mean_of_tiles_and_mask():
    torch.manual_seed(2)
    head = torch.nn.Linear(4, 11)
    x = torch.randn(2, 6, 4, requires_grad=True)
    y = torch.randint(0, 11, (2, 6))
    mask = torch.rand(2, 6) > 0.3

    def masked(module, xs, ys, ms):
        losses = F.cross_entropy(module(xs), ys, reduction="none")
        return (losses * ms).sum()

    loss = TiledFusedLogitsLoss.apply(masked, head, x, y, mask, 3, [head.weight], "mean")
    loss.backward()
    got = [x.grad.clone(), *grads_of(head.parameters())]
    x.grad = None
    rows = F.cross_entropy(head(x).view(-1, 11), y.view(-1), reduction="none") * mask.view(-1)
    (rows.view(3, 4).sum(1).mean()).backward()  # tiles of 4 of the 12 rows, mean of sums
    assert torch.allclose(loss, rows.view(3, 4).sum(1).mean())
    for a, b in zip(got, [x.grad, *grads_of(head.parameters())], strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    with pytest.raises(ValueError, match="must share their first two dimensions"):
        TiledFusedLogitsLoss.apply(masked, head, x, y[:, :5], None, 2, None, "sum")


def test_sequence_tiled_compute_equals_the_function():
    torch.manual_seed(3)
    w = torch.randn(5, 5, requires_grad=True)
    x = torch.randn(2, 9, 5, requires_grad=True)
    scale = torch.randn(2, 9, 1)

    def fn(hidden, gain, power):
        return ((hidden @ w) * gain) ** power

    out = sequence_tiled_compute(
        fn, 9, 4, {"hidden": x, "gain": scale}, {"power": 2}, "hidden", [w], 1, None
    )
    out.sum().backward()
    got = [x.grad.clone(), w.grad.clone()]
    x.grad = w.grad = None
    want = fn(x, scale, 2)
    want.sum().backward()
    assert torch.allclose(out, want, atol=1e-6)
    assert torch.allclose(got[0], x.grad, atol=1e-5) and torch.allclose(got[1], w.grad, atol=1e-5)


def test_tiling_a_causal_lm_changes_no_loss_or_gradient():
    ids = torch.randint(1, 97, (2, 30), generator=torch.Generator().manual_seed(4))
    labels = ids.clone()
    labels[:, :5] = -100
    plain = llama()
    plain(input_ids=ids, labels=labels).loss.backward()
    tiled = llama()
    assert tile_mlps(tiled, tile_tokens=7) == 2
    from zerotrain.comm import Communicator

    tile_loss(tiled, Communicator(), tile_tokens=8)
    out = tiled(input_ids=ids, labels=labels)
    assert out.logits is None  # never made whole
    out.loss.backward()
    assert torch.allclose(out.loss, plain(input_ids=ids, labels=labels).loss, rtol=1e-6)
    for (name, a), b in zip(tiled.named_parameters(), plain.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name
    assert tiled(input_ids=ids).logits.shape == (2, 30, 97)  # no labels: the model's forward


def test_tiled_fused_loss_under_no_grad_computes_no_gradient():
    """Evaluation: the loss alone (forward computes gradients only when they are wanted)."""
    head = torch.nn.Linear(4, 11)
    x, y = torch.randn(1, 6, 4), torch.randint(0, 11, (1, 6))

    def loss_sum(module, xs, ys):
        return F.cross_entropy(module(xs), ys, reduction="sum")

    grad = torch.autograd.grad
    with torch.no_grad(), mock.patch("torch.autograd.grad", wraps=grad) as computed:
        loss = TiledFusedLogitsLoss.apply(loss_sum, head, x, y, None, 3, None, "sum")
    assert torch.allclose(loss, loss_sum(head, x[0], y[0]))
    assert computed.call_count == 0 and head.weight.grad is None


def test_tiled_recomputation_draws_the_forwards_random_numbers():
    """Backward recomputes each tile with the generator's state of the forward: dropout keeps
    the masks the output was made with (a gradient of 4 where the output is not zero)."""
    x = torch.randn(2, 9, 5, requires_grad=True)

    def dropped(module, tile):
        return F.dropout(tile, 0.5, training=True) * 2  # 4 x tile where kept

    torch.manual_seed(7)
    out = TiledMLP.apply(dropped, None, x, 3, None)
    torch.rand(100)  # other draws between forward and backward
    out.sum().backward()
    assert torch.equal(x.grad, 4.0 * (out != 0))
