"""An Adam catching up on top-k and gTop-k's gradients (zerotrain/optim/catch_up.py): the step
against n Adam steps of the mean gradient, the codec's counts, and on 2 ranks the engine's
steps against both."""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from test_compression import every_tensor, relative_error
from torch import nn

from zerotrain.comm import Communicator
from zerotrain.compression.codec import BucketShape, GradientCompression, SparseCodec
from zerotrain.config import ConfigError, load_config
from zerotrain.optim.adam import FusedAdam
from zerotrain.optim.catch_up import catch_up_step

LR, BETAS, EPS, DECAY = 0.01, (0.9, 0.99), 1e-8, 0.1


def reference_step(value, m, v, total, n, step, decay, decoupled):
    """One element by the definition: after n steps without news, ``total`` arrives; it takes n
    Adam steps of total/n for its moments, and n times the last one's update for its value.
    ``step``: the optimizer's count after this step."""
    if decoupled:
        value *= 1 - LR * decay
    for _ in range(n):
        g = total / n + (0.0 if decoupled else decay * value)
        m = BETAS[0] * m + (1 - BETAS[0]) * g
        v = BETAS[1] * v + (1 - BETAS[1]) * g * g
    m_hat, v_hat = m / (1 - BETAS[0] ** step), v / (1 - BETAS[1] ** step)
    return value - n * LR * m_hat / (v_hat**0.5 + EPS), m, v


@pytest.mark.parametrize("decoupled", [True, False])
def test_a_catch_up_step_is_n_adam_steps_of_the_mean_gradient(decoupled):
    """Elements that waited 0-4 steps (0: nothing arrived, so the moments stay and the value
    only decays, decoupled), each against :func:`reference_step` in float64."""
    gen = torch.Generator().manual_seed(0)
    value, total = torch.randn(6, generator=gen), torch.randn(6, generator=gen)
    m, v = torch.randn(6, generator=gen) * 0.1, torch.rand(6, generator=gen) * 0.1
    counts = torch.tensor([0.0, 1, 2, 3, 4, 0])
    total[counts == 0] = 0.0  # what the codec delivers where nothing arrived
    param = value.clone()
    state = {"step": torch.tensor(6.0), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    group = {"betas": BETAS, "lr": LR, "eps": EPS, "weight_decay": DECAY}
    group["decoupled_weight_decay"] = decoupled
    arrived = counts.nonzero().squeeze(1)
    catch_up_step(param, total.clone(), arrived, counts[arrived], state, group)
    for i, n in enumerate(counts.int().tolist()):
        want = reference_step(
            value[i].double().item(),
            m[i].item(),
            v[i].item(),
            total[i].item(),
            n,
            7,
            DECAY,
            decoupled,
        )
        got = (param[i].item(), state["exp_avg"][i].item(), state["exp_avg_sq"][i].item())
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7), (i, n)
    assert state["step"].item() == 7.0


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.AdamW([p], lr=LR, betas=BETAS, weight_decay=DECAY),
        lambda p: torch.optim.Adam([p], lr=LR, betas=BETAS, weight_decay=DECAY),
        lambda p: FusedAdam([p], lr=LR, betas=BETAS, weight_decay=DECAY, bias_correction=False),
    ],
)
def test_every_element_arriving_each_step_is_the_optimizers_own_step(make):
    """Counts of 1 everywhere: the optimizer's step, from a state it creates itself, for torch
    AdamW, Adam with L2 decay, and FusedAdam without bias correction (1e-6 over 5 steps, of
    what the steps changed: a parameter's size would hide an error in its updates)."""
    gen = torch.Generator().manual_seed(1)
    start = torch.randn(50, generator=gen)
    ours = nn.Parameter(start.clone())
    theirs = nn.Parameter(start.clone())
    optimizer = make(theirs)
    group = optimizer.param_groups[0]
    state: dict = {}
    for _ in range(5):
        grad = torch.randn(50, generator=gen)
        theirs.grad = grad.clone()
        optimizer.step()
        with torch.no_grad():
            catch_up_step(ours, grad.clone(), torch.arange(50), torch.ones(50), state, group)
    assert relative_error(ours.detach() - start, theirs.detach() - start) < 1e-6
    for key in ("exp_avg", "exp_avg_sq"):
        assert relative_error(state[key], optimizer.state[theirs][key]) < 1e-6


def dense(arrivals, numel: int) -> torch.Tensor:
    """Arrivals (positions, counts) as one count per element, 0 where nothing arrived."""
    assert arrivals is not None
    positions, counts = arrivals
    assert len(positions.unique()) == len(positions)
    return torch.zeros(numel).index_put_((positions,), counts)


def test_the_codec_counts_the_steps_each_arrival_carries():
    """Top-k in one process, a steady gradient of 1 but for one large element: each arrival's
    count is the steps its value sums (error feedback), exact elements (below min_numel) count
    1, and nothing else arrives. A skipped step's gradient stays in the residuals too, so it
    counts. The counts come back from a checkpoint."""
    shapes = [BucketShape(14, [(0, (12,)), (12, (2,))])]
    options = GradientCompression(method="topk", ratio=0.25, min_numel=4)
    codec = SparseCodec(Communicator(), shapes, options)
    steady = torch.tensor([5.0, *[1.0] * 10, 0.5, 1.0, 1.0])
    waited = torch.zeros(12)
    for step in range(6):
        if step == 3:
            saved, resumed = codec.state_dict(), SparseCodec(Communicator(), shapes, options)
            assert resumed.load_state_dict(saved, steps=0) is None
        flat = steady.clone()
        codec.all_reduce(0, flat).wait()
        counts = dense(codec.catch_up(0), 14)
        assert torch.equal(counts[12:], torch.ones(2))
        arrived = counts[:12] > 0
        assert arrived.sum() == 3 and torch.equal(counts[:12][arrived], waited[arrived] + 1)
        assert torch.equal(flat[:12], counts[:12] * steady[:12])
        if step == 3:  # the same as the run it was saved from
            again = steady.clone()
            resumed.all_reduce(0, again).wait()
            assert torch.equal(again, flat) and torch.equal(dense(resumed.catch_up(0), 14), counts)
        waited = torch.where(arrived, 0.0, waited + 1)
        codec.skip_step() if step == 1 else codec.end_step()
    assert waited.max() >= 3  # some element waited, and its sum carried that many steps
    assert codec.steps == 5


def test_micro_batches_count_steps_and_a_backward_that_raised_empties_what_it_sent():
    """Stages 2-3 reduce each micro-batch. Top-k of 3 in 12: each step's first micro-batch
    sends elements 0-2, its second 3-5, and each arrival counts one step (the half step an
    element sent first holds from the second micro-batch makes a step's worth with the next
    first one). A reduction of a backward that raised sent 6-8, which had waited since step 0,
    and emptied their residuals: sent again after it, they count one step, not three."""
    shapes = [BucketShape(12, [(0, (12,))])]
    options = GradientCompression(method="topk", ratio=0.25, min_numel=0)
    codec = SparseCodec(Communicator(), shapes, options)

    def reduce(large: slice) -> torch.Tensor | None:
        grad = torch.full((12,), 0.01)
        grad[large] = 10.0
        codec.all_reduce(0, grad).wait()
        arrivals = codec.catch_up(0)
        return None if arrivals is None else dense(arrivals, 12)

    for _ in range(2):
        reduce(slice(0, 3))
        assert torch.equal(reduce(slice(3, 6)), torch.tensor([1.0] * 6 + [0.0] * 6))
        codec.end_step()
    reduce(slice(6, 9))
    codec.abort_backward()
    assert codec.catch_up(0) is None
    assert torch.equal(reduce(slice(6, 9)), torch.tensor([0.0] * 6 + [1.0] * 3 + [0.0] * 3))


ADAMW = {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "weight_decay": DECAY}}
CASES = {  # name: (stage, comm_compression.gradients)
    "s0": (0, {}),
    "s2": (2, {}),
    "topk 100% s0": (0, {"method": "topk", "ratio": 1.0}),
    "gtopk 100% s2": (2, {"method": "gtopk", "ratio": 1.0}),
    "topk 10% s0": (0, {"method": "topk", "ratio": 0.1}),
    "gtopk 10% s2": (2, {"method": "gtopk", "ratio": 0.1}),
    "gtopk 10% s2, catch_up false": (2, {"method": "gtopk", "ratio": 0.1, "catch_up": False}),
}
STEPS = 4


def moments(store) -> list[tuple[torch.Tensor, ...]]:
    """Per bucket: a copy of the master and its Adam moments (zeros before the first step)."""
    out = []
    for master in store.master_shards():
        state = store.optimizer.state.get(master, {})
        kept = [state.get(k, torch.zeros_like(master)) for k in ("exp_avg", "exp_avg_sq")]
        out.append(tuple(t.clone() for t in (master, *kept)))
    return out


def train_catching_up(cases: dict[str, tuple[int, dict]]) -> dict:
    """Each case: the model after every step, and per step and bucket the master and moments
    before and after it, with the counts the optimizer took."""
    return {name: train_case(stage, grads) for name, (stage, grads) in cases.items()}


def train_case(stage: int, grads: dict) -> tuple:
    import zerotrain

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 48), nn.GELU(), nn.Linear(48, 3))
    engine = zerotrain.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 4,
            "steps_per_print": None,
            "optimizer": ADAMW,
            "zero_optimization": {"stage": stage},
            "comm_compression": {"gradients": every_tensor(grads)},
        },
    )[0]
    group = engine.optimizer.group
    counts: list = []
    extension = group.extensions.get("catch_up")
    if extension is not None:
        catch_up = extension.catch_up
        arrive, masters = catch_up.arrive, group.store.master_shards()

        def record(arrivals: list) -> None:
            counts.append([dense(a, m.numel()) for a, m in zip(arrivals, masters, strict=True)])
            arrive(arrivals)

        catch_up.arrive = record
    gen = torch.Generator().manual_seed(Communicator().rank)
    states, steps = [], []
    for _ in range(STEPS):
        before = moments(group.store)
        engine.backward(engine(torch.randn(4, 40, generator=gen)).pow(2).mean())
        engine.step()
        steps.append((before, moments(group.store)))
        states.append(engine.consolidated_state_dict())
    return states, steps, counts, extension is not None


@pytest.fixture(scope="module")
def catching_up() -> list[dict]:
    return run_distributed(train_catching_up, 2, CASES)


def test_an_engine_catches_up_exactly_where_all_arrives_and_leaves_the_rest(catching_up):
    """2 ranks, AdamW: top-k and gTop-k of every element train as uncompressed AdamW (1e-6),
    each step catching up with counts of 1. At 10%, each step's counts are 1 plus the steps
    the element waited (as the test counts them), an element with nothing arriving keeps its
    moments and only decays, one that arrives moves; at stage 0 the replicas stay equal.
    With catch_up false the optimizer steps as AdamW does (no counts)."""
    for per_rank in catching_up:
        for name, (states, steps, counts, catches) in per_rank.items():
            assert catches == ("%" in name and "false" not in name), name
            stage = CASES[name][0]
            if "100%" in name:
                plain = per_rank[f"s{stage}"][0]
                for a, b in zip(states, plain, strict=True):
                    assert max(relative_error(a[k], b[k]) for k in b) < 1e-6, name
                assert all(torch.equal(c, torch.ones_like(c)) for cs in counts for c in cs)
            if "10%" not in name or not catches:
                continue
            assert len(counts) == STEPS
            waited = [torch.zeros_like(c) for c in counts[0]]
            for (before, after), step_counts in zip(steps, counts, strict=True):
                for (w0, m0, v0), (w1, m1, v1), c, wait in zip(
                    before, after, step_counts, waited, strict=True
                ):
                    still = c == 0
                    assert still.any() and (~still).any()
                    assert torch.equal(c[~still], wait[~still] + 1), name
                    assert torch.equal(m1[still], m0[still]) and torch.equal(v1[still], v0[still])
                    assert torch.equal(w1[still], w0[still] * (1 - LR * DECAY))
                    assert not torch.equal(w1[~still], w0[~still] * (1 - LR * DECAY))
                    wait.copy_(torch.where(still, wait + 1, 0))
            assert max(w.max().item() for w in waited) >= 2, name
    for name in CASES:  # stage 0: every rank steps the same replica
        if CASES[name][0] == 0:
            a, b = (per_rank[name][0][-1] for per_rank in catching_up)
            assert all(torch.equal(a[k], b[k]) for k in a), name


TOPK_10 = {"gradients": {"method": "topk", "ratio": 0.1, "min_numel": 0, "warmup_steps": 0}}


def train_tied_copies() -> tuple:
    """Top-k 10% under AdamW, pp 2 x dp 2 with the embedding tied to the head across the two
    stages (ZeRO stage 1, 1F1B): this rank's copies of the summed parameters after training,
    and per shard group the buckets that caught up and the summed ones."""
    import test_pipeline as pipe

    import zerotrain
    from zerotrain.pipe import PipelineModule

    tied = PipelineModule(pipe.tied_specs(), num_stages=2, loss_fn=pipe.loss_fn, seed_layers=True)
    config = {**pipe.config(1, "1f1b"), "comm_compression": TOPK_10}
    engine = zerotrain.initialize(model=tied, config=config)[0]
    groups = engine.optimizer.groups
    caught_up: list[set[int]] = [set() for _ in groups]
    for group, buckets in zip(groups, caught_up, strict=True):
        catch_up = group.extensions["catch_up"].catch_up
        arrive = catch_up.arrive

        def record(arrivals: list, arrive=arrive, buckets=buckets) -> None:
            buckets.update(i for i, a in enumerate(arrivals) if a is not None)
            arrive(arrivals)

        catch_up.arrive = record
    pipe.pipeline_trained(engine)
    copies = {
        g.buckets[i].slots[0].name: g.buckets[i].slots[0].param.detach().clone()
        for g in groups
        for i, _ in g.summed
    }
    return copies, caught_up, [{i for i, _ in g.summed} for g in groups]


def test_copies_summed_across_model_parallel_ranks_stay_equal():
    """A layer tied across pipeline stages takes the sum of its copies' gradients (so do the
    norms of sequence parallelism, by the same rule); each copy's codec chooses other
    elements, so such buckets step as they come (catching up per copy stepped the copies
    apart), while the other buckets catch up."""
    per_rank = run_distributed(train_tied_copies, 4)
    assert all(set(copies) == {"tied_modules.embed.weight"} for copies, _, _ in per_rank)
    weights = [copies["tied_modules.embed.weight"] for copies, _, _ in per_rank]
    assert all(torch.equal(w, weights[0]) for w in weights)  # both stages' copies, both replicas
    for _, caught_up, summed in per_rank:
        both = [c & s for c, s in zip(caught_up, summed, strict=True)]
        assert any(caught_up) and not any(both)


def test_catch_up_set_where_it_does_nothing_is_a_config_error():
    base = {"train_batch_size": 2, "optimizer": ADAMW, "zero_optimization": {"stage": 2}}
    for gradients, optimizer, why in [
        ({"method": "powersgd"}, ADAMW, "gradients.method is powersgd"),
        ({"method": "topk", "error_feedback": False}, ADAMW, "error_feedback is false"),
        ({"method": "gtopk"}, {"type": "SGD", "params": {"lr": 0.1}}, "optimizer.type SGD"),
    ]:
        config = {**base, "optimizer": optimizer}
        config["comm_compression"] = {"gradients": {**gradients, "catch_up": True}}
        with pytest.raises(ConfigError, match=why):
            load_config(config, world_size=2)
        del config["comm_compression"]["gradients"]["catch_up"]
        load_config(config, world_size=2)  # left at its default: no error
    # false where no method reads it is refused too, naming the methods it acts on
    config = {**base, "comm_compression": {"gradients": {"method": "int8", "catch_up": False}}}
    with pytest.raises(ConfigError, match="catch_up: acts on topk, gtopk, and gradients.method"):
        load_config(config, world_size=2)
