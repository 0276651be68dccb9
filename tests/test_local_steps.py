"""0/1 Adam's local steps at stage 0 (zerotrain/optim/local_steps.py): the schedule, the
settings that refuse them, and on 2 ranks each rank's replica against the paper's algorithm run
in one process, the bytes of each step, and resume."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
from distributed import run_distributed
from test_compression import relative_error
from test_moe import EXPERTS, SEQ, WIDTH, MoEModel, moe_model
from torch import nn

from zerotrain.compression import make_codec
from zerotrain.config import ConfigError, load_config
from zerotrain.optim.local_steps import LocalStepSchedule

# the variance learns at steps 1, 2 and 4 (var_update_scaler 2) and freezes; steps 5-6 sync
# every step, 7-8 every 2nd, from 9 every 4th (local_step_scaler 2, local_step_clipper 4)
PARAMS = {
    "lr": 0.02,
    "betas": [0.9, 0.99],
    "weight_decay": 0.01,
    "var_freeze_step": 3,
    "var_update_scaler": 2,
    "local_step_scaler": 2,
    "local_step_clipper": 4,
}
STEPS = 14
CLIP = 0.2  # gradient_clipping: it clips some steps' gradients and not others'
SYNCS = {1, 2, 3, 4, 5, 6, 8, 12}  # of steps 1-14
SAVED_AT = 10  # inside the window of steps 9-12
FP16 = {"enabled": True, "loss_scale": 1024}


def lr_at(step: int) -> float:
    """A learning rate that changes every step (1-based), set by hand on both sides."""
    return PARAMS["lr"] * (1 + 0.1 * (step % 3))


def test_the_schedule_is_deepspeeds():
    schedule = LocalStepSchedule(frozen_from=5, scaler=2, clipper=4)
    assert {s for s in range(1, 15) if schedule.syncs(s)} == SYNCS
    assert [schedule.interval(s) for s in (4, 5, 7, 9, 10**9)] == [1, 1, 2, 4, 4]


def test_settings_where_a_replica_cannot_step_alone():
    config = {
        "train_batch_size": 8,
        "optimizer": {"type": "ZeroOneAdam", "params": PARAMS},
        "zero_optimization": {"stage": 0},
    }
    load_config(config, world_size=2)  # stage 0, fp32, bf16 or fp16: local steps
    load_config({**config, "fp16": {"enabled": True}}, world_size=2)
    with pytest.raises(
        ConfigError,
        match="local_step_clipper: 4 asks 0/1 Adam.*zero_optimization.stage 1 partitions them",
    ):
        load_config({**config, "zero_optimization": {"stage": 1}}, world_size=2)


def engine_with(params: dict, exact: bool, gradients: dict | None = None, **more):
    """The test model at stage 0 under ZeroOneAdam with ``params``; ``exact``: its gradients
    travel uncompressed (the algorithm alone, against the reference); ``gradients``: the
    comm_compression.gradients section (another method than signs after the freeze); ``more``:
    other config keys."""
    import zerotrain

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": None,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "ZeroOneAdam", "params": params},
        "zero_optimization": {"stage": 0},
        "comm_compression": {"gradients": gradients or {}},
        **more,
    }
    engine = zerotrain.initialize(model=model, config=config)[0]
    if exact:
        for group in engine.optimizer.groups:
            group.reduction.codec = make_codec(None, group.reduction.comm, group.reduction.shapes)
    return engine


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(1000 * rank + step))


def train(engine, first: int, last: int, nan_at: int = 0) -> list[tuple[dict, int]]:
    """Steps ``first``..``last`` (1-based): after each, the replica and the bytes sent.
    ``nan_at``: rank 1's loss at that step is NaN."""
    rank, comm = engine.optimizer.comm.rank, engine.optimizer.comm
    out = []
    for step in range(first, last + 1):
        for group in engine.optimizer.param_groups:
            group["lr"] = lr_at(step)
        before = sum(s.sent for s in comm.stats.values())
        dtype = next(engine.module.parameters()).dtype
        loss = engine(batch(rank, step).to(dtype)).float().pow(2).mean()
        engine.backward(loss * float("nan") if (step, rank) == (nan_at, 1) else loss)
        engine.step()
        sent = sum(s.sent for s in comm.stats.values()) - before
        out.append(({n: p.detach().clone() for n, p in engine.module.named_parameters()}, sent))
    return out


def local_step_runs(tmp: str) -> dict:
    out = {
        "exact": train(engine_with(PARAMS, exact=True), 1, STEPS),
        "one bit": train(engine_with(PARAMS, exact=False), 1, STEPS),
        "every step": train(engine_with({**PARAMS, "local_step_clipper": 1}, False), 1, 6),
        "top-k": train(engine_with(PARAMS, False, {"method": "topk", "ratio": 0.25}), 1, STEPS),
        "nan": train(engine := engine_with(PARAMS, exact=False), 1, STEPS, nan_at=10),
        "fp16": train(engine_with(PARAMS, exact=True, fp16=FP16), 1, STEPS),
        "skipped": engine.skipped_steps,
    }
    engine = engine_with(PARAMS, exact=False)
    train(engine, 1, SAVED_AT)
    out["compression bytes"] = engine.memory_breakdown()["compression"]
    engine.save_checkpoint(tmp, tag="window")
    out["resumed"] = engine_with(PARAMS, exact=False)
    out["resumed"].load_checkpoint(tmp, tag="window")
    out["resumed"] = train(out["resumed"], SAVED_AT + 1, STEPS)
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def runs(checkpoint) -> list[dict]:
    return run_distributed(local_step_runs, 2, checkpoint)


def clip_factor(tensors: list[torch.Tensor]) -> float:
    """What the engine multiplies ``tensors`` by to clip their global norm to CLIP."""
    norm = sum(t.square().sum() for t in tensors).sqrt().item()
    return min(1.0, CLIP / (norm + 1e-6))


def clipped(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` scaled to a global norm of at most CLIP (as the engine clips)."""
    factor = clip_factor(tensors)
    return [t * factor for t in tensors]


def squared_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def reference(
    model: nn.Module | None = None,
    workers: int = 2,
    holder: Callable[[str, int], int] = lambda name, worker: worker,
    stepper: Callable[[str, int], int] = lambda name, replica: replica,
    loss: Callable[[nn.Module, torch.Tensor], torch.Tensor] = squared_loss,
    batch_of: Callable[[int, int], torch.Tensor] = batch,
    eps: float = 1e-8,
) -> list[list[dict]]:
    """0/1 Adam with local steps as the paper states it (arXiv:2202.06009, Algorithm 1),
    ``workers`` workers in one process, exact averages: each replica's momentum and sum of
    lr·momentum since the last synchronization, stepped one step at a time. Clipping as
    zerotrain defines it: a local step clips by its worker's gradient norm, a synchronization
    the averaged message (the window's lr-weighted mean gradient; one step's window: the
    averaged gradient).

    By default each worker has a replica of every parameter. ``holder(name, worker)`` names
    the replica of a parameter a worker trains with where workers share one (an MoE expert,
    once per expert-parallel group): a shared replica steps with the mean of its workers'
    gradients, clipped by the norm of worker ``stepper(name, replica)``, the one holding it; a
    worker's norm counts the replicas it trains with. Per step, each worker's view of
    ``model`` (default: the test model), whose ``loss`` on ``batch_of(worker, step)`` gives
    the gradients; ``eps``: Adam's."""
    if model is None:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    names = [n for n, _ in model.named_parameters()]
    start = [p.detach().clone() for p in model.parameters()]
    beta1, beta2 = PARAMS["betas"]
    wd = PARAMS["weight_decay"]
    held = [[holder(n, w) for w in range(workers)] for n in names]  # [param][worker]: replica
    count = [max(h) + 1 for h in held]  # replicas of each parameter
    replicas = [[t.clone() for _ in range(c)] for t, c in zip(start, count, strict=True)]
    local_m = [[torch.zeros_like(t) for _ in range(c)] for t, c in zip(start, count, strict=True)]
    progress = [[torch.zeros_like(t) for _ in range(c)] for t, c in zip(start, count, strict=True)]
    synced = [t.clone() for t in start]
    m = [torch.zeros_like(t) for t in start]
    v = [torch.zeros_like(t) for t in start]
    lrs, decay, weight = 0.0, 1.0, 0.0
    schedule = LocalStepSchedule(PARAMS["var_freeze_step"] + 2, 2, 4)
    out = []
    for step in range(1, STEPS + 1):
        lr = lr_at(step)
        grads = [[torch.zeros_like(t) for _ in range(c)] for t, c in zip(start, count, strict=True)]
        for w in range(workers):
            with torch.no_grad():
                for i, p in enumerate(model.parameters()):
                    p.copy_(replicas[i][held[i][w]])
            model.zero_grad()
            loss(model, batch_of(w, step)).backward()
            for i, p in enumerate(model.parameters()):
                grads[i][held[i][w]] += p.grad / held[i].count(held[i][w])
        if step < schedule.frozen_from:  # every step synchronizes
            averaged = clipped([sum(g) / len(g) for g in grads])
            for i, g in enumerate(averaged):
                m[i].mul_(beta1).add_(g, alpha=1 - beta1)
                if step in (1, 2, 4):
                    v[i].mul_(beta2).addcmul_(g, g, value=1 - beta2)
                new = synced[i] - lr * (m[i] / (v[i].sqrt() + eps) + wd * synced[i])
                synced[i] = new
                for h in range(count[i]):
                    replicas[i][h], local_m[i][h] = new.clone(), m[i].clone()
        else:
            lrs += lr
            decay *= beta1
            weight += lr * decay  # Σ lr·β1^(k-s): m_s's part of the progress
            syncs = schedule.syncs(step)
            factors = [  # a local step clips by its worker's norm
                1.0 if syncs else clip_factor([grads[i][held[i][w]] for i in range(len(start))])
                for w in range(workers)
            ]
            for i in range(len(start)):
                for h in range(count[i]):
                    g = grads[i][h] * factors[stepper(names[i], h)]
                    local_m[i][h].mul_(beta1).add_(g, alpha=1 - beta1)
                    progress[i][h].add_(local_m[i][h], alpha=lr)
                    d = v[i].sqrt() + eps
                    replicas[i][h] = synced[i] * (1 - wd * lrs) - progress[i][h] / d
            if syncs:  # the replicas' S / (L·(1 - β1)), averaged, clipped
                scale = lrs * (1 - beta1)
                sent = [
                    sum((progress[i][h] - weight * m[i]) / scale for h in range(count[i]))
                    / count[i]
                    for i in range(len(start))
                ]
                for i, average in enumerate(clipped(sent)):
                    mean = weight * m[i] + average * scale
                    m[i] = mean / lrs
                    synced[i] = synced[i] * (1 - wd * lrs) - mean / (v[i].sqrt() + eps)
                    for h in range(count[i]):
                        replicas[i][h], local_m[i][h] = synced[i].clone(), m[i].clone()
                        progress[i][h].zero_()
                lrs, decay, weight = 0.0, 1.0, 0.0
        out.append(
            [
                {n: replicas[i][held[i][w]].clone() for i, n in enumerate(names)}
                for w in range(workers)
            ]
        )
    return out


def test_each_replica_steps_as_the_papers_algorithm(runs):
    """With exact averages each rank's replica is the reference worker's after every step,
    to rounding: apart on local steps, and the same bits on every rank after a
    synchronization."""
    expected = reference()
    for step in range(1, STEPS + 1):
        replicas = [per_rank["exact"][step - 1][0] for per_rank in runs]
        for rank, replica in enumerate(replicas):
            reference_replica = expected[step - 1][rank]
            errors = [relative_error(replica[k], reference_replica[k]) for k in replica]
            assert max(errors) < 1e-5, (step, rank)
        same = all(torch.equal(replicas[0][k], replicas[1][k]) for k in replicas[0])
        assert same == (step in SYNCS), step


def test_fp16_synchronizes_the_loss_scaled_message(runs):
    """fp16 at a loss scale of 1024: each rank's replica is the reference worker's after every
    step to fp16's rounding (its forward in fp16; Adam's normalization makes that 0.03% after
    step 1, 3% after step 14). The window's carry in a synchronization's message takes the
    scale the gradient in it has: without it, the replicas end 25% off at the first
    synchronization after a local step (step 8), 600% at step 14."""
    expected = reference()
    for step in range(1, STEPS + 1):
        replicas = [per_rank["fp16"][step - 1][0] for per_rank in runs]
        for rank, replica in enumerate(replicas):
            errors = [relative_error(replica[k], expected[step - 1][rank][k]) for k in replica]
            assert max(errors) < 0.05, (step, rank, max(errors))
        same = all(torch.equal(replicas[0][k], replicas[1][k]) for k in replicas[0])
        assert same == (step in SYNCS), step


class Twice(nn.Module):
    """One linear layer used twice, then a head: the tie a pipeline splits across stages."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.shared, self.head = nn.Linear(6, 6), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.shared(torch.tanh(self.shared(x))))


def pipeline_local_steps() -> list[dict]:
    """:class:`Twice` cut into 2 pipeline stages x 2 data-parallel ranks, each stage holding a
    copy of the shared layer, under ZeroOneAdam's local steps with exact averages: after each
    step, this rank's parameters under :class:`Twice`'s names."""
    import zerotrain
    from zerotrain.pipe import PipelineModule, TiedLayerSpec

    specs = [TiedLayerSpec("shared", nn.Linear, 6, 6), nn.Tanh()]
    specs += [TiedLayerSpec("shared", nn.Linear, 6, 6), nn.Linear(6, 2)]
    model = PipelineModule(
        specs, num_stages=2, loss_fn=lambda out, _: out.pow(2).mean(), partition_method="uniform"
    )
    start = Twice().state_dict()
    names = {
        "tied_modules.shared.weight": "shared.weight",
        "tied_modules.shared.bias": "shared.bias",
    }
    names |= {"3.weight": "head.weight", "3.bias": "head.bias"}
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(start[names[name]])
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "steps_per_print": None,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "ZeroOneAdam", "params": PARAMS},
        "zero_optimization": {"stage": 0},
        "pipeline": {"schedule": "gpipe"},  # one micro-batch
    }
    engine = zerotrain.initialize(model=model, config=config)[0]
    for group in engine.optimizer.groups:
        group.reduction.codec = make_codec(None, group.reduction.comm, group.reduction.shapes)
    out = []
    for step in range(1, STEPS + 1):
        for group in engine.optimizer.param_groups:
            group["lr"] = lr_at(step)
        x = batch(engine.optimizer.comm.rank, step)
        engine.train_batch(iter([(x, torch.zeros(len(x)))]))
        out.append({names[n]: p.detach().clone() for n, p in model.named_parameters()})
    return out


def test_a_layer_tied_across_pipeline_stages_steps_locally_as_one_parameter():
    """pp 2 x dp 2: each data-parallel replica, its shared layer in two copies on two stages,
    steps as the paper's worker of the same replica with one shared parameter (1e-5). A
    synchronization sums the copies' messages over the stages, so each copy sends half its
    window's carry: sent whole, the replica is 16% off at the first synchronization after a
    local step (step 8)."""
    expected = reference(Twice())
    per_rank = run_distributed(pipeline_local_steps, 4)
    for rank, steps in enumerate(per_rank):
        stage, replica = divmod(rank, 2)
        assert "shared.weight" in steps[0] and ("head.weight" in steps[0]) == (stage == 1)
        for step in range(1, STEPS + 1):
            want = expected[step - 1][replica]
            errors = [relative_error(v, want[k]) for k, v in steps[step - 1].items()]
            assert max(errors) < 1e-5, (rank, step, max(errors))
    for step in range(1, STEPS + 1):  # the copies on the two stages stay equal
        copies = [steps[step - 1]["shared.weight"] for steps in per_rank]
        assert torch.equal(copies[0], copies[2]) and torch.equal(copies[1], copies[3]), step


MOE_EP = 2  # over 4 ranks: ranks 0-1 and 2-3 each hold every expert once
# an expert that gets few tokens has tiny gradients, whose rounding Adam's normalization would
# magnify at eps 1e-8 (as in test_moe)
MOE_EPS = 1e-5


def moe_batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(2, SEQ, WIDTH, generator=torch.Generator().manual_seed(1000 * rank + step))


def moe_local_steps() -> dict[str, list[dict]]:
    """test_moe's MoEModel at ep 2 over 4 ranks under ZeroOneAdam's local steps, with exact
    averages and in 1 bit: after each step, this rank's parameters (its experts under their
    global names)."""
    return {"exact": train_moe(exact=True), "one bit": train_moe(exact=False)}


def train_moe(exact: bool) -> list[dict]:
    import zerotrain

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": None,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "ZeroOneAdam", "params": {**PARAMS, "eps": MOE_EPS}},
        "zero_optimization": {"stage": 0},
    }
    engine = zerotrain.initialize(model=moe_model(MOE_EP), config=config)[0]
    for group in engine.optimizer.groups if exact else []:
        group.reduction.codec = make_codec(None, group.reduction.comm, group.reduction.shapes)
    out = []
    for step in range(1, STEPS + 1):
        for group in engine.optimizer.param_groups:
            group["lr"] = lr_at(step)
        engine.backward(engine(moe_batch(engine.optimizer.comm.rank, step)))
        engine.step()
        out.append({n: p.detach().clone() for n, p in engine.module.named_parameters()})
    return out


def by_layer(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each module's parameters in one vector."""
    layers: dict[str, list[torch.Tensor]] = {}
    for name, value in params.items():
        layers.setdefault(name.rsplit(".", 1)[0], []).append(value.flatten())
    return {layer: torch.cat(values) for layer, values in layers.items()}


def test_moe_experts_step_locally_as_one_replica_per_expert_parallel_group():
    """ep 2 x 4 data-parallel ranks: each rank's dense parameters step as its reference
    worker's, and each expert, held once per expert-parallel group, as one replica stepped
    with the mean of its group's gradients (1e-5). An expert's gradient on a rank already sums
    its group's tokens: a local step takes half of it, and a synchronization counts the
    window's carry twice, as much as that sum weighs. In 1 bit, the ranks holding the same
    experts, and all four for the dense parameters, are equal after each synchronization
    only."""
    runs = run_distributed(moe_local_steps, 4)
    per_rank = [run["exact"] for run in runs]
    experts_each = EXPERTS // MOE_EP

    def expert(name: str) -> int | None:
        match = re.search(r"deepspeed_experts\.(\d+)\.", name)
        return None if match is None else int(match.group(1))

    def holder(name: str, worker: int) -> int:
        return worker if expert(name) is None else worker // MOE_EP

    def stepper(name: str, replica: int) -> int:
        index = expert(name)
        return replica if index is None else replica * MOE_EP + index // experts_each

    expected = reference(
        MoEModel(), 4, holder, stepper, lambda model, x: model(x), moe_batch, MOE_EPS
    )
    for rank, steps in enumerate(per_rank):
        assert {expert(n) for n in steps[0]} - {None} == set(
            range(rank % MOE_EP * experts_each, (rank % MOE_EP + 1) * experts_each)
        )
        for step in range(1, STEPS + 1):  # by layer: the head's bias alone nears zero
            want = by_layer(expected[step - 1][rank])
            for layer, value in by_layer(steps[step - 1]).items():
                assert relative_error(value, want[layer]) < 1e-5, (rank, step, layer)
    for method in ("exact", "one bit"):
        for step in range(1, STEPS + 1):
            after = [run[method][step - 1] for run in runs]
            assert all(torch.isfinite(t).all() for t in after[0].values())
            for a, b in ((0, 1), (0, 2), (0, 3), (1, 3)):  # 0-2 and 1-3 hold the same experts
                same = all(torch.equal(after[a][k], after[b][k]) for k in after[a] if k in after[b])
                assert same == (step in SYNCS), (method, step, a, b)


FLAG_BYTES = 4  # a local step's one-element overflow flag, sent to the other rank


def test_local_steps_send_a_flag_and_synchronizations_send_signs(runs):
    """In 1 bit: a local step sends only the overflow flag, a synchronization a sign per
    element and a scale per block, and leaves equal replicas; before any local step the run is
    bit for bit the one without local steps (local_step_clipper 1). Top-k's messages after
    the freeze likewise."""
    for per_rank in runs:
        sent = [s for _, s in per_rank["one bit"]]
        exact_steps = [sent[step - 1] for step in (1, 2, 4)]  # fp32, whole
        assert all(sent[step - 1] < min(exact_steps) / 8 for step in (3, 5, 6, 8, 12)), sent
        pairs = zip(per_rank["one bit"][:6], per_rank["every step"], strict=True)
        for (ours, _), (theirs, _) in pairs:
            assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    for method in ("one bit", "top-k"):  # top-k in place of the signs after the freeze
        for step in range(1, STEPS + 1):
            (a, sent), (b, _) = (per_rank[method][step - 1] for per_rank in runs)
            assert all(torch.equal(a[k], b[k]) for k in a) == (step in SYNCS), (method, step)
            assert (sent == FLAG_BYTES) == (step not in SYNCS), (method, step, sent)


def test_a_non_finite_gradient_on_one_rank_skips_the_step_on_both(runs):
    """Rank 1's loss is NaN at step 10, a local step: both ranks skip it (the flag), stay in
    step, and synchronize to equal replicas at the next synchronization."""
    assert [per_rank["skipped"] for per_rank in runs] == [1, 1]
    for per_rank in runs:  # step 10 changed nothing: it is step 9's replica
        after_9, after_10 = (per_rank["nan"][step - 1][0] for step in (9, 10))
        assert all(torch.equal(after_9[k], after_10[k]) for k in after_9)
    a, b = (per_rank["nan"][13 - 1][0] for per_rank in runs)  # its 12th step: a sync
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.isfinite(t).all() for t in a.values())


def test_resume_inside_a_window_is_bitwise_an_uninterrupted_run(runs):
    """Saved after step 10, two local steps into a window: each rank rebuilds its own replica
    from its window and the run goes on with the same bits. The window is counted in
    memory_breakdown()["compression"]: the synced parameters, deviation and progress."""
    numel = 6 * 8 + 8 + 8 * 2 + 2
    for per_rank in runs:
        straight = per_rank["one bit"][SAVED_AT:]
        for (a, _), (b, _) in zip(straight, per_rank["resumed"], strict=True):
            assert all(torch.equal(a[k], b[k]) for k in a)
        assert per_rank["compression bytes"] >= 3 * 4 * numel
    assert not torch.equal(*(r["resumed"][0][0]["0.weight"] for r in runs))  # step 11: local


def test_another_world_size_goes_on_from_the_last_synchronization(runs, checkpoint):
    """One process loads the 2 ranks' checkpoint: the open window cannot be taken over, which
    it says, and it goes on from the last synchronization's parameters (step 8's), which the
    checkpoint holds; so does a load without the optimizer's state, silently."""
    saved = runs[0]["one bit"][8 - 1][0]
    engine = engine_with(PARAMS, exact=False)
    with pytest.warns(UserWarning, match="ranks were stepping alone when it was saved"):
        engine.load_checkpoint(checkpoint, tag="window")
    assert all(torch.equal(p, saved[n]) for n, p in engine.module.named_parameters())
    engine = engine_with(PARAMS, exact=False)
    engine.load_checkpoint(checkpoint, tag="window", load_optimizer_states=False)
    assert all(torch.equal(p, saved[n]) for n, p in engine.module.named_parameters())
    assert (
        engine.optimizer.groups[0].extensions["local_steps"].local_steps.steps == 0
    )  # as the optimizer's own count


def test_parameters_set_from_outside_are_the_next_windows_start(checkpoint):
    """Mid-window, a module-only load and the optimizer's own load_state_dict set every
    rank's parameters alike: the window is dropped, so the next step starts from them, not
    from the window's; local steps then read the optimizer's new groups (lr, betas)."""
    engine = engine_with(PARAMS, exact=False)
    local = engine.optimizer.groups[0].extensions["local_steps"].local_steps
    train(engine, 1, SAVED_AT)  # one process: steps 9 and 10 are local too
    assert local.open_window(0)
    engine.load_checkpoint(checkpoint, tag="window", load_module_only=True)
    assert not local.open_window(0)
    train(engine, SAVED_AT + 1, SAVED_AT + 1)
    assert local.open_window(0)
    engine.optimizer.load_state_dict(engine.optimizer.state_dict())
    assert not local.open_window(0)
    assert local.hyper(0) is engine.optimizer.groups[0].store.optimizer.param_groups[0]


def test_an_optimizer_the_script_builds_is_checked_as_the_config_is():
    """A ZeroOneAdam with local steps from a factory, at stage 1: refused, not ignored."""
    import zerotrain
    from zerotrain.optim.onebit import ZeroOneAdam

    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    with pytest.raises(ValueError, match="local steps .*only at zero_optimization.stage 0"):
        zerotrain.initialize(
            model=model,
            optimizer=lambda params: ZeroOneAdam(params, local_step_clipper=4),
            config={"train_batch_size": 4, "zero_optimization": {"stage": 1}},
        )
