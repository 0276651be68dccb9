"""Masters and optimizer state stored narrower than fp32, stepped in fp32.

[Note: low-precision masters and states]
DeepSpeed's ``bf16_master_weights_and_grads`` keeps the masters (and the gradients the optimizer
reads) in bf16, its ``bf16_optimizer_states`` the optimizer's per-element state (Adam's m and v).
Where the masters are bf16 in bf16 training they are the model's own parameters: no copy. The
update itself is computed in fp32: for one bucket at a time, the store's master, its gradient
and its state are widened to fp32, the torch optimizer steps them, and the results are rounded
back into the narrow storage. So any element-wise optimizer works unchanged, the transient is
one bucket's fp32 copies, and a step is what a single process computes with the same storage
(tests/test_precision_policies.py). The tensors an optimizer's step is collective over (Lamb's
every bucket, Muon's matrices) are widened together for their one step.

Rounding to nearest loses an update smaller than half a bf16 step of the weight (2^-8 relative):
late in training, with small learning rates, bf16 masters stall. Stochastic rounding (Gupta et
al., arXiv:1502.02551; Zamirai et al., arXiv:2010.06192) rounds up with the probability of the
remainder, so the expected stored value is the exact one. Its random bits are drawn from a
generator seeded with a checksum of the value being rounded and the bucket's index: the same
state gives the same rounding, so a resumed run rounds as the uninterrupted one, and nothing is
saved for it. It applies to the masters; the state is rounded to nearest (the moments are
averages, not sums of small increments).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from zerotrain.optim.muon import MatrixRun, Muon
from zerotrain.precision import PrecisionPolicy

__all__ = ["LowPrecisionSteps", "copy_into", "gradients_only", "round_stochastically"]


def round_stochastically(value: torch.Tensor, into: torch.Tensor, seed: int) -> None:
    """``into`` (bf16) takes fp32 ``value`` rounded stochastically: up (in magnitude) with the
    probability of the part below bf16's last bit, so the expected result is ``value``."""
    bits = value.contiguous().view(torch.int32)
    generator = torch.Generator(device=value.device).manual_seed(seed)
    noise = torch.randint(
        0, 1 << 16, bits.shape, dtype=torch.int32, device=value.device, generator=generator
    )
    # adding to the low bits carries into the mantissa with that probability; a value whose
    # rounding would overflow (the largest finite ones, inf, nan) is left to nearest rounding
    rounded = ((bits + noise) & -65536).view(torch.float32)  # -65536 = 0xFFFF0000
    rounded = torch.where(torch.isfinite(rounded), rounded, value)
    into.copy_(rounded.view_as(into))


def _checksum(value: torch.Tensor) -> int:
    return int(value.view(torch.int32).sum(dtype=torch.int64).item()) & 0x7FFFFFFF


class LowPrecisionSteps:
    """Steps a torch optimizer over masters whose storage (or whose state's) is narrower than
    fp32, bucket by bucket, in fp32 (see [Note: low-precision masters and states])."""

    def __init__(self, precision: PrecisionPolicy):
        self.precision = precision

    @property
    def active(self) -> bool:
        return self.precision.narrow_optimizer

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        masters: Sequence[torch.Tensor],
        *,
        indices: Sequence[int] | None = None,
    ) -> None:
        """``optimizer.step()`` over ``masters`` (those with a gradient): one bucket at a time,
        but the tensors whose update is collective (:func:`stepped_together`) in one step.
        ``indices``: each master's bucket index (default: their positions), which salts
        stochastic rounding."""
        if not self.active:
            optimizer.step()
            return
        positions = range(len(masters)) if indices is None else indices
        indexed = [(i, m) for i, m in zip(positions, masters, strict=True) if m.grad is not None]
        together = stepped_together(optimizer)
        rounds = [[(i, m) for i, m in indexed if id(m) in together]]
        rounds += [[(i, m)] for i, m in indexed if id(m) not in together]
        for chosen in filter(None, rounds):
            stepped = [m for _, m in chosen]
            if isinstance(optimizer, Muon) and id(stepped[0]) in together:
                self._step_muon(optimizer, chosen)
                continue
            with gradients_only(masters, stepped), self._widened(optimizer, chosen):
                optimizer.step()

    # Muon's matrices are stepped together (their update is collective), but widening them all
    # at once would hold 12 bytes per element in fp32 (master, gradient, momentum) for the
    # step: its three parts (optim/muon.py) are widened tensor by tensor instead, and only the
    # updates are fp32 together, for the exchange. The arithmetic, and so the bits, are the
    # same. NVMe offload steps sub-groups through the same two calls (zero/nvme.py).
    def _step_muon(self, muon: Muon, chosen: list[tuple[int, torch.Tensor]]) -> None:
        for group_index, group in enumerate(muon.param_groups):
            mine = {id(p) for p in group["params"]}
            masters = [(i, m) for i, m in chosen if id(m) in mine]
            if not group["use_muon"] or not masters:
                continue
            layout = muon.layout(group_index)
            updates = {}
            for _, master in masters:
                buf = muon.momentum_buffer(master, self.precision.state_dtype)
                update = torch.empty_like(master, dtype=torch.float32)
                grad = master.grad
                assert grad is not None
                self.prepare_muon(muon, group_index, grad, buf, update)
                updates[master] = update
            layout.orthogonalize(updates, muon.orthogonalizer(group_index))
            for index, master in masters:
                runs = layout.runs(master)
                self.apply_muon(
                    muon, group_index, master.view(-1), updates[master].view(-1), runs, index
                )

    def prepare_muon(
        self, muon: Muon, group_index: int, grad: torch.Tensor, buf: torch.Tensor, out: torch.Tensor
    ) -> None:
        """Muon's first part in fp32: the momentum ``buf`` (as stored, rounded back to
        nearest as the other states) takes ``grad``, and ``out`` (fp32; may be ``grad``) the
        update."""
        wide_buf, wide_grad = buf.float(), grad.float()
        muon.prepare_update(group_index, wide_grad, wide_buf, wide_grad)
        copy_into(buf, wide_buf)
        copy_into(out, wide_grad)

    def apply_muon(
        self,
        muon: Muon,
        group_index: int,
        master: torch.Tensor,
        update: torch.Tensor,
        runs: list[MatrixRun],
        index: int,
    ) -> None:
        """Muon's last part on the flat ``master`` (bucket ``index``'s, or a piece of it) with
        its orthogonalised fp32 ``update``, in fp32, rounded back as :meth:`round_into`."""
        wide = master.float()
        muon.apply_update(group_index, wide, update, runs)
        if wide is not master:
            self.round_into(wide, master, index)

    @contextmanager
    def _widened(
        self, optimizer: torch.optim.Optimizer, masters: list[tuple[int, torch.Tensor]]
    ) -> Iterator[None]:
        """While inside: each master, its gradient and its state are fp32 copies; after, the
        values are rounded back into the narrow storage (the state in ``state_dtype``)."""
        narrow = []
        for _, master in masters:
            storage, grad = master.data, master.grad
            assert grad is not None
            master.data = storage.float()
            master.grad = grad.float()
            state = optimizer.state.get(master, {})
            kept = {k: v for k, v in state.items() if _per_element(v, storage)}
            for key, value in kept.items():
                state[key] = value.float()
            narrow.append((storage, grad, kept))
        try:
            yield
        finally:
            for (index, master), (storage, grad, kept) in zip(masters, narrow, strict=True):
                self.round_into(master.data, storage, index)
                master.data = storage
                master.grad = grad
                state = optimizer.state.get(master, {})
                for key, value in list(state.items()):
                    if not _per_element(value, storage):
                        continue
                    target = kept.get(key)
                    if target is None or target.dtype != self.precision.state_dtype:
                        target = torch.empty_like(storage, dtype=self.precision.state_dtype)
                    target.copy_(value)  # to nearest
                    state[key] = target

    def round_into(self, wide: torch.Tensor, storage: torch.Tensor, index: int) -> None:
        """``storage`` (a master) takes the fp32 ``wide``: to nearest, or stochastically where
        the policy says so (``index``: its bucket's, which salts the random bits)."""
        if storage.dtype == torch.float32:
            storage.copy_(wide)
        elif self.precision.stochastic_rounding and storage.dtype == torch.bfloat16:
            round_stochastically(wide, storage, _checksum(wide) ^ (index * 0x9E3779B1 & 0x7FFFFFFF))
        else:
            storage.copy_(wide)  # to nearest


@contextmanager
def gradients_only(
    masters: Sequence[torch.Tensor], stepped: Sequence[torch.Tensor]
) -> Iterator[None]:
    """While inside, of ``masters`` only ``stepped`` have their gradients (a torch optimizer's
    step leaves tensors without one alone); the others' are given back after."""
    keep = {id(m) for m in stepped}
    held = [(m, m.grad) for m in masters if id(m) not in keep and m.grad is not None]
    for master, _ in held:
        master.grad = None
    try:
        yield
    finally:
        for master, grad in held:
            master.grad = grad


def stepped_together(optimizer: torch.optim.Optimizer) -> set[int]:
    """``id`` of the tensors an optimizer must step in one step, its update being collective
    over them: Muon's matrices (``collective_tensors``), every tensor of another optimizer that
    ``steps_collectively`` (Lamb), none of an element-wise one."""
    if not getattr(optimizer, "steps_collectively", False):
        return set()
    chosen = getattr(optimizer, "collective_tensors", None)
    tensors = (
        chosen() if chosen is not None else [t for g in optimizer.param_groups for t in g["params"]]
    )
    return {id(t) for t in tensors}


def copy_into(target: torch.Tensor, value: torch.Tensor) -> None:
    """``target`` takes ``value`` (shaped like it); nothing to do when they share storage."""
    if value.data_ptr() != target.data_ptr():
        with torch.no_grad():
            target.copy_(value.view_as(target))


def _per_element(value: object, master: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.shape == master.shape
