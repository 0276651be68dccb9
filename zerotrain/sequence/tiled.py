"""Compute over tiles of the sequence, so that no intermediate of the whole sequence is kept:
``TiledMLP`` (the MLP's 4h-wide intermediate exists for one tile at a time, recomputed tile by
tile in backward) and ``TiledFusedLogitsLoss`` (the logits, sequence x vocabulary in fp32, exist
for one tile at a time: forward computes each tile's loss and its gradients at once and keeps
only the gradient of the input). DeepSpeed's ALST names and signatures (arXiv:2506.13996).

[Note: one gradient per parameter]
DeepSpeed runs each tile's backward into ``param.grad`` and flags (``ds_grad_is_ready``) which
tile may hand it to the reduction. Here the parameters are inputs of the autograd function
itself: each tile's parameter gradients come from ``torch.autograd.grad`` (which accumulates
nothing) and are summed, and the function returns the sums, so autograd accumulates each
parameter once, as for any layer, and the shard group's gradient hooks (every ZeRO stage, the
reductions in backward, stage 3's re-gathers) see one gradient per parameter and backward.
The parameters are those of the module given that require a gradient, and ``compute_params``
(DeepSpeed's list, for parameters ``fn`` reads from elsewhere); a parameter ``fn`` reads from
neither would get no gradient, so name it in ``compute_params``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn


def _trained(module: Any, compute_params: Iterable[torch.Tensor] | None) -> list[torch.Tensor]:
    own = list(module.parameters()) if isinstance(module, nn.Module) else []
    found: dict[int, torch.Tensor] = {}
    for p in [*own, *(compute_params or [])]:
        if p.requires_grad:
            found.setdefault(id(p), p)
    return list(found.values())


def _tile_length(length: int, shards: int) -> int:
    """Elements per tile for ``shards`` tiles of ``length`` (the last may be shorter)."""
    return max(1, math.ceil(length / max(1, int(shards))))


def _add(total: list[torch.Tensor | None], grads: Iterable[torch.Tensor | None]) -> None:
    """Add each gradient into ``total``'s (a copy first: a gradient autograd returns may alias
    the incoming one)."""
    for i, g in enumerate(grads):
        if g is not None:
            held = total[i]
            total[i] = g.clone() if held is None else held.add_(g)


class TiledMLP:
    """``TiledMLP.apply(fn, self, x, shards, compute_params)``: ``fn(self, x)`` (an MLP) over
    ``shards`` tiles of ``x`` along its sequence (dimension -2), recomputed tile by tile in
    backward; the output equals ``fn(self, x)``. DeepSpeed's signature."""

    @staticmethod
    def apply(
        fn: Callable[[Any, torch.Tensor], torch.Tensor],
        self: Any,
        x: torch.Tensor,
        shards: int,
        compute_params: Iterable[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        dim = x.dim() - 2
        params = _trained(self, compute_params)
        tile = _tile_length(x.shape[dim], shards)
        return _Tiled.apply(lambda _, part: fn(self, part), x, dim, tile, dim, *params)


def sequence_tiled_compute(
    fn: Callable[..., torch.Tensor],
    seqlen: int,
    shards: int,
    kwargs_to_shard: dict[str, torch.Tensor],
    kwargs_to_pass: dict[str, Any],
    grad_requiring_tensor_key: str,
    compute_params: Iterable[torch.Tensor] | None = None,
    output_unshard_dimension: int = 1,
    output_reduction: str | None = "mean",
) -> torch.Tensor:
    """DeepSpeed's generic tiled compute: ``fn(**tiles of kwargs_to_shard, **kwargs_to_pass)``
    over ``shards`` tiles along dimension 1 of every ``kwargs_to_shard`` tensor, recomputed in
    backward; the outputs joined along ``output_unshard_dimension`` (0: one scalar per tile,
    stacked), then reduced (None, "mean" or "sum"). Only ``grad_requiring_tensor_key``'s tensor
    gets a gradient among the inputs."""
    if output_reduction not in (None, "mean", "sum"):
        raise ValueError(f"output_reduction: None, 'mean' or 'sum', got {output_reduction!r}")
    key = grad_requiring_tensor_key
    x = kwargs_to_shard[key]
    others = {k: v for k, v in kwargs_to_shard.items() if k != key}
    tile = _tile_length(x.shape[1], shards)

    def run(index: int, part: torch.Tensor) -> torch.Tensor:
        start = index * tile
        sliced = {k: v[:, start : start + part.shape[1]] for k, v in others.items()}
        out = fn(**{key: part}, **sliced, **kwargs_to_pass)
        return out.unsqueeze(0) if output_unshard_dimension == 0 else out

    params = _trained(None, compute_params)
    out = _Tiled.apply(run, x, 1, tile, output_unshard_dimension, *params)
    if output_reduction == "mean":
        return out.mean()
    return out.sum() if output_reduction == "sum" else out


class _Replay:
    """The state a recomputation must see to repeat the forward: the random number generators
    (dropout draws the same masks; the tiles run in the same order, so they draw in the same
    order) and autocast, as ``torch.utils.checkpoint`` restores them."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.autocast = (
            torch.is_autocast_enabled(device.type),
            torch.get_autocast_dtype(device.type),
        )

    @contextlib.contextmanager
    def __call__(self):
        devices = [self.device] if self.cuda_rng is not None else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            torch.set_rng_state(self.cpu_rng)
            if self.cuda_rng is not None:
                torch.cuda.set_rng_state(self.cuda_rng, self.device)  # CUDA only
            enabled, dtype = self.autocast
            with torch.autocast(self.device.type, dtype=dtype, enabled=enabled):
                yield


class _Tiled(torch.autograd.Function):
    """``run(i, tile i)`` over tiles of ``tile`` elements of ``x`` along ``dim``, the outputs
    joined along ``out_dim`` (0: one scalar per tile, stacked); backward recomputes each tile
    (see [Note: one gradient per parameter])."""

    @staticmethod
    def forward(ctx, run, x, dim, tile, out_dim, *params):
        ctx.run, ctx.dim, ctx.tile, ctx.out_dim, ctx.params = run, dim, tile, out_dim, params
        ctx.save_for_backward(x)
        ctx.replay = _Replay(x.device)
        parts = x.split(tile, dim)
        return torch.cat([run(i, part) for i, part in enumerate(parts)], out_dim)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        grad = grads[0]
        (x,) = ctx.saved_tensors
        wants_x = ctx.needs_input_grad[1]
        needs = ctx.needs_input_grad[5:]
        params = [p for p, need in zip(ctx.params, needs, strict=True) if need]
        x_grads = []
        param_grads: list[torch.Tensor | None] = [None] * len(params)
        offset = 0
        # one tile at a time, under the forward's random numbers and autocast
        with ctx.replay():
            for i, part in enumerate(x.split(ctx.tile, ctx.dim)):
                part = part.detach().requires_grad_(wants_x)
                with torch.enable_grad():
                    out = ctx.run(i, part)
                part_grad = grad.narrow(ctx.out_dim, offset, out.shape[ctx.out_dim])
                offset += out.shape[ctx.out_dim]
                inputs = ([part] if wants_x else []) + params
                found = torch.autograd.grad(out, inputs, part_grad, allow_unused=True)
                if wants_x:
                    x_grads.append(found[0] if found[0] is not None else torch.zeros_like(part))
                _add(param_grads, found[1:] if wants_x else found)
        by_param = iter(param_grads)
        out_params = [next(by_param) if need else None for need in needs]
        x_grad = torch.cat(x_grads, ctx.dim) if wants_x else None
        return (None, x_grad, None, None, None, *out_params)


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class _FusedLoss(torch.autograd.Function):
    """Each tile's loss and its gradients computed in forward (see TiledFusedLogitsLoss)."""

    @staticmethod
    def forward(ctx, fn, module, x, y, mask, shards, reduction, grads_wanted, *params):
        wants_x = x.requires_grad and grads_wanted
        flat_x = x.detach().reshape(-1, *x.shape[2:])
        flat_y = y.reshape(-1, *y.shape[2:])
        flat_mask = None if mask is None else mask.reshape(-1)
        tile = _tile_length(flat_x.shape[0], shards)
        xs = flat_x.split(tile)
        scale = 1.0 / len(xs) if reduction == "mean" else 1.0
        trained = [p for p in params if p.requires_grad and grads_wanted]
        x_grads, losses = [], []
        param_grads: list[torch.Tensor | None] = [None] * len(trained)
        masks = flat_mask.split(tile) if flat_mask is not None else [None] * len(xs)
        tiles = zip(xs, flat_y.split(tile), masks, strict=True)
        for tile_x, tile_y, tile_mask in tiles:
            tile_x = tile_x.requires_grad_(wants_x)
            args = (module, tile_x, tile_y) + (() if tile_mask is None else (tile_mask,))
            # the tile's graph lives and dies in this forward: the saved-tensor hooks around
            # the step (activation offload, the planner's count) must not take it as the step's
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
                loss = fn(*args)
            inputs = ([tile_x] if wants_x else []) + trained
            if inputs and loss.requires_grad:
                found = torch.autograd.grad(
                    loss, inputs, torch.full_like(loss, scale), allow_unused=True
                )
                if wants_x:
                    x_grads.append(found[0] if found[0] is not None else torch.zeros_like(tile_x))
                _add(param_grads, found[1:] if wants_x else found)
            losses.append(loss.detach())
        by_param = iter(param_grads)
        ctx.grads = [next(by_param) if p.requires_grad and grads_wanted else None for p in params]
        ctx.x_grad = torch.cat(x_grads).view(x.shape) if x_grads else None
        total = torch.stack(losses)
        return total.mean() if reduction == "mean" else total.sum()

    @staticmethod
    def backward(ctx, *outer: torch.Tensor):
        def scaled(g):
            return None if g is None else g * outer[0]

        x_grad, grads = scaled(ctx.x_grad), [scaled(g) for g in ctx.grads]
        ctx.x_grad = ctx.grads = None
        return (None, None, x_grad, None, None, None, None, None, *grads)


class TiledFusedLogitsLoss:
    """``TiledFusedLogitsLoss.apply(fn, self, x, y, mask, shards, compute_params,
    output_reduction)``: ``fn(self, x_tile, y_tile[, mask_tile])`` (logits and their loss, one
    scalar) over ``shards`` tiles of the flattened ``[batch x sequence]`` rows of ``x``, ``y``
    and ``mask``, reduced by ``output_reduction`` ("mean" of the tiles' losses or "sum": with
    tiles of unequal valid counts, return sums and divide yourself). Each tile's gradients are
    computed as it is, so logits exist for one tile at a time (DeepSpeed's signature; see
    [Note: one gradient per parameter])."""

    @staticmethod
    def apply(
        fn: Callable[..., torch.Tensor],
        self: Any,
        x: torch.Tensor,
        y: torch.Tensor,
        mask: torch.Tensor | None,
        shards: int,
        compute_params: Iterable[torch.Tensor] | None,
        output_reduction: str = "mean",
    ) -> torch.Tensor:
        if output_reduction not in ("mean", "sum"):
            raise ValueError(f"output_reduction: 'mean' or 'sum', got {output_reduction!r}")
        if x.dim() < 2 or y.dim() < 2 or tuple(x.shape[:2]) != tuple(y.shape[:2]):
            raise ValueError(
                f"TiledFusedLogitsLoss: x {tuple(x.shape)} and y {tuple(y.shape)} must share "
                "their first two dimensions [batch, sequence]"
            )
        if mask is not None and tuple(mask.shape) != tuple(x.shape[:2]):
            raise ValueError(
                f"TiledFusedLogitsLoss: mask {tuple(mask.shape)} must be [batch, sequence] "
                f"{tuple(x.shape[:2])}"
            )
        params = _trained(self, compute_params)
        # forward computes the gradients: none under no_grad (evaluation)
        wanted = torch.is_grad_enabled()
        return _FusedLoss.apply(fn, self, x, y, mask, shards, output_reduction, wanted, *params)
