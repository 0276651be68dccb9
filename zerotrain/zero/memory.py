"""Model-state memory: the ZeRO formula for what a rank holds, as zerotrain allocates it.

# [Note: model states]
ZeRO (arXiv:1910.02054) §5: with Ψ trainable parameters on N ranks one rank holds
p·Ψ/N_p + g·Ψ/N_g + (m + s)·Ψ/N_o bytes of model states: p and g bytes per parameter and
gradient element, m for a separate fp32 master copy, s for the optimizer's state (Adam: m and v,
8), and N_x = N where the stage partitions that state (optimizer states from stage 1, gradients
from 2, parameters at 3), else 1. This is what zerotrain allocates (zerotrain/zero/optimizer.py,
measured by ``memory_breakdown()`` in tests/test_estimate.py). Where it differs from the paper:
- fp32 training has no master copy: the optimizer steps the parameters themselves (m = 0), so
  Adam costs 4 + 4 + 8 = 16 bytes per parameter, not the paper's 4 + 4 + 12. Quantized
  parameter gathers (comm_compression.parameters) write dequantized values into the
  parameters, so there the masters are a copy again (m = 4).
- 16-bit training (bf16, fp16): parameters and gradients in the training dtype (gradients are
  reduced in it too), fp32 masters: 2 + 2 + (4 + 8) = 16, as in the paper. With
  ``data_types.grad_accum_dtype: fp32`` (bf16, fp16) the gradient buffers are fp32, g = 4, and the
  step takes them as they are: no step transient ([Note: fp32 gradient accumulation] in
  zerotrain/zero/reduce.py).
- bf16 masters (``bf16.bf16_master_weights_and_grads``) and optimizer state
  (``bf16_optimizer_states``): m is the masters' bytes, 0 where they are the bf16 parameters
  themselves, and s is scaled to the state's dtype (Adam: 8 -> 4); with both, 2 + 2 + 4 = 8
  bytes per parameter. The step's fp32 copies of one bucket at a time are a transient not
  counted ([Note: low-precision masters and states] in zerotrain/zero/low_precision.py).
- Stage 3 keeps units smaller than ``stage3_param_persistence_threshold`` whole on every rank.
- Frozen parameters have no gradient and no state; stage 3 partitions them (p/N bytes each,
  but in persistent units), the other stages keep them whole. They are counted apart:
  ``memory_breakdown()["frozen"]``, not in the formula's total.
- Left out, a few bytes: each bucket is padded to a multiple of N (< N elements per bucket), and
  Adam keeps a 4-byte step counter per master tensor (one per bucket).

Two transients come on top, at different moments of a step:
- *step*: in 16-bit training the step casts the reduced gradient partition of every bucket to
  fp32 (4·Ψ/N_o) for the optimizer, and frees it after the step. DeepSpeed's estimator counts
  such an fp32 gradient partition as always there (the 4 in its "18 bytes per parameter").
- *gathered* (stage 3, during forward and backward): the units gathered at once. zerotrain's
  gatherer (zerotrain/zero/unit_cycle.py) prefetches and keeps units for reuse only while the live
  total stays within ``stage3_max_live_parameters``, and always gathers the unit in use next to
  the root unit (embeddings, head), so at most max(min(max_live, Ψ), root + largest block)
  elements are gathered, persistent units included.
Not counted: the gradient bucket being reduce-scattered at stages 2-3 (up to
``reduce_bucket_size`` elements of the training dtype; stages 0-1 reduce in place), autograd's
``param.grad`` of a unit before the reducer copies it, kernel workspaces, the CUDA context and
the allocator's fragmentation.

Offload (zerotrain/zero/offload.py) moves the fp32 masters, the optimizer state and an fp32
gradient of the offloaded share of the optimizer's part to the host: (4 + s + 4)·Ψ/N_o per
rank there (``offloaded``), as DeepSpeed's ZeRO-Offload does, plus a ring of ``buffer_count``
buffers of one bucket in the training dtype that carries parameters back (``staging``, not in
the formula). The device keeps the rest; with ``offload_params`` (stage 3's offload_param) the
parameter shards, p·Ψ/N, are on the host too. ``zerotrain estimate --offload`` reports the host
bytes with the preflight's own functions (offload.host_bytes, nvme.staging_host_bytes), ring
included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from zerotrain.optim.state_bytes import OPTIMIZER_STATE_BYTES, optimizer_state_bytes_per_element
from zerotrain.precision import PrecisionPolicy

if TYPE_CHECKING:
    from zerotrain.zero.group import ShardGroup
    from zerotrain.zero.policy import ZeroPolicy


@dataclass(frozen=True, kw_only=True)
class ModelStateBytes:
    """Bytes of model states one rank holds (see [Note: model states])."""

    parameters: float
    """Trainable parameters in the training dtype, on the device."""
    gradients: float
    """Gradients in the training dtype, on the device."""
    optimizer_states: float
    """fp32 masters that are separate copies, plus the optimizer's state, on the device."""
    step_grads: float = 0.0
    """Transient: the fp32 copy of the reduced gradient partition during the optimizer step."""
    offloaded: float = 0.0
    """Moved off the device by offload, per rank: in CPU memory or on NVMe."""

    @property
    def total(self) -> float:
        """Parameters + gradients + optimizer states on the device."""
        return self.parameters + self.gradients + self.optimizer_states


def model_state_bytes(
    num_params: float,
    *,
    world_size: int,
    policy: ZeroPolicy,
    precision: PrecisionPolicy,
    optimizer_state_bytes: float = OPTIMIZER_STATE_BYTES["adam"],
    persistent_numel: float = 0,
    offload: float = 0.0,
    offload_params: bool = False,
    master_copy: bool | None = None,
) -> ModelStateBytes:
    """ZeRO's p·Ψ/N_p + g·Ψ/N_g + (m + s)·Ψ/N_o for ``num_params`` trainable elements, as
    zerotrain allocates them (see [Note: model states]).

    ``policy`` says what is partitioned; ``persistent_numel`` elements (stage 3's units below the
    persistence threshold) stay whole. ``offload``: the share of the optimizer's part whose
    masters and state (and an fp32 gradient) are on the host, in ``offloaded``;
    ``offload_params``: stage 3's parameter shards are there too. ``master_copy``: whether
    the fp32 masters are a copy of their own (None: in 16-bit training; a quantized parameter
    gather needs one in fp32 training too).
    """
    psi, n = float(num_params), world_size
    p = precision.param_dtype.itemsize
    g = precision.grad_dtype.itemsize
    master_copy = precision.has_master_copy if master_copy is None else master_copy
    m = precision.master_dtype.itemsize if master_copy else 0
    s = precision.stored_state_bytes(optimizer_state_bytes)
    n_p = n if policy.shard_parameters else 1
    n_g = n if policy.shard_gradients else 1
    n_o = n if policy.shard_optimizer_states else 1
    whole = min(float(persistent_numel), psi) if policy.shard_parameters else 0.0
    parameters = p * (whole + (psi - whole) / n_p)
    gradients = g * psi / n_g
    on_device = (psi / n_o) * (1.0 - offload)
    on_host = (psi / n_o) * offload
    # The host steps masters (a copy even in fp32 training) with gradients in their dtype.
    offloaded = (2 * precision.master_dtype.itemsize + s) * on_host
    if offload_params and policy.shard_parameters:  # shards on the host between gathers
        offloaded += p * (psi - whole) / n
        parameters = p * whole
    return ModelStateBytes(
        parameters=parameters,
        gradients=gradients,
        optimizer_states=(m + s) * on_device,
        # a 16-bit gradient cast to the masters' dtype for the step (buffers in it are taken
        # as they are)
        step_grads=(
            precision.master_dtype.itemsize * on_device
            if precision.grad_dtype != precision.master_dtype
            else 0.0
        ),
        offloaded=offloaded,
    )


def measured_model_states(group: ShardGroup) -> dict[str, int]:
    """Bytes of model states ``group`` holds on this rank, from the allocated storage (each
    storage once): ``parameters``, ``gradients``, ``optimizer_states`` (fp32 masters that are
    separate copies, plus the optimizer's state) and their ``total``, on the device; and off it
    ``offloaded`` (host masters, state and gradients, parameter shards), ``staging`` (the host
    buffers that carry data to and from the device or disk) and ``disk`` (NVMe working files).
    Frozen parameters are not model states of the formula: ``frozen`` counts theirs apart,
    wherever they are (whole, or stage 3's shards and gathered buffers, on the device or the
    host). ``compression`` counts what communication compression keeps between steps (a
    gradient codec's error feedback and low-rank factors, hpZ's secondary partition, 0/1 Adam's
    local-step windows), also apart; ``sites`` what the sites' outer steps keep (the anchor and
    the outer momentum)."""
    seen: set[int] = set()

    def nbytes(tensors) -> int:
        total = 0
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    store = group.store
    frozen = nbytes(group.residency.frozen_tensors())
    # then what is off the device (nbytes counts each storage once): the rest is on it
    offloaded = nbytes(store.offloaded_tensors()) + nbytes(group.residency.host_param_tensors())
    params = nbytes(group.residency.param_tensors())
    grads = nbytes(group.reduction.grad_buffers())
    optim = nbytes(store.held_tensors())
    return {
        "parameters": params,
        "gradients": grads,
        "optimizer_states": optim,
        "total": params + grads + optim,
        "offloaded": offloaded,
        "frozen": frozen,
        "compression": nbytes(group.reduction.codec.state_tensors())
        + nbytes(group.residency.secondary_tensors())
        + nbytes(group.extension_tensors("compression")),
        "sites": nbytes(group.extension_tensors("sites")),
        "staging": store.staging_bytes(),
        "disk": store.disk_bytes() + group.residency.home.disk_bytes(),
    }


def memory_breakdown(
    groups: list[ShardGroup], policy: ZeroPolicy, precision: PrecisionPolicy
) -> dict[str, float]:
    """Bytes of model states this rank holds in ``groups``, measured from the allocated
    tensors: ``parameters``/``gradients``/``optimizer_states`` (fp32 masters that are separate
    copies plus the optimizer's state) and their ``total``; ``formula_total`` is the ZeRO
    paper's figure for the same job (arXiv:1910.02054 §5: 16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N in mixed
    precision with Adam), each group over its own ranks (stage 3 keeps units below the
    persistence threshold whole: those count p·Ψ_persistent)."""
    measured: dict[str, float] = {}
    for group in groups:
        for key, value in measured_model_states(group).items():
            measured[key] = measured.get(key, 0) + value
    formulas = [_formula(group, policy, precision) for group in groups]
    return {
        **measured,
        "formula_total": sum(f.total for f in formulas),
        "formula_offloaded": sum(f.offloaded for f in formulas),
    }


def _formula(group: ShardGroup, policy: ZeroPolicy, precision: PrecisionPolicy) -> ModelStateBytes:
    """:func:`model_state_bytes` for ``group`` over its own ranks."""
    store = group.store
    numels = store.master_numels()
    return model_state_bytes(
        group.num_params,
        world_size=group.comm.world_size,
        policy=policy,
        precision=precision,
        optimizer_state_bytes=optimizer_state_bytes_per_element(store.optimizer),
        persistent_numel=group.residency.persistent_numel,
        offload=store.offloaded_numel() / max(1, sum(numels)),
        offload_params=group.residency.home.on_host,
        # quantized parameter gathers keep exact masters apart (compression/gather.py)
        master_copy=precision.has_master_copy or group.residency.in_flight.gather.lossy,
    )
