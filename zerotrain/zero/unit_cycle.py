"""Stage 3's gather units through forward and backward: gathered before use, released after,
prefetched in the recorded order, kept for a near reuse (zerotrain/zero/gather.py's
``GatheredForUse`` drives them).

[Note: the life of a stage-3 unit]
Between uses a unit's parameters are empty placeholders and only this rank's shard
(``bucket.param_shard``) exists. Before the unit's module runs forward its buckets are
all-gathered into fresh full buffers and every parameter's ``.data`` is pointed into them; after
the forward they are released again (``.data`` back to the placeholder). Autograd saved the
parameter *objects*, not their storage, so a hook on the module's outputs re-gathers the unit
just before its backward runs; once every gradient of a bucket has been handed to the reducer
the unit is released. The root unit stays gathered from the start of the forward to the end of
the backward (and is gathered again for a retained graph's second backward). Units smaller than
the persistence threshold are never released: their shard is a view of a full buffer that the
optimizer step refreshes, as in stages 1-2.

[Note: frozen parameters at stage 3]
Frozen parameters (a LoRA fine-tune's base model) are partitioned too, or stage 3 would not fit
the models it is for: each unit packs its floating-point frozen parameters into *frozen buckets*
that are gathered and released with the unit's trainable buckets, but that no reduction, store
or optimizer sees. One thing changes in the life cycle: backward reads a frozen weight to
compute the gradient of the unit's input (``W^T g``), and autograd may run that after every
trainable gradient of the unit has arrived (a LoRA adapter's come first). So the forward
pre-hook of a unit with frozen buckets passes the inputs that need gradients through an
identity function (:class:`_InputGradsDone`, as FSDP2 does for its post-backward), whose
backward runs once this unit's backward has produced their gradients, and the unit is released
only after that too. Each backward use of the unit (a retained graph's second backward
included) holds it once; a recomputation whose first forward ran without grad (reentrant
checkpointing) wraps its own inputs, as its backward follows at once.

Prefetch: the order in which units are gathered is recorded on the first step (forward and
backward separately; forwards without grad, which have no backward, are left out). Later,
gathering the unit at position k also issues the gathers of the next units in that order, up to
``prefetch_numel`` elements, as long as the live gathered total stays within ``max_live_numel``.
A forward without grad releases, at its end, what it prefetched. Every rank records the same
order when every rank runs the same modules, which stage 3 requires (as FSDP does): gathers are
collectives.

Reuse: from the recorded order, each forward use of a unit knows its reuse distance, the
elements gathered between the end of that forward and the unit's next use (DeepSpeed's
``stage3_max_reuse_distance``). A unit whose reuse distance is within ``max_reuse_numel`` is
kept gathered, if the live total allows, instead of being released and gathered again: the last
blocks of the forward are the first of the backward. With DeepSpeed's defaults a small model is
gathered once per step; lower the bounds to trade that traffic for memory.

Recomputation: activation checkpointing (zerotrain.checkpointing, or torch.utils.checkpoint
directly) runs a region's forward again inside the backward, and with it the hooks of the units
the region calls. Such a forward gathers its unit for immediate use and nothing else: it neither
records nor advances the order, nor releases the unit afterwards (the hook on the first
forward's outputs and the reducer do that, as without checkpointing).

[Note: stage 3 under torch.compile]
``model.compile()`` compiles ``Module._call_impl``, forward hooks included, so dynamo would trace
the gatherer's forward hooks. It turns their ``param.data = ...`` into ``aten.set_`` on graph
inputs, which AOTAutograd replays as real in-place ops: the version counter of a parameter that
an earlier compiled region saved for backward moves, and backward fails with "modified by an
inplace operation". (It would also cut the collectives and the bookkeeping into small graphs,
recompiled per parameter shape.) The hooks therefore run eagerly (``torch.compiler.disable``,
as FSDP2 does with its own): dynamo breaks the graph at each hook and compiles the module code
between them, which only ever sees gathered parameters. Eager ``.data`` assignment keeps the
version counter, a gather writes a fresh buffer (never one that parameters saved for backward
view), and AOTAutograd saves the parameter objects, so backward finds them re-gathered as
without compile. The multi-grad and reducer hooks run in the autograd engine, outside dynamo;
compiled autograd, which would trace them, is not supported.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch import nn

from zerotrain.comm import Communicator
from zerotrain.zero.in_flight import BucketGathers
from zerotrain.zero.init import ZeroParamStatus, mark_partitioned
from zerotrain.zero.layout import FlatBucket, point_params_at


class UnitState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"  # all-gather issued (prefetch), not yet waited on
    GATHERED = "gathered"


_DS_STATUS = {
    UnitState.SHARDED: ZeroParamStatus.NOT_AVAILABLE,
    UnitState.GATHERING: ZeroParamStatus.INFLIGHT,
    UnitState.GATHERED: ZeroParamStatus.AVAILABLE,
}


@dataclass
class GatherUnit:
    """One module subtree's parameters: the trainable ones as one or more buckets (one per
    optimizer group), the frozen ones in ``frozen`` buckets (see [Note: frozen parameters at
    stage 3])."""

    index: int
    module: nn.Module
    buckets: list[FlatBucket]
    is_root: bool
    persistent: bool
    frozen: list[FlatBucket] = field(default_factory=list)
    state: UnitState = UnitState.SHARDED
    buckets_left: int = 0  # buckets whose gradients have not all arrived this backward
    # frozen buckets only: forward uses whose inputs were wrapped (see _InputGradsDone), and
    # backward uses still to produce their input gradients
    wrapped_uses: int = 0
    inputs_left: int = 0

    @property
    def all_buckets(self) -> list[FlatBucket]:
        return self.buckets + self.frozen

    @property
    def numel(self) -> int:
        return sum(b.numel_padded for b in self.all_buckets)

    def set_status(self, state: UnitState) -> None:
        """The unit's state, mirrored on its parameters' DeepSpeed ``ds_status``."""
        self.state = state
        status = _DS_STATUS[state]
        for bucket in self.all_buckets:
            for slot in bucket.slots:
                # pyrefly: ignore[missing-attribute] (a DeepSpeed attribute torch does not declare)
                slot.param.ds_status = status


class _InputGradsDone(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once the unit's own backward has produced
    their gradients (as FSDP2's post-backward function): then ``done`` (see [Note: frozen
    parameters at stage 3])."""

    @staticmethod
    def forward(ctx, done, *tensors):
        ctx.done = done
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.done()
        return (None, *grads)


class ParameterGatherer:
    """Runs the stage-3 unit life cycle through module hooks (see the note above)."""

    def __init__(
        self,
        units: list[GatherUnit],
        comm: Communicator,
        gathers: BucketGathers,
        *,
        prefetch_numel: int,
        max_live_numel: int,
        max_reuse_numel: int = 0,
    ):
        self.units = units
        self.comm = comm
        self.in_flight = gathers
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.max_reuse_numel = max_reuse_numel
        self._keep_after_forward: list[bool] = []  # per recorded forward position
        self._kept: list[GatherUnit] = []  # gathered for a later reuse, not in use now
        self.live_numel = 0
        self.max_live_numel_seen = 0  # high-water mark of gathered elements
        self.prefetched = 0  # gathers issued ahead of use
        self.gathers = 0  # all gathers issued (per unit)
        self._placeholders: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self._order: dict[str, list[int]] = {"forward": [], "backward": []}
        self._recorded = False
        self._cursor = {"forward": 0, "backward": 0}
        self._records_forward = True  # whether this forward's uses enter the recorded order
        self._wrapped_now = False  # the unit whose forward runs now had its inputs wrapped
        for unit in units:
            unit.buckets_left = len(unit.buckets)
            for bucket in unit.all_buckets:
                for slot in bucket.slots:
                    mark_partitioned(
                        slot.param, slot.shape, comm.world_size, _DS_STATUS[unit.state]
                    )
            if unit.persistent:  # its full buffer exists already, and its shard views it
                for bucket in unit.all_buckets:
                    point_params_at(bucket)
                unit.set_status(UnitState.GATHERED)
                self.live_numel += unit.numel
            else:
                self._point_at_placeholders(unit)
            # Eager even in a compiled model: [Note: stage 3 under torch.compile]. Wrapped here,
            # not at import: torch.compiler.disable imports dynamo (seconds), which torch.optim's
            # constructors do anyway but `import zerotrain` should not.
            eager = torch.compiler.disable
            if unit.is_root:
                unit.module.register_forward_pre_hook(eager(self._root_pre_forward))
                unit.module.register_forward_hook(eager(self._root_post_forward))
            else:
                unit.module.register_forward_pre_hook(
                    eager(lambda m, args, kwargs, u=unit: self._pre_forward(u, args, kwargs)),
                    with_kwargs=True,
                )
                unit.module.register_forward_hook(
                    eager(lambda m, args, out, u=unit: self._post_forward(u, out))
                )
        self._unit_of_bucket = {id(b): u for u in units for b in u.all_buckets}

    # -- gather / release ----------------------------------------------------------------------
    def _issue(self, unit: GatherUnit) -> None:
        if unit.state is not UnitState.SHARDED:
            return
        for bucket in unit.all_buckets:
            bucket.flat_param = torch.empty(
                bucket.numel_padded, dtype=bucket.dtype, device=bucket.device
            )
            self.in_flight.issue(bucket)
        unit.set_status(UnitState.GATHERING)
        self.gathers += 1
        self.live_numel += unit.numel
        self.max_live_numel_seen = max(self.max_live_numel_seen, self.live_numel)

    def _wait(self, unit: GatherUnit) -> None:
        if unit.state is not UnitState.GATHERING:
            return
        self.in_flight.wait(unit.all_buckets)
        for bucket in unit.all_buckets:
            point_params_at(bucket)
        unit.set_status(UnitState.GATHERED)

    def _gather_now(self, unit: GatherUnit) -> None:
        self._issue(unit)
        self._wait(unit)

    def release(self, unit: GatherUnit) -> None:
        """Drop the unit's full parameters (no-op for persistent units)."""
        if unit in self._kept:
            self._kept.remove(unit)
        if unit.persistent or unit.state is UnitState.SHARDED:
            return
        self._wait(unit)  # never free a buffer a collective is still writing
        self._point_at_placeholders(unit)
        for bucket in unit.all_buckets:
            bucket.flat_param = None
        unit.set_status(UnitState.SHARDED)
        self.live_numel -= unit.numel

    def _point_at_placeholders(self, unit: GatherUnit) -> None:
        for bucket in unit.all_buckets:
            key = (bucket.dtype, bucket.device)
            if key not in self._placeholders:
                self._placeholders[key] = torch.empty(0, dtype=bucket.dtype, device=bucket.device)
            for slot in bucket.slots:
                slot.param.data = self._placeholders[key]

    # -- prefetch ------------------------------------------------------------------------------
    def _make_room(self, unit: GatherUnit) -> None:
        """Release units kept for reuse until gathering ``unit`` fits the live bound; the
        earliest kept is reused last (backward runs in reverse), so it goes first."""
        if unit in self._kept:
            self._kept.remove(unit)
        if unit.state is not UnitState.SHARDED:
            return
        while self._kept and self.live_numel + unit.numel > self.max_live_numel:
            self.release(self._kept.pop(0))

    def _use(self, unit: GatherUnit, phase: str) -> None:
        """Gather ``unit`` for immediate use in ``phase`` and prefetch what follows it."""
        self._make_room(unit)
        self._issue(unit)  # before any prefetch: the live bound counts the unit in use first
        order = self._order[phase]
        if not self._recorded:
            if phase == "backward" or self._records_forward:
                order.append(unit.index)
        else:
            cursor = self._cursor[phase]
            if cursor < len(order) and order[cursor] == unit.index:
                self._cursor[phase] = cursor + 1
                self._prefetch(order[cursor + 1 :])
            else:  # the order changed (e.g. control flow): stop prefetching this step
                self._cursor[phase] = len(order)
        self._wait(unit)

    def _prefetch(self, upcoming: list[int]) -> None:
        budget = self.prefetch_numel
        for index in upcoming:
            unit = self.units[index]
            if unit.state is not UnitState.SHARDED:
                continue
            if unit.numel > budget or self.live_numel + unit.numel > self.max_live_numel:
                self.in_flight.read_ahead(unit.all_buckets)  # the next to gather: start its reads
                return
            self._issue(unit)
            self.prefetched += 1
            budget -= unit.numel

    def _reused_soon(self, position: int) -> bool:
        """Whether the unit used at recorded forward ``position`` should stay gathered."""
        if not self._recorded or not 0 <= position < len(self._keep_after_forward):
            return False
        return self._keep_after_forward[position] and self.live_numel <= self.max_live_numel

    def _plan_reuse(self) -> None:
        """After the recording step: which forward uses are followed soon by another use."""
        uses = self._order["forward"] + self._order["backward"]
        numel = [self.units[u].numel for u in uses]
        keep = []
        for position, unit in enumerate(self._order["forward"]):
            following = uses[position + 1 :]
            if unit not in following:
                keep.append(False)
                continue
            distance = sum(numel[position + 1 : position + 1 + following.index(unit)])
            keep.append(distance <= self.max_reuse_numel)
        self._keep_after_forward = keep

    # -- hooks ---------------------------------------------------------------------------------
    def _root_pre_forward(self, module, args) -> None:
        if _recomputing():  # the root is gathered until the end of the backward
            return
        self._cursor = {"forward": 0, "backward": 0}  # a new forward (training or eval)
        # the recorded order is a training step's: a forward without grad has no backward
        self._records_forward = torch.is_grad_enabled()
        self._use(self.units[-1], "forward")

    def _root_post_forward(self, module, args, output) -> None:
        if _recomputing():
            return
        if not torch.is_grad_enabled():  # no backward will follow: release the units in use,
            for unit in self.units:  # and those prefetched for a use that did not come
                self.release(unit)
            return
        tensors = [t for t in pytree.tree_leaves(output) if torch.is_tensor(t) and t.requires_grad]
        if tensors:  # a second backward of a retained graph finds the root released: gather it
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda grads: self._gather_now(self.units[-1]), mode="any"
            )

    def _pre_forward(self, unit: GatherUnit, args, kwargs):
        if _recomputing():  # see "Recomputation" in the note above
            self._make_room(unit)
            self._gather_now(unit)
            if unit.frozen and not unit.wrapped_uses:
                # the first forward ran without grad (reentrant checkpointing): this
                # recomputation's backward is the unit's, and it starts now
                wrapped = self._wrap_inputs(unit, args, kwargs)
                if wrapped is not None:
                    unit.inputs_left += 1
                return wrapped
            return None
        self._use(unit, "forward")
        if unit.frozen and torch.is_grad_enabled():
            wrapped = self._wrap_inputs(unit, args, kwargs)
            unit.wrapped_uses += wrapped is not None
            self._wrapped_now = wrapped is not None  # for the post-forward of this call
            return wrapped
        return None

    def _wrap_inputs(self, unit: GatherUnit, args, kwargs):
        """``(args, kwargs)`` with the tensors that need gradients passed through
        :class:`_InputGradsDone` for ``unit``; None when none needs them."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        needing = [i for i, t in enumerate(leaves) if torch.is_tensor(t) and t.requires_grad]
        if not needing:
            return None

        def done(u=unit) -> None:
            u.inputs_left = max(0, u.inputs_left - 1)
            self._release_after_backward(u)

        wrapped = _InputGradsDone.apply(done, *(leaves[i] for i in needing))
        for i, tensor in zip(needing, wrapped, strict=True):
            leaves[i] = tensor
        return pytree.tree_unflatten(leaves, spec)

    def _post_forward(self, unit: GatherUnit, output) -> None:
        if _recomputing():
            return
        if not torch.is_grad_enabled():  # no backward will follow
            self.release(unit)
            return
        if self._reused_soon(self._cursor["forward"] - 1):
            self._kept.append(unit)
        else:
            self.release(unit)
        tensors = [t for t in pytree.tree_leaves(output) if torch.is_tensor(t) and t.requires_grad]
        wrapped, self._wrapped_now = self._wrapped_now, False
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda grads, u=unit: self._begin_backward(u, wrapped), mode="any"
            )

    def _begin_backward(self, unit: GatherUnit, inputs_wrapped: bool) -> None:
        """Backward reached one forward use of ``unit``: gather it, and where that use's inputs
        were wrapped, hold it until their gradients are computed (_InputGradsDone)."""
        if inputs_wrapped:
            unit.inputs_left += 1
        self._use(unit, "backward")

    def _release_after_backward(self, unit: GatherUnit) -> None:
        if unit.buckets_left == 0 and unit.inputs_left == 0 and not unit.is_root:
            self.release(unit)

    # -- driven by the reducer and the optimizer ------------------------------------------------
    def bucket_grads_taken(self, bucket: FlatBucket) -> None:
        """All of ``bucket``'s gradients are with the reducer: release its unit once complete."""
        unit = self._unit_of_bucket[id(bucket)]
        unit.buckets_left -= 1
        self._release_after_backward(unit)

    def finish_backward(self) -> None:
        """End of a micro-step's backward: release every unit, reset per-step state."""
        for unit in self.units:
            self.release(unit)
            unit.buckets_left = len(unit.buckets)
            unit.wrapped_uses = unit.inputs_left = 0
        if not self._recorded:
            self._recorded = True
            self._plan_reuse()

    def refresh_persistent(self) -> None:
        """After an optimizer step: start bringing persistent units' full buffers up to date
        (each unit's next use waits for its own; see [Note: waiting for parameters] in
        gather.py), and drop any other unit still gathered (a backward this engine did not
        run, e.g. another engine's loss through this model, gathers without releasing): its
        values predate the step, so its next use must gather again."""
        for unit in self.units:
            if not unit.persistent:
                self.release(unit)
            unit.buckets_left = len(unit.buckets)
            unit.wrapped_uses = unit.inputs_left = 0
        for unit in self.units:
            if unit.persistent:
                for bucket in unit.buckets:
                    self.in_flight.issue(bucket)
                unit.set_status(UnitState.GATHERING)

    def wait_all(self) -> None:
        """Complete every gather in flight (prefetched units, persistent refreshes)."""
        for unit in self.units:
            self._wait(unit)

    def gather(self, unit: GatherUnit) -> None:
        """Gather ``unit`` now, outside the hooks (pair with :meth:`release`)."""
        self._gather_now(unit)

    def unit_of(self, bucket: FlatBucket) -> GatherUnit:
        return self._unit_of_bucket[id(bucket)]


def _recomputing() -> bool:
    """Whether a module forward runs inside a backward pass: activation checkpointing's
    recomputation. (torch.utils.checkpoint asks autograd the same question.)"""
    return torch._C._current_graph_task_id() != -1
