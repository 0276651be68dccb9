"""PyTorch-style ``loss.backward()`` trains exactly as ``engine.backward(loss)`` does, at every
stage, world size and accumulation; what cannot be reduced is refused before any update."""

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
from torch import nn

import zerotrain

STEPS, MICRO = 3, 2
LR, CLIP = 2e-2, 0.5


def reference(world: int, accum: int):
    """Single process, the whole global batch, torch AdamW and clipping."""
    torch.manual_seed(0)
    model = AwkwardModel()
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=LR, eps=1e-6)
    idx, tgt = make_batches(STEPS, MICRO * accum * world)
    for step in range(STEPS):
        model(idx[step], tgt[step]).backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], CLIP)
        opt.step()
        opt.zero_grad()
    return model.state_dict()


class DictOutput(AwkwardModel):
    """Returns {"loss", "logits"} with the loss computed from the logits inside the model, as
    HuggingFace models do: the gradient of ``logits`` then comes partly through ``loss``."""

    def forward(self, idx, targets):
        h = self.embed(idx) + self.odd * self.mix
        h = h + self.down(torch.tanh(self.frozen(torch.tanh(self.up(h)))))
        logits = self.head(h)
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, 11), targets.view(-1))
        return {"loss": loss, "logits": logits}


def _engine(stage: int, accum: int, precision: str = "fp32", model_class=AwkwardModel):
    torch.manual_seed(0)
    model = model_class()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": 1e-6}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 60,
            "stage3_param_persistence_threshold": 0,
        },
        "steps_per_print": 10**6,
    }
    if precision != "fp32":
        config[precision] = {"enabled": True}
    engine, *_ = zerotrain.initialize(
        model=model, model_parameters=param_groups(model, 0.1), config=config
    )
    return engine


def _train(engine, accum: int, direct: bool):
    """``direct``: loss.backward(), through engine.scale under fp16 (where it is required)."""
    from zerotrain.comm import Communicator

    def backward(out) -> None:
        loss = out["loss"] if isinstance(out, dict) else out
        if not direct:
            engine.backward(loss)
        elif engine.fp16_enabled():
            engine.scale(loss).backward()
        else:
            loss.backward()

    comm = Communicator()
    idx, tgt = make_batches(STEPS, MICRO * accum * comm.world_size)
    run_steps(engine, idx, tgt, MICRO, accum, comm.world_size, comm.rank, backward=backward)
    return engine.consolidated_state_dict()


def both_ways(cases):
    """Per (stage, accumulation, precision, model): the states trained by
    engine.backward(loss) and by loss.backward()."""
    out = {}
    for stage, accum, precision, model in cases:
        model_class = DictOutput if model == "dict" else AwkwardModel
        managed = _train(_engine(stage, accum, precision, model_class), accum, direct=False)
        direct = _train(_engine(stage, accum, precision, model_class), accum, direct=True)
        out[(stage, accum, precision, model)] = (managed, direct)
    return out


GRID = [(stage, accum, "fp32", "loss") for stage in (0, 1, 2, 3) for accum in (1, 2, 3)]
EXTRA = [(s, 2, p, "loss") for s in (0, 2) for p in ("fp16", "bf16")] + [
    (s, 2, "fp32", "dict") for s in (1, 3)
]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_loss_backward_trains_like_engine_backward(world):
    results = run_distributed(both_ways, world, GRID + (EXTRA if world == 2 else []))
    references = {accum: reference(world, accum) for accum in (1, 2, 3)}
    for rank, per_case in enumerate(results):
        for (stage, accum, precision, model), (managed, direct) in per_case.items():
            label = f"world {world} rank {rank} stage {stage} accum {accum} {precision} {model}"
            for key, value in managed.items():
                if accum != 3:  # a power-of-two factor on the gradient: the same bits
                    assert torch.equal(direct[key], value), f"{label} {key}"
                else:  # 1/3 on the parameters' gradients instead of on the loss: rounding apart
                    assert relative_error(direct[key], value) < 1e-6, f"{label} {key}"
                if precision == "fp32":
                    err = relative_error(direct[key], references[accum][key])
                    assert err < 1e-5, f"{label} {key}: {err:.2e} from single-process AdamW"
    # every rank holds the same model
    for per_case in results[1:]:
        for case, (_, direct) in per_case.items():
            for key, value in results[0][case][1].items():
                assert torch.equal(direct[key], value), (case, key)


def misuse(stage: int):
    """Each way of getting gradients the engine cannot average, and what it says."""
    errors = {}
    idx, tgt = make_batches(1, MICRO)
    engine = _engine(stage, 1)
    try:  # the model called directly: no engine output saw the backward
        engine.module(idx[0], tgt[0]).backward()
    except RuntimeError as err:
        errors["module"] = str(err)
    engine.zero_grad()
    try:  # no backward at all before an updating step
        engine(idx[0], tgt[0])
        engine.step()
    except RuntimeError as err:
        errors["step"] = str(err)
    try:
        with engine.no_sync():
            pass
    except RuntimeError as err:
        errors["no_sync"] = str(err)
    fp16 = _engine(stage, 1, "fp16")
    try:  # fp16 loss scaling needs the scaled loss
        fp16(idx[0], tgt[0]).backward()
    except RuntimeError as err:
        errors["fp16"] = str(err)
    return errors, engine.global_steps + fp16.global_steps


def test_gradients_the_engine_cannot_average_are_refused():
    for stage, (errors, steps) in enumerate(run_distributed(misuse_all_stages, 2)[0]):
        assert "engine.module(...) bypasses gradient averaging" in errors["module"], stage
        assert "found no reduced gradients" in errors["step"], stage
        assert "Call engine.backward(loss), or engine.scale(loss).backward()" in errors["fp16"]
        assert steps == 0, stage  # nothing was updated
        if stage >= 2:
            assert f"ZeRO stage {stage} partitions gradients" in errors["no_sync"]
        else:
            assert "no_sync" not in errors, stage


def misuse_all_stages():
    return [misuse(stage) for stage in range(4)]


def no_sync_accumulation(stage: int):
    """Accumulation 2: the first micro-step inside no_sync (as DDP users write it), the second
    outside; then an accumulation whose boundary backward is inside no_sync."""
    from zerotrain.comm import Communicator

    comm = Communicator()
    engine = _engine(stage, 2)
    idx, tgt = make_batches(STEPS, MICRO * 2 * comm.world_size)
    for step in range(STEPS):
        for micro in range(2):
            x = micro_batch(idx[step], micro, comm.rank, comm.world_size, MICRO)
            y = micro_batch(tgt[step], micro, comm.rank, comm.world_size, MICRO)
            if micro == 0:
                with engine.no_sync():
                    engine(x, y).backward()
            else:
                engine(x, y).backward()
            engine.step()
    state = engine.consolidated_state_dict()
    error = None
    for _ in range(2):
        with engine.no_sync():
            engine.backward(engine(idx[0][:MICRO], tgt[0][:MICRO]))
        try:
            engine.step()
        except RuntimeError as err:
            error = str(err)
    return state, error


def test_no_sync_defers_reduction_at_stages_0_and_1():
    want = reference(2, 2)
    for per_stage in run_cases(no_sync_accumulation, 2, [(0,), (1,)]):
        for stage, (state, error) in enumerate(per_stage):
            for key, value in want.items():
                assert relative_error(state[key], value) < 1e-5, (stage, key)
            assert "outside engine.no_sync()" in error


class Critic(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x):
        return self.net(x)


def gradient_penalty():
    """WGAN-GP: torch.autograd.grad through the engine's output (create_graph) must neither
    be scaled nor reduce anything; the loss.backward() that follows trains as plain torch."""
    torch.manual_seed(0)
    plain = Critic()
    torch.manual_seed(0)
    wrapped = Critic()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**6,
    }
    engine, *_ = zerotrain.initialize(model=wrapped, config=config)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(3)
    penalties, collectives = [], []
    for _ in range(2):  # one optimizer step of two micro-steps (every rank the same batch)
        x = torch.randn(4, 4, generator=gen, requires_grad=True)
        losses = []
        for model in (plain, engine):
            out = model(x)
            calls = sum(stats.calls for stats in engine.comm.stats.values())
            (grad_x,) = torch.autograd.grad(out.sum(), x, create_graph=True)
            collectives.append(sum(stats.calls for stats in engine.comm.stats.values()) - calls)
            penalty = ((grad_x.norm(dim=1) - 1) ** 2).mean()
            losses.append(out.mean() + penalty)
            penalties.append(penalty.item())
        (losses[0] / 2).backward()
        losses[1].backward()
        engine.step()
    opt.step()
    return plain.state_dict(), engine.consolidated_state_dict(), penalties, collectives


def test_autograd_grad_through_the_engine_is_left_alone():
    for plain, zt, penalties, collectives in run_distributed(gradient_penalty, 2):
        assert penalties[0] == penalties[1] and penalties[2] == penalties[3]
        assert collectives == [0, 0, 0, 0]  # nothing opened, nothing reduced (the boundary too)
        for key, value in plain.items():
            assert relative_error(zt[key], value) < 1e-6, key


class Faulty(AwkwardModel):
    """Raises in the backward of the micro-batch it is told to, half-way through the model (on
    every rank alike: the reductions launched before stay paired)."""

    fail = False

    def forward(self, idx, targets):
        h = self.embed(idx) + self.odd * self.mix
        up = _RaiseInBackward.apply(self.up(h), self)
        h = h + self.down(torch.tanh(self.frozen(torch.tanh(up))))
        logits = self.head(h)
        return torch.nn.functional.cross_entropy(logits.float().view(-1, 11), targets.view(-1))


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, model):
        ctx.model = model
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        if ctx.model.fail:
            raise MemoryError("injected: out of memory in backward")
        return grad, None


def recover_after_a_failed_backward(stages):
    """Per stage and way of calling backward: a run whose step-2 backward raises (caught; the
    batch skipped with engine.zero_grad()), and a run that skips that batch."""
    from zerotrain.comm import Communicator

    comm = Communicator()
    out = {}
    for stage in stages:
        for direct in (False, True):
            runs = []
            for inject in (True, False):
                engine = _engine(stage, 1, model_class=Faulty)
                idx, tgt = make_batches(4, MICRO * comm.world_size)
                for step in range(4):
                    x = micro_batch(idx[step], 0, comm.rank, comm.world_size, MICRO)
                    y = micro_batch(tgt[step], 0, comm.rank, comm.world_size, MICRO)
                    if step == 2 and not inject:
                        continue
                    engine.module.fail = inject and step == 2
                    loss = engine(x, y)
                    try:
                        loss.backward() if direct else engine.backward(loss)
                    except MemoryError:
                        engine.zero_grad()
                        continue
                    engine.step()
                runs.append(engine.consolidated_state_dict())
            out[(stage, direct)] = runs
    return out


def test_a_backward_that_raises_can_be_skipped():
    for per_case in run_distributed(recover_after_a_failed_backward, 2, [0, 1, 2, 3]):
        for case, (recovered, skipped) in per_case.items():
            for key, value in skipped.items():
                assert torch.equal(recovered[key], value), (case, key)


def scale_then_engine_backward():
    """engine.scale(loss) used only for logging must not change the next loss.backward()."""
    states = []
    for mixed in (False, True):
        engine = _engine(2, 2)
        idx, tgt = make_batches(2, MICRO * 2)
        for step in range(2):
            for micro in range(2):
                loss = engine(
                    micro_batch(idx[step], micro, 0, 1, MICRO),
                    micro_batch(tgt[step], micro, 0, 1, MICRO),
                )
                if mixed and micro == 0:
                    engine.scale(loss)  # computed, never used
                    engine.backward(loss)
                elif mixed:
                    loss.backward()
                else:
                    engine.backward(loss)
                engine.step()
        states.append(engine.consolidated_state_dict())
    return states


def test_engine_scale_does_not_leak_into_a_later_backward():
    ((managed, mixed),) = run_distributed(scale_then_engine_backward, 1)
    for key, value in managed.items():
        assert torch.equal(mixed[key], value), key


class Adapted(nn.Module):
    """LoRA-shaped: a frozen embedding and head outside, every trainable parameter inside a
    reentrant activation checkpoint (its gradients come from a nested backward)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 8).requires_grad_(False)
        self.adapter = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 11).requires_grad_(False)

    def forward(self, idx, targets):
        h = self.embed(idx).requires_grad_()  # HuggingFace's enable_input_require_grads()
        h = h + torch.utils.checkpoint.checkpoint(self.adapter, h, use_reentrant=True)
        return torch.nn.functional.cross_entropy(self.head(h).view(-1, 11), targets.view(-1))


def reentrant_checkpointing(cases):
    out = {}
    for stage, accum in cases:
        states = []
        for direct in (False, True):
            engine = _engine(stage, accum, model_class=Adapted)
            try:
                _train(engine, accum, direct)
            except RuntimeError as err:
                states.append(str(err))
                continue
            states.append(engine.consolidated_state_dict())
        out[(stage, accum)] = states
    return out


def test_loss_backward_with_reentrant_checkpointing():
    for per_case in run_distributed(reentrant_checkpointing, 2, [(0, 1), (2, 2), (3, 2), (0, 2)]):
        for (stage, accum), (managed, direct) in per_case.items():
            if (stage, accum) == (0, 2):  # the buffer holds the gradient before we can divide
                assert "checkpoint with use_reentrant=False" in direct
                continue
            for key, value in managed.items():
                assert torch.equal(direct[key], value), (stage, accum, key)
