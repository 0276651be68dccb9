"""Muon (Jordan et al., https://kellerjordan.github.io/posts/muon/; Liu et al., "Muon is
Scalable for LLM Training", arXiv:2502.16982) with an AdamW half, as DeepSpeed's
``MuonWithAuxAdam``: groups with ``use_muon`` true take Muon's update, the others AdamW's.

The Muon update is ``torch.optim.Muon``'s:

    B = mu * B + (1 - mu) * g                  (momentum_buffer)
    U = (1 - mu) * g + mu * B                  (nesterov; else U = B)
    O = NS5(U)                                 (Newton-Schulz, on the whole matrix)
    W = W * (1 - lr * weight_decay) - lr * scale(shape) * O

with ``scale`` sqrt(max(1, rows / cols)) ("original") or Moonlight's 0.2 * sqrt(max(rows, cols))
("match_rms_adamw"). Newton-Schulz runs in ``ns_dtype``: torch's Muon always uses bf16;
zerotrain uses the update's dtype unless told, fp32 (the masters', or bf16 masters widened to
fp32 for the step: zerotrain/zero/low_precision.py).

[Note: Muon on shards]
Every step but one is element-wise, so the momentum lives on the flat master shards like Adam's
moments (offloaded, checkpointed and resharded with them). Newton-Schulz needs each matrix
whole. The optimizer hands its flat updates to a :class:`MatrixLayout`, which says where each
matrix lies in the flat tensors and orthogonalises them in place: :class:`WholeTensors` when
every tensor is a parameter of its own, zerotrain.zero.whole_matrices's when the tensors are
ZeRO shards (each matrix sent to one rank, orthogonalised there, sent back: the design is
written there).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, TypeVar, cast

import torch
from torch import Tensor

from zerotrain.optim.adam import adam_step
from zerotrain.optim.closure_step import ClosureStep

__all__ = [
    "MatrixLayout",
    "Muon",
    "WholeTensors",
    "newton_schulz",
    "update_scale",
    "uses_muon",
]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic, as torch.optim.Muon
ADJUST_LR = ("original", "match_rms_adamw")

# A run of a flat tensor that holds one matrix: elements [start, end) of the tensor are
# elements [start, end) shifted of the matrix of this (rows, cols) shape.
MatrixRun = tuple[int, int, torch.Size]


def uses_muon(name: str, shape: Sequence[int], param: Tensor) -> bool:
    """Whether Muon steps a parameter: its ``use_muon`` attribute where set (DeepSpeed's
    flag), else DeepSpeed's rule: a 2-D weight (``shape``: its real shape, ``ds_shape`` under
    zero.Init) whose name contains neither ``embed`` nor ``lm_head``."""
    flag = getattr(param, "use_muon", None)
    if flag is not None:
        if flag and len(shape) != 2:
            raise ValueError(
                f"parameter {name!r} has use_muon=True but shape {tuple(shape)}: Muon "
                "orthogonalises 2-D matrices only; leave the flag unset or False"
            )
        return bool(flag)
    return len(shape) == 2 and "embed" not in name and "lm_head" not in name


def update_scale(shape: Sequence[int], adjust_lr_fn: str | None) -> float:
    """The factor on the learning rate of a ``(rows, cols)`` matrix (torch.optim.Muon's)."""
    rows, cols = shape[0], shape[1]
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1.0, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols))


def newton_schulz(
    matrices: Tensor, steps: int, coefficients: tuple[float, float, float], eps: float
) -> Tensor:
    """The orthogonalised ``matrices`` (a batch, ``(batch, rows, cols)``, all of one shape),
    in their dtype: torch.optim.Muon's quintic iteration on each, computed as one batched
    product per term."""
    a, b, c = coefficients
    tall = matrices.size(-2) > matrices.size(-1)
    x = matrices.mT if tall else matrices
    norms = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    x = x / norms.clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x.mT if tall else x


def orthogonalize_all(
    matrices: Sequence[Tensor], fn: Callable[[Tensor], Tensor], batched: bool | None = None
) -> list[Tensor]:
    """``fn`` (a batch of matrices of one shape -> its result) of each of ``matrices``: batched
    by shape on a GPU (``batched`` None), where one launch per product for several matrices
    pays; one matrix at a time elsewhere (on this CPU, 1 thread, the 56 matrices of the 100M
    GPT took 12.10 s batched and 11.25 s one at a time: bench/precision.py --part
    newton-schulz)."""
    if not matrices:
        return []
    if batched is None:
        batched = matrices[0].device.type == "cuda"
    if not batched:
        return [fn(m[None])[0].contiguous() for m in matrices]
    by_shape: dict[torch.Size, list[int]] = {}
    for index, matrix in enumerate(matrices):
        by_shape.setdefault(matrix.shape, []).append(index)
    out: list[Tensor | None] = [None] * len(matrices)
    for indices in by_shape.values():
        batch = fn(torch.stack([matrices[i] for i in indices]))
        for i, result in zip(indices, batch, strict=True):
            out[i] = result.contiguous()
    return [t for t in out if t is not None]


class MatrixLayout(Protocol):
    """Where the matrices a Muon group steps lie in its tensors, and how they are made whole."""

    def runs(self, tensor: Tensor) -> list[MatrixRun]:
        """The runs of ``tensor`` (one of the group's parameters) that hold matrices, in order;
        elements in none are padding, which never moves."""
        ...

    def orthogonalize(self, updates: dict[Tensor, Tensor], fn: Callable[[Tensor], Tensor]) -> None:
        """Replace in place each matrix's elements in ``updates`` (per parameter of the group,
        laid out like it) by ``fn`` of the whole matrix; ``fn`` takes and returns a batch of
        matrices of one shape. Collective where the tensors are shards."""
        ...


class WholeTensors:
    """Every tensor is a matrix of its own (Muon outside ZeRO)."""

    def runs(self, tensor: Tensor) -> list[MatrixRun]:
        return [(0, tensor.numel(), tensor.shape)]

    def orthogonalize(self, updates: dict[Tensor, Tensor], fn: Callable[[Tensor], Tensor]) -> None:
        tensors = list(updates.values())
        for update, result in zip(tensors, orthogonalize_all(tensors, fn), strict=True):
            update.copy_(result)


class Muon(ClosureStep):
    """Muon for the groups with ``use_muon`` true, AdamW (decoupled decay, bias-corrected,
    torch's fused kernel where it runs) for the others.

    ``lr``, ``weight_decay`` are both halves'; ``muon_lr`` / ``adam_lr`` override ``lr`` for
    one half (DeepSpeed's keys). ``momentum``, ``nesterov``, ``ns_steps``, ``ns_coefficients``,
    ``ns_dtype`` ("fp32", "bf16"; None: the tensors' dtype), ``adjust_lr_fn`` and ``ns_eps``
    (torch.optim.Muon's ``eps``) are Muon's; ``betas`` and ``eps`` AdamW's, as in DeepSpeed's
    config. A group's own keys win, as in torch.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        muon_lr: float | None = None,
        adam_lr: float | None = None,
        momentum: float = 0.95,
        nesterov: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        ns_dtype: str | None = None,
        ns_eps: float = 1e-7,
        adjust_lr_fn: str | None = None,
    ):
        if adjust_lr_fn not in (None, *ADJUST_LR):
            raise ValueError(f"Muon: adjust_lr_fn must be one of {ADJUST_LR}, got {adjust_lr_fn!r}")
        if ns_dtype not in (None, "fp32", "bf16"):
            raise ValueError(f"Muon: ns_dtype must be 'fp32' or 'bf16', got {ns_dtype!r}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Muon: momentum must be in [0, 1), got {momentum}")
        defaults = {
            "lr": lr,
            "muon_lr": muon_lr,
            "adam_lr": adam_lr,
            "momentum": momentum,
            "nesterov": nesterov,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "ns_steps": ns_steps,
            "ns_coefficients": tuple(ns_coefficients),
            "ns_dtype": ns_dtype,
            "ns_eps": ns_eps,
            "adjust_lr_fn": adjust_lr_fn,
            "use_muon": False,
        }
        super().__init__(params, defaults)
        self._layouts: dict[int, MatrixLayout] = {}  # group index -> layout (default: whole)

    steps_collectively = True
    """Its step exchanges pieces of matrices between ranks on shards: one step over every
    bucket, which every rank takes (zerotrain/zero/offload.py)."""

    def collective_tensors(self) -> list[Tensor]:
        """The tensors whose step is collective: the matrices' (exchanged whole between ranks
        on shards); the AdamW groups step element-wise, each tensor on its own if need be."""
        return [p for group in self.param_groups if group["use_muon"] for p in group["params"]]

    def element_state_keys_of(self, tensor: Tensor) -> tuple[str, ...]:
        """The per-element states of ``tensor``: Muon's momentum, or AdamW's moments."""
        group = next(g for g in self.param_groups if any(p is tensor for p in g["params"]))
        return ("momentum_buffer",) if group["use_muon"] else ("exp_avg", "exp_avg_sq")

    def set_layout(self, group_index: int, layout: MatrixLayout) -> None:
        """Group ``group_index``'s tensors are laid out as ``layout`` says (ZeRO's shards)."""
        self._layouts[group_index] = layout

    def layout(self, group_index: int) -> MatrixLayout:
        layout = self._layouts.get(group_index)
        if layout is not None:
            return layout
        group = self.param_groups[group_index]
        for p in group["params"]:
            if p.ndim != 2:
                raise ValueError(
                    f"Muon: a use_muon group holds a tensor of shape {tuple(p.shape)}; Muon "
                    "orthogonalises 2-D matrices (give the others to a group with use_muon "
                    "False, which steps them with AdamW)"
                )
        return WholeTensors()

    def update(self) -> None:
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if group["use_muon"]:
                # on ZeRO's shards the gradients are the engine's, consumed by this step: the
                # update is made in their storage (no copy of every matrix)
                self._muon_step(index, params, self.layout(index), index in self._layouts)
            elif params:
                self._adamw_step(group, params)

    def _muon_step(
        self, index: int, params: list[Tensor], layout: MatrixLayout, in_place: bool
    ) -> None:
        # the layout's exchange is collective: it runs even when this rank has no gradient
        updates: dict[Tensor, Tensor] = {}
        for p in params:
            grad = cast(Tensor, p.grad)
            update = grad if in_place else torch.empty_like(grad)
            self.prepare_update(index, grad, self.momentum_buffer(p), update)
            updates[p] = update
        if updates:  # ZeRO attaches a gradient to every shard: every rank exchanges
            layout.orthogonalize(updates, self.orthogonalizer(index))
        for p, update in updates.items():
            self.apply_update(index, p.view(-1), update.view(-1), layout.runs(p))

    # Muon's step in three parts, for a store that holds the tensors piece by piece (NVMe
    # offload, zerotrain/zero/nvme.py): the first and last are element-wise, so a piece of a
    # tensor steps exactly as within the whole.
    def momentum_buffer(self, tensor: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """``tensor``'s momentum, made zero (in ``dtype``, default the tensor's) at its first
        step."""
        state = self.state[tensor]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(tensor, dtype=dtype)
        return state["momentum_buffer"]

    def prepare_update(self, group_index: int, grad: Tensor, buf: Tensor, out: Tensor) -> None:
        """The first part: the momentum ``buf`` takes ``grad``, and ``out`` (may be ``grad``)
        the update before orthogonalisation."""
        group = self.param_groups[group_index]
        mu = group["momentum"]
        buf.lerp_(grad, 1 - mu)
        if group["nesterov"]:
            torch.lerp(grad, buf, mu, out=out)
        else:
            out.copy_(buf)

    def orthogonalizer(self, group_index: int) -> Callable[[Tensor], Tensor]:
        """The second part, for a layout's ``orthogonalize``: Newton-Schulz of a batch of
        matrices of one shape, in ``ns_dtype``, returned in their dtype."""
        group = self.param_groups[group_index]
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(group["ns_dtype"] or "")

        def orthogonalized(matrices: Tensor) -> Tensor:
            work = matrices.to(dtype) if dtype is not None else matrices
            out = newton_schulz(work, group["ns_steps"], group["ns_coefficients"], group["ns_eps"])
            return out.to(matrices.dtype)

        return orthogonalized

    def apply_update(
        self, group_index: int, param: Tensor, update: Tensor, runs: list[MatrixRun]
    ) -> None:
        """The last part: over each run of the flat ``param``, the weight decay and the scaled
        orthogonalised ``update`` (laid out like ``param``; consumed). The update is scaled,
        then subtracted: two correctly rounded operations, so a piece of a run (an NVMe
        sub-group) takes the bits it takes within the whole run, whichever of a CPU kernel's
        vector or scalar loops it meets (a multiply-add may round differently in each)."""
        group = self.param_groups[group_index]
        lr = group["muon_lr"] if group["muon_lr"] is not None else group["lr"]
        decay = 1 - lr * group["weight_decay"]
        for start, end, shape in runs:
            piece = param[start:end]
            if decay != 1:
                piece.mul_(decay)
            step = update[start:end]
            step.mul_(lr * update_scale(shape, group["adjust_lr_fn"]))
            piece.sub_(step)

    def _adamw_step(self, group: dict, params: list[Tensor]) -> None:
        adam_step(
            self.state,
            params,
            decoupled=True,
            lr=group["adam_lr"] if group["adam_lr"] is not None else group["lr"],
            betas=group["betas"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
        )


P = TypeVar("P", bound=Tensor)


def muon_groups(
    groups: list[tuple[dict, list[tuple[str, P]]]], shape_of: Callable[[P], Sequence[int]]
) -> tuple[list[tuple[dict, list[tuple[str, P]]]], list[str]]:
    """Each group split into its Muon part and its AdamW part (:func:`uses_muon` on each
    parameter's real shape, ``shape_of``), empty parts dropped; and the Muon parameters' names."""
    out, matrices = [], []
    for hyper, named in groups:
        flags = [uses_muon(n, shape_of(p), p) for n, p in named]
        chosen = [pair for pair, flag in zip(named, flags, strict=True) if flag]
        rest = [pair for pair, flag in zip(named, flags, strict=True) if not flag]
        matrices += [n for n, _ in chosen]
        out += [
            ({**hyper, "use_muon": flag}, part)
            for flag, part in ((True, chosen), (False, rest))
            if part
        ]
    return out, matrices
