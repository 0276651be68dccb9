"""The engine and optimizer members DeepSpeed scripts and frameworks call, DeepSpeed's
checkpoint helpers on zerotrain checkpoints, and the config keys the engine now acts on."""

from __future__ import annotations

import json
import logging
import warnings

import pytest
import torch
from distributed import run_cases, run_distributed
from models import AwkwardModel, BlockModel, make_batches, relative_error, run_steps
from torch import nn
from torch.utils.data import TensorDataset

import zerotrain
from zerotrain.config import OffloadDeviceEnum, OffloadStateTypeEnum, load_config

MICRO = 2


def _config(stage: int, **extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 10**6,
        **extra,
    }


def _steps(engine, steps: int = 2, accum: int = 1) -> None:
    from zerotrain.comm import Communicator

    comm = Communicator()
    idx, tgt = make_batches(steps, MICRO * accum * comm.world_size)
    run_steps(engine, idx, tgt, MICRO, accum, comm.world_size, comm.rank)


# -- checkpoints through DeepSpeed's helpers ---------------------------------------------------
def save_for_helpers(save_dir: str):
    torch.manual_seed(0)
    engine, *_ = zerotrain.initialize(model=AwkwardModel(), config=_config(2))
    _steps(engine)
    engine.save_checkpoint(save_dir)
    lora_like = engine.save_checkpoint(save_dir, tag="trainable", exclude_frozen_parameters=True)
    return engine.consolidated_state_dict(), str(lora_like)


def test_zero_to_fp32_reads_zerotrain_checkpoints(tmp_path) -> None:
    from zerotrain.utils import zero_to_fp32

    save_dir = tmp_path / "ckpt"
    (state, _), _ = run_distributed(save_for_helpers, 2, str(save_dir))
    loaded = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="global_step2")
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    trainable = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
        save_dir, tag="global_step2", exclude_frozen_parameters=True
    )
    assert trainable.keys() == state.keys() - {"frozen.weight", "frozen.bias"}

    zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(
        save_dir, tmp_path / "bin", max_shard_size=600, tag="global_step2"
    )
    index = json.loads((tmp_path / "bin" / "pytorch_model.bin.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"pytorch_model-00001-of-{len(shards):05d}.bin"
    merged = {}
    for name in shards:
        merged.update(torch.load(tmp_path / "bin" / name, weights_only=True))
    assert all(torch.equal(merged[k], v) for k, v in state.items())
    zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(
        save_dir, tmp_path / "st", safe_serialization=True, tag="global_step2"
    )
    assert (tmp_path / "st" / "model.safetensors").exists()

    model = zero_to_fp32.load_state_dict_from_zero_checkpoint(AwkwardModel(), save_dir, "trainable")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in trainable.items())


def resume_without_frozen(save_dir: str):
    torch.manual_seed(1)  # other frozen values than the saving run's
    model = AwkwardModel()
    frozen_before = model.frozen.weight.detach().clone()
    engine, *_ = zerotrain.initialize(model=model, config=_config(1))
    path, _ = engine.load_checkpoint(save_dir, tag="trainable")  # strict by default
    return path, engine.consolidated_state_dict(), frozen_before


def test_checkpoint_without_frozen_parameters_loads_strictly(tmp_path) -> None:
    save_dir = tmp_path / "ckpt"
    (state, lora_like), _ = run_distributed(save_for_helpers, 2, str(save_dir))
    manifest = json.loads((tmp_path / "ckpt" / "trainable" / "manifest.json").read_text())
    assert manifest["frozen_keys"] == ["frozen.bias", "frozen.weight"]
    assert "frozen.weight" not in manifest["module_keys"]
    for path, loaded, frozen_before in run_distributed(resume_without_frozen, 2, str(save_dir)):
        assert path.endswith("trainable")
        assert torch.equal(loaded["frozen.weight"], frozen_before)  # the model's own
        assert torch.equal(loaded["up.weight"], state["up.weight"])


# -- engine members ------------------------------------------------------------------------------
def engine_members():
    from zerotrain.comm import Communicator
    from zerotrain.zero import ZeroParamStatus

    rank = Communicator().rank
    out = {}
    config = _config(
        3,
        bf16={"enabled": True},
        zero_optimization={
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
    )
    torch.manual_seed(0)
    engine, optimizer, _, _ = zerotrain.initialize(model=BlockModel(), config=config)
    out["config_is_the_dict"] = engine.config is config
    out["queries"] = (
        engine.zero_optimization_stage(),
        engine.zero_optimization_partition_weights(),
        engine.zero_gather_16bit_weights_on_model_save(),
        engine.optimizer_name(),
        engine.communication_data_type,
        engine.get_batch_info(),
    )
    out["isinstance"] = (
        isinstance(engine, zerotrain.DeepSpeedEngine),
        isinstance(optimizer, zerotrain.DeepSpeedOptimizer),
    )
    block = engine.module.blocks[0]
    out["ds"] = (
        block.up.weight.ds_numel,
        tuple(block.up.weight.ds_shape),
        block.up.weight.partition_numel(),
        block.up.weight.ds_status,
    )
    _steps(engine)
    with zerotrain.zero.GatheredParameters([block.up.weight]):
        out["status_gathered"] = block.up.weight.ds_status
    out["status_after"] = block.up.weight.ds_status is ZeroParamStatus.NOT_AVAILABLE
    out["sixteen_bit"] = engine._zero3_consolidated_16bit_state_dict()
    out["consolidated_bf16"] = engine.consolidated_state_dict(dtype=torch.bfloat16)
    out["fp32_param"] = zerotrain.utils.safe_get_full_fp32_param(block.up.weight)
    out["exp_avg"] = zerotrain.utils.safe_get_full_optimizer_state(block.up.weight, "exp_avg")
    out["passthrough"] = engine.blocks is engine.module.blocks
    out["optimizer_members"] = (
        optimizer.defaults["lr"],
        optimizer.overflow,
        len(optimizer.state) > 0,
        type(optimizer.state_dict()).__name__,
    )
    out["rank"] = rank
    return out


def test_engine_and_optimizer_members_at_stage_3() -> None:
    from zerotrain.zero import ZeroParamStatus

    results = run_distributed(engine_members, 2)
    for got in results:
        assert got["config_is_the_dict"]
        stage, weights, gather, name, comm_dtype, batch = got["queries"]
        assert (stage, weights, gather, name) == (3, True, True, "adamw")
        assert comm_dtype == torch.bfloat16 and batch == (4, 2, 1)
        assert got["isinstance"] == (True, True)
        assert got["ds"] == (7 * 13, (13, 7), 46, ZeroParamStatus.NOT_AVAILABLE)
        assert got["status_gathered"] is ZeroParamStatus.AVAILABLE and got["status_after"]
        assert got["fp32_param"].shape == (13, 7) and got["exp_avg"].shape == (13, 7)
        assert got["passthrough"]
        assert got["optimizer_members"] == (1e-2, False, True, "dict")
    rank0, rank1 = results
    assert rank1["sixteen_bit"] is None
    full = rank0["sixteen_bit"]
    assert full.keys() == rank0["consolidated_bf16"].keys()
    assert all(torch.equal(full[k], v) for k, v in rank0["consolidated_bf16"].items())
    assert torch.equal(rank0["fp32_param"], rank1["fp32_param"])
    assert torch.equal(rank0["fp32_param"].bfloat16(), full["blocks.0.up.weight"])


def test_members_below_stage_3_and_state_dict_round_trip() -> None:
    torch.manual_seed(0)
    config = _config(1)
    engine, optimizer, _, _ = zerotrain.initialize(model=AwkwardModel(), config=config)
    with pytest.raises(ValueError, match="this function requires ZeRO-3 mode"):
        engine._zero3_consolidated_16bit_state_dict()
    with pytest.raises(ValueError, match="only applicable to cases where weights are partitioned"):
        engine._consolidated_16bit_state_dict()
    assert not hasattr(engine.module.up.weight, "ds_id")  # not a ZeRO-3 parameter
    assert engine.module_state_dict(exclude_frozen_parameters=True).keys() == (
        engine.module.state_dict().keys() - {"frozen.weight", "frozen.bias"}
    )
    _steps(engine)
    saved = optimizer.state_dict()
    before = engine.consolidated_state_dict()
    _steps(engine)
    optimizer.load_state_dict(saved)
    after = engine.consolidated_state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert optimizer.state_dict()["optimizer"]["state"].keys() == saved["optimizer"]["state"].keys()
    other = zerotrain.initialize(model=AwkwardModel(), config=_config(0))[0].optimizer
    with pytest.raises(ValueError, match="stage"):
        other.load_state_dict(saved)


def test_offload_states_on_a_cpu_device_checks_and_moves_nothing() -> None:
    engine, *_ = zerotrain.initialize(model=nn.Linear(3, 2), config=_config(2))
    engine.offload_states(include=[OffloadStateTypeEnum.optim_states, "lp_grads"])
    engine.offload_states(device=OffloadDeviceEnum.none)
    engine.reload_states()
    with pytest.raises(ValueError, match="is not a valid OffloadStateTypeEnum"):
        engine.offload_states(include=["optimizer"])
    with pytest.raises(ValueError, match="NVMe is not supported"):
        engine.offload_states(device="nvme")


def test_an_engine_without_optimizer_evaluates_and_refuses_to_train() -> None:
    model = AwkwardModel()
    engine, optimizer, _, _ = zerotrain.initialize(
        model=model, model_parameters=[], config={"train_micro_batch_size_per_gpu": 2}
    )
    idx, tgt = make_batches(1, 2)
    with torch.no_grad():
        assert engine(idx[0], tgt[0]).item() > 0
    loss = engine(idx[0], tgt[0])
    with pytest.raises(RuntimeError, match="initialized without an optimizer"):
        engine.backward(loss)
    engine(idx[0], tgt[0]).backward()  # plain gradients, as torch leaves them
    assert engine.module.up.weight.grad is not None
    with pytest.raises(RuntimeError, match="initialized without an optimizer"):
        engine.step()
    assert engine.optimizer_name() is None


def test_config_optimizer_and_object_use_the_object() -> None:
    model = nn.Linear(3, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.5)
    config = _config(0, optimizer={"type": "SGD", "params": {"lr": 0.1}})
    with pytest.warns(UserWarning, match=r"`optimizer` section \(SGD\) is ignored"):
        engine, optimizer, _, _ = zerotrain.initialize(model=model, optimizer=sgd, config=config)
    assert engine.get_lr() == [0.5] and engine.optimizer_name() == "SGD"


def test_set_gradient_accumulation_boundary_decides_until_reset() -> None:
    engine, *_ = zerotrain.initialize(
        model=AwkwardModel(), config=_config(2, gradient_accumulation_steps=4)
    )
    idx, tgt = make_batches(1, 2)
    for boundary in (False, False, True):
        engine.set_gradient_accumulation_boundary(boundary)
        engine.backward(engine(idx[0], tgt[0]))
        engine.step()
    assert (engine.micro_steps, engine.global_steps) == (3, 1)
    engine.backward(engine(idx[0], tgt[0]))  # still True: sticky, as in DeepSpeed
    engine.step()
    assert engine.global_steps == 2
    engine.set_gradient_accumulation_boundary(None)  # back to counting
    assert not engine.is_gradient_accumulation_boundary()


def test_zero_grad_takes_module_zero_grads_argument() -> None:
    """``engine.zero_grad(set_to_none=...)`` as on any nn.Module (found by the type checker:
    the engine's override took no argument, so torch-style calls raised TypeError)."""
    engine, *_ = zerotrain.initialize(
        model=AwkwardModel(), config=_config(1, gradient_accumulation_steps=2)
    )
    idx, tgt = make_batches(1, 2)
    for set_to_none in (True, False):
        engine.backward(engine(idx[0], tgt[0]))  # not a boundary: the gradients stay
        grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
        assert any(g.any() for g in grads)
        engine.zero_grad(set_to_none=set_to_none)
        assert not any(g.any() for g in grads)  # the buffers are reused, zeroed


def compiled_vs_eager(stage: int):
    states = []
    for compile_it in (False, True):
        torch.manual_seed(0)
        engine, *_ = zerotrain.initialize(model=AwkwardModel(), config=_config(stage))
        if compile_it:
            engine.compile(backend="eager")
            assert engine.is_compiled
        _steps(engine, steps=3)
        states.append(engine.consolidated_state_dict())
    return states


def test_compile_trains_the_same_model() -> None:
    for eager, compiled in run_distributed(compiled_vs_eager, 2, 2):
        for key, value in eager.items():
            assert relative_error(compiled[key], value) < 1e-6, key


class External(nn.Module):
    """Block 1 reads block 0's weight: the case DeepSpeed's register_external_parameter is
    for."""

    def __init__(self, register: bool = True):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(5, 5), nn.Linear(5, 5)])
        if register:
            zerotrain.zero.register_external_parameter(self.blocks[1], self.blocks[0].weight)

    def forward(self, x):
        h = self.blocks[0](x)
        return (self.blocks[1](h) + h @ self.blocks[0].weight).square().mean()


def unregistered_external_parameter():
    engine, *_ = zerotrain.initialize(model=External(register=False), config=_config(3))
    try:
        engine(torch.randn(MICRO, 5))
    except RuntimeError as err:
        return str(err)
    return None


def external_parameter():
    from zerotrain.comm import Communicator

    rank = Communicator().rank
    torch.manual_seed(0)
    adamw = {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-6}}
    engine, *_ = zerotrain.initialize(model=External(), config=_config(3, optimizer=adamw))
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        batches = torch.randn(MICRO * 2, 5, generator=gen)
        engine.backward(engine(batches[rank * MICRO : (rank + 1) * MICRO]))
        engine.step()
    return engine.consolidated_state_dict()


def test_registered_external_parameters_are_gathered_for_the_reader() -> None:
    torch.manual_seed(0)
    plain = External()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.0)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        batches = torch.randn(MICRO * 2, 5, generator=gen)  # both ranks' micro-batches
        plain(batches[:MICRO]).add(plain(batches[MICRO:])).div(2).backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    for state in run_distributed(external_parameter, 2):
        for key, value in plain.state_dict().items():
            assert relative_error(state[key], value) < 1e-5, key
    # unregistered, block 0's weight is released after its forward: block 1 finds it empty
    assert all(run_distributed(unregistered_external_parameter, 2))


# -- config keys the engine acts on ------------------------------------------------------------
class Recorder(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 1)
        self.dtypes = []

    def forward(self, x, ids):
        self.dtypes.append((x.dtype, ids.dtype))
        return self.lin(x).float().mean()


def test_fp16_auto_cast_casts_floating_inputs(capsys) -> None:
    engine, *_ = zerotrain.initialize(
        model=Recorder(),
        config=_config(0, fp16={"enabled": True, "auto_cast": True}, dump_state=True),
    )
    assert '"auto_cast": true' in capsys.readouterr().out  # dump_state
    engine.scale(engine(torch.randn(2, 3), torch.arange(2))).backward()
    engine.step()
    assert engine.module.dtypes == [(torch.float16, torch.int64)]


def test_bf16_auto_cast_casts_floating_inputs() -> None:
    engine, *_ = zerotrain.initialize(
        model=Recorder(), config=_config(0, bf16={"enabled": True, "auto_cast": True})
    )
    engine.backward(engine(torch.randn(2, 3), torch.arange(2)))
    engine.step()
    assert engine.module.dtypes == [(torch.bfloat16, torch.int64)]


@pytest.mark.parametrize("grad", [True, False])
def test_fp32_inputs_to_a_16_bit_model_name_the_fix(grad: bool) -> None:
    engine, *_ = zerotrain.initialize(model=Recorder(), config=_config(0, bf16={"enabled": True}))
    with torch.set_grad_enabled(grad), pytest.raises(RuntimeError) as raised:
        engine(torch.randn(2, 3), ids=torch.arange(2))
    message = str(raised.value)
    assert "zerotrain: engine(...) got float32/float64 tensors (argument 0) while the model's " in (
        message
    )
    assert "weights are bfloat16 (bf16.enabled): cast them before the call, or set " in message
    assert "bf16.auto_cast: true" in message
    assert isinstance(raised.value.__cause__, RuntimeError)  # torch's own error, kept
    # other failures pass through unchanged
    with pytest.raises(RuntimeError, match=r"^Expected all tensors|^mat1 and mat2 shapes"):
        engine(torch.randn(2, 5, dtype=torch.bfloat16), torch.arange(2))


def test_log_level_is_left_alone_unless_the_config_sets_it() -> None:
    from zerotrain.utils import logger

    before = logger.level
    try:
        logger.setLevel("WARNING")
        zerotrain.initialize(model=nn.Linear(3, 2), config=_config(0))
        assert logger.level == logging.WARNING
        zerotrain.initialize(model=nn.Linear(3, 2), config=_config(0, log_level="Error"))
        assert logger.level == logging.ERROR
    finally:
        logger.setLevel(before)


def test_dataloader_drop_last() -> None:
    data = TensorDataset(torch.arange(5.0))
    for drop_last, sizes in ((False, [2, 2, 1]), (True, [2, 2])):
        _, _, loader, _ = zerotrain.initialize(
            model=nn.Linear(1, 1),
            training_data=data,
            config=_config(0, dataloader_drop_last=drop_last),
        )
        assert [len(batch[0]) for batch in loader] == sizes


def test_a_dataset_that_yields_no_batch_is_named() -> None:
    """Issue 42: an empty dataset (or one smaller than a batch, with drop_last) was accepted
    without a word, and a training loop over it did nothing."""
    for samples, drop_last in ((0, False), (1, True)):
        data = TensorDataset(torch.arange(float(samples)))
        with pytest.warns(UserWarning, match=f"training_data has {samples} samples, so the") as got:
            zerotrain.initialize(
                model=nn.Linear(1, 1),
                training_data=data,
                config=_config(0, dataloader_drop_last=drop_last),
            )
        assert got[0].filename == __file__  # points at the caller's initialize
        assert ("dataloader_drop_last" in str(got[0].message)) == drop_last
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a dataset with a batch: not a word
        zerotrain.initialize(
            model=nn.Linear(1, 1), training_data=TensorDataset(torch.arange(2.0)), config=_config(0)
        )


def offload_on_cpu_and_comm_dtype():
    out = {}
    for key, extra in {
        "plain": {},
        "offload": {"cpu_offload": True, "offload_param": {"device": "cpu"}},
    }.items():
        torch.manual_seed(0)
        zero = {"stage": 3, "stage3_param_persistence_threshold": 0, **extra}
        engine, *_ = zerotrain.initialize(
            model=AwkwardModel(), config=_config(3, zero_optimization=zero)
        )
        _steps(engine)
        out[key] = engine.consolidated_state_dict()
    sgd = {"type": "SGD", "params": {"lr": 0.1}}  # Adam's first steps hide small differences
    for comm_dtype in (None, "fp32"):
        for stage in (0, 1, 2, 3):
            torch.manual_seed(0)
            config = _config(
                stage,
                bf16={"enabled": True},
                communication_data_type=comm_dtype,
                gradient_accumulation_steps=2,
                optimizer=sgd,
            )
            engine, *_ = zerotrain.initialize(model=AwkwardModel(), config=config)
            _steps(engine, accum=2)
            out[(comm_dtype, stage)] = engine.consolidated_state_dict()
    return out


def test_cpu_offload_on_a_cpu_device_and_fp32_gradient_communication() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # 3 ranks: a sum of two bf16 values is rounded once either way
        results = run_distributed(offload_on_cpu_and_comm_dtype, 3)
    for got in results:
        # the states are in CPU memory already: the same training
        assert all(torch.equal(got["offload"][k], v) for k, v in got["plain"].items())
        for stage in (0, 1, 2, 3):
            bf16_wire, fp32_wire = got[(None, stage)], got[("fp32", stage)]
            assert any(not torch.equal(fp32_wire[k], v) for k, v in bf16_wire.items())
            for key, value in bf16_wire.items():  # same training, summed more precisely
                assert relative_error(fp32_wire[key], value) < 2e-2, (stage, key)
    for other in results[1:]:
        assert all(
            torch.equal(other[("fp32", 2)][k], v) for k, v in results[0][("fp32", 2)].items()
        )


def test_parameter_offload_below_stage_3_is_ignored_with_a_warning() -> None:
    from zerotrain.api import _check_offload
    from zerotrain.config import load_config

    below_3 = _config(2, zero_optimization={"stage": 2, "offload_param": {"device": "cpu"}})
    with pytest.warns(UserWarning, match="offload_param.device: cpu is ignored at stage 2"):
        _check_offload(load_config(below_3, world_size=1), rank=0)


def test_zero_init_takes_the_configs_precision_and_unmarks_what_stage_2_trains() -> None:
    hf_style = {
        "train_micro_batch_size_per_gpu": "auto",
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"},
    }
    with zerotrain.zero.Init(config_dict_or_path=hf_style, remote_device="cpu", pin_memory=True):
        layer = nn.Linear(4, 6)
    assert layer.weight.dtype == torch.bfloat16 and layer.weight.ds_numel == 24
    validated = load_config({"train_batch_size": 2, "fp16": {"enabled": True}}, world_size=1)
    with zerotrain.zero.Init(config_dict_or_path=validated):
        layer = nn.Linear(4, 6)
    assert layer.weight.dtype == torch.float16
    # trained below stage 3 the parameter is whole: libraries must not take it for ZeRO-3's
    zerotrain.initialize(model=layer, config=_config(2, fp16={"enabled": True}))
    assert not hasattr(layer.weight, "ds_id") and layer.weight.shape == (6, 4)
    with pytest.raises(ValueError, match="NVMe offload is not implemented"):
        zerotrain.zero.Init(remote_device="nvme")


# -- two engines, one loss through both (DeepSpeed's GAN example) -------------------------------
def _gan_models():
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 5))
    discriminator = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))
    return generator, discriminator


def _gan_batches(world: int):
    gen = torch.Generator().manual_seed(5)
    return [
        (torch.randn(MICRO * world, 5, generator=gen), torch.randn(MICRO * world, 3, generator=gen))
        for _ in range(3)
    ]


def _gan_step(gen, disc, backward_d, step_d, backward_g, step_g, real, noise) -> None:
    """One iteration as DeepSpeed's GAN example writes it: the discriminator takes two backward
    passes before one step, and the generator's loss runs through the discriminator, whose
    gradients the next iteration's zero_grad drops. ``gen`` and ``disc`` are the raw modules
    (as the example calls them) or the engines."""
    criterion = nn.BCEWithLogitsLoss()
    disc.zero_grad()
    backward_d(criterion(disc(real), torch.ones(len(real), 1)))
    fake = gen(noise)
    backward_d(criterion(disc(fake.detach()), torch.zeros(len(real), 1)))
    step_d()
    gen.zero_grad()
    backward_g(criterion(disc(fake), torch.ones(len(real), 1)))
    step_g()


def _gan_engines(stage: int):
    net_g, net_d = _gan_models()
    config = _config(stage, optimizer={"type": "SGD", "params": {"lr": 0.1}}, gradient_clipping=0)
    engine_g, *_ = zerotrain.initialize(model=net_g, config=config)
    engine_d, *_ = zerotrain.initialize(model=net_d, config=config)
    return net_g, net_d, engine_g, engine_d


def gan_engines(stage: int):
    from zerotrain.comm import Communicator

    comm = Communicator()
    rows = slice(comm.rank * MICRO, (comm.rank + 1) * MICRO)
    trained = {}
    for through_engines in (False, True):
        net_g, net_d, engine_g, engine_d = _gan_engines(stage)
        gen, disc = (engine_g, engine_d) if through_engines else (net_g, net_d)
        for real, noise in _gan_batches(comm.world_size):
            _gan_step(
                gen,
                disc,
                engine_d.backward,
                engine_d.step,
                engine_g.backward,
                engine_g.step,
                real[rows],
                noise[rows],
            )
        trained[through_engines] = (
            engine_g.consolidated_state_dict(),
            engine_d.consolidated_state_dict(),
        )

    # The discriminator steps after the generator's backward through the raw module wrote
    # into its .grad, unaveraged: refused. (Through engine_d's outputs, that backward would
    # count as one of the discriminator's and be averaged into its step, as in torch.)
    net_g, net_d, engine_g, engine_d = _gan_engines(stage)
    real, noise = (t[rows] for t in _gan_batches(comm.world_size)[0])
    criterion = nn.BCEWithLogitsLoss()
    engine_d.backward(criterion(net_d(real), torch.ones(MICRO, 1)))
    engine_g.backward(criterion(net_d(net_g(noise)), torch.ones(MICRO, 1)))
    with pytest.raises(RuntimeError, match="came from another engine's backward"):
        engine_d.step()
    return trained


def test_two_engines_where_one_loss_runs_through_both() -> None:
    net_g, net_d = _gan_models()
    opt_g = torch.optim.SGD(net_g.parameters(), lr=0.1)
    opt_d = torch.optim.SGD(net_d.parameters(), lr=0.1)

    def backward(loss):  # the reference sees both ranks' micro-batches at once
        loss.backward()

    for real, noise in _gan_batches(2):
        _gan_step(net_g, net_d, backward, opt_d.step, backward, opt_g.step, real, noise)
    stages = (0, 1, 2, 3)
    for per_stage in run_cases(gan_engines, 2, [(stage,) for stage in stages]):
        for stage, trained in zip(stages, per_stage, strict=True):
            for through_engines, (state_g, state_d) in trained.items():
                for got, want in ((state_g, net_g.state_dict()), (state_d, net_d.state_dict())):
                    for key, value in want.items():
                        error = relative_error(got[key], value)
                        assert error < 1e-5, (stage, through_engines, key)


def frozen_critic(stage: int):
    """A student trained through a critic engine built without an optimizer."""
    from zerotrain.comm import Communicator

    comm = Communicator()
    student, critic = _gan_models()
    adamw = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}}
    config = _config(stage, optimizer=adamw, gradient_clipping=0)
    engine_s, *_ = zerotrain.initialize(model=student, config=config)
    config = {k: v for k, v in config.items() if k != "optimizer"}
    engine_c, *_ = zerotrain.initialize(model=critic, config=config)
    rows = slice(comm.rank * MICRO, (comm.rank + 1) * MICRO)
    for _, noise in _gan_batches(comm.world_size):
        engine_s.backward(engine_c(engine_s(noise[rows])).square().mean())
        engine_s.step()
    with pytest.raises(RuntimeError, match="without an optimizer"):
        engine_c.step()
    return engine_s.consolidated_state_dict()


def test_a_critic_engine_without_optimizer_on_the_students_loss_path() -> None:
    student, critic = _gan_models()
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-2, weight_decay=0.0)
    for _, noise in _gan_batches(2):
        critic(student(noise)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    for per_stage in run_cases(frozen_critic, 2, [(0,), (3,)]):
        for stage, state in zip((0, 3), per_stage, strict=True):
            for key, value in student.state_dict().items():
                assert relative_error(state[key], value) < 1e-5, (stage, key)


class _ModelParallelUnit:
    """The part of Megatron's mpu that DeepSpeed's examples pass to initialize."""

    def __init__(self, size: int):
        self.size = size

    def get_model_parallel_world_size(self) -> int:
        return self.size


def test_an_mpu_of_model_parallel_size_one_trains_data_parallel() -> None:
    engine, *_ = zerotrain.initialize(
        model=nn.Linear(3, 2), mpu=_ModelParallelUnit(1), config=_config(0)
    )
    assert engine.data_parallel_group.rank() == 0 and engine.data_parallel_group.size() == 1
    with pytest.raises(zerotrain.ConfigError, match=r"get_model_parallel_world_size\(\) = 2"):
        zerotrain.initialize(model=nn.Linear(3, 2), mpu=_ModelParallelUnit(2), config=_config(0))
