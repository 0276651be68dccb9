"""Tests for zerotrain.optim: build_optimizer's DeepSpeed semantics and Lamb, plain and on shards."""

from __future__ import annotations

import copy
import itertools
import math
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from torch import Tensor

from zerotrain.config import ConfigError, check_config
from zerotrain.optim import (
    DEEPSPEED_ONLY_OPTIMIZERS,
    OPTIMIZERS,
    FusedAdam,
    Lamb,
    build_optimizer,
)

# Awkward shapes, as in FSDP2's tests; the last one starts at zero (trust ratio 1 on step 1).
SHAPES = [(7, 15), (13,), (5, 3), (4,)]


# Weight scales per shape that make the trust ratio hit max_coeff, min_coeff, neither, and the
# zero-norm case.
CLAMP_SCALES = (30.0, 0.01, 1.0, 0.0)
# The same cases, with the unclamped ratio on the (7, 15) parameter that straddles the shards.
STRADDLE_SCALES = (1.0, 30.0, 0.01, 0.0)


def _params(
    dtype: torch.dtype = torch.float32, seed: int = 0, scales: tuple[float, ...] = CLAMP_SCALES
) -> list[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=dtype) * scale)
        for shape, scale in zip(SHAPES, scales, strict=True)
    ]


def _grads(num_steps: int, dtype: torch.dtype = torch.float32, seed: int = 1) -> list[list[Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(shape, generator=gen, dtype=dtype) for shape in SHAPES]
        for _ in range(num_steps)
    ]


def _run(opt: torch.optim.Optimizer, params: list[Tensor], grads: list[list[Tensor]]) -> None:
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()


# ---------------------------------------------------------------------------------------------
# build_optimizer


@pytest.mark.parametrize(
    ("options", "expected_cls"),
    [({}, torch.optim.AdamW), ({"adam_w_mode": False}, torch.optim.Adam)],
    ids=["default_is_adamw", "adam_w_mode_false_is_l2_adam"],
)
def test_adam_is_deepspeeds_fused_adam_with_torchs_fused_update(
    options: dict[str, Any], expected_cls: type
) -> None:
    """DeepSpeed's "Adam" is its FusedAdam (client code checks isinstance), adam_w_mode=True
    by default: decoupled decay; its update is torch's fused AdamW's (Adam's) bit for bit."""
    params, ref_params = _params(), _params()
    grads = _grads(5)
    opt = build_optimizer(
        "Adam", {"lr": 0.01, "weight_decay": 0.1, **options}, [{"params": params}]
    )
    assert type(opt) is FusedAdam
    assert opt.param_groups[0]["adam_w_mode"] is (expected_cls is torch.optim.AdamW)
    ref = expected_cls(ref_params, lr=0.01, weight_decay=0.1, fused=True)
    _run(opt, params, grads)
    _run(ref, ref_params, grads)
    for p, r in zip(params, ref_params, strict=True):
        assert torch.equal(p, r)


def test_decoupled_and_l2_decay_differ() -> None:
    """Guards the test above: the two modes are distinguishable with these settings."""
    grads = _grads(5)
    results = []
    for options in ({}, {"adam_w_mode": False}):
        params = _params()
        opt = build_optimizer(
            "Adam", {"lr": 0.01, "weight_decay": 0.1, **options}, [{"params": params}]
        )
        _run(opt, params, grads)
        results.append(params[0].detach())
    assert not torch.allclose(results[0], results[1], atol=1e-4)


def test_adamw_is_decoupled_whatever_adam_w_mode_says() -> None:
    opt = build_optimizer("AdamW", {"adam_w_mode": False}, [{"params": _params()}])
    assert type(opt) is FusedAdam and opt.param_groups[0]["adam_w_mode"] is True


@pytest.mark.parametrize(
    "params", [{"torch_adam": True}, {"amsgrad": True}, {"fused": False}, {"foreach": True}]
)
def test_adam_is_torchs_own_where_fused_adam_does_not_serve(params: dict[str, Any]) -> None:
    opt = build_optimizer("AdamW", params, [{"params": _params()}])
    assert type(opt) is torch.optim.AdamW


def test_adam_defaults_are_deepspeeds() -> None:
    opt = build_optimizer("Adam", {}, [{"params": _params()}])
    group = opt.param_groups[0]
    assert group["lr"] == 1e-3
    assert tuple(group["betas"]) == (0.9, 0.999)
    assert group["eps"] == 1e-8
    assert group["weight_decay"] == 0.0  # FusedAdam's default, not torch AdamW's 0.01
    assert group["amsgrad"] is False


def test_torch_adam_keeps_torch_defaults() -> None:
    """torch_adam: DeepSpeed calls torch.optim.AdamW itself, so torch's defaults apply."""
    opt = build_optimizer("Adam", {"torch_adam": True}, [{"params": _params()}])
    assert type(opt) is torch.optim.AdamW
    assert opt.param_groups[0]["weight_decay"] == 0.01
    assert not opt.param_groups[0]["fused"]


@pytest.mark.parametrize("optimizer_type", ["Adam", "AdamW", "SGD"])
def test_fused_kernel_chosen_for_cpu_float_tensors(optimizer_type: str) -> None:
    params = [
        torch.nn.Parameter(torch.randn(3, dtype=dtype)) for dtype in (torch.float32, torch.float64)
    ]
    opt = build_optimizer(optimizer_type, {}, [{"params": params}])
    if optimizer_type == "SGD":
        assert opt.param_groups[0]["fused"] is True
    else:  # FusedAdam, which steps with torch's fused kernel on these tensors
        assert type(opt) is FusedAdam


def test_fused_falls_back_when_a_tensor_is_not_floating_point() -> None:
    params = [
        torch.nn.Parameter(torch.randn(3)),
        torch.nn.Parameter(torch.randn(3, dtype=torch.complex64)),
    ]
    opt = build_optimizer("Adam", {}, [{"params": params}])
    assert not opt.param_groups[0]["fused"]
    with pytest.raises(ValueError, match=r"optimizer\.params\.fused"):
        build_optimizer("Adam", {"fused": True}, [{"params": params}])


def test_fused_false_is_honoured() -> None:
    opt = build_optimizer("AdamW", {"fused": False}, [{"params": _params()}])
    assert not opt.param_groups[0]["fused"]


def test_sgd_momentum_matches_torch() -> None:
    params, ref_params = _params(), _params()
    grads = _grads(5)
    options = {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}
    opt = build_optimizer("SGD", options, [{"params": params}])
    assert type(opt) is torch.optim.SGD
    ref = torch.optim.SGD(ref_params, **options, foreach=False)
    _run(opt, params, grads)
    _run(ref, ref_params, grads)
    for p, r in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("optimizer_type", ["Adam", "AdamW", "Lamb"])
def test_param_group_overrides_are_honoured(optimizer_type: str) -> None:
    """weight_decay 0 for biases: with zero gradients only the decay moves a tensor."""
    weight = torch.nn.Parameter(torch.ones(6))
    bias = torch.nn.Parameter(torch.ones(3))
    groups = [{"params": [weight]}, {"params": [bias], "weight_decay": 0.0}]
    opt = build_optimizer(optimizer_type, {"lr": 0.01, "weight_decay": 0.1}, groups)
    assert opt.param_groups[1]["weight_decay"] == 0.0
    for _ in range(3):
        weight.grad, bias.grad = torch.zeros(6), torch.zeros(3)
        opt.step()
    # AdamW: w *= 1 - lr * wd per step. Lamb: update = wd * w, trust ratio 1/wd, so w *= 1 - lr.
    factor = 1 - 0.01 * 0.1 if optimizer_type != "Lamb" else 1 - 0.01
    torch.testing.assert_close(weight.detach(), torch.full((6,), factor**3))
    torch.testing.assert_close(bias.detach(), torch.ones(3), rtol=0, atol=0)


def test_betas_list_from_json_becomes_tuple() -> None:
    opt = build_optimizer("AdamW", {"betas": [0.8, 0.95]}, [{"params": _params()}])
    assert opt.param_groups[0]["betas"] == (0.8, 0.95)


def test_build_lamb() -> None:
    calls: list[Tensor] = []
    opt = build_optimizer(
        "Lamb",
        {"lr": 0.02, "max_coeff": 0.3, "min_coeff": 0.01, "bias_correction": False},
        [{"params": _params()}],
        norm_allreduce=calls.append,
    )
    assert isinstance(opt, Lamb)
    assert opt.norm_allreduce is not None
    group = opt.param_groups[0]
    assert (group["lr"], group["max_coeff"], group["bias_correction"]) == (0.02, 0.3, False)
    assert (group["weight_decay"], group["eps"], tuple(group["betas"])) == (0.0, 1e-8, (0.9, 0.999))


@pytest.mark.parametrize(
    ("optimizer_type", "options", "match"),
    [
        ("MuAdam", {}, r"optimizer\.type"),
        ("Adam", {"momentum": 0.9}, r"optimizer\.params\.momentum"),
        ("SGD", {"betas": (0.9, 0.99)}, r"optimizer\.params\.betas"),
        ("Lamb", {"torch_adam": True}, r"optimizer\.params\.torch_adam"),
        ("Adam", {"max_grad_norm": 1.0}, r"gradient_clipping"),
        ("Adam", {"bias_correction": False, "amsgrad": True}, r"amsgrad"),
        ("Lamb", {"amsgrad": True}, r"amsgrad"),
    ],
)
def test_build_optimizer_rejects(optimizer_type: str, options: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_optimizer(optimizer_type, options, [{"params": _params()}])


# ---------------------------------------------------------------------------------------------
# The registry: what the config accepts is what build_optimizer builds

# A value for every `optimizer.params` key of the registry, each a DeepSpeed default or near it.
PARAM_VALUES: dict[str, Any] = {
    "lr": 0.01,
    "betas": [0.9, 0.99],
    "eps": 1e-8,
    "weight_decay": 0.01,
    "amsgrad": False,
    "torch_adam": False,
    "fused": False,
    "foreach": False,
    "adam_w_mode": True,
    "bias_correction": True,
    "set_grad_none": True,
    "momentum": 0.9,
    "dampening": 0.0,
    "nesterov": False,
    "max_coeff": 10.0,
    "min_coeff": 0.01,
    "eps_inside_sqrt": False,
    "freeze_step": 2,
    "var_freeze_step": 4,
    "var_update_scaler": 2,
    "local_step_scaler": 100,
    "local_step_clipper": 1,
    "cuda_aware": False,
    "comm_backend_name": "nccl",
    "lr_decay": 0.0,
    "initial_accumulator_value": 0.1,
    "muon_lr": 0.02,
    "adam_lr": 0.01,
    "ns_steps": 5,
    "ns_coefficients": [3.4445, -4.7750, 2.0315],
    "ns_dtype": "fp32",
    "ns_eps": 1e-7,
    "adjust_lr_fn": "match_rms_adamw",
}


@pytest.mark.parametrize("spelling", [str, str.lower, str.upper], ids=["name", "lower", "upper"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_registered_optimizer_passes_the_config_and_builds(name: str, spelling) -> None:
    params = {key: PARAM_VALUES[key] for key in OPTIMIZERS[name].params}
    section = check_config({"optimizer": {"type": spelling(name), "params": params}}).optimizer
    assert section is not None and section.type == name
    assert section.params.keys() == params.keys()
    weights = _params()
    opt = build_optimizer(spelling(name), section.params, [{"params": weights}])
    before = [w.detach().clone() for w in weights]
    _run(opt, weights, _grads(1))
    assert all(not torch.equal(w, b) for w, b in zip(weights, before, strict=True))


def test_unknown_optimizer_is_a_config_error_listing_the_choices() -> None:
    with pytest.raises(ConfigError) as error:
        check_config({"optimizer": {"type": "Adamax"}})
    message = str(error.value)
    assert message.startswith("optimizer.type: unknown optimizer 'Adamax'")
    assert message.endswith(f"zerotrain supports {', '.join(OPTIMIZERS)}")


@pytest.mark.parametrize("name", sorted(DEEPSPEED_ONLY_OPTIMIZERS))
def test_deepspeed_optimizers_not_implemented_are_named(name: str) -> None:
    with pytest.raises(ConfigError, match=f"optimizer.type: '{name}' is a DeepSpeed optimizer"):
        check_config({"optimizer": {"type": name}})
    with pytest.raises(ValueError, match=r"optimizer\.type"):
        build_optimizer(name, {}, [{"params": _params()}])


def test_one_bit_adam_is_uncorrected_adam_until_its_variance_freezes() -> None:
    """DeepSpeed's 1-bit Adam update: FusedAdam without bias correction (decoupled decay) for
    freeze_step steps; after that the variance stays as it was."""
    from zerotrain.optim import FusedAdam
    from zerotrain.optim.onebit import OneBitAdam

    weights, reference = _params(), _params()
    onebit = OneBitAdam([{"params": weights}], lr=0.01, freeze_step=2, weight_decay=0.01)
    adam = FusedAdam([{"params": reference}], lr=0.01, bias_correction=False, weight_decay=0.01)
    for step, grads in enumerate(_grads(3)):
        frozen = [onebit.state[w]["exp_avg_sq"].clone() for w in weights] if step == 2 else None
        _run(onebit, weights, [grads])
        _run(adam, reference, [grads])
        if frozen is None:  # the same update (the terms added in another order)
            for w, r in zip(weights, reference, strict=True):
                torch.testing.assert_close(w, r, rtol=1e-6, atol=1e-7)
        else:
            assert all(
                torch.equal(onebit.state[w]["exp_avg_sq"], v)
                for w, v in zip(weights, frozen, strict=True)
            )
            assert not all(torch.equal(w, r) for w, r in zip(weights, reference, strict=True))


def test_zero_one_adam_updates_the_variance_on_deepspeeds_schedule() -> None:
    """0/1 Adam: the variance is updated at steps 1-4, then every 2nd step 4 times, every 4th
    4 times, ... (var_update_scaler 4), until var_freeze_step + 1; the momentum every step."""
    from zerotrain.optim.onebit import ZeroOneAdam, variance_update_steps

    assert sorted(variance_update_steps(100, 4)) == [
        *(1, 2, 3, 4),
        *(6, 8, 10, 12),
        *(16, 20, 24, 28),
        *(32, 40, 48, 56),
        *(64, 80, 96),
    ]
    assert sorted(variance_update_steps(5, 1)) == [1, 2, 4]
    weights, reference = _params(), _params()
    zero_one = ZeroOneAdam(
        [{"params": weights}], lr=0.01, weight_decay=0.01, var_freeze_step=10, var_update_scaler=1
    )
    state = {id(w): (torch.zeros_like(w), torch.zeros_like(w)) for w in reference}
    for step, grads in enumerate(_grads(6), start=1):
        _run(zero_one, weights, [grads])
        for r, g in zip(reference, grads, strict=True):  # DeepSpeed's update, written out
            m, v = state[id(r)]
            m.mul_(0.9).add_(g, alpha=0.1)
            if step in (1, 2, 4):
                v.mul_(0.999).addcmul_(g, g, value=0.001)
            r.data.add_(m / (v.sqrt() + 1e-8) + 0.01 * r, alpha=-0.01)
        for w, r in zip(weights, reference, strict=True):
            torch.testing.assert_close(w, r, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# Lamb against a per-parameter reference

LAMB_OPTIONS: dict[str, Any] = {
    "lr": 0.01,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 0.01,
    "max_coeff": 5.0,
    "min_coeff": 0.05,
}


def _reference_lamb(
    params: list[Tensor],
    grads: list[list[Tensor]],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    max_coeff: float,
    min_coeff: float,
    bias_correction: bool = True,
    eps_inside_sqrt: bool = False,
) -> tuple[list[Tensor], set[str]]:
    """Textbook LAMB (arXiv:1904.00962, Alg. 2) in float64, one parameter at a time.

    Also returns which trust-ratio cases were taken, to show the test covers all of them.
    """
    beta1, beta2 = betas
    weights = [p.detach().double().clone() for p in params]
    m = [torch.zeros_like(w) for w in weights]
    v = [torch.zeros_like(w) for w in weights]
    cases: set[str] = set()
    for t, step_grads in enumerate(grads, start=1):
        bc1 = 1 - beta1**t if bias_correction else 1.0
        bc2 = 1 - beta2**t if bias_correction else 1.0
        for i, grad in enumerate(step_grads):
            g = grad.double()
            m[i] = beta1 * m[i] + (1 - beta1) * g
            v[i] = beta2 * v[i] + (1 - beta2) * g * g
            if eps_inside_sqrt:
                denom = torch.sqrt(v[i] / bc2 + eps)
            else:
                denom = torch.sqrt(v[i] / bc2) + eps
            update = (m[i] / bc1) / denom + weight_decay * weights[i]
            w_norm, u_norm = weights[i].norm().item(), update.norm().item()
            if w_norm == 0 or u_norm == 0:
                ratio, case = 1.0, "zero norm"
            elif w_norm / u_norm > max_coeff:
                ratio, case = max_coeff, "max"
            elif w_norm / u_norm < min_coeff:
                ratio, case = min_coeff, "min"
            else:
                ratio, case = w_norm / u_norm, "free"
            cases.add(case)
            weights[i] = weights[i] - lr * ratio * update
    return weights, cases


@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 1e-6)], ids=["fp64", "fp32"]
)
@pytest.mark.parametrize(
    "variant",
    [{}, {"bias_correction": False}, {"eps_inside_sqrt": True}, {"weight_decay": 0.0}],
    ids=["default", "no_bias_correction", "eps_inside_sqrt", "no_decay"],
)
def test_lamb_matches_reference(dtype: torch.dtype, tol: float, variant: dict[str, Any]) -> None:
    options = {**LAMB_OPTIONS, **variant}
    params = _params(dtype)
    grads = _grads(6, dtype)
    expected, cases = _reference_lamb(params, grads, **options)
    assert cases == {"zero norm", "max", "min", "free"}
    _run(Lamb(params, **options), params, grads)
    for p, e in zip(params, expected, strict=True):
        torch.testing.assert_close(p.detach().double(), e, rtol=tol, atol=tol)


def test_lamb_chunks_and_strides_do_not_change_the_result() -> None:
    """Small chunks and a non-contiguous (transposed) parameter give the reference result."""
    params = _params()
    params[0] = torch.nn.Parameter(params[0].detach().t().contiguous().t())
    assert not params[0].is_contiguous()
    grads = _grads(4)
    expected, _ = _reference_lamb(params, grads, **LAMB_OPTIONS)
    opt = Lamb(params, **LAMB_OPTIONS)
    opt._chunk_numel = 8
    _run(opt, params, grads)
    for p, e in zip(params, expected, strict=True):
        torch.testing.assert_close(p.detach().double(), e, rtol=1e-6, atol=1e-6)


def test_lamb_skips_params_without_grad() -> None:
    params = _params()
    before = params[1].detach().clone()
    opt = Lamb(params, **LAMB_OPTIONS)
    for i, g in enumerate(_grads(1)[0]):
        params[i].grad = None if i == 1 else g
    opt.step()
    assert torch.equal(params[1].detach(), before)
    assert params[1] not in opt.state


def test_lamb_state_dict_round_trip_resumes_identically() -> None:
    grads = _grads(4)
    straight = _params()
    _run(Lamb(straight, **LAMB_OPTIONS), straight, grads)

    params = _params()
    first = Lamb(params, **LAMB_OPTIONS)
    _run(first, params, grads[:2])
    state = copy.deepcopy(first.state_dict())
    resumed = Lamb(params, **LAMB_OPTIONS)
    resumed.load_state_dict(state)
    _run(resumed, params, grads[2:])
    for p, s in zip(params, straight, strict=True):
        assert torch.equal(p, s)


# ---------------------------------------------------------------------------------------------
# Lamb on ZeRO shards: segment_ranges, padding and the norm all-reduce

Ranges = list[tuple[int, int, int]]


def _shard(
    tensors: list[Tensor], world: int, pieces: int
) -> tuple[list[list[Tensor]], list[list[Ranges]]]:
    """Flatten, concatenate and pad to a multiple of ``world``, then give each rank its slice,
    itself cut into ``pieces`` tensors of unequal size. Returns (shards, segment_ranges) per
    rank.
    """
    numels = [t.numel() for t in tensors]
    total = sum(numels)
    padded = math.ceil(total / world) * world
    flat = torch.cat(
        [t.detach().reshape(-1) for t in tensors] + [tensors[0].new_zeros(padded - total)]
    )
    ends = list(itertools.accumulate(numels))
    param_bounds = list(zip([0, *ends[:-1]], ends, strict=True))
    shard_numel = padded // world
    cuts = [0, shard_numel // 3, shard_numel] if pieces == 2 else [0, shard_numel]
    shards, shard_ranges = [], []
    for rank in range(world):
        base = rank * shard_numel
        bounds = [(base + lo, base + hi) for lo, hi in zip(cuts[:-1], cuts[1:], strict=True)]
        shards.append([flat[lo:hi].clone() for lo, hi in bounds])
        shard_ranges.append(
            [
                [
                    (max(start, lo) - lo, min(end, hi) - lo, i)
                    for i, (start, end) in enumerate(param_bounds)
                    if max(start, lo) < min(end, hi)
                ]
                for lo, hi in bounds
            ]
        )
    return shards, shard_ranges


def _padding(ranges: Ranges, numel: int) -> Tensor:
    """True where an element of a segmented tensor is in none of its ranges."""
    padding = torch.ones(numel, dtype=torch.bool)
    for start, end, _ in ranges:
        padding[start:end] = False
    return padding


def _unshard(shards: list[list[Tensor]], shapes: list[tuple[int, ...]]) -> list[Tensor]:
    flat = torch.cat([piece.detach() for rank in shards for piece in rank])
    out, offset = [], 0
    for shape in shapes:
        numel = math.prod(shape)
        out.append(flat[offset : offset + numel].view(shape))
        offset += numel
    return out


class _ThreadAllReduce:
    """Simulated all-reduce for ranks run as threads in lock step: every rank gets the same sum."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=60)
        self.slots: list[Tensor | None] = [None] * world
        self.calls = [0] * world

    def for_rank(self, rank: int) -> Callable[[Tensor], None]:
        def all_reduce(tensor: Tensor) -> None:
            assert tensor.dim() == 1
            self.calls[rank] += 1
            self.slots[rank] = tensor.clone()
            self.barrier.wait()
            total = torch.stack([s for s in self.slots if s is not None]).sum(0)
            self.barrier.wait()  # nobody overwrites a slot before everyone has summed
            tensor.copy_(total)

        return all_reduce


def _run_ranks(world: int, fn: Callable[[int], None]) -> None:
    with ThreadPoolExecutor(max_workers=world) as pool:
        for future in [pool.submit(fn, rank) for rank in range(world)]:
            future.result()


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("pieces", [1, 2])
@pytest.mark.parametrize("chunk_numel", [None, 8], ids=["one_chunk", "chunks_of_8"])
def test_segmented_lamb_matches_per_parameter_lamb(
    world: int, pieces: int, chunk_numel: int | None
) -> None:
    num_steps = 5
    params = _params(scales=STRADDLE_SCALES)
    grads = _grads(num_steps)
    reference = _params(scales=STRADDLE_SCALES)
    _run(Lamb(reference, **LAMB_OPTIONS), reference, grads)

    shards, shard_ranges = _shard(params, world, pieces)
    allreduce = _ThreadAllReduce(world)
    optimizers = []
    for rank in range(world):
        shard = [torch.nn.Parameter(piece) for piece in shards[rank]]
        shards[rank] = shard
        group = {
            "params": shard,
            "segment_ranges": shard_ranges[rank],
            "num_segments": len(SHAPES),
        }
        opt = Lamb([group], **LAMB_OPTIONS, norm_allreduce=allreduce.for_rank(rank))
        if chunk_numel is not None:
            opt._chunk_numel = chunk_numel
        optimizers.append(opt)

    gen = torch.Generator().manual_seed(7)
    for step_grads in grads:
        grad_shards, _ = _shard(step_grads, world, pieces)
        for rank in range(world):
            for piece, grad, ranges in zip(
                shards[rank], grad_shards[rank], shard_ranges[rank], strict=True
            ):
                # Garbage in the padding's gradient must not move the padding.
                noise = torch.randn(grad.shape, generator=gen)
                piece.grad = torch.where(_padding(ranges, grad.numel()), noise, grad)
        _run_ranks(world, lambda rank: optimizers[rank].step())

    assert allreduce.calls == [num_steps] * world
    for got, want in zip(_unshard(shards, SHAPES), reference, strict=True):
        torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-6)
    flat = torch.cat([piece.detach() for rank in shards for piece in rank])
    total = sum(math.prod(s) for s in SHAPES)
    assert torch.count_nonzero(flat[total:]) == 0


def test_padding_between_ranges_stays_and_the_ranges_match_per_parameter_lamb() -> None:
    """Ranges need not be adjacent: padding may sit between them, and before them."""
    num_steps = 4
    params = _params(scales=STRADDLE_SCALES)[:2]  # (7, 15) and (13,)
    grads = [step[:2] for step in _grads(num_steps)]
    reference = _params(scales=STRADDLE_SCALES)[:2]
    _run(Lamb(reference, **LAMB_OPTIONS), reference, grads)

    gap = 3
    flat = torch.nn.Parameter(
        torch.cat([torch.zeros(gap), params[0].detach().reshape(-1), torch.zeros(gap), params[1]])
    )
    first, second = gap + 105, 2 * gap + 105
    ranges = [(gap, first, 0), (second, second + 13, 1)]
    opt = Lamb([{"params": [flat], "segment_ranges": [ranges], "num_segments": 2}], **LAMB_OPTIONS)
    opt._chunk_numel = 16
    garbage = torch.full((gap,), 5.0)  # in the padding's gradient: must not move the padding
    for step_grads in grads:
        flat.grad = torch.cat([garbage, step_grads[0].reshape(-1), garbage, step_grads[1]])
        opt.step()
    got = flat.detach()
    padding = _padding(ranges, flat.numel())
    torch.testing.assert_close(
        got[gap:first].view(7, 15), reference[0].detach(), rtol=1e-6, atol=1e-6
    )
    torch.testing.assert_close(got[second:], reference[1].detach(), rtol=1e-6, atol=1e-6)
    assert torch.count_nonzero(got[padding]) == 0


def test_segmented_groups_share_one_allreduce_per_step() -> None:
    params = _params()
    ranges = [[(0, 4, 0), (4, 9, 1)], [(0, 2, 0), (2, 4, 1), (4, 6, 2)]]
    shards = [torch.nn.Parameter(torch.randn(10)), torch.nn.Parameter(torch.randn(6))]
    seen: list[int] = []
    opt = Lamb(
        [
            {"params": [shards[0]], "segment_ranges": [ranges[0]], "num_segments": 2},
            {"params": [shards[1]], "segment_ranges": [ranges[1]], "num_segments": 3},
            {"params": params},  # a plain group takes no part in the collective
        ],
        norm_allreduce=lambda t: seen.append(t.numel()),
    )
    for p in [*shards, *params]:
        p.grad = torch.randn_like(p)
    opt.step()
    assert seen == [2 * (2 + 1) + 2 * (3 + 1)]


def test_segmented_state_dict_leaves_out_the_layout() -> None:
    shard = torch.nn.Parameter(torch.randn(6))
    ranges = ((0, 2, 0), (2, 5, 1))
    opt = Lamb([{"params": [shard], "segment_ranges": [ranges], "num_segments": 2}])
    shard.grad = torch.randn(6)
    opt.step()
    state = opt.state_dict()
    assert "segment_ranges" not in state["param_groups"][0]
    assert "num_segments" not in state["param_groups"][0]
    opt.load_state_dict(state)
    assert opt.param_groups[0]["segment_ranges"][0] == ranges
    assert opt.param_groups[0]["num_segments"] == 2


def test_set_segments_is_the_group_keys_on_a_built_optimizer() -> None:
    """What the engine does to a Lamb built before its tensors were sharded."""
    ranges = [[(0, 4, 0), (4, 9, 1)], [(0, 2, 1), (2, 6, 2)]]
    start = [torch.randn(10), torch.randn(6)]
    grads = [torch.randn(10), torch.randn(6)]
    keyed = [torch.nn.Parameter(t.clone()) for t in start]
    later = [torch.nn.Parameter(t.clone()) for t in start]
    seen: list[int] = []
    opt_keyed = Lamb(
        [{"params": keyed, "segment_ranges": ranges, "num_segments": 3}], **LAMB_OPTIONS
    )
    opt_later = Lamb(later, **LAMB_OPTIONS)
    opt_later.set_segments(
        dict(zip(later, ranges, strict=True)), 3, norm_allreduce=lambda t: seen.append(t.numel())
    )
    for opt, tensors in ((opt_keyed, keyed), (opt_later, later)):
        for t, g in zip(tensors, grads, strict=True):
            t.grad = g.clone()
        opt.step()
    assert seen == [2 * (3 + 1)]
    for a, b in zip(keyed, later, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"param_groups\[0\] params\[1\] .* no entry"):
        Lamb(later).set_segments({later[0]: ranges[0]}, 3)


@pytest.mark.parametrize(
    ("group", "match"),
    [
        ({"segment_ranges": [[(0, 6, 0)]]}, "together"),
        ({"num_segments": 2}, "together"),
        ({"segment_ranges": [[(0, 7, 0)]], "num_segments": 1}, "within the tensor's 6 elements"),
        ({"segment_ranges": [[(0, 3, 0), (2, 6, 1)]], "num_segments": 2}, "previous range"),
        ({"segment_ranges": [[(3, 3, 0)]], "num_segments": 1}, "non-empty"),
        ({"segment_ranges": [[(0, 6, 2)]], "num_segments": 2}, r"\[0, 2\)"),
        ({"segment_ranges": [[(0, 6, -1)]], "num_segments": 2}, r"\[0, 2\)"),
        ({"segment_ranges": [[(0, 6.0, 0)]], "num_segments": 1}, "triple of ints"),
        ({"segment_ranges": [[(0, 6)]], "num_segments": 1}, "triple of ints"),
        ({"segment_ranges": [], "num_segments": 2}, "one per tensor"),
    ],
)
def test_segment_layout_is_validated(group: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Lamb([{"params": [torch.nn.Parameter(torch.zeros(6))], **group}])


# ---------------------------------------------------------------------------------------------
# DeepSpeed's FusedAdam: torch's kernels with bias correction, DeepSpeed's update without


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_is_torch_adam_with_bias_correction(adam_w_mode: bool) -> None:
    from zerotrain.ops.adam import DeepSpeedCPUAdam, FusedAdam

    torch.manual_seed(0)
    start = torch.randn(5, 7)
    ours = [torch.nn.Parameter(start.clone()) for _ in range(2)]
    theirs = torch.nn.Parameter(start.clone())
    optimizers = [
        FusedAdam([ours[0]], lr=0.1, weight_decay=0.1, adam_w_mode=adam_w_mode),
        DeepSpeedCPUAdam([ours[1]], lr=0.1, weight_decay=0.1, adamw_mode=adam_w_mode),
        (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(
            [theirs], lr=0.1, weight_decay=0.1, fused=True
        ),
    ]
    for _ in range(3):
        grad = torch.randn(5, 7)
        for param in [*ours, theirs]:
            param.grad = grad.clone()
        for optimizer in optimizers:
            optimizer.step()
    assert torch.equal(ours[0], theirs) and torch.equal(ours[1], theirs)


def test_adam_without_bias_correction_steps_deepspeeds_update() -> None:
    from zerotrain.optim import FusedAdam

    torch.manual_seed(0)
    start = torch.randn(5, 7)
    param = torch.nn.Parameter(start.clone())
    optimizer = build_optimizer(
        "Adam", {"lr": 0.1, "weight_decay": 0.1, "bias_correction": False}, [{"params": [param]}]
    )
    assert isinstance(optimizer, FusedAdam)
    m, v, w = (torch.zeros(5, 7, dtype=torch.float64) for _ in range(3))
    w += start.double()
    for _ in range(3):
        grad = torch.randn(5, 7)
        param.grad = grad.clone()
        optimizer.step()
        grad = grad.double()
        m, v = 0.9 * m + 0.1 * grad, 0.999 * v + 0.001 * grad * grad
        w = w * (1 - 0.1 * 0.1) - 0.1 * m / (v.sqrt() + 1e-8)  # no 1 - beta**t
    assert (param.double() - w).abs().max() < 1e-6


def test_state_bytes_are_known_by_class_before_the_first_step() -> None:
    """The preflight and the memory formula read the table before any state exists: DeepSpeed's
    Adam classes are Adam (they fell to the caller's guess), a subclass of SGD is SGD."""
    from zerotrain.optim import DeepSpeedCPUAdam
    from zerotrain.optim.state_bytes import optimizer_state_bytes_per_element as per_element

    class MySGD(torch.optim.SGD):
        pass

    assert per_element(FusedAdam(_params()), unknown=-1) == 8
    assert per_element(DeepSpeedCPUAdam(_params()), unknown=-1) == 8
    assert per_element(torch.optim.Adam(_params(), amsgrad=True), unknown=-1) == 12
    assert per_element(MySGD(_params(), lr=0.1, momentum=0.9), unknown=-1) == 4
    assert per_element(Lamb(_params()), unknown=-1) == 8
