"""bf16 masters and bf16 optimizer states (DeepSpeed's bf16_master_weights_and_grads and
bf16_optimizer_states): what each copy is stored in, that the update is computed in fp32 and
rounded back, that every stage and world trains the single-process recipe of the same storage,
that offload steps exactly as in memory, and what the bytes are."""

from __future__ import annotations

import pytest
import torch
from distributed import run_cases, run_distributed
from models import (
    AwkwardModel,
    make_batches,
    micro_batch,
    param_groups,
    relative_error,
    run_steps,
)

import zerotrain
from zerotrain.zero.low_precision import round_stochastically

STEPS, MICRO = 3, 2
BASE = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**6, "gradient_clipping": 0}
POLICIES = {
    "none": {},
    "masters": {"bf16_master_weights_and_grads": True},
    "states": {"bf16_optimizer_states": True},
    "both": {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
}
OPTIMIZERS = {
    "AdamW": {"lr": 1e-2, "weight_decay": 0.1},
    "Lion": {"lr": 1e-3, "weight_decay": 0.1},
}


class NarrowRecipe:
    """The single-process recipe, written out: masters and state stored in their dtypes, each
    parameter's update computed by torch's fp32 optimizer on widened copies, rounded back to
    nearest."""

    def __init__(self, model, name: str, masters: torch.dtype, states: torch.dtype):
        """``model`` in fp32: the masters start from its values, then it trains in bf16."""
        self.groups = param_groups(model, 0.1)
        self.masters = {
            p: p.detach().to(masters, copy=True) for g in self.groups for p in g["params"]
        }
        model.to(torch.bfloat16)
        self.name, self.state_dtype = name, states
        self.state: dict = {}

    def step(self):
        for group in self.groups:
            for p in group["params"]:
                wide = self.masters[p].float().clone()
                wide.grad = p.grad.float()
                options = {**OPTIMIZERS[self.name], "weight_decay": group["weight_decay"]}
                if self.name == "AdamW":
                    optimizer = torch.optim.AdamW([wide], **options, fused=True)
                else:
                    from zerotrain.optim.lion import Lion

                    optimizer = Lion([wide], **options)
                saved = self.state.get(p)
                if saved is not None:
                    optimizer.state[wide] = {
                        k: v.float() if v.shape == wide.shape else v.clone()
                        for k, v in saved.items()
                    }
                optimizer.step()
                self.masters[p].copy_(wide)
                p.data.copy_(self.masters[p])
                self.state[p] = {
                    k: v.to(self.state_dtype) if v.shape == wide.shape else v
                    for k, v in optimizer.state[wide].items()
                }
                p.grad = None


def _dtypes(policy: str) -> tuple[torch.dtype, torch.dtype]:
    """The dtypes of the masters and of the optimizer's state under ``policy``."""
    keys = POLICIES[policy]
    masters = torch.bfloat16 if keys.get("bf16_master_weights_and_grads") else torch.float32
    return masters, torch.bfloat16 if keys.get("bf16_optimizer_states") else torch.float32


def recipe(name: str, policy: str, world: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = AwkwardModel()
    optimizer = NarrowRecipe(model, name, *_dtypes(policy))
    idx, tgt = make_batches(STEPS, MICRO * world)
    for step in range(STEPS):
        model(idx[step], tgt[step]).backward()
        optimizer.step()
    # what a consolidated checkpoint holds: the masters of what is trained
    state = {k: v.float() for k, v in model.state_dict().items()}
    for name, param in model.named_parameters():
        if param in optimizer.masters:
            state[name] = optimizer.masters[param].float()
    state["head.weight"] = state["embed.weight"]  # tied
    return state


# with stochastic rounding too (not in POLICIES: the recipe above rounds to nearest)
ALL_POLICIES = {**POLICIES, "both-sr": {**POLICIES["both"], "stochastic_rounding": True}}


def _engine(name: str, policy: str, stage: int, offload: str | None = None, nvme: str = ""):
    torch.manual_seed(0)
    model = AwkwardModel()
    zero = {"stage": stage, "reduce_bucket_size": 50}
    if offload:
        zero["offload_optimizer"] = {"device": offload, "nvme_path": nvme or None}
    config = dict(
        BASE,
        optimizer={"type": name, "params": OPTIMIZERS[name]},
        zero_optimization=zero,
        bf16={"enabled": True, **ALL_POLICIES[policy]},
    )
    engine, *_ = zerotrain.initialize(
        model=model, model_parameters=param_groups(model, 0.1), config=config
    )
    return engine


def train(name: str, policy: str, stage: int, offload: str | None = None, nvme: str = ""):
    from zerotrain.comm import Communicator

    comm = Communicator()
    engine = _engine(name, policy, stage, offload, nvme)
    idx, tgt = make_batches(STEPS, MICRO * comm.world_size)
    run_steps(engine, idx, tgt, MICRO, 1, comm.world_size, comm.rank)
    stored = {
        (p.dtype, t.dtype)
        for g in engine.optimizer.groups
        for p in g.store.master_shards() or []
        for t in g.store.optimizer.state.get(p, {}).values()
        if torch.is_tensor(t) and t.shape == p.shape
    }
    state = {k: v.float() for k, v in engine.consolidated_state_dict().items()}
    return state, stored, engine.memory_breakdown()


GRID = [
    (name, policy, stage) for name in OPTIMIZERS for policy in POLICIES for stage in (0, 1, 2, 3)
]


def test_one_rank_is_the_recipe_bit_for_bit():
    """On one rank the gradients are the recipe's, so every stage's parameters are its bits:
    the storage, the fp32 update and the rounding are the same."""
    results = run_cases(train, 1, GRID)[0]
    for (name, policy, stage), (got, stored, _) in zip(GRID, results, strict=True):
        want = recipe(name, policy, 1)
        for key, value in want.items():
            assert torch.equal(got[key], value), (name, policy, stage, key)
        assert stored == {_dtypes(policy)}, (name, policy, stage, stored)


@pytest.mark.parametrize("world", [2, 3])
def test_every_stage_trains_the_recipe_within_bf16_rounding(world):
    """Every stage is as near the single-process recipe as the fp32-master run of the same
    ranks is (the gradients are averaged over ranks in bf16; the recipe's come from one
    backward). On 2 ranks, where a bf16 sum of two shares does not depend on the order, every
    stage trains the same model (within an fp32 ulp, where the fused kernel's vector lanes
    fall elsewhere in a bucket); on 3, reduce-scatter and all-reduce add in other orders."""
    cases = [
        (name, policy, stage) for name in OPTIMIZERS for policy in POLICIES for stage in range(4)
    ]
    for rank_results in run_cases(train, world, cases):
        got = {case: state for case, (state, _, _) in zip(cases, rank_results, strict=True)}
        for name in OPTIMIZERS:
            error = {}
            for policy in POLICIES:
                want = recipe(name, policy, world)
                for stage in range(4):
                    state = got[(name, policy, stage)]
                    error[policy, stage] = max(relative_error(state[k], v) for k, v in want.items())
                    if world == 2:
                        for key, value in got[(name, policy, 0)].items():
                            assert relative_error(state[key], value) < 1e-6, (name, policy, stage)
            bound = max(2 * max(error["none", stage] for stage in range(4)), 5e-3)
            assert max(error.values()) <= bound, (name, error)


def offloaded(name: str, policy: str, stage: int, nvme: str):
    return {where: train(name, policy, stage, where, nvme) for where in (None, "cpu", "nvme")}


def test_offload_steps_the_narrow_storage_bit_for_bit(tmp_path):
    """bf16 masters and states on the host and on NVMe (stored in their dtype there, stepped
    in fp32) train the in-memory run's bits; the bytes per parameter are the formula's."""
    cases = [("AdamW", policy, stage, str(tmp_path)) for policy in POLICIES for stage in (1, 3)]
    for rank_results in run_cases(offloaded, 2, cases):
        for case, runs in zip(cases, rank_results, strict=True):
            in_memory, _, breakdown = runs[None]
            for where in ("cpu", "nvme"):
                state, stored, offload_breakdown = runs[where]
                for key, value in in_memory.items():
                    assert torch.equal(state[key], value), (case, where, key)
            # the formula leaves out Adam's 4-byte step counter per bucket and the padding
            formula = breakdown["formula_total"]
            assert breakdown["total"] == pytest.approx(formula, rel=0.02, abs=80), case
            host = runs["cpu"][2]
            assert host["offloaded"] == pytest.approx(host["formula_offloaded"], rel=0.05), case


def bytes_per_parameter(policy: str) -> dict[str, float]:
    """Model-state bytes per trained element at stage 0 on one rank (AdamW, bf16 training)."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256))
    config = dict(
        BASE,
        optimizer={"type": "AdamW", "params": {"lr": 1e-3}},
        zero_optimization={"stage": 0},
        bf16={"enabled": True, **POLICIES[policy]},
    )
    engine, *_ = zerotrain.initialize(model=model, config=config)
    engine.backward(engine(torch.randn(2, 256, dtype=torch.bfloat16)).float().square().mean())
    engine.step()
    psi = sum(p.numel() for p in model.parameters())
    breakdown = engine.memory_breakdown()
    return {k: breakdown[k] / psi for k in ("parameters", "gradients", "optimizer_states")}


def test_bytes_per_parameter_of_each_policy():
    """DeepSpeed's recipe is 2 + 2 + (4 + 8) = 16 bytes; bf16 masters are the parameters (no
    copy); bf16 states halve Adam's 8; both: 2 + 2 + 4 = 8."""
    want = {"none": (2, 2, 12), "masters": (2, 2, 8), "states": (2, 2, 8), "both": (2, 2, 4)}
    results = run_cases(bytes_per_parameter, 1, [(policy,) for policy in POLICIES])[0]
    for policy, got in zip(POLICIES, results, strict=True):
        keys = ("parameters", "gradients", "optimizer_states")
        expected = dict(zip(keys, want[policy], strict=True))
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, abs=0.01), (policy, key, got)


def test_stochastic_rounding_is_unbiased_and_deterministic():
    value = torch.full((200_000,), 1.0 + 2**-10)  # a quarter of the way to the next bf16
    into = torch.empty_like(value, dtype=torch.bfloat16)
    round_stochastically(value, into, seed=7)
    assert set(into.float().unique().tolist()) == {1.0, 1.0 + 2**-7}  # the two neighbours
    assert into.float().mean().item() == pytest.approx(1.0 + 2**-10, abs=2e-5)
    again = torch.empty_like(into)
    round_stochastically(value, again, seed=7)
    assert torch.equal(into, again)
    negative = torch.full((200_000,), -(1.0 + 2**-10))
    round_stochastically(negative, into, seed=3)
    assert into.float().mean().item() == pytest.approx(-(1.0 + 2**-10), abs=2e-5)
    exact = torch.tensor([0.0, 1.5, -2.0, float("inf"), torch.finfo(torch.bfloat16).max])
    into = torch.empty_like(exact, dtype=torch.bfloat16)
    round_stochastically(exact, into, seed=1)
    assert torch.equal(into.float(), exact)


def test_small_updates_stall_in_bf16_unless_rounded_stochastically():
    """1000 updates of 1e-4 to a weight of 1: rounding to nearest loses every one of them
    (half a bf16 step at 1 is 2^-8), stochastic rounding keeps their sum in expectation."""
    from zerotrain.precision import PrecisionPolicy
    from zerotrain.zero.low_precision import LowPrecisionSteps

    ends = {}
    for stochastic in (False, True):
        weight = torch.ones(4096, dtype=torch.bfloat16)
        optimizer = torch.optim.SGD([weight], lr=1.0)
        policy = PrecisionPolicy(
            torch.bfloat16, master_dtype=torch.bfloat16, stochastic_rounding=stochastic
        )
        steps = LowPrecisionSteps(policy)
        for _ in range(1000):
            weight.grad = torch.full_like(weight, -1e-4)
            steps.step(optimizer, [weight])
        ends[stochastic] = weight.float().mean().item()
    assert ends[False] == 1.0
    assert ends[True] == pytest.approx(1.1, abs=0.005)


def save_then_resume(policy: str, directory: str, load_policy: str | None):
    """One step and a save under ``policy``; or (``load_policy``) a load of it into an engine of
    that policy and the other steps: the state at the end, and the load's warnings."""
    import warnings

    from zerotrain.comm import Communicator

    comm = Communicator()
    idx, tgt = make_batches(STEPS, MICRO * comm.world_size)
    engine = _engine("AdamW", load_policy or policy, 2)
    if load_policy is None:
        run_steps(engine, idx[:1], tgt[:1], MICRO, 1, comm.world_size, comm.rank)
        engine.save_checkpoint(directory, tag=policy)
        run_steps(engine, idx[1:], tgt[1:], MICRO, 1, comm.world_size, comm.rank)
        return {k: v.float() for k, v in engine.consolidated_state_dict().items()}, []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.load_checkpoint(directory, tag=policy)
    assert engine.global_steps == 1
    run_steps(engine, idx[1:], tgt[1:], MICRO, 1, comm.world_size, comm.rank)
    state = {k: v.float() for k, v in engine.consolidated_state_dict().items()}
    return state, [str(w.message) for w in caught if "load_checkpoint" in str(w.message)]


def test_checkpoints_resume_exactly_and_convert_between_policies(tmp_path):
    """Each policy resumes its own checkpoint to the uninterrupted run's bits (stochastic
    rounding too: its random bits come from the values rounded, nothing is saved for them); a
    checkpoint of fp32 masters loads into bf16 masters (rounded to nearest) and back (widened),
    saying so."""
    cases = [(policy, str(tmp_path), None) for policy in ALL_POLICIES]
    saved = run_cases(save_then_resume, 2, cases)[0]
    uninterrupted = {c[0]: r[0] for c, r in zip(cases, saved, strict=True)}
    resumed = [(policy, str(tmp_path), policy) for policy in ALL_POLICIES]
    crossed = [("none", str(tmp_path), "both"), ("both", str(tmp_path), "none")]
    results = run_cases(save_then_resume, 2, resumed + crossed)[0]
    for (policy, _, _), (state, warned) in zip(resumed, results, strict=False):
        assert warned == [], (policy, warned)
        for key, value in uninterrupted[policy].items():
            assert torch.equal(state[key], value), (policy, key)
    # stochastic rounding reached the stores: it trained other bits than rounding to nearest
    assert any(
        not torch.equal(uninterrupted["both-sr"][k], v) for k, v in uninterrupted["both"].items()
    )
    (_, to_narrow), (_, to_wide) = results[len(resumed) :]
    assert any(
        "master weights are fp32, this engine keeps them in bf16: rounded" in w for w in to_narrow
    )
    assert any("optimizer states are fp32" in w for w in to_narrow)
    assert any(
        "master weights are bf16, this engine keeps them in fp32: widened" in w for w in to_wide
    )


def muon_narrow(policy: str, stage: int, offload: str | None = None, nvme: str = ""):
    from zerotrain.comm import Communicator

    comm = Communicator()
    torch.manual_seed(0)
    model = AwkwardModel()
    zero = {"stage": stage, "reduce_bucket_size": 50, "sub_group_size": 32}
    if offload:
        zero["offload_optimizer"] = {"device": offload, "nvme_path": nvme or None}
    config = dict(
        BASE,
        optimizer={"type": "Muon", "params": {"lr": 2e-2, "adam_lr": 1e-2}},
        zero_optimization=zero,
        bf16={"enabled": True, **ALL_POLICIES[policy]},
    )
    engine, *_ = zerotrain.initialize(model=model, config=config)
    idx, tgt = make_batches(STEPS, MICRO * comm.world_size)
    run_steps(engine, idx, tgt, MICRO, 1, comm.world_size, comm.rank)
    store = engine.optimizer.group.store
    dtypes = {
        (m.dtype, k, v.dtype)
        for m in store.master_shards() or []
        for k, v in store.optimizer.state[m].items()
        if v.shape == m.shape
    }
    return {k: v.float() for k, v in engine.consolidated_state_dict().items()}, dtypes


def muon_recipe() -> dict[str, torch.Tensor]:
    """One process, bf16 masters (the parameters) and bf16 state, each update in fp32 and
    rounded back to nearest: Muon's written out for its matrices (with the library's
    Newton-Schulz, tested against the plain iteration in test_optimizers_sharded.py), torch's
    fused AdamW for the rest."""
    import math

    from zerotrain.optim.muon import NS_COEFFICIENTS, newton_schulz, uses_muon

    torch.manual_seed(0)
    model = AwkwardModel().to(torch.bfloat16)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    state: dict = {}
    idx, tgt = make_batches(STEPS, MICRO)
    for step in range(STEPS):
        model(idx[step], tgt[step]).backward()
        for name, p in named:
            wide, grad = p.detach().float(), p.grad.float()
            saved = state.setdefault(p, {})
            if uses_muon(name, p.shape, p):
                buf = saved.get("buf", torch.zeros_like(p)).float()
                buf.lerp_(grad, 1 - 0.95)
                update = newton_schulz(grad.lerp(buf, 0.95)[None], 5, NS_COEFFICIENTS, 1e-7)[0]
                scale = math.sqrt(max(1, p.shape[0] / p.shape[1]))
                wide.sub_(update * (2e-2 * scale))  # weight decay 0
                saved["buf"] = buf.to(torch.bfloat16)
            else:
                wide.grad = grad
                adamw = torch.optim.AdamW([wide], lr=1e-2, weight_decay=0.0, fused=True)
                if saved:
                    adamw.state[wide] = {k: v.float() if v.dim() else v for k, v in saved.items()}
                adamw.step()
                state[p] = {
                    k: v.to(torch.bfloat16) if v.dim() else v for k, v in adamw.state[wide].items()
                }
            p.data.copy_(wide)
            p.grad = None
    return {k: v.float() for k, v in model.state_dict().items()}


def test_muon_steps_bf16_masters_and_momentum_whole():
    """Muon's step is collective (its matrices are exchanged whole): its matrices are widened
    together for it, its AdamW half bucket by bucket, and its momentum is stored in bf16 like
    AdamW's moments. On one rank every stage is the single-process recipe's bits."""
    want = muon_recipe()
    cases = [("both", stage) for stage in range(4)]
    for (_, stage), (got, dtypes) in zip(cases, run_cases(muon_narrow, 1, cases)[0], strict=True):
        assert dtypes == {
            (torch.bfloat16, "momentum_buffer", torch.bfloat16),
            (torch.bfloat16, "exp_avg", torch.bfloat16),
            (torch.bfloat16, "exp_avg_sq", torch.bfloat16),
        }
        for key, value in want.items():
            assert torch.equal(got[key], value), (stage, key)


def muon_offloaded(policy: str, stage: int, nvme: str) -> dict:
    """Muon's state in memory, on the host and on NVMe, with NVMe's sub-groups cut at 16
    elements (see memory_and_offload in test_optimizers_sharded.py)."""
    from zerotrain.zero import nvme as nvme_store

    nvme_store.SUB_GROUP_ALIGNMENT = 16
    return {where: muon_narrow(policy, stage, where, nvme)[0] for where in (None, "cpu", "nvme")}


def test_muon_offload_steps_the_narrow_storage_bit_for_bit(tmp_path):
    """Muon over bf16 masters and momentum on the host and on NVMe trains the in-memory run's
    bits: on NVMe its update is made whole from sub-groups ([Note: Muon on NVMe])."""
    cases = [(policy, stage, str(tmp_path)) for policy in POLICIES for stage in (1, 3)]
    for rank_results in run_cases(muon_offloaded, 2, cases):
        for case, runs in zip(cases, rank_results, strict=True):
            for where in ("cpu", "nvme"):
                for key, value in runs[None].items():
                    assert torch.equal(runs[where][key], value), (case, where, key)


# -- torch_autocast ----------------------------------------------------------------------------
def autocast_reference(world: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """One process: fp32 parameters, the forward under torch.autocast, torch's AdamW; the
    global batch as ``world`` micro-batches of the ranks' shapes (a bf16 product's rounding
    depends on the shapes it is blocked in)."""
    torch.manual_seed(0)
    model = AwkwardModel()
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2, fused=True)
    idx, tgt = make_batches(STEPS, MICRO * world)
    for step in range(STEPS):
        for rank in range(world):
            with torch.autocast("cpu", dtype=dtype):
                x, y = (micro_batch(t[step], 0, rank, world, MICRO) for t in (idx, tgt))
                loss = model(x, y) / world
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def autocast_run(stage: int, safe: list[str] | None, dtype: str = "bfloat16"):
    from zerotrain.comm import Communicator

    comm = Communicator()
    torch.manual_seed(0)
    model = AwkwardModel()
    section = {"enabled": True, "dtype": dtype, "lower_precision_safe_modules": safe}
    config = dict(
        BASE,
        optimizer={"type": "AdamW", "params": OPTIMIZERS["AdamW"]},
        zero_optimization={"stage": stage, "reduce_bucket_size": 50},
        torch_autocast=section,
        fp16={"enabled": False, "initial_scale_power": 4},  # the scaler autocast to fp16 uses
    )
    engine, *_ = zerotrain.initialize(
        model=model, model_parameters=param_groups(model, 0.1), config=config
    )
    seen = []
    model.up.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    idx, tgt = make_batches(STEPS, MICRO * comm.world_size)
    run_steps(engine, idx, tgt, MICRO, 1, comm.world_size, comm.rank)
    dtypes = {p.dtype for p in model.parameters()}
    if dtype == "float16":  # scaled as fp16 training is, dynamically
        scaler = engine.optimizer.loss_scaler
        assert scaler.dynamic and scaler.scale == 2.0**4, scaler.state_dict()
        assert engine.skipped_steps == 0
    wires = {
        (b.slots[0].name, str(g.reduction.wire_dtype(b)))
        for g in engine.optimizer.groups
        for b in g.buckets
    }
    return engine.consolidated_state_dict(), set(seen), dtypes, wires


def test_torch_autocast_is_torch_autocast_over_fp32_parameters():
    """The forward runs under torch.autocast over fp32 parameters at every stage: with no module
    reduced in bf16 it is the single-process autocast run (1e-5); with DeepSpeed's default
    (nn.Linear's gradients summed over the ranks in bf16) it is within bf16's rounding of it."""
    cases = [(stage, []) for stage in range(4)] + [(stage, None) for stage in (0, 3)]
    want = autocast_reference(2)
    for rank_results in run_cases(autocast_run, 2, cases):
        for (stage, safe), (got, seen, dtypes, wires) in zip(cases, rank_results, strict=True):
            assert seen == {torch.bfloat16} and dtypes == {torch.float32}, (stage, seen, dtypes)
            error = max(relative_error(got[k], v) for k, v in want.items())
            if safe == []:
                assert error < 1e-5, (stage, error)
                assert {wire for _, wire in wires} == {"torch.float32"}
            else:
                assert error < 2e-2, (stage, error)
                linear = {name for name, wire in wires if wire == "torch.bfloat16"}
                assert linear and all(
                    n.startswith(("up.", "down.", "head.", "embed.")) for n in linear
                )
                assert ("odd", "torch.float32") in wires


def test_torch_autocast_to_fp16_scales_the_loss():
    want = autocast_reference(2, torch.float16)
    for got, seen, _, _ in run_distributed(autocast_run, 2, 2, [], "float16"):
        assert seen == {torch.float16}
        assert max(relative_error(got[k], v) for k, v in want.items()) < 1e-4
