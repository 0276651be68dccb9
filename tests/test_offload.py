"""Optimizer offload: the same parameters as in-memory training, bit for bit, at every stage,
ratio and world size; the hand-off, the ring, the preflight, checkpoints across placements."""

from __future__ import annotations

import tempfile

import pytest
import torch
from distributed import run_cases, run_distributed
from models import AwkwardModel, make_batches, param_groups, relative_error, run_steps
from test_parity import ACCUM, BETAS, CLIP, EPS, LR, MICRO, STEPS, WD, reference
from test_precision import train_fp16_with_overflow

import zerotrain
import zerotrain.policies
from zerotrain.accelerator import HostMemoryLimit
from zerotrain.config import ConfigError
from zerotrain.estimate import preflight
from zerotrain.zero.host import host_cores_for_rank
from zerotrain.zero.offload import (
    HostBytes,
    choose_host_buckets,
    fit_on_device,
    host_bytes,
)

# offload_optimizer sections; "none" is the in-memory run the others must equal bit for bit.
# NVME_PATH is replaced by a fresh directory per process.
NVME_PATH = "<tmp>"
VARIANTS = {
    "none": {"device": "none"},
    "cpu": {"device": "cpu", "buffer_count": 1},  # one ring buffer: reused for every bucket
    "cpu-half": {"device": "cpu", "ratio": 0.5},
    "nvme": {"device": "nvme", "nvme_path": NVME_PATH, "buffer_count": 3},
    "nvme-half": {"device": "nvme", "nvme_path": NVME_PATH, "ratio": 0.5, "buffer_count": 1},
}
OFFLOADED = [name for name in VARIANTS if name != "none"]


def _config(
    stage: int, offload: dict, precision: dict | None = None, zero: dict | None = None
) -> dict:
    if offload.get("nvme_path") == NVME_PATH:
        offload = {**offload, "nvme_path": tempfile.mkdtemp(prefix="zerotrain-nvme-")}
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 60,  # several buckets: the ratio splits them
            "stage3_param_persistence_threshold": 0,
            "offload_optimizer": offload,
        },
        "steps_per_print": 10**6,
        **(precision or {}),
    }
    config["zero_optimization"].update(zero or {})
    return config


def _run_parity_steps(engine, comm, after_step) -> None:
    """The parity tests' STEPS global batches on this rank, ``after_step()`` after each step."""
    idx, tgt = make_batches(STEPS, MICRO * ACCUM * comm.world_size)
    run_steps(engine, idx, tgt, MICRO, ACCUM, comm.world_size, comm.rank, lambda _: after_step())


def train_variants(stages, variants, precision=None, zero=None):
    from zerotrain.comm import Communicator

    comm = Communicator()
    out = {}
    for stage in stages:
        for name in variants:
            torch.manual_seed(0)
            model = AwkwardModel()
            engine, optimizer, *_ = zerotrain.initialize(
                model=model,
                model_parameters=param_groups(model, WD),
                config=_config(stage, VARIANTS[name], precision, zero),
            )
            norms = []
            _run_parity_steps(
                engine, comm, lambda e=engine, n=norms: n.append(e.get_global_grad_norm())
            )
            out[(stage, name)] = {
                "state": engine.consolidated_state_dict(),
                "norms": norms,
                "on_host": list(getattr(optimizer.group.store, "on_host", [])),
                "memory": engine.memory_breakdown(),
                "param_home": _home_figures(engine.optimizer.group.residency.home),
            }
    return out


def _home_figures(home) -> dict:
    """What stage 3's NVMe parameter home did (see zerotrain/zero/param_home.py)."""
    buffers = home.host_tensors()
    return {
        "read_ahead": getattr(home, "reads_ahead", 0),
        "bytes_read": getattr(home, "bytes_read", 0),
        "buffers": len(buffers),
        "buffer_bytes": max((b.numel() for b in buffers), default=0),
    }


@pytest.mark.parametrize("world", [1, 2, 3])
def test_offload_equals_in_memory_bit_for_bit(world):
    expected_state, _ = reference(world)
    for results in run_distributed(train_variants, world, [1, 2, 3], list(VARIANTS)):
        for stage in (1, 2, 3):
            base = results[(stage, "none")]
            for name in OFFLOADED:
                got = results[(stage, name)]
                for key, value in base["state"].items():
                    assert torch.equal(got["state"][key], value), (world, stage, name, key)
                assert got["norms"] == base["norms"]
            for half in ("cpu-half", "nvme-half"):
                on_host = results[(stage, half)]["on_host"]
                assert any(on_host) and not all(on_host), on_host  # really split
            assert all(results[(stage, "cpu")]["on_host"])
            assert results[(stage, "nvme")]["memory"]["disk"] > 0
            for key, value in expected_state.items():  # and the single-process reference
                assert relative_error(base["state"][key], value) < 1e-5, (stage, key)


def test_stage3_parameter_offload_equals_in_memory_bit_for_bit():
    devices = ["cpu", "nvme"]
    cases = [([3], ["none"])]
    for device in devices:
        section = {"device": device}
        if device == "nvme":  # two buffers, reused for every bucket
            section.update(nvme_path=tempfile.mkdtemp(prefix="zerotrain-nvme-"), buffer_count=2)
        cases.append(([3], ["none", "cpu", "nvme"], None, {"offload_param": section}))
    for base, *per_device in run_cases(train_variants, 2, cases):  # per rank
        for device, got in zip(devices, per_device, strict=True):
            _check_parameter_offload(base[(3, "none")], got, device)


def _check_parameter_offload(in_memory: dict, got: dict, device: str) -> None:
    """One rank's results with the parameter shards on ``device``, against in-memory ones."""
    for name in ("none", "cpu", "nvme"):
        result = got[(3, name)]
        for key, value in in_memory["state"].items():
            assert torch.equal(result["state"][key], value), (name, key)
        assert result["norms"] == in_memory["norms"], name
        # every unit is sharded (persistence threshold 0): no shard is on the device
        params = in_memory["memory"]["parameters"]
        assert result["memory"]["parameters"] == 0 and params > 0, name
        if device == "cpu":
            assert result["memory"]["offloaded"] >= params, name
            continue
        # on NVMe: in the file, read at each gather; the host holds two buffers
        home = result["param_home"]
        assert result["memory"]["disk"] >= params, name
        assert home["bytes_read"] > 0 and home["buffers"] == 2, (name, home)
        assert home["buffer_bytes"] < params, (name, home)  # one bucket's shard


def test_offload_bf16_equals_in_memory_bit_for_bit():
    for results in run_distributed(
        train_variants, 2, [2], ["none", "cpu-half"], {"bf16": {"enabled": True}}
    ):
        base, got = results[(2, "none")], results[(2, "cpu-half")]
        for key, value in base["state"].items():
            assert torch.equal(got["state"][key], value), key


def test_fp16_overflow_skips_the_offloaded_step_on_every_rank(tmp_path):
    cases = [
        (stage, 1, 1, {"offload_optimizer": {"device": device, "nvme_path": str(tmp_path)}})
        for device in ("cpu", "nvme")
        for stage in (1, 3)
    ]
    for per_case in run_cases(train_fp16_with_overflow, 2, cases):
        for case, rank_log in zip(cases, per_case, strict=True):
            assert [e["changed"] for e in rank_log] == [True, False, True, True], case
            assert rank_log[-1]["skipped"] == 1
            assert all(e["finite"] for e in rank_log)


# stage 3 with both the optimizer and the parameter shards on NVMe: three buffers, prefetch
# of at most one block ahead, so that the next block's shard is read ahead
PARAMS_ON_NVME = {
    "offload_param": {"device": "nvme", "nvme_path": NVME_PATH, "buffer_count": 3},
    "stage3_prefetch_bucket_size": 6000,
}


def train_gpt2(stages):
    from test_transformers_gpt2 import batches, build_gpt2, groups

    from zerotrain.comm import Communicator

    comm = Communicator()
    out = {}
    for stage in stages:
        names = ["none", "cpu", "nvme"] + (["nvme-params"] if stage == 3 else [])
        for name in names:
            model = build_gpt2()
            config = _config(stage, VARIANTS[name.removesuffix("-params")])
            # NVMe: several sub-groups per bucket (sub-group sizes are multiples of 1024)
            config["zero_optimization"].update(reduce_bucket_size=5000, sub_group_size=2048)
            if name == "nvme-params":
                section = {**PARAMS_ON_NVME["offload_param"], "nvme_path": tempfile.mkdtemp()}
                config["zero_optimization"].update(PARAMS_ON_NVME, offload_param=section)
            config["optimizer"]["params"]["eps"] = 1e-6
            engine, optimizer, *_ = zerotrain.initialize(
                model=model, model_parameters=groups(model), config=config
            )
            data = batches(comm.world_size)
            for step in range(2):
                for micro in range(ACCUM):
                    chunk = micro * comm.world_size + comm.rank
                    x = data[step][chunk * MICRO : (chunk + 1) * MICRO]
                    engine.backward(engine(input_ids=x, labels=x).loss)
                    engine.step()
            out[(stage, name)] = engine.consolidated_state_dict()
            out[(stage, name, "home")] = _home_figures(optimizer.group.residency.home)
    return out


def test_offload_gpt2_equals_in_memory_bit_for_bit():
    pytest.importorskip("transformers")
    for results in run_distributed(train_gpt2, 2, [1, 2, 3]):
        for stage in (1, 2, 3):
            for name in ("cpu", "nvme") + (("nvme-params",) if stage == 3 else ()):
                base, got = results[(stage, "none")], results[(stage, name)]
                for key, value in base.items():
                    assert torch.equal(got[key], value), (stage, name, key)
        home = results[(3, "nvme-params", "home")]
        assert home["read_ahead"] > 0 and home["buffers"] == 3, home


def _engine(stage: int, offload: dict, zero: dict | None = None):
    torch.manual_seed(0)
    model = AwkwardModel()
    engine, *_ = zerotrain.initialize(
        model=model,
        model_parameters=param_groups(model, WD),
        config=_config(stage, offload, zero=zero),
    )
    return engine


def _train(engine, steps: range) -> None:
    idx, tgt = make_batches(4, MICRO * ACCUM)  # the same 4 batches, whichever steps run
    run_steps(
        engine, idx[steps.start : steps.stop], tgt[steps.start : steps.stop], MICRO, ACCUM, 1, 0
    )


@pytest.mark.parametrize(
    ("first", "second"),
    [("cpu", "none"), ("none", "cpu-half"), ("nvme", "none"), ("none", "nvme-half")],
)
def test_checkpoints_move_between_offloaded_and_in_memory_runs(tmp_path, first, second):
    straight = _engine(2, VARIANTS["none"])
    _train(straight, range(4))
    before = _engine(2, VARIANTS[first])
    _train(before, range(2))
    before.save_checkpoint(tmp_path, tag="two")
    after = _engine(2, VARIANTS[second])
    after.load_checkpoint(tmp_path, tag="two")
    _train(after, range(2, 4))
    want = straight.consolidated_state_dict()
    for key, value in after.consolidated_state_dict().items():
        assert torch.equal(value, want[key]), key


def test_memory_breakdown_counts_the_host_bytes_of_the_formula():
    engine = _engine(1, VARIANTS["cpu"])
    _train(engine, range(1))  # Adam's state exists after a step
    memory = engine.memory_breakdown()
    # fp32 masters + exp_avg + exp_avg_sq + fp32 gradients, per element, and Adam's 4-byte step
    # counter per master; the formula leaves out the counters, and the padding of each bucket to
    # the world size (none here: one rank)
    masters = len(engine.optimizer.group.store.master_shards())
    assert memory["formula_offloaded"] == 16 * engine.optimizer.num_params
    assert memory["offloaded"] == memory["formula_offloaded"] + 4 * masters
    assert memory["optimizer_states"] == 0  # none left on the device
    largest = max(m.numel() for m in engine.optimizer.group.store.master_shards())
    assert memory["staging"] == 1 * largest * 4  # buffer_count 1, fp32 training


def test_host_buckets_are_the_first_in_backward():
    assert choose_host_buckets([10, 10, 10, 10], 0.5) == [True, True, False, False]
    assert choose_host_buckets([10, 10, 10, 10], 0.3) == [True, True, False, False]
    assert choose_host_buckets([10, 10, 10, 10], 0.0) == [False] * 4
    assert choose_host_buckets([10, 10, 10, 10], 1.0) == [True] * 4
    # auto: the device keeps the last buckets while their 12 bytes per element fit
    assert fit_on_device([10, 10, 10, 10], 12, 250) == [True, True, False, False]
    assert fit_on_device([10, 10, 10, 10], 12, 10_000) == [False] * 4
    assert fit_on_device([10, 10, 10, 10], 12, 0) == [True] * 4


def test_each_rank_steps_on_its_share_of_the_cores():
    cores = list(range(16))
    assert host_cores_for_rank(cores, 1, 4) == [4, 5, 6, 7]
    assert host_cores_for_rank(cores, 0, 1) == cores  # one rank: all of them
    assert host_cores_for_rank(cores[:6], 2, 4) == cores[:6]  # one core each: not pinned


def test_ratio_auto_keeps_on_the_device_what_fits(monkeypatch):
    per_bucket = []

    def budget(device):
        per_bucket.append(device)
        return 0  # a full device: everything goes to the host

    monkeypatch.setattr(zerotrain.policies, "device_budget", budget)
    engine = _engine(2, {"device": "cpu", "ratio": "auto"})
    assert per_bucket and all(engine.optimizer.group.store.on_host)
    monkeypatch.setattr(zerotrain.policies, "device_budget", lambda device: 10**12)
    assert not any(_engine(2, {"device": "cpu", "ratio": "auto"}).optimizer.group.store.on_host)


def test_preflight_refuses_what_the_host_cannot_hold(monkeypatch):
    needed = host_bytes(3 << 30, 3 << 30, state_bytes=8, param_itemsize=2, buffer_count=4)
    # the ring: 4 buffers of at most 16M elements (RING_CHUNK), however large the bucket
    assert needed == HostBytes(12 << 30, 24 << 30, 12 << 30, 4 * (1 << 24) * 2)
    # at initialize (the memory preflight), before the host buffers are allocated
    limit = [HostMemoryLimit(100, "RLIMIT_AS", "process")]
    monkeypatch.setattr(preflight, "host_memory_limits", lambda: limit)
    with pytest.raises(ConfigError) as error:
        _engine(2, {"device": "cpu"})
    assert "rank 0 needs " in str(error.value), error.value
    assert "of host memory (parameters " in str(error.value), error.value
    assert "offloaded optimizer state " in str(error.value), error.value
    assert "(RLIMIT_AS: 100 B, plus " in str(error.value), error.value
    # stage 3's parameter shards (offload_param), before they are allocated
    with pytest.raises(ConfigError, match=r", parameter shards [\d.]+ KiB"):
        _engine(3, VARIANTS["none"], {"offload_param": {"device": "cpu"}})


def test_nvme_preflight_and_refusals(tmp_path, monkeypatch):
    from zerotrain.zero import host

    nvme_config = {"device": "nvme", "nvme_path": str(tmp_path)}
    # a file left by a process killed with -9 (pid 2**22 + 1 is above Linux's pid_max)
    stale = tmp_path / f"zerotrain-{2**22 + 1}-1.swap"
    stale.write_bytes(b"x")
    engine = _engine(2, nvme_config)
    assert not stale.exists()
    assert len(list(tmp_path.glob("zerotrain-*.swap"))) == 1  # this engine's
    del engine
    monkeypatch.setattr(host.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 100})())
    with pytest.raises(ConfigError) as error:
        _engine(2, nvme_config)
    assert str(error.value).startswith(
        f"zero_optimization.offload_optimizer.nvme_path: {tmp_path} has 100 B free, but each "
        "rank's working file needs "
    )
    monkeypatch.undo()
    lamb = _config(2, nvme_config)
    lamb["optimizer"] = {"type": "Lamb", "params": {"lr": 1e-3}}
    torch.manual_seed(0)
    with pytest.raises(ConfigError, match="Lamb needs whole parameters"):
        zerotrain.initialize(model=AwkwardModel(), config=lamb)


def test_parameters_on_nvme_preflight(tmp_path, monkeypatch):
    from zerotrain.zero import host

    params_on_nvme = {"offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}
    stale = tmp_path / f"zerotrain-{2**22 + 1}-params-1.swap"  # a killed process's
    stale.write_bytes(b"x")
    _engine(3, VARIANTS["none"], params_on_nvme)
    assert not stale.exists()
    assert len(list(tmp_path.glob("zerotrain-*-params-*.swap"))) == 1  # this engine's
    small = {"offload_param": {**params_on_nvme["offload_param"], "buffer_size": 10}}
    with pytest.raises(ConfigError) as error:
        _engine(3, VARIANTS["none"], small)
    assert str(error.value) == (
        "zero_optimization.offload_param.buffer_size: 10 elements, but this rank's largest "
        "stage-3 parameter shard (one gather unit's share) has 294; set buffer_size to at "
        "least 294"
    )
    limit = [HostMemoryLimit(100, "MemAvailable", "node")]
    monkeypatch.setattr(preflight, "host_memory_limits", lambda: limit)
    with pytest.raises(ConfigError, match="offload_param's NVMe buffers"):
        _engine(3, VARIANTS["none"], params_on_nvme)
    monkeypatch.undo()
    monkeypatch.setattr(host.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 100})())
    with pytest.raises(ConfigError) as error:
        _engine(3, VARIANTS["none"], params_on_nvme)
    assert str(error.value).startswith(
        f"zero_optimization.offload_param.nvme_path: {tmp_path} has 100 B free, but each rank's "
        "working file needs 1.95 KiB (stage-3 parameter shards)"  # 318 + 182 frozen, fp32
    )


@pytest.mark.parametrize(("first", "second"), [("nvme", "none"), ("none", "nvme")])
def test_checkpoints_move_between_parameter_homes(tmp_path, first, second):
    def engine(where: str):
        section = {"device": where, "nvme_path": str(tmp_path / "swap"), "buffer_count": 1}
        return _engine(3, VARIANTS[where], {"offload_param": section})

    straight = engine("none")
    _train(straight, range(4))
    before = engine(first)
    _train(before, range(2))
    before.save_checkpoint(tmp_path, tag="two")
    after = engine(second)
    after.load_checkpoint(tmp_path, tag="two")
    _train(after, range(2, 4))
    want = straight.consolidated_state_dict()
    for key, value in after.consolidated_state_dict().items():
        assert torch.equal(value, want[key]), key


@pytest.mark.parametrize(
    ("stage", "optimizer", "params"), [(3, "none", "nvme"), (2, "cpu", "none")]
)
def test_a_parameter_modified_in_place_reaches_its_offloaded_copies(
    tmp_path, stage, optimizer, params
):
    section = {"device": params, "nvme_path": str(tmp_path), "buffer_count": 1}
    engine = _engine(stage, VARIANTS[optimizer], {"offload_param": section})
    weight = engine.module.up.weight
    with zerotrain.zero.GatheredParameters([weight], modifier_rank=0):
        weight.data.fill_(0.25)
    with zerotrain.zero.GatheredParameters([weight]):  # gathered again (from the file)
        assert torch.equal(weight.data, torch.full((13, 7), 0.25))
    assert engine.consolidated_state_dict()["up.weight"].eq(0.25).all()  # the master (host)


def test_lamb_offloaded_to_cpu_equals_in_memory():
    states = []
    for name in ("none", "cpu-half"):
        config = _config(2, VARIANTS[name])
        config["optimizer"] = {"type": "Lamb", "params": {"lr": 1e-2}}
        torch.manual_seed(0)
        engine, *_ = zerotrain.initialize(model=AwkwardModel(), config=config)
        _train(engine, range(3))
        states.append(engine.consolidated_state_dict())
    for key, value in states[0].items():
        assert torch.equal(states[1][key], value), key


def train_deferred(stages):
    """Stage 3, and stage 2 with overlap_param_gather: the host buckets' steps wait for their
    next use, under a scheduler that changes the learning rate every step."""
    from zerotrain.comm import Communicator

    comm = Communicator()
    out = {}
    for stage in stages:
        for name in ("none", "cpu-half"):
            torch.manual_seed(0)
            model = AwkwardModel()
            config = _config(stage, VARIANTS[name], zero={"overlap_param_gather": stage < 3})
            config["scheduler"] = {
                "type": "WarmupLR",
                "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": LR, "warmup_num_steps": 4},
            }
            engine, optimizer, *_ = zerotrain.initialize(
                model=model, model_parameters=param_groups(model, WD), config=config
            )
            deferred = []
            in_flight = optimizer.group.residency.in_flight
            _run_parity_steps(engine, comm, lambda f=in_flight, d=deferred: d.append(f.deferred))
            out[(stage, name)] = (engine.consolidated_state_dict(), deferred)
    return out


def test_a_deferred_host_step_runs_at_the_next_use_with_its_own_learning_rate():
    for results in run_distributed(train_deferred, 2, [2, 3]):
        for stage in (2, 3):
            (want, _), (got, deferred) = results[(stage, "none")], results[(stage, "cpu-half")]
            assert all(deferred), deferred  # host buckets waited for the next forward
            for key, value in want.items():
                assert torch.equal(got[key], value), (stage, key)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_checkpoint_loaded_while_steps_are_deferred_trains_on_exactly(tmp_path, stage):
    overlap = {"overlap_param_gather": stage == 2}
    straight = _engine(stage, VARIANTS["none"], overlap)
    _train(straight, range(4))
    saver = _engine(stage, VARIANTS["cpu"], overlap)
    _train(saver, range(2))
    saver.save_checkpoint(tmp_path, tag="two")  # with the host steps still deferred
    loader = _engine(stage, VARIANTS["cpu"], overlap)
    _train(loader, range(1))
    assert loader.optimizer.group.residency.in_flight.deferred  # pending when it loads
    loader.load_checkpoint(tmp_path, tag="two")
    _train(loader, range(2, 4))
    want = straight.consolidated_state_dict()
    for key, value in loader.consolidated_state_dict().items():
        assert torch.equal(value, want[key]), key


def test_buckets_larger_than_a_ring_buffer_go_through_it_in_pieces(monkeypatch):
    monkeypatch.setattr(zerotrain.zero.offload, "RING_CHUNK", 7)  # every bucket is larger
    want = _engine(2, VARIANTS["none"])
    _train(want, range(2))
    got = _engine(2, VARIANTS["cpu"])  # buffer_count 1
    _train(got, range(2))
    assert got.memory_breakdown()["staging"] == 1 * 7 * 4
    expected = want.consolidated_state_dict()
    for key, value in got.consolidated_state_dict().items():
        assert torch.equal(value, expected[key]), key
