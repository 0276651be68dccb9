"""The optimizer ``initialize`` returns, case by case as DeepSpeed 0.19 returns it
(``engine._configure_optimizer``), checked the way client code checks it: identity, isinstance,
an ``lr`` set in the param groups the client holds taking effect at the next step, a scheduler
over the client's optimizer that the client steps itself, and Accelerate's ``prepare``."""

from __future__ import annotations

import importlib.util
import os
import warnings

import pytest
import torch
from distributed import run_distributed
from torch import nn

import zerotrain
from zerotrain.ops.adam import FusedAdam
from zerotrain.runtime.base_optimizer import DeepSpeedOptimizer
from zerotrain.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from zerotrain.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _config(stage: int, **extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 10**6,
        **extra,
    }


def _step(engine) -> None:
    x, y = torch.randn(2, 5), torch.randn(2, 3)
    engine.backward(nn.functional.mse_loss(engine(x.to(engine.device)).float(), y))
    engine.step()


def _weights(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.consolidated_state_dict().items()}


def _unchanged(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, after[k]) for k, v in before.items())


@pytest.mark.parametrize(
    ("stage", "precision"), [(0, None), (1, None), (2, None), (3, None), (0, "bf16")]
)
def test_the_clients_optimizer_steps_and_initialize_returns_deepspeeds_choice(stage, precision):
    model = _model()
    client = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    extra = {precision: {"enabled": True, "auto_cast": True}} if precision else {}
    engine, returned, _, _ = zerotrain.initialize(
        model=model, optimizer=client, config=_config(stage, **extra)
    )
    # the client's object is what steps the shards (DeepSpeed's basic optimizer)
    assert isinstance(engine.optimizer, DeepSpeedOptimizer)
    assert engine.optimizer.optimizer is client
    if stage == 0 and precision is None:  # DeepSpeed returns the basic optimizer itself
        assert returned is client and isinstance(returned, torch.optim.AdamW)
        assert not isinstance(returned, DeepSpeedOptimizer)
    else:  # a wrapper: DeepSpeedZeroOptimizer(_Stage3), FP16_/BF16_Optimizer at stage 0
        assert returned is engine.optimizer and not isinstance(returned, torch.optim.Optimizer)
        assert isinstance(returned, DeepSpeedZeroOptimizer) == (stage in (1, 2))
        assert isinstance(returned, DeepSpeedZeroOptimizer_Stage3) == (stage == 3)
        assert returned.param_groups is client.param_groups
    before = _weights(engine)
    _step(engine)
    stepped = _weights(engine)
    assert not _unchanged(before, stepped)
    assert client.state  # its state is the shards' (state_dict, as DeepSpeed's basic optimizer)
    client.param_groups[0]["lr"] = 0.0  # what a client's own scheduler does
    _step(engine)
    assert _unchanged(stepped, _weights(engine))
    assert engine.get_lr() == [0.0]


def test_stage_0_returns_the_optimizer_a_callable_or_the_config_built_or_none():
    built = []

    def factory(groups):
        built.append(torch.optim.SGD(groups, lr=0.1))
        return built[-1]

    engine, returned, *_ = zerotrain.initialize(
        model=_model(), optimizer=factory, config=_config(0)
    )
    assert returned is built[-1] is engine.optimizer.optimizer
    sgd = _config(0, optimizer={"type": "SGD", "params": {"lr": 0.1}})
    engine, returned, *_ = zerotrain.initialize(model=_model(), config=sgd)
    assert type(returned) is torch.optim.SGD and returned is engine.optimizer.optimizer
    for name in ("Adam", "AdamW"):  # DeepSpeed builds its FusedAdam for both
        adam = _config(0, optimizer={"type": name, "params": {"lr": 0.1}})
        engine, returned, *_ = zerotrain.initialize(model=_model(), config=adam)
        assert isinstance(returned, FusedAdam) and returned is engine.optimizer.optimizer
    engine, returned, *_ = zerotrain.initialize(model=_model(), config=_config(0))
    assert returned is None and isinstance(engine.optimizer, DeepSpeedOptimizer)


def test_a_scheduler_the_client_steps_itself_sets_the_lr_of_the_next_step():
    """A torch scheduler over the client's optimizer that the client steps itself, as
    Accelerate's AcceleratedScheduler does with one prepared beside the optimizer."""
    model = _model()
    client = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(client, lambda step: 1.0 if step == 0 else 0.0)
    engine, *_ = zerotrain.initialize(model=model, optimizer=client, config=_config(2))
    with warnings.catch_warnings():  # torch's warnings of a scheduler that misses the steps
        warnings.filterwarnings("error", message=r".*(optimizer|lr_scheduler)\.step\(\)")
        _step(engine)
        scheduler.step()
    stepped = _weights(engine)
    _step(engine)
    assert _unchanged(stepped, _weights(engine))


def test_a_failed_initialize_leaves_the_clients_optimizer_as_it_was_given():
    """initialize adopts the client's object early; a later failure (here the scheduler
    argument) gives it back its own groups and state (it held the failed engine's shards)."""
    model = _model()
    client = torch.optim.AdamW(model.parameters(), lr=1e-2)
    params = [list(group["params"]) for group in client.param_groups]
    with pytest.raises(TypeError):
        zerotrain.initialize(model=model, optimizer=client, lr_scheduler="bad", config=_config(1))
    assert [len(group["params"]) for group in client.param_groups] == [len(p) for p in params]
    assert all(
        a is b
        for got, given in zip(client.param_groups, params, strict=True)
        for a, b in zip(got["params"], given, strict=True)
    )
    assert not client.state


def test_building_a_deepspeed_wrapper_class_is_refused_naming_initialize():
    with pytest.raises(TypeError, match=r"DeepSpeedZeroOptimizer_Stage3: .*initialize"):
        DeepSpeedZeroOptimizer_Stage3(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1))
    assert issubclass(DeepSpeedZeroOptimizer, DeepSpeedOptimizer)
    assert not isinstance(object(), DeepSpeedZeroOptimizer)


def accelerate_prepare(stage: int) -> dict:
    """Accelerate's prepare with the client's AdamW and a LambdaLR, a config without optimizer
    and scheduler sections: Accelerate steps the scheduler itself (AcceleratedScheduler)."""
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # what accelerate launch sets
    from zerotrain.compat.deepspeed import activate

    activate(announce=False)
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    accelerator = Accelerator(
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=_config(stage)),
        kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")],
    )
    model = _model()
    client = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.LambdaLR(client, lambda step: 1.0 if step == 0 else 0.0)
    engine, optimizer, scheduler = accelerator.prepare(model, client, schedule)
    weights = []
    for _ in range(2):
        x, y = torch.randn(2, 5), torch.randn(2, 3)
        accelerator.backward(nn.functional.mse_loss(engine(x), y))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        weights.append(_weights(engine))
    return {
        "inner_is_client": optimizer.optimizer is client,
        "zero_1_2": isinstance(optimizer.optimizer, DeepSpeedZeroOptimizer),
        "lr": optimizer.param_groups[0]["lr"],
        "second_step_unchanged": _unchanged(weights[0], weights[1]),
    }


@pytest.mark.skipif(not importlib.util.find_spec("accelerate"), reason="needs accelerate")
@pytest.mark.parametrize("stage", [pytest.param(0, marks=pytest.mark.slow), 2])  # ~35 s each
def test_accelerate_prepare_keeps_the_clients_optimizer_and_its_schedule(stage):
    (got,) = run_distributed(accelerate_prepare, 1, stage, fresh_interpreter=True)
    assert got["inner_is_client"] == (stage == 0)
    assert got["zero_1_2"] == (stage == 2)
    assert got["lr"] == 0.0 and got["second_step_unchanged"]


class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> dict:
        ids = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids}


def hf_trainer_schedule(stage: int, out: str) -> dict:
    """HF Trainer with a DeepSpeed config without optimizer and scheduler sections: the Trainer
    builds its AdamW, and after prepare a linear LambdaLR over the optimizer prepare returned
    (DeepSpeedOptimizerWrapper of what initialize returned), which it steps itself."""
    from zerotrain.compat.deepspeed import activate

    activate(announce=False)
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=8)
    )
    auto = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=2,
        max_steps=2,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        deepspeed={"zero_optimization": {"stage": stage}, **dict.fromkeys(auto, "auto")},
        use_cpu=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=_Tokens())
    trainer.train()
    return {
        "scheduled": trainer.lr_scheduler.get_last_lr(),
        "stepped_with": trainer.model_wrapped.get_lr(),
        "logged": [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e],
    }


@pytest.mark.slow
@pytest.mark.skipif(not importlib.util.find_spec("transformers"), reason="needs transformers")
@pytest.mark.parametrize("stage", [0, 2])
def test_hf_trainers_own_schedule_sets_the_lr_the_engine_steps_with(tmp_path, stage):
    (got,) = run_distributed(
        hf_trainer_schedule, 1, stage, str(tmp_path), timeout=300, fresh_interpreter=True
    )
    assert len(got["logged"]) == 2 and got["logged"][0] > got["logged"][1]  # a linear decay
    assert got["stepped_with"] == got["scheduled"] and set(got["scheduled"]) == {0.0}


def test_stepping_the_returned_optimizer_itself_is_refused_naming_engine_step():
    """At stage 0 in fp32 initialize returns the torch optimizer, which has gradients only
    inside engine.step(): a step() of its own changed nothing, silently."""
    model = _model()
    client = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, returned, *_ = zerotrain.initialize(model=model, optimizer=client, config=_config(0))
    x, y = torch.randn(2, 5), torch.randn(2, 3)
    engine.backward(nn.functional.mse_loss(engine(x), y))
    before = _weights(engine)
    with pytest.raises(RuntimeError, match=r"outside engine\.step\(\).*call engine\.step\(\)"):
        returned.step()
    assert _unchanged(before, _weights(engine))
    engine.step()  # the engine's own step goes through the same optimizer
    assert not _unchanged(before, _weights(engine))
