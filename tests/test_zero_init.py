"""zero.Init (build partitioned) and GatheredParameters (full access for a moment)."""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from models import BlockModel
from test_stage3 import _check_against_reference, _config, train_block_model
from torch import nn

import zerotrain

LAYERS, WIDTH, HIDDEN = 32, 512, 1024


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, WIDTH))
            for _ in range(LAYERS)
        )

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


TOWER_BYTES = LAYERS * (2 * WIDTH * HIDDEN + HIDDEN + WIDTH) * 4  # 134 MB of fp32 parameters
BLOCK_NUMEL = 2 * WIDTH * HIDDEN + HIDDEN + WIDTH


def _data_segment_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmData in /proc/self/status")


def build_and_train_beyond_limit(budget_fraction: float):
    import resource

    limit = _data_segment_bytes() + int(budget_fraction * TOWER_BYTES)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.RLIM_INFINITY))
    with zerotrain.zero.Init():
        model = Tower()
    try:
        Tower()  # control: the same model built whole must not fit under this limit
        control = "fits"
    except RuntimeError as err:
        control = "fails" if "allocate" in str(err) else str(err)
    resource.setrlimit(resource.RLIMIT_DATA, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    engine, optimizer, *_ = zerotrain.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
            "zero_optimization": {
                "stage": 3,
                "stage3_param_persistence_threshold": 0,
                "stage3_prefetch_bucket_size": BLOCK_NUMEL,
                "stage3_max_live_parameters": 3 * BLOCK_NUMEL,
            },
            "steps_per_print": 10**6,
        },
    )
    torch.manual_seed(1)
    x = torch.randn(2, WIDTH)
    losses = []
    for _ in range(3):
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return control, losses, optimizer.group.residency.gatherer.max_live_numel_seen


def test_init_builds_a_model_larger_than_the_rank_limit_and_trains_it(monkeypatch):
    # A fixed mmap threshold makes glibc return freed large blocks to the OS, so the data
    # segment measures live memory rather than heap fragmentation. glibc reads it as the
    # process starts, so each rank is a new interpreter.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    ranks = run_distributed(build_and_train_beyond_limit, 2, 0.65, fresh_interpreter=True)
    for control, losses, max_live in ranks:
        assert control == "fails", control
        assert losses[-1] < losses[0]
        assert max_live <= 3 * BLOCK_NUMEL + 2  # gathered parameters never near the full model


def _init_block_model():
    torch.manual_seed(0)
    with zerotrain.zero.Init():
        model = BlockModel()
    assert all(p.dim() == 1 for p in model.parameters())  # chunks until initialize
    return model


@pytest.mark.parametrize("world", [2, 3])
def test_model_built_under_init_trains_like_a_whole_one(world):
    for per_stage in run_distributed(train_block_model, world, [1, 3], {}, _init_block_model):
        _check_against_reference(per_stage, world)


def gathered_parameters_cases(stage, precision):
    from zerotrain.comm import Communicator

    rank = Communicator().rank
    torch.manual_seed(0)
    with zerotrain.zero.Init():
        model = BlockModel()
    weight = model.blocks[0].up.weight
    seen = {}
    with zerotrain.zero.GatheredParameters(weight):
        seen["init_shape"] = tuple(weight.shape)
        seen["init_value"] = weight.detach().clone()
        weight.data.fill_(7.0)  # no modifier_rank: discarded
    with zerotrain.zero.GatheredParameters([weight, model.embed.weight], modifier_rank=0):
        if rank == 0:
            model.embed.weight.data.fill_(0.5)
    seen["chunk_shape"] = tuple(weight.shape)
    config = _config(stage)
    config.update(precision)
    engine, *_ = zerotrain.initialize(model=model, config=config)
    head = engine.module.blocks[2].down.weight
    with zerotrain.zero.GatheredParameters(head, modifier_rank=1):
        seen["engine_shape"] = tuple(head.shape)
        if rank == 1:
            head.data.fill_(0.25)
    seen["after_exit_numel"] = head.numel()
    seen["state"] = engine.consolidated_state_dict()
    return seen


@pytest.mark.parametrize("stage,precision", [(3, {}), (1, {"bf16": {"enabled": True}})])
def test_gathered_parameters_read_and_modify(stage, precision):
    torch.manual_seed(0)
    want = BlockModel().state_dict()
    for seen in run_distributed(gathered_parameters_cases, 2, stage, precision):
        assert seen["init_shape"] == (13, 7) and seen["chunk_shape"] == (46,)
        assert torch.equal(seen["init_value"], want["blocks.0.up.weight"])
        state = seen["state"]
        tol = 1e-2 if precision else 0  # bf16 parameters round the values
        assert torch.allclose(state["blocks.0.up.weight"], want["blocks.0.up.weight"], atol=tol)
        assert torch.all(state["embed.weight"] == 0.5)  # rank 0's change kept
        assert torch.all(state["blocks.2.down.weight"] == 0.25)  # rank 1's change, masters too
        assert seen["engine_shape"] == (7, 5)
        assert seen["after_exit_numel"] == (0 if stage == 3 else 35)


def test_init_checks_its_config_before_any_module_is_built(tmp_path):
    # a typo is reported before the (possibly minutes-long) build, not at initialize
    typo = {"train_batch_size": 8, "zero_optimisation": {"stage": 3}}
    with pytest.raises(zerotrain.ConfigError, match="zero_optimisation: unknown key; did you mean"):
        zerotrain.zero.Init(config_dict_or_path=typo)
    path = tmp_path / "ds_config.json"
    path.write_text('{"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": -1}}}')
    with pytest.raises(zerotrain.ConfigError, match="optimizer.params.lr: must be >= 0"):
        zerotrain.zero.Init(config=str(path))
    # HuggingFace's unfilled placeholders are left to the Trainer: no error, bf16 still read
    unfilled = {
        "train_batch_size": "auto",
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"},
    }
    assert zerotrain.zero.Init(config_dict_or_path=unfilled).dtype == torch.bfloat16


def _torch_state() -> dict:
    """What zero.Init patches: torch's constructors, nn.Module's subclass hook, every
    module class's own __init__."""
    from zerotrain.zero.init import _module_classes

    return {
        "constructors": {n: getattr(torch, n) for n in TORCH_CONSTRUCTORS},
        "subclass_hook": nn.Module.__dict__.get("__init_subclass__"),
        "inits": {cls: cls.__dict__.get("__init__") for cls in _module_classes()},
    }


TORCH_CONSTRUCTORS = ("tensor", "empty", "zeros", "ones", "full", "arange", "eye", "randn")


class _Buffers(nn.Module):
    """Buffers only (nothing to partition, so no process group): what torch's constructors
    give inside Init."""

    def __init__(self):
        super().__init__()
        self.register_buffer("default", torch.zeros(3))
        self.register_buffer(
            "rope", 1.0 / (10000 ** (torch.arange(0, 4, 2, dtype=torch.int64) / 4))
        )
        self.register_buffer("explicit", torch.ones(2, dtype=torch.float64))
        self.register_buffer("ids", torch.tensor([1, 2]))


def test_init_leaves_torch_device_contexts_working():
    """torch caches the constructors a device context redirects the first time one is used;
    built inside Init, the cache held Init's wrappers, and torch.device("meta") then built on
    the CPU for the rest of the process (an OnDevice meta model, whole, in host memory)."""
    from torch.utils import _device

    _device._device_constructors.cache_clear()  # as in a process that never used one
    try:
        with zerotrain.zero.Init(), torch.device("cpu"):
            torch.empty(1)
        with torch.device("meta"):
            assert torch.empty(3).device.type == "meta"
    finally:
        _device._device_constructors.cache_clear()


def test_init_wraps_torch_constructors_through_the_served_name(monkeypatch):
    from zerotrain.runtime.zero import partition_parameters as pp
    from zerotrain.zero import init as init_module

    before = _torch_state()
    asked = []
    wrapper = pp.zero_wrapper_for_fp_tensor_constructor

    def override(fn, *args, **kwargs):  # as transformers replaces it around from_pretrained
        asked.append((fn, kwargs))
        return wrapper(fn, *args, **kwargs)

    monkeypatch.setattr(pp, "zero_wrapper_for_fp_tensor_constructor", override)
    assert init_module.zero_wrapper_for_fp_tensor_constructor is override  # one value
    with zerotrain.zero.Init(dtype=torch.bfloat16):
        inside = {n: getattr(torch, n) for n in TORCH_CONSTRUCTORS}
        buffers = _Buffers()
    originals = {n: getattr(pp, f"_orig_torch_{n}") for n in TORCH_CONSTRUCTORS}
    assert originals == before["constructors"]
    assert [fn for fn, _ in asked] == list(originals.values())
    assert all(kw == {"target_fp_dtype": None, "target_device": None} for _, kw in asked)
    assert all(inside[n] is not originals[n] for n in TORCH_CONSTRUCTORS)
    # dtypes as the code asked for (zerotrain casts parameters when it partitions them)
    assert {n: b.dtype for n, b in buffers.named_buffers()} == {
        "default": torch.float32,
        "rope": torch.float32,
        "explicit": torch.float64,
        "ids": torch.int64,
    }
    assert all(torch.equal(b, getattr(_Buffers(), n)) for n, b in buffers.named_buffers())
    assert _torch_state() == before


def test_zero_wrapper_for_fp_tensor_constructor_as_deepspeed_defines_it():
    from zerotrain.runtime.zero.partition_parameters import zero_wrapper_for_fp_tensor_constructor

    zeros = zero_wrapper_for_fp_tensor_constructor(torch.zeros, torch.bfloat16, "meta")
    assert zeros(3).dtype == torch.bfloat16 and zeros(3).device.type == "meta"
    assert zeros(3, device="cpu").device.type == "cpu"  # a device the call names is kept
    arange = zero_wrapper_for_fp_tensor_constructor(torch.arange, torch.bfloat16)
    assert arange(4).dtype == torch.int64  # only floating-point tensors are cast
    assert arange(4.0).dtype == torch.bfloat16
    unchanged = zero_wrapper_for_fp_tensor_constructor(torch.ones, None, None)
    assert torch.equal(unchanged(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64))


class _Fails(nn.Module):
    def __init__(self):
        super().__init__()
        _Fails.zeros_seen = torch.zeros
        raise ValueError("a module's __init__ failed")


@pytest.mark.parametrize("where", ["inside", "wrapper", "patching"])
def test_a_failed_init_restores_torch_and_module_classes(monkeypatch, where):
    from zerotrain.runtime.zero import partition_parameters as pp
    from zerotrain.zero.init import Init

    before = _torch_state()
    if where == "wrapper":  # a client's wrapper fails on the fifth constructor
        wrapper, made = pp.zero_wrapper_for_fp_tensor_constructor, []

        def failing_wrapper(fn, *args, **kwargs):
            made.append(fn)
            if len(made) == 5:
                raise RuntimeError("a client's wrapper failed")
            return wrapper(fn, *args, **kwargs)

        monkeypatch.setattr(pp, "zero_wrapper_for_fp_tensor_constructor", failing_wrapper)
    if where == "patching":  # patching a module class fails part-way through __enter__
        patch, patched = Init._patch, []

        def failing_patch(self, cls):
            patched.append(cls)
            if len(patched) == 5:
                raise RuntimeError("patching failed")
            patch(self, cls)

        monkeypatch.setattr(Init, "_patch", failing_patch)
    with pytest.raises((ValueError, RuntimeError), match="failed"):
        with zerotrain.zero.Init():
            _Fails()
    if where == "inside":
        assert _Fails.zeros_seen is not before["constructors"]["zeros"]  # it was wrapped
    assert _torch_state() == before
    linear = nn.Linear(3, 2)  # built as without Init
    assert linear.weight.shape == (2, 3) and not hasattr(linear.weight, "ds_id")
