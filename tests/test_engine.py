"""Engine behaviour beyond AdamW parity: other optimizers, user objects, data, odd models."""

from __future__ import annotations

import argparse
import json
import warnings

import pytest
import torch
from distributed import run_cases, run_distributed
from models import AwkwardModel, make_batches, param_groups, relative_error, run_steps
from torch import nn

import zerotrain
from zerotrain.optim import Lamb

STEPS, MICRO = 3, 2
# no clipping: the references do not clip (DeepSpeed's default clips at 1.0)
BASE = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**6, "gradient_clipping": 0}


def _train(engine, world, rank, accum=1):
    idx, tgt = make_batches(STEPS, MICRO * accum * world)
    run_steps(engine, idx, tgt, MICRO, accum, world, rank)
    return engine.consolidated_state_dict()


def _reference(make_optimizer, world, accum=1, make_scheduler=None):
    torch.manual_seed(0)
    model = AwkwardModel()
    opt = make_optimizer(param_groups(model, 0.1))
    sched = make_scheduler(opt) if make_scheduler else None
    idx, tgt = make_batches(STEPS, MICRO * accum * world)
    for step in range(STEPS):
        model(idx[step], tgt[step]).backward()
        opt.step()
        opt.zero_grad()
        if sched:
            sched.step()
    return model.state_dict()


OPTIMIZERS = {
    "Lamb": {"lr": 1e-2, "weight_decay": 0.01},
    "SGD": {"lr": 0.1, "momentum": 0.9, "nesterov": True},
}
REFERENCES = {
    "Lamb": lambda groups: Lamb(groups, lr=1e-2, weight_decay=0.01),
    "SGD": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True),
}


def config_optimizers(names, stages):
    from zerotrain.comm import Communicator

    comm = Communicator()
    out = {}
    for name in names:
        for stage in stages:
            torch.manual_seed(0)
            model = AwkwardModel()
            config = dict(
                BASE,
                optimizer={"type": name, "params": OPTIMIZERS[name]},
                zero_optimization={"stage": stage, "reduce_bucket_size": 50},
            )
            engine, *_ = zerotrain.initialize(
                model=model, model_parameters=param_groups(model, 0.1), config=config
            )
            out[(name, stage)] = _train(engine, comm.world_size, comm.rank)
    return out


def test_lamb_and_sgd_on_shards_match_single_process():
    # Lamb's trust ratio is per original parameter, so shards must combine partial norms.
    results = run_distributed(config_optimizers, 3, list(OPTIMIZERS), [0, 1, 2])
    for name, make in REFERENCES.items():
        want = _reference(make, 3)
        for rank_result in results:
            for stage in (0, 1, 2):
                got = rank_result[(name, stage)]
                for key, value in want.items():
                    assert relative_error(got[key], value) < 1e-5, (name, stage, key)


def user_optimizer_and_scheduler(stage):
    from zerotrain.comm import Communicator

    comm = Communicator()
    torch.manual_seed(0)
    model = AwkwardModel()
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    engine, zero_opt, _, engine_sched = zerotrain.initialize(
        model=model,
        optimizer=opt,
        lr_scheduler=sched,
        config=dict(BASE, gradient_accumulation_steps=2, zero_optimization={"stage": stage}),
    )
    # the client's own optimizer steps (and is returned at stage 0, as DeepSpeed does)
    assert engine_sched is sched and sched.optimizer is opt is engine.optimizer.optimizer
    assert zero_opt is (opt if stage == 0 else engine.optimizer)
    with warnings.catch_warnings():
        # torch's "optimizer.step() has been overridden" / "lr_scheduler.step() before
        # optimizer.step()": the repointed scheduler must see the new optimizer's steps
        warnings.filterwarnings("error", message=r".*(optimizer|lr_scheduler)\.step\(\)")
        state = _train(engine, comm.world_size, comm.rank, accum=2)
    return state, engine.get_lr()


def test_user_torch_optimizer_and_scheduler_step_the_shards():
    want = _reference(
        lambda g: torch.optim.AdamW(g, lr=1e-2, betas=(0.9, 0.95)),
        2,
        accum=2,
        make_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)),
    )
    for state, lrs in run_distributed(user_optimizer_and_scheduler, 2, 2):
        assert lrs == pytest.approx([1e-2 / 4, 1e-2 / 4])
        for key, value in want.items():
            assert relative_error(state[key], value) < 1e-5, key


def user_lamb(stages):
    from zerotrain.comm import Communicator

    def factory(groups):
        return Lamb(groups, **OPTIMIZERS["Lamb"])

    comm = Communicator()
    out = {}
    for how in ("instance", "factory"):
        for stage in stages:
            torch.manual_seed(0)
            model = AwkwardModel()
            groups = param_groups(model, 0.1)
            engine, *_ = zerotrain.initialize(
                model=model,
                optimizer=Lamb(groups, **OPTIMIZERS["Lamb"]) if how == "instance" else factory,
                model_parameters=None if how == "instance" else groups,
                config=dict(BASE, zero_optimization={"stage": stage, "reduce_bucket_size": 50}),
            )
            # The layout costs memory per parameter, not per element: at most one range for
            # each parameter (a parameter lies in one bucket), plain ints, no tensors.
            layout = [
                value
                for group in engine.optimizer.param_groups
                for ranges in group["segment_ranges"]
                for value in ranges
            ]
            trainable = [p for p in model.parameters() if p.requires_grad]
            assert len(layout) <= len(trainable), (how, stage, layout)
            assert all(type(v) is int for entry in layout for v in entry), (how, stage)
            out[(how, stage)] = _train(engine, comm.world_size, comm.rank)
    return out


def test_user_lamb_gets_per_parameter_trust_ratios_on_shards():
    """A Lamb the user builds (an instance or a factory) is rebuilt over the flat masters; its
    trust ratios must still be those of the model's parameters, as from the config."""
    want = _reference(REFERENCES["Lamb"], 2)
    for rank_result in run_distributed(user_lamb, 2, [0, 1, 2, 3]):
        for (how, stage), got in rank_result.items():
            for key, value in want.items():
                error = relative_error(got[key], value)
                assert error < 1e-5, (how, stage, key, error)


class Branchy(nn.Module):
    """``skip`` is used only on rank 1's batches; ``never`` is never used."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(6, 6)
        self.skip = nn.Linear(6, 6)
        self.never = nn.Linear(6, 6)

    def forward(self, x, use_skip: bool):
        h = self.body(x)
        if use_skip:
            h = h + self.skip(x)
        return h.square().mean()


def unused_parameters(stage):
    from zerotrain.comm import Communicator

    comm = Communicator()
    torch.manual_seed(0)
    model = Branchy()
    never_before = model.never.weight.detach().clone()
    config = dict(
        BASE,
        gradient_accumulation_steps=2,
        optimizer={"type": "SGD", "params": {"lr": 0.1}},
        zero_optimization={"stage": stage, "reduce_bucket_size": 36},  # one bucket per layer
    )
    engine, *_ = zerotrain.initialize(model=model, config=config)
    for _ in range(4):
        engine.backward(engine(torch.randn(MICRO, 6), use_skip=comm.rank == 1))
        engine.step()
    return engine.global_steps, torch.equal(model.never.weight.detach(), never_before)


def test_parameters_without_gradients_do_not_hang():
    for per_stage in run_cases(unused_parameters, 2, [(0,), (1,), (2,)], timeout=90):
        for steps, never_unchanged in per_stage:
            assert steps == 2
            assert never_unchanged  # zero gradient, plain SGD: no movement


def unseeded_replicas():
    from zerotrain.comm import Communicator

    rank = Communicator().rank
    torch.manual_seed(100 + rank)  # a different initialisation on every rank
    model = AwkwardModel()
    model.mix.fill_(rank)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    engine, *_ = zerotrain.initialize(
        model=model,
        config=dict(BASE, optimizer={"type": "SGD", "params": {"lr": 0.1}}),
    )
    return initial, engine.consolidated_state_dict(), model.state_dict()


def test_rank0_weights_and_buffers_are_broadcast_at_initialize():
    (initial0, *_), *others = run_distributed(unseeded_replicas, 3)
    for _, consolidated, live in others:
        for key, value in initial0.items():
            assert torch.equal(consolidated[key], value), key
            assert torch.equal(live[key], value), key


def dataloader_shards(seed):
    from torch.utils.data import TensorDataset

    data = TensorDataset(torch.arange(12.0).unsqueeze(1))
    model = nn.Linear(1, 1)
    _, _, loader, _ = zerotrain.initialize(
        model=model,
        training_data=data,
        config=dict(BASE, seed=seed, optimizer={"type": "SGD", "params": {"lr": 0.1}}),
    )
    return [batch[0].view(-1).tolist() for batch in loader]


def test_training_data_is_sharded_by_distributed_sampler():
    ranks = run_distributed(dataloader_shards, 2, 7)
    assert all(len(b) == MICRO for r in ranks for b in r)
    seen = sorted(x for r in ranks for b in r for x in b)
    assert seen == [float(i) for i in range(12)]  # every sample once, split across ranks
    assert ranks[0] != ranks[1]


def test_config_from_deepspeed_args(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(dict(BASE, optimizer={"type": "Adam", "params": {"lr": 0.5}})))
    parser = zerotrain.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    engine, optimizer, _, _ = zerotrain.initialize(args=args, model=nn.Linear(3, 2))
    assert engine.get_lr() == [0.5]
    # DeepSpeed's Adam: its FusedAdam, decoupled decay
    assert type(optimizer).__name__ == "FusedAdam" and optimizer.defaults["adam_w_mode"]
    assert engine.train_batch_size() == MICRO and engine.world_size == 1
    with pytest.raises(zerotrain.ConfigError, match="given twice"):
        zerotrain.initialize(args=args, model=nn.Linear(3, 2), config=dict(BASE))


def test_clear_errors_for_bad_setups():
    model = nn.Linear(3, 2)
    sgd = dict(BASE, optimizer={"type": "SGD", "params": {"lr": 0.1}})
    with pytest.raises(ValueError, match=r"\['bias'\] are in no optimizer group"):
        zerotrain.initialize(model=model, model_parameters=[model.weight], config=sgd)
    with pytest.raises(ValueError, match="not a parameter of the model"):
        zerotrain.initialize(model=model, model_parameters=[nn.Linear(3, 2).weight], config=sgd)
    with pytest.raises(zerotrain.ConfigError, match="zero_optimization.stage"):
        zerotrain.initialize(
            model=nn.Linear(3, 2), config=dict(BASE, zero_optimization={"stage": 5})
        )
    wrapped = nn.Linear(3, 2)
    engine, *_ = zerotrain.initialize(model=wrapped, config=sgd)
    with pytest.raises(ValueError, match="already wrapped by an engine"):
        zerotrain.initialize(model=wrapped, config=sgd)
    with pytest.raises(ValueError, match="scalar loss"):
        engine.backward(engine(torch.randn(2, 3)))
    with torch.no_grad():
        loss = engine(torch.randn(2, 3)).sum()
    with pytest.raises(ValueError, match="does not require grad"):
        engine.backward(loss)


def test_engine_surface_matches_deepspeed_tutorials():
    model = nn.Linear(3, 2)
    engine, *_ = zerotrain.initialize(
        model=model,
        config=dict(
            BASE,
            gradient_accumulation_steps=2,
            optimizer={"type": "AdamW", "params": {"lr": 0.1}},
            zero_optimization={"stage": 1},
        ),
    )
    assert engine.module is model
    assert (engine.local_rank, engine.global_rank, engine.world_size) == (0, 0, 1)
    assert engine.device == torch.device("cpu")
    assert not engine.fp16_enabled() and not engine.bfloat16_enabled()
    assert engine.zero_optimization_stage() == 1
    assert engine.gradient_accumulation_steps() == 2 and engine.train_batch_size() == 2 * MICRO
    assert engine.train_micro_batch_size_per_gpu() == MICRO
    assert engine.is_gradient_accumulation_boundary() is False
    engine.backward(engine(torch.randn(MICRO, 3)).sum())
    engine.step()
    assert (engine.micro_steps, engine.global_steps) == (1, 0) and not engine.was_step_applied()
    assert engine.is_gradient_accumulation_boundary() is True
    engine.backward(engine(torch.randn(MICRO, 3)).sum())
    engine.step()
    assert (engine.micro_steps, engine.global_steps) == (2, 1) and engine.was_step_applied()
    assert engine.get_global_grad_norm() > 0
    engine.eval()
    assert not model.training
    engine.train()
    assert model.training
    state = engine.consolidated_state_dict(dtype=torch.bfloat16)
    assert state.keys() == model.state_dict().keys()
    assert all(v.dtype == torch.bfloat16 for v in state.values())


def test_steps_per_print_reports_with_wall_clock_breakdown(capsys):
    engine, *_ = zerotrain.initialize(
        model=nn.Linear(3, 2),
        config=dict(
            BASE,
            steps_per_print=2,
            wall_clock_breakdown=True,
            optimizer={"type": "SGD", "params": {"lr": 0.25}},
        ),
    )
    for _ in range(4):
        engine.backward(engine(torch.randn(MICRO, 3)).sum())
        engine.step()
    lines = [line for line in capsys.readouterr().out.splitlines() if "[zerotrain]" in line]
    assert [line.split(" | ")[0] for line in lines] == ["[zerotrain] step 2", "[zerotrain] step 4"]
    assert "| lr 0.25 |" in lines[0] and "grad norm" in lines[0]
    assert all(f"{part} " in lines[1] for part in ("forward", "backward", "step"))
    # one process: nothing to communicate
    assert "communication: 0.0 ms exposed, 0.00 MB sent per step" in lines[1]
