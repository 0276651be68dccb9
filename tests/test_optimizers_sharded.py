"""Muon, Lion and Adagrad on ZeRO shards: every stage and world 1-3 trains the model a single
process trains with torch's optimizer (torch.optim.Adagrad), or with the algorithm written
plainly here (Lion; Muon with fp32 Newton-Schulz), or torch.optim.Muon itself (bf16
Newton-Schulz)."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from distributed import run_cases, run_distributed
from models import AwkwardModel, make_batches, param_groups, relative_error, run_steps

import zerotrain
from zerotrain.optim.muon import Muon, uses_muon

STEPS, MICRO = 3, 2
BASE = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**6, "gradient_clipping": 0}
CONFIGS = {
    "Lion": {"lr": 1e-2, "betas": [0.9, 0.99], "weight_decay": 0.1},
    "Adagrad": {"lr": 5e-2, "weight_decay": 0.01},
    "Muon": {"lr": 2e-2, "adam_lr": 1e-2, "weight_decay": 0.1, "momentum": 0.9},
    "Muon-bf16": {"lr": 2e-2, "adam_lr": 1e-2, "weight_decay": 0.1, "ns_dtype": "bf16"},
}
MUON_MATRICES = {"up.weight", "down.weight", "odd"}  # embed.weight (tied head) is AdamW's


# -- the single-process references ------------------------------------------------------------
class PlainLion(torch.optim.Optimizer):
    """Lion, Algorithm 2 of arXiv:2302.06675, one parameter at a time."""

    def __init__(self, params, lr, betas, weight_decay):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                m = self.state[p].setdefault("m", torch.zeros_like(p))
                c = beta1 * m + (1 - beta1) * p.grad
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.sub_(group["lr"] * torch.sign(c))
                m.copy_(beta2 * m + (1 - beta2) * p.grad)


def plain_newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Keller Jordan's quintic iteration on one matrix, in fp32."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.T if g.size(0) > g.size(1) else g
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.size(0) > g.size(1) else x


class PlainMuon(torch.optim.Optimizer):
    """torch.optim.Muon's update with Newton-Schulz in fp32, one matrix at a time."""

    def __init__(self, params, lr, weight_decay, momentum):
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "momentum": momentum})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            mu, lr = group["momentum"], group["lr"]
            for p in group["params"]:
                buf = self.state[p].setdefault("buf", torch.zeros_like(p))
                buf.copy_(mu * buf + (1 - mu) * p.grad)
                update = plain_newton_schulz((1 - mu) * p.grad + mu * buf)
                p.mul_(1 - lr * group["weight_decay"])
                p.sub_(lr * math.sqrt(max(1, p.shape[0] / p.shape[1])) * update)


def _split(model):
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    matrices = [p for n, p in named if uses_muon(n, p.shape, p)]
    return matrices, [p for n, p in named if not uses_muon(n, p.shape, p)]


def _reference_optimizers(name: str, model) -> list[torch.optim.Optimizer]:
    options = CONFIGS[name]
    if name == "Lion":
        return [PlainLion(param_groups(model, 0.1), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)]
    if name == "Adagrad":
        return [torch.optim.Adagrad(param_groups(model, 0.1), lr=5e-2, weight_decay=0.01)]
    matrices, rest = _split(model)
    adamw = torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.1)
    if name == "Muon":
        return [PlainMuon(matrices, lr=2e-2, weight_decay=0.1, momentum=options["momentum"]), adamw]
    return [torch.optim.Muon(matrices, lr=2e-2, weight_decay=0.1), adamw]


def reference(name: str, world: int, accum: int = 1, clip: float = 0.0) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = AwkwardModel()
    optimizers = _reference_optimizers(name, model)
    idx, tgt = make_batches(STEPS, MICRO * world * accum)
    for step in range(STEPS):
        model(idx[step], tgt[step]).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return model.state_dict()


# -- the engine ---------------------------------------------------------------------------------
def _engine(
    name: str,
    stage: int,
    offload: str | None = None,
    zero_init: bool = False,
    accum: int = 1,
    clip: float = 0.0,
    nvme_dir: str | None = None,
):
    torch.manual_seed(0)
    zero = {"stage": stage, "reduce_bucket_size": 50, "sub_group_size": 32}
    if offload:  # "cpu-half": half of the buckets on the host, the others on the device
        device, _, half = offload.partition("-")
        zero["offload_optimizer"] = {
            "device": device,
            "nvme_path": nvme_dir,
            **({"ratio": 0.5} if half else {}),
        }
    config = dict(
        BASE,
        optimizer={"type": name.split("-")[0], "params": CONFIGS[name]},
        zero_optimization=zero,
        gradient_accumulation_steps=accum,
        gradient_clipping=clip,
    )
    if zero_init:
        with zerotrain.zero.Init(config_dict_or_path=config):
            model = AwkwardModel()
    else:
        model = AwkwardModel()
    groups = param_groups(model, 0.1) if name in ("Lion", "Adagrad") else None
    engine, *_ = zerotrain.initialize(model=model, model_parameters=groups, config=config)
    return engine


def train(
    name: str,
    stage: int,
    offload: str | None = None,
    zero_init: bool = False,
    accum: int = 1,
    clip: float = 0.0,
):
    from zerotrain.comm import Communicator

    comm = Communicator()
    engine = _engine(name, stage, offload, zero_init, accum, clip)
    idx, tgt = make_batches(STEPS, MICRO * comm.world_size * accum)
    run_steps(engine, idx, tgt, MICRO, accum, comm.world_size, comm.rank)
    return engine.consolidated_state_dict()


def _check(got: dict, want: dict, what, tolerance: float = 1e-5) -> None:
    for key, value in want.items():
        assert relative_error(got[key], value) < tolerance, (what, key)


GRID = [(name, stage) for name in ("Lion", "Adagrad", "Muon") for stage in (0, 1, 2, 3)]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_optimizer_at_every_stage_matches_a_single_process(world):
    results = run_cases(train, world, GRID)
    for rank_results in results:
        for (name, stage), got in zip(GRID, rank_results, strict=True):
            _check(got, reference(name, world), (name, stage, world))


def train_in_small_rounds(name: str, stage: int):
    """``train`` with the matrices exchanged in rounds of at most 40 elements (each matrix a
    round of its own here) instead of all at once."""
    from zerotrain.zero.whole_matrices import ShardedMatrices

    ShardedMatrices.round_numel = 40  # this rank's process only
    return train(name, stage)


def test_muon_exchanges_matrices_in_rounds():
    cases = [("Muon", stage) for stage in (0, 2, 3)]
    want = reference("Muon", 3)
    for rank_results in run_cases(train_in_small_rounds, 3, cases):
        for case, got in zip(cases, rank_results, strict=True):
            _check(got, want, case)


def test_accumulation_and_clipping():
    """Two micro-steps per step, gradients clipped by their global norm before the optimizer
    steps (torch's meaning, for Muon too: its orthogonalised update is not clipped)."""
    cases = [(name, stage, None, False, 2, 0.05) for name in ("Muon", "Lion") for stage in (1, 3)]
    for rank_results in run_cases(train, 2, cases):
        for case, got in zip(cases, rank_results, strict=True):
            _check(got, reference(case[0], 2, accum=2, clip=0.05), case)


def test_muon_with_bf16_newton_schulz_is_torch_muon():
    """ns_dtype bf16 is torch.optim.Muon's arithmetic: the same bf16 iteration, batched."""
    cases = [("Muon-bf16", stage) for stage in (0, 2, 3)]
    want = reference("Muon-bf16", 2)
    for rank_results in run_cases(train, 2, cases):
        for case, got in zip(cases, rank_results, strict=True):
            _check(got, want, case, tolerance=1e-3)  # bf16 products: batched vs one at a time


def test_a_wrong_split_would_fail_the_parity():
    """The Muon parity above can fail: the same steps with the tied embedding given to Muon
    instead of AdamW end elsewhere."""
    want = reference("Muon", 1)
    torch.manual_seed(0)
    model = AwkwardModel()
    optimizer = Muon(
        [
            {
                "params": [p for p in model.parameters() if p.requires_grad and p.ndim == 2],
                "use_muon": True,
                "lr": 2e-2,
                "momentum": 0.9,
            },
            {
                "params": [p for p in model.parameters() if p.requires_grad and p.ndim != 2],
                "lr": 1e-2,
            },
        ],
        weight_decay=0.1,
        ns_dtype="fp32",
    )
    idx, tgt = make_batches(STEPS, MICRO)
    for step in range(STEPS):
        model(idx[step], tgt[step]).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert relative_error(model.state_dict()["embed.weight"], want["embed.weight"]) > 1e-3


def zero_init_split(stage: int):
    """Under zero.Init the parameters are 1-D placeholders; the split reads their real shape."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("zerotrain")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        state = train("Muon", stage, zero_init=True)
    finally:
        logger.removeHandler(handler)
    return state, [r for r in records if "Muon steps" in r]


def test_zero_init_placeholders_do_not_hide_the_matrices():
    """DeepSpeed PR #8438's bug (Muon silently off under zero.Init: placeholders look 1-D) is
    impossible: the same parameters take Muon's update, said once on rank 0."""
    want = reference("Muon", 2)
    results = run_distributed(zero_init_split, 2, 3)
    for rank, (state, lines) in enumerate(results):
        _check(state, want, ("zero.Init", rank))
        if rank == 0:
            assert len(lines) == 1 and "Muon steps 3 matrices" in lines[0], lines
            assert all(name in lines[0] for name in MUON_MATRICES), lines
        else:
            assert lines == []


def test_use_muon_flag_overrides_the_rule():
    from zerotrain.optim.muon import muon_groups

    model = AwkwardModel()
    model.up.weight.use_muon = False
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups, matrices = muon_groups([({"lr": 1.0}, named)], lambda p: p.shape)
    assert set(matrices) == MUON_MATRICES - {"up.weight"}
    assert [g["use_muon"] for g, _ in groups] == [True, False]
    model.up.bias.use_muon = True
    with pytest.raises(ValueError, match="up.bias.*use_muon=True but shape"):
        muon_groups([({}, named)], lambda p: p.shape)


# -- memory, offload, checkpoints ------------------------------------------------------------
def _trained_engine(name: str, stage: int, offload: str | None, nvme_dir: str | None = None):
    from zerotrain.comm import Communicator

    comm = Communicator()
    engine = _engine(name, stage, offload, nvme_dir=nvme_dir)
    idx, tgt = make_batches(STEPS, MICRO * comm.world_size)
    run_steps(engine, idx, tgt, MICRO, 1, comm.world_size, comm.rank)
    return engine


def memory_and_offload(name: str, stage: int, nvme_dir: str):
    """The in-memory run's memory and state, and the state with the optimizer on the host, on
    NVMe, and half of each. NVMe's sub-groups are cut at 16 elements here (1024 in a run,
    SUB_GROUP_ALIGNMENT, which this tiny model's buckets never reach), so that they cut
    matrices: 16 floats are a whole number of vector-lane blocks of torch's CPU kernels on
    AVX2 and AVX-512, which is what the alignment keeps."""
    from zerotrain.zero import nvme

    nvme.SUB_GROUP_ALIGNMENT = 16
    engine = _trained_engine(name, stage, None)
    breakdown = engine.memory_breakdown()
    in_memory = engine.consolidated_state_dict()
    on_host = _trained_engine(name, stage, "cpu").consolidated_state_dict()
    half = _trained_engine(name, stage, "cpu-half").consolidated_state_dict()
    engine = _trained_engine(name, stage, "nvme", nvme_dir)
    sub_groups = engine.optimizer.groups[0].store.sub_groups
    cut = len({g.bucket for g in sub_groups}) < len(sub_groups)
    on_disk = engine.consolidated_state_dict()
    half_on_disk = _trained_engine(name, stage, "nvme-half", nvme_dir).consolidated_state_dict()
    return (
        breakdown,
        in_memory,
        cut,
        {"cpu": on_host, "cpu, ratio 0.5": half, "nvme": on_disk, "nvme, ratio 0.5": half_on_disk},
    )


def test_state_bytes_follow_the_formula_and_offload_is_bit_for_bit(tmp_path):
    """The measured model-state bytes are the formula's (Lion, Adagrad: 4 bytes of state per
    element; Muon: 4 for its matrices, Adam's 8 for the rest), and the optimizer state on the
    host and on NVMe, all or half of it, steps exactly as in memory (Muon on NVMe: its
    sub-groups cutting matrices, [Note: Muon on NVMe])."""
    cases = [
        (name, stage, str(tmp_path)) for name in ("Lion", "Adagrad", "Muon") for stage in (1, 3)
    ]
    for rank_results in run_cases(memory_and_offload, 2, cases):
        for case, (breakdown, in_memory, cut, offloaded) in zip(cases, rank_results, strict=True):
            assert breakdown["total"] == pytest.approx(breakdown["formula_total"], rel=0.02), case
            assert cut, case  # some bucket is stepped as several sub-groups
            for where, state in offloaded.items():
                assert state.keys() == in_memory.keys(), (case, where)
                for key, value in in_memory.items():
                    assert torch.equal(state[key], value), (case, key, where)


def test_muon_state_bytes_per_element():
    """4 bytes per matrix element, 8 per AdamW element: the weighted figure the formula uses."""
    from zerotrain.optim.state_bytes import optimizer_state_bytes_per_element

    matrices, vectors = [torch.zeros(30, 10)], [torch.zeros(100)]
    muon = Muon([{"params": matrices, "use_muon": True}, {"params": vectors}])
    assert optimizer_state_bytes_per_element(muon) == (300 * 4 + 100 * 8) / 400


def resume(
    name: str,
    stage: int,
    directory: str,
    save_after: int | None,
    offload: str | None = None,
    nvme_dir: str | None = None,
):
    """``save_after`` steps then a save, or (None) a load of that save and the remaining steps;
    the consolidated state at the end."""
    from zerotrain.comm import Communicator

    comm = Communicator()
    engine = _engine(name, stage, offload, nvme_dir=nvme_dir)
    idx, tgt = make_batches(STEPS, MICRO * 2)  # the global batch of 2 ranks, at any world
    micro = MICRO * 2 // comm.world_size
    if save_after is not None:
        run_steps(engine, idx[:save_after], tgt[:save_after], micro, 1, comm.world_size, comm.rank)
        engine.save_checkpoint(directory, tag="mid")
        return None
    engine.load_checkpoint(directory, tag="mid")
    first = engine.global_steps
    assert first == 1  # resumed, not trained from the start
    run_steps(engine, idx[first:], tgt[first:], micro, 1, comm.world_size, comm.rank)
    return engine.consolidated_state_dict()


@pytest.mark.parametrize("name", ["Muon", "Lion", "Adagrad"])
def test_checkpoints_resume_exactly_and_reshard(tmp_path, name):
    """Saved at 2 ranks after one step, resumed at 2 ranks (same stage) and at 1 rank (another
    stage, the shards cut differently): the end is the uninterrupted run's."""
    want = reference(name, 2)
    run_distributed(resume, 2, name, 2, str(tmp_path), 1)
    for world, stage in ((2, 2), (1, 3)):
        for got in run_distributed(resume, world, name, stage, str(tmp_path), None):
            _check(got, want, (name, world, stage))


def test_muon_on_nvme_resumes_exactly_and_reshards(tmp_path):
    """Saved from NVMe at 2 ranks after one step: resumed on NVMe at the same stage, it ends
    with the in-memory resume's bits; in memory at 1 rank and another stage, as the reference.
    Saved in memory, it resumes on NVMe at another stage."""
    want = reference("Muon", 2)
    swap, from_disk, from_memory = (str(tmp_path / d) for d in ("swap", "disk", "memory"))
    run_distributed(resume, 2, "Muon", 1, from_disk, 1, "nvme", swap)
    on_disk = run_distributed(resume, 2, "Muon", 1, from_disk, None, "nvme", swap)
    in_memory = run_distributed(resume, 2, "Muon", 1, from_disk, None)
    for got, same in zip(on_disk, in_memory, strict=True):
        assert got.keys() == same.keys()
        for key, value in same.items():
            assert torch.equal(got[key], value), key
        _check(got, want, "nvme")
    for got in run_distributed(resume, 1, "Muon", 3, from_disk, None):
        _check(got, want, "from nvme, 1 rank")
    run_distributed(resume, 2, "Muon", 2, from_memory, 1)
    for got in run_distributed(resume, 2, "Muon", 3, from_memory, None, "nvme", swap):
        _check(got, want, "onto nvme")


def muon_with_tensor_parallelism() -> str:
    from zerotrain.config import ConfigError

    config = dict(
        BASE,
        optimizer={"type": "Muon", "params": {}},
        tensor_parallel={"autotp_size": 2},
    )
    try:
        zerotrain.initialize(model=AwkwardModel(), config=config)
    except ConfigError as error:
        return str(error)
    return "no error"


def test_muon_with_tensor_parallelism_is_refused_with_the_reason():
    """The config's Muon before the model is split; one the script built once the layout
    checks the optimizer."""
    for message in run_distributed(muon_with_tensor_parallelism, 2):
        assert "Muon orthogonalises whole matrices, and tensor parallelism splits" in message
    for message in run_distributed(client_muon_with_tensor_parallelism, 2):
        assert "Muon orthogonalises whole matrices, and tensor parallelism" in message


# -- with pipeline parallelism -------------------------------------------------------------------
def muon_pipeline(stage: int):
    """Muon on the pipeline tests' PipelineModule (pp 2 x dp 2): each stage's shard group
    orthogonalises the matrices of its own layers."""
    import test_pipeline as pipe

    from zerotrain.pipe import PipelineModule

    model = PipelineModule(
        pipe.layer_specs(),
        num_stages=2,
        loss_fn=pipe.loss_fn,
        seed_layers=True,
        base_seed=pipe.SEED,
        partition_method="parameters",
    )
    settings = pipe.config(stage, "1f1b")
    settings["optimizer"] = {"type": "Muon", "params": {"lr": pipe.LR, **PIPELINE_MUON}}
    engine, *_ = zerotrain.initialize(model=model, config=settings)
    dp, dp_rank = engine.dp_world_size, engine.optimizer.comm.rank
    for batch in pipe.batches(dp):
        engine.train_batch(pipe.micro_batches(batch, dp, dp_rank))
    return engine.consolidated_state_dict()


PIPELINE_MUON = {"muon_lr": 0.02, "momentum": 0.9, "eps": 1e-5}


def pipeline_reference(dp: int) -> dict[str, torch.Tensor]:
    import test_pipeline as pipe

    model = pipe.reference_model()
    matrices, rest = _split(model)
    optimizers = [
        PlainMuon(matrices, lr=0.02, weight_decay=0.0, momentum=0.9),
        torch.optim.AdamW(rest, lr=pipe.LR, eps=1e-5, weight_decay=0.0),
    ]
    for batch in pipe.batches(dp):
        chunks = pipe.ACCUM * dp
        for chunk in range(chunks):
            window = batch[chunk * pipe.MICRO : (chunk + 1) * pipe.MICRO]
            (pipe.loss_fn(model(window[:, :-1]), window[:, 1:]) / chunks).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), pipe.CLIP)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return model.state_dict()


def test_muon_with_pipeline_parallelism_matches_a_single_process():
    want = pipeline_reference(dp=2)
    for rank_results in run_cases(muon_pipeline, 4, [(0,), (2,)]):
        for got in rank_results:
            assert got.keys() == want.keys()
            for key, value in want.items():
                assert relative_error(got[key], value) < 1e-5, key


# -- with expert parallelism ---------------------------------------------------------------------
MOE_MUON = {"type": "Muon", "params": {"lr": 1e-2, "muon_lr": 0.02, "momentum": 0.9, "eps": 1e-5}}


def muon_moe(ep: int, stage: int):
    """Muon on the MoE tests' model: the experts' matrices are orthogonalised in their own shard
    group (the ranks holding the same experts)."""
    import test_moe as moe

    moe.MOE_CONFIG["optimizer"] = MOE_MUON  # this rank's process only
    engine = moe.moe_engine(ep, stage, ranks=4)
    moe.run_moe(engine, moe.moe_batches(engine.dp_world_size))
    return engine.consolidated_state_dict()


def moe_reference() -> dict[str, torch.Tensor]:
    import test_moe as moe

    model = moe.MoEModel(k=2)
    matrices, rest = _split(model)
    optimizers = [
        PlainMuon(matrices, lr=0.02, weight_decay=0.0, momentum=0.9),
        torch.optim.AdamW(rest, lr=1e-2, eps=1e-5, weight_decay=0.0),
    ]
    for batch in moe.moe_batches(4):
        for chunk in range(moe.ACCUM * 4):
            window = batch[chunk * moe.MICRO : (chunk + 1) * moe.MICRO]
            (model(window) / (moe.ACCUM * 4)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return model.state_dict()


def test_muon_with_expert_parallelism_matches_a_single_process():
    want = moe_reference()
    for rank_results in run_cases(muon_moe, 4, [(2, 1), (4, 3)]):
        for got in rank_results:
            assert got.keys() == want.keys()
            for key, value in want.items():
                assert relative_error(got[key], value) < 1e-5, key


def test_newton_schulz_batched_by_shape_is_one_at_a_time():
    """The GPU's path (matrices of one shape orthogonalised in one batch) computes what the
    CPU's (one at a time) does."""
    from zerotrain.optim.muon import NS_COEFFICIENTS, newton_schulz, orthogonalize_all

    torch.manual_seed(0)
    matrices = [torch.randn(shape) for shape in [(13, 7), (7, 13), (13, 7), (5, 7), (13, 7)]]

    def fn(batch):
        return newton_schulz(batch, 5, NS_COEFFICIENTS, 1e-7)

    batched = orthogonalize_all(matrices, fn, batched=True)
    single = orthogonalize_all(matrices, fn, batched=False)
    for a, b, m in zip(batched, single, matrices, strict=True):
        assert a.shape == m.shape and a.is_contiguous()
        assert relative_error(a, b) < 1e-5
        assert relative_error(b, plain_newton_schulz(m)) < 1e-5


def client_muon_with_tensor_parallelism() -> str:
    from torch import nn

    from zerotrain.config import ConfigError

    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
    matrices = [model[0].weight, model[2].weight]
    biases = [model[0].bias, model[2].bias]
    optimizer = Muon([{"params": matrices, "use_muon": True}, {"params": biases}])
    plan = {"0": "colwise", "2": "rowwise"}
    config = dict(
        BASE, tensor_parallel={"autotp_size": 2, "tp_plan": plan}, zero_optimization={"stage": 1}
    )
    try:
        zerotrain.initialize(model=model, optimizer=optimizer, config=config)
    except ConfigError as error:
        return str(error)
    return "no error"
