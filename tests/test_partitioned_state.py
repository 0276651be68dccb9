"""DeepSpeed's partitioned-state utilities (deepspeed.utils.safe_get_* / safe_set_*) as client
code calls them, at every ZeRO stage on 2 ranks, against a single process that sets the same
values on a plain model."""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from models import BlockModel, make_batches, micro_batch, relative_error

import zerotrain

STEPS, MICRO, LR = 3, 2, 2e-2
WEIGHT_SHAPE = (13, 7)  # blocks[0].up.weight
# (name, zero_optimization): reduce_bucket_size 60 cuts parameters across shards and buckets
SETUPS = [
    ("stage0", {"stage": 0}),
    ("stage1", {"stage": 1, "reduce_bucket_size": 60}),
    ("stage2", {"stage": 2, "reduce_bucket_size": 60}),
    ("stage3", {"stage": 3, "stage3_param_persistence_threshold": 0}),
    (
        "stage2_offload",
        {"stage": 2, "reduce_bucket_size": 60, "offload_optimizer": {"device": "cpu"}},
    ),
    (
        "stage3_offload",
        {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "offload_optimizer": {"device": "cpu"},
            "offload_param": {"device": "cpu"},
        },
    ),
]


def _model() -> BlockModel:
    torch.manual_seed(0)
    return BlockModel()


def _new_master(value: torch.Tensor) -> torch.Tensor:
    return value * 0.5 + 0.25


def _new_grad(shape: torch.Size) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, torch.Size(shape).numel()).view(shape)


def _update(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    return grad * 0.5 + 1.0


def _targets(model):
    """A block parameter (a stage-3 unit of its own) and a root one."""
    return model.blocks[0].up.weight, model.embed.weight


def reference() -> dict[str, torch.Tensor]:
    """One process: step 1; set the block weight and the embedding's exp_avg; step 2; after
    step 3's backward set the block weight's gradient, then update both gradients; step 3."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-6, weight_decay=0.0)
    idx, tgt = make_batches(STEPS, MICRO * 2)
    weight, embed = _targets(model)
    for step in range(STEPS):
        if step == 1:
            with torch.no_grad():
                weight.copy_(_new_master(weight))
            opt.state[embed]["exp_avg"] = _new_master(opt.state[embed]["exp_avg"])
        model(idx[step], tgt[step]).backward()
        if step == 2:
            weight.grad = _new_grad(torch.Size(WEIGHT_SHAPE))
            for param in (weight, embed):
                param.grad = _update(param.grad, param)
        # DeepSpeed's default clipping, at 1.0: the norm includes the gradients set by hand
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1.0)
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def train_and_set(setups):
    from zerotrain.comm import Communicator
    from zerotrain.utils import (
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_full_optimizer_state,
        safe_get_local_fp32_param,
        safe_get_local_grad,
        safe_get_local_optimizer_state,
        safe_set_full_fp32_param,
        safe_set_full_grad,
        safe_set_full_optimizer_state,
        safe_set_local_fp32_param,
        safe_set_local_grad,
        safe_set_local_optimizer_state,
        safe_update_full_grad_vectorized,
    )

    comm = Communicator()
    out = {}
    for name, zero in setups:
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": 1e-6, "weight_decay": 0}},
            "zero_optimization": zero,
            "steps_per_print": 10**6,
        }
        engine, *_ = zerotrain.initialize(model=_model(), config=config)
        weight, embed = _targets(engine.module)
        idx, tgt = make_batches(STEPS, MICRO * comm.world_size)
        got: dict = {}
        for step in range(STEPS):
            x = micro_batch(idx[step], 0, comm.rank, comm.world_size, MICRO)
            y = micro_batch(tgt[step], 0, comm.rank, comm.world_size, MICRO)
            if step == 1:
                master = _new_master(safe_get_full_fp32_param(weight))
                safe_set_full_fp32_param(weight, master)
                got["master_round_trip"] = torch.equal(safe_get_full_fp32_param(weight), master)
                with zerotrain.zero.GatheredParameters([weight]):  # the model's copy too
                    got["param_is_master"] = torch.equal(weight.detach(), master)
                exp_avg = _new_master(safe_get_full_optimizer_state(embed, "exp_avg"))
                safe_set_full_optimizer_state(embed, exp_avg, "exp_avg")
                got["state_round_trip"] = torch.equal(
                    safe_get_full_optimizer_state(embed, "exp_avg"), exp_avg
                )
                # this rank's elements: set to twice, read back, seen whole, then set back
                for kind, get, put, full in [
                    ("master", safe_get_local_fp32_param, safe_set_local_fp32_param, master),
                    (
                        "exp_avg_sq",
                        lambda p: safe_get_local_optimizer_state(p, "exp_avg_sq"),
                        lambda p, v: safe_set_local_optimizer_state(p, v, "exp_avg_sq"),
                        safe_get_full_optimizer_state(weight, "exp_avg_sq"),
                    ),
                ]:
                    local = get(weight)
                    put(weight, local * 2)
                    twice = (
                        safe_get_full_fp32_param(weight)
                        if kind == "master"
                        else safe_get_full_optimizer_state(weight, "exp_avg_sq")
                    )
                    got[f"local_{kind}"] = (
                        local.numel(),
                        torch.equal(get(weight), local * 2),
                        torch.equal(twice, full * 2),
                    )
                    put(weight, local)
            engine.backward(engine(x, y))
            if step == 2:
                grad = _new_grad(torch.Size(WEIGHT_SHAPE))  # stage 3: weight.shape is (0,)
                safe_set_full_grad(weight, grad)
                got["grad_round_trip"] = torch.equal(safe_get_full_grad(weight), grad)
                local = safe_get_local_grad(weight)
                safe_set_local_grad(weight, local * 3)
                got["local_grad"] = torch.equal(safe_get_local_grad(weight), local * 3)
                safe_set_local_grad(weight, local)
                before = safe_get_full_grad(embed)
                safe_update_full_grad_vectorized([weight, embed], _update)
                got["updated"] = torch.equal(safe_get_full_grad(embed), _update(before, embed))
            engine.step()
        got["state"] = engine.consolidated_state_dict()
        out[name] = got
    return out


@pytest.mark.parametrize(
    "names",
    [
        ("stage1", "stage3"),
        pytest.param(
            ("stage0", "stage2", "stage2_offload", "stage3_offload"), marks=pytest.mark.slow
        ),
    ],
)
def test_set_state_trains_as_a_single_process_that_set_it(names) -> None:
    want = reference()
    numel = _model().blocks[0].up.weight.numel()
    setups = [setup for setup in SETUPS if setup[0] in names]
    results = run_distributed(train_and_set, 2, setups)
    for name, _ in setups:
        for kind in ("master", "exp_avg_sq"):
            # each rank's elements: all of them at stage 0, else each element on one rank
            local_numels = [r[name][f"local_{kind}"][0] for r in results]
            assert local_numels == [numel] * 2 if name == "stage0" else sum(local_numels) == numel
        for got in (r[name] for r in results):
            assert got["master_round_trip"] and got["param_is_master"], name
            assert got["state_round_trip"] and got["grad_round_trip"], name
            assert got["local_grad"] and got["updated"], name
            for kind in ("master", "exp_avg_sq"):
                _, round_trip, whole = got[f"local_{kind}"]
                assert round_trip and whole, (name, kind)
            for key, value in want.items():
                err = relative_error(got["state"][key], value)
                assert err < 1e-5, f"{name} {key}: {err:.2e}"


def misuse():
    from zerotrain.utils import (
        safe_get_full_fp32_param,
        safe_get_full_optimizer_state,
        safe_get_local_grad,
        safe_set_full_fp32_param,
        safe_set_full_grad,
        safe_set_full_optimizer_state,
    )

    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": {"stage": 2},
    }
    model = _model()
    model.head_bias.requires_grad_(False)
    engine, *_ = zerotrain.initialize(model=model, config=config)
    weight = engine.module.blocks[0].up.weight
    errors = {}
    for name, call in [
        ("grad_outside_backward", lambda: safe_set_full_grad(weight, torch.zeros(13, 7))),
        ("local_grad_outside_backward", lambda: safe_get_local_grad(weight)),
        ("wrong_shape", lambda: safe_set_full_fp32_param(weight, torch.zeros(7, 13, 2))),
        ("no_state_yet", lambda: safe_set_full_optimizer_state(weight, weight, "exp_avg")),
    ]:
        try:
            call()
            errors[name] = None
        except (RuntimeError, ValueError) as error:
            errors[name] = str(error)
    # a frozen parameter: getters None, setters no-ops (DeepSpeed's)
    frozen = engine.module.head_bias
    safe_set_full_fp32_param(frozen, torch.ones(frozen.shape))
    errors["frozen"] = (safe_get_full_fp32_param(frozen), torch.equal(frozen, torch.zeros(11)))
    # a state key before the first step is None (still to come); after it, a key the optimizer
    # does not have is an error, not None forever
    errors["state_before_step"] = safe_get_full_optimizer_state(weight, "exp_avg")
    idx, tgt = make_batches(1, MICRO)
    engine.backward(
        engine(micro_batch(idx[0], 0, 0, 1, MICRO), micro_batch(tgt[0], 0, 0, 1, MICRO))
    )
    engine.step()
    try:
        errors["misspelled_state"] = safe_get_full_optimizer_state(weight, "exp_avgsq")
    except ValueError as error:
        errors["misspelled_state"] = str(error)
    return errors


def test_misuse_names_the_parameter_and_the_fix() -> None:
    (errors,) = run_distributed(misuse, 1)
    assert "between the backward" in errors["grad_outside_backward"]
    assert "between the backward" in errors["local_grad_outside_backward"]
    assert "blocks.0.up.weight" in errors["wrong_shape"] and "(13, 7)" in errors["wrong_shape"]
    assert "first step" in errors["no_state_yet"]
    assert errors["frozen"] == (None, True)
    assert errors["state_before_step"] is None
    assert "'exp_avgsq' is not an optimizer state" in errors["misspelled_state"], errors
    assert "exp_avg_sq" in errors["misspelled_state"]
