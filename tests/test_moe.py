"""Mixture-of-Experts: DeepSpeed's gating against its dense formulation, the layer against one
process running every expert, and expert parallelism's all-to-all (outputs, gradients, bytes)
on 4 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from distributed import run_distributed
from models import relative_error
from safetensors.torch import load_file
from torch import nn

from zerotrain.comm import Communicator
from zerotrain.config import ConfigError
from zerotrain.moe import MoE
from zerotrain.moe.gating import top1, top2
from zerotrain.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

EXPERTS, WIDTH, TOKENS = 8, 12, 40


# -- gating against DeepSpeed's dense formulation -------------------------------------------------
def dense_gating(logits: torch.Tensor, k: int, capacity: int | None):
    """DeepSpeed's top-k gating written densely (combine weights (S, E, C), positional
    capacity, no noise): the combine weights per (token, expert), the assignments dropped."""
    gates = F.softmax(logits, dim=1)
    tokens, experts = gates.shape
    first = F.one_hot(gates.argmax(1), experts)
    masks = [first]
    if k == 2:
        masks.append(F.one_hot(logits.masked_fill(first.bool(), float("-inf")).argmax(1), experts))
    locations = [masks[0].cumsum(0) - 1]
    if k == 2:
        locations.append(masks[1].cumsum(0) - 1 + masks[0].sum(0, keepdim=True))
    before = sum(int(m.sum()) for m in masks)
    if capacity is not None:
        masks = [m * (loc < capacity) for m, loc in zip(masks, locations, strict=True)]
    chosen = [(gates * m).sum(1) for m in masks]
    if k == 2:
        denominator = (chosen[0] + chosen[1]).clamp(min=torch.finfo(gates.dtype).eps)
        chosen = [c / denominator for c in chosen]
    size = capacity or tokens * k
    combine = torch.zeros(tokens, experts, size)
    for mask, loc, weight in zip(masks, locations, chosen, strict=True):
        place = F.one_hot((loc * mask).sum(1), size).float()
        combine += (weight[:, None] * mask)[:, :, None] * place[:, None, :]
    return combine.sum(2), before - sum(int(m.sum()) for m in masks)


def routed_weights(routing, experts: int) -> torch.Tensor:
    """Our routing as (token, expert) weights."""
    out = torch.zeros(len(routing.experts), experts)
    return out.scatter_add(1, routing.experts, routing.weights * routing.kept)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, None])
def test_gating_matches_deepspeeds_dense_formulation(k, capacity_factor):
    """Expert choices, weights, capacity and dropped assignments (positional selection, no
    noise) against the dense formulation; l_aux against its formula."""
    torch.manual_seed(k)
    logits = torch.randn(TOKENS, EXPERTS) * 2
    drop = capacity_factor is not None
    if k == 1:
        routing = top1(logits, capacity_factor or 1.0, 2, drop_tokens=drop, use_rts=False)
    else:
        routing = top2(logits, capacity_factor or 1.0, 2, drop_tokens=drop, second_sampling=False)
    want_capacity = max(-(-TOKENS * k * (capacity_factor or 0) // EXPERTS), 2) if drop else None
    assert routing.capacity == want_capacity
    want, dropped = dense_gating(logits, k, routing.capacity)
    assert torch.allclose(routed_weights(routing, EXPERTS), want, atol=1e-6)
    assert routing.dropped == dropped
    assert (dropped == 0) if not drop else (dropped > 0 or capacity_factor != 0.5)
    gates = F.softmax(logits, dim=1)
    first = F.one_hot(gates.argmax(1), EXPERTS).float()
    assert routing.l_aux.item() == pytest.approx(
        EXPERTS * (gates.mean(0) * first.mean(0)).sum().item(), rel=1e-6
    )
    assert routing.exp_counts.sum() == TOKENS * k  # before capacity


def test_random_token_selection_keeps_capacity_tokens_per_expert():
    torch.manual_seed(3)
    logits = torch.randn(TOKENS, 4) * 3
    routing = top1(logits, 0.5, 0, use_rts=True)
    kept_per_expert = torch.bincount(routing.experts[routing.kept], minlength=4)
    assert routing.capacity == 5
    want = routing.exp_counts.clamp(max=routing.capacity)
    assert torch.equal(kept_per_expert, want)


def test_bad_layer_arguments_are_errors():
    with pytest.raises(ConfigError, match="num_experts 6 must be a positive multiple of ep_size 4"):
        MoE(4, nn.Linear(4, 4), num_experts=6, ep_size=4)
    with pytest.raises(ConfigError, match="k=3"):
        MoE(4, nn.Linear(4, 4), num_experts=4, k=3)
    with pytest.raises(ConfigError, match="use_tutel"):
        MoE(4, nn.Linear(4, 4), num_experts=4, use_tutel=True)
    with pytest.raises(ConfigError, match="'RSample' samples the first choice of top-1"):
        MoE(4, nn.Linear(4, 4), num_experts=4, k=2, noisy_gate_policy="RSample")
    with pytest.raises(RuntimeError, match="ep_size 2 spreads the experts"):
        MoE(4, nn.Linear(4, 4), num_experts=4, ep_size=2)(torch.zeros(3, 4))


# -- the layer against one process running every expert ------------------------------------------
class Scale(nn.Module):
    """Multiplies by a buffer: state of an expert that is not a parameter."""

    def __init__(self):
        super().__init__()
        self.register_buffer("factor", torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def expert() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, 16), nn.GELU(), nn.Linear(16, WIDTH), Scale())


def moe(ep: int, k: int, drop: bool, **options) -> MoE:
    """Every expert different (DeepSpeed's copies start equal, which would hide a token sent to
    the wrong one), the same on every rank; noise off."""
    torch.manual_seed(0)
    layer = MoE(
        WIDTH,
        expert(),
        EXPERTS,
        ep_size=ep,
        k=k,
        capacity_factor=0.75,
        min_capacity=0,
        drop_tokens=drop,
        use_rts=False,
        top2_2nd_expert_sampling=False,
        **options,
    )
    with torch.no_grad():
        for tensor in [*layer.parameters(), *layer.buffers()]:
            tensor.copy_(torch.randn_like(tensor) * 0.5)
    return layer


def dense_reference(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token's output as the sum over its kept choices of weight x expert(token)."""
    routing = layer.deepspeed_moe.gate(x)
    experts = layer.deepspeed_moe.experts.deepspeed_experts
    rows = []
    for s in range(len(x)):
        terms = [
            routing.weights[s, j] * experts[str(int(routing.experts[s, j]))](x[s])
            for j in range(routing.experts.shape[1])
            if routing.kept[s, j]
        ]
        rows.append(sum(terms) if terms else torch.zeros(WIDTH))
    return torch.stack(rows)


@pytest.mark.parametrize("k", [1, 2])
def test_layer_output_is_the_weighted_sum_of_its_experts(k):
    layer = moe(1, k, drop=True)
    x = torch.randn(2, TOKENS // 2, WIDTH)
    out, l_aux, counts = layer(x)
    routing = layer.deepspeed_moe.routing
    assert routing is not None and routing.dropped > 0  # capacity 0.75: some tokens dropped
    want = dense_reference(layer, x.reshape(-1, WIDTH)).reshape(x.shape)
    assert relative_error(out, want) < 1e-6
    assert l_aux is routing.l_aux and counts is routing.exp_counts
    names = [n for n, p in layer.named_parameters() if is_moe_param(p)]
    assert names[0] == "deepspeed_moe.experts.deepspeed_experts.0.0.weight"
    assert len(names) == EXPERTS * 4


def test_residual_moe_mixes_in_a_dense_expert():
    layer = moe(1, 1, drop=False, use_residual=True)
    x = torch.randn(TOKENS, WIDTH)
    out, _, _ = layer(x)
    mixed = F.softmax(layer.coefficient(x), dim=-1)
    want = dense_reference(layer, x) * mixed[:, :1] + layer.mlp(x) * mixed[:, 1:]
    assert relative_error(out, want) < 1e-6


def test_optimizer_groups_split_experts_by_group_name():
    layer = moe(1, 2, drop=True)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(layer.parameters()), "lr": 0.1}, max_group_size=2 * 16 * WIDTH
    )
    assert [g.get("name") for g in groups] == [None, *["ep_size_1"] * (EXPERTS * 4 // 2)]
    assert all(g["lr"] == 0.1 for g in groups) and groups[1]["moe"]
    assert sum(len(g["params"]) for g in groups) == len(list(layer.parameters()))


# -- expert parallelism on 4 ranks ----------------------------------------------------------------
EP_CASES = [  # (ep, k, drop tokens, deduplicate, chunks)
    (2, 1, False, False, 1),
    (4, 2, False, False, 1),
    (4, 2, False, True, 1),
    (2, 2, True, True, 1),
    (2, 1, False, False, 3),
    (4, 2, False, True, 2),
]


def expert_parallel(cases: list[tuple[int, int, bool, bool, int]]) -> list[dict]:
    """Each case: the layer at ``ep`` (groups of neighbouring ranks) and one process's copy of
    every expert on this rank's tokens; what differs, and the all-to-all bytes."""
    world = Communicator()
    out = []
    for ep, k, drop, dedup, chunks in cases:
        comm = world.split([list(range(r, r + ep)) for r in range(0, world.world_size, ep)])
        reference, layer = moe(1, k, drop), moe(ep, k, drop)
        layer.place(comm)
        layer.deepspeed_moe.dedup, layer.deepspeed_moe.chunks = dedup, chunks
        missing, _ = layer.load_state_dict(reference.state_dict(), strict=False)
        assert not missing, missing
        x = torch.randn(TOKENS, WIDTH, generator=torch.Generator().manual_seed(world.rank))
        probe = torch.randn(TOKENS, WIDTH, generator=torch.Generator().manual_seed(99))
        grads = {}
        for name, model in (("reference", reference), ("ep", layer)):
            inputs = x.clone().requires_grad_()
            comm.reset_stats()
            output, l_aux, _ = model(inputs)
            held = held_exchanges(output)
            ((output * probe).sum() + l_aux).backward()
            grads[name] = (output, inputs.grad, dict(model.named_parameters()))
        stats = {op: (st.bytes, st.sent) for op, st in comm.stats.items()}  # the ep layer's
        out_ref, x_grad_ref, ref_params = grads["reference"]
        out_ep, x_grad_ep, ep_params = grads["ep"]
        errors = {
            "output": relative_error(out_ep, out_ref),
            "input grad": relative_error(x_grad_ep, x_grad_ref),
        }
        for name, param in ref_params.items():  # the same order on every rank
            want = param.grad.clone()
            if is_moe_param(param):  # an expert's gradient sums the tokens of its ep group
                comm.all_reduce(want)
            if name in ep_params:
                errors[name] = relative_error(ep_params[name].grad, want)
        assert len(errors) == 2 + len(ep_params)
        out.append(
            {
                "errors": errors,
                "stats": stats,
                "want": expected_bytes(layer, comm, dedup, chunks),
                "held": held,
                "duplicates": remote_duplicates(layer, comm) if k == 2 else None,
            }
        )
    return out


def held_exchanges(output: torch.Tensor) -> int:
    """Completed all-to-alls that the graph behind ``output`` still holds (their work keeps
    the rows sent alive until the backward)."""
    held, seen, nodes = 0, set(), [output.grad_fn]
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        transfer = getattr(node, "transfer", None)
        held += transfer is not None and transfer.op is not None
        nodes += [n for n, _ in node.next_functions]
    return held


def expected_bytes(layer: MoE, comm, dedup: bool, chunks: int) -> dict[str, tuple[int, int]]:
    """Payload and bytes sent by this rank in one forward and backward per all-to-all kind, from
    the routing (see [Note: dispatch by units]): U units sent, R received. Hidden states (fp32)
    go there and back in forward, and again in backward: 2 (U + R) x width x 4 bytes. The
    metadata: the units per rank (ep int64), and each unit's slots (weight and expert, fp32; k
    of them with deduplication, 1 without), there in forward and back in backward."""
    routing = layer.deepspeed_moe.routing
    assert routing is not None
    per_rank = layer.num_experts // layer.ep_size
    dest = (routing.experts // per_rank)[routing.kept]
    token = torch.arange(len(routing.experts))[:, None].expand_as(routing.experts)[routing.kept]
    units = [d for _, d in set(zip(token.tolist(), dest.tolist(), strict=True))]
    units = units if dedup else dest.tolist()
    sends = [units.count(r) for r in range(comm.world_size)]
    received = [every[comm.rank] for every in comm.all_gather_object(sends)]
    both, remote = sum(sends) + sum(received), sum(sends) + sum(received) - 2 * sends[comm.rank]
    hidden, slots = 2 * WIDTH * 4, (routing.experts.shape[1] if dedup else 1) * 2 * 4
    counts = comm.world_size * chunks * 8  # per rank and chunk
    return {
        "all_to_all": (both * hidden, remote * hidden),
        "all_to_all_metadata": (both * slots + counts, remote * slots + counts - chunks * 8),
    }


def remote_duplicates(layer: MoE, comm) -> int:
    """Tokens whose two choices are experts of one other rank, sent by this rank or to it."""
    routing = layer.deepspeed_moe.routing
    assert routing is not None and routing.experts.shape[1] == 2
    dest = routing.experts // (layer.num_experts // layer.ep_size)
    same = (dest[:, 0] == dest[:, 1]) & routing.kept.all(1)
    per_rank = torch.bincount(dest[same, 0], minlength=comm.world_size).tolist()
    received = sum(every[comm.rank] for every in comm.all_gather_object(per_rank))
    return sum(per_rank) + received - 2 * per_rank[comm.rank]


@pytest.fixture(scope="module")
def expert_parallel_runs() -> list[list[dict]]:
    """Every rank's results of EP_CASES, in one spawn."""
    return run_distributed(expert_parallel, 4, EP_CASES)


def test_expert_parallel_matches_every_expert_in_one_process(expert_parallel_runs):
    """ep 2 (top-1) and ep 4 (top-2), dropless; top-2 with deduplication, dropless at ep 4 and
    with dropped tokens at ep 2; the tokens in 3 and 2 chunks in flight (overlap): outputs,
    input and gate gradients as one process computes them on this rank's tokens, each
    expert's gradient the sum over its ep group's tokens, and the all-to-all bytes as the
    routing predicts (the same units whatever the chunks); no exchange that completed in the
    forward holds the rows it sent (42 MB a step of the MoE GPT of bench/plan.py)."""
    for rank_results in expert_parallel_runs:
        for case, result in zip(EP_CASES, rank_results, strict=True):
            assert max(result["errors"].values()) < 1e-5, (case, result["errors"])
            assert result["stats"] == result["want"], case
            assert result["held"] == 0, case  # the rows sent are freed once they arrived


def test_deduplication_sends_each_token_once_per_rank(expert_parallel_runs):
    """Top-2 at ep 4 (the same tokens with and without): the hidden-state bytes saved are
    exactly the duplicate (token, rank) pairs', sent by a rank or to it, each counted twice
    (the token's way in forward and its gradient's in backward, or the expert output's and its
    gradient's)."""
    plain_case, dedup_case = (
        EP_CASES.index((4, 2, False, False, 1)),
        EP_CASES.index((4, 2, False, True, 1)),
    )
    for rank_results in expert_parallel_runs:
        plain, dedup = rank_results[plain_case], rank_results[dedup_case]
        saved = plain["stats"]["all_to_all"][1] - dedup["stats"]["all_to_all"][1]
        assert saved == 2 * plain["duplicates"] * WIDTH * 4 and saved > 0


class MoEModel(nn.Module):
    """A block with an MoE layer: the output and the load-balancing loss."""

    def __init__(self, ep: int = 1, k: int = 2):
        super().__init__()
        self.moe = moe(ep, k, drop=False)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        out, l_aux, _ = self.moe(x)
        return self.head(out).pow(2).mean() + 0.01 * l_aux


MICRO, ACCUM, STEPS, SEQ = 2, 2, 3, 5
MOE_CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": ACCUM,
    "gradient_clipping": 0.05,  # every step clips: the norm must be global
    # eps 1e-5: an expert that gets few tokens has tiny gradients, which Adam turns into +-lr
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-5, "weight_decay": 0.01}},
    "zero_optimization": {"stage": 0, "stage3_param_persistence_threshold": 0},
}


def moe_batches(ranks: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(STEPS, MICRO * ACCUM * ranks, SEQ, WIDTH, generator=gen)


def moe_reference(ranks: int, k: int = 2) -> dict[str, torch.Tensor]:
    """One process, every expert: each data-parallel rank's micro-batch gated alone (capacity
    and l_aux are per rank), their losses averaged, clipped as the engine clips."""
    model = MoEModel(k=k)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5, weight_decay=0.01)
    for batch in moe_batches(ranks):
        for chunk in range(ACCUM * ranks):
            (model(batch[chunk * MICRO : (chunk + 1) * MICRO]) / (ACCUM * ranks)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def moe_model(ep: int, k: int = 2) -> MoEModel:
    """MoEModel at ``ep`` with this rank's experts' values from one holding every expert."""
    model = MoEModel(ep, k)
    if ep > 1:  # place it as initialize will, to know which experts are this rank's
        world = Communicator()
        model.moe.place(world.split([list(range(r, r + ep)) for r in range(0, 4, ep)]))
    missing, _ = model.load_state_dict(MoEModel(k=k).state_dict(), strict=False)
    assert not missing
    return model


def moe_engine(
    ep: int,
    stage: int,
    ranks: int = 4,
    dedup: bool = False,
    chunks: int = 1,
    k: int = 2,
    gradients: dict | None = None,
):
    """An engine for MoEModel at ``ep`` and ZeRO ``stage`` with top-``k`` gating, its global
    batch that of ``ranks`` data-parallel ranks accumulating ACCUM micro-batches;
    ``gradients``: the comm_compression.gradients section."""
    import zerotrain

    zero = {**MOE_CONFIG["zero_optimization"], "stage": stage}
    moe_section = {"token_dedup": dedup, "overlap_chunks": chunks}
    config = {**MOE_CONFIG, "zero_optimization": zero, "moe": moe_section}
    if gradients is not None:
        config["comm_compression"] = {"gradients": {"min_numel": 0, **gradients}}
    del config["gradient_accumulation_steps"]
    config["train_batch_size"] = MICRO * ACCUM * ranks
    return zerotrain.initialize(model=moe_model(ep, k), config=config)[0]


def run_moe(engine, batches: torch.Tensor) -> None:
    """One step per global batch, this rank's micro-batches."""
    dp, rank = engine.dp_world_size, engine.optimizer.comm.rank
    for batch in batches:
        for micro in range(engine.gradient_accumulation_steps()):
            chunk = micro * dp + rank
            engine.backward(engine(batch[chunk * MICRO : (chunk + 1) * MICRO]))
            engine.step()


def train_moe(cases: list[tuple]) -> dict:
    """(ep, ZeRO stage, options...) each, the options "token_dedup", "overlap_chunks", "top1"
    and "gtopk" (the gradients compressed where it is exact: gTop-k of every element):
    MoEModel trained on this rank's micro-batches."""
    out = {}
    for case in cases:
        ep, stage, *options = case
        engine = moe_engine(
            ep,
            stage,
            ranks=Communicator().world_size,
            dedup="token_dedup" in options,
            chunks=2 if "overlap_chunks" in options else 1,
            k=1 if "top1" in options else 2,
            gradients={"method": "gtopk", "ratio": 1.0} if "gtopk" in options else None,
        )
        run_moe(engine, moe_batches(engine.dp_world_size))
        if "gtopk" in options:  # the experts' group and the dense one both exchanged sparsely
            assert all(g.reduction.codec.method == "gtopk" for g in engine.optimizer.groups)
            assert engine.comm.stats["gtopk"].sent > 0
        memory = engine.memory_breakdown()
        out[case] = (
            engine.consolidated_state_dict(),
            memory["total"] / memory["formula_total"],
        )
    return out


def test_the_engine_trains_an_moe_whose_experts_are_on_every_rank():
    """ep_size 1 in one process: the engine's steps match torch's AdamW on the same model."""
    want = moe_reference(1)
    state, _ = train_moe([(1, 2)])[(1, 2)]
    assert state.keys() == want.keys()
    for key, value in want.items():
        assert relative_error(state[key], value) < 1e-5, key


def test_expert_parallel_training_matches_one_process():
    """ep 1, 2 and 4 over 4 data-parallel ranks, ZeRO stages 0-3, top-2 and top-1 gating (and
    the config's token deduplication at ep 4, stage 1, overlap in 2 chunks at ep 2, stage 3,
    and gTop-k of every element at ep 2, stage 2): the experts' parameters are a second shard
    group over the ranks holding the same experts, their gradients averaged over all four; the
    same weights as one process running every expert, and model states as the ZeRO formula
    over each group's ranks."""
    want = {2: moe_reference(4, k=2), 1: moe_reference(4, k=1)}
    cases = [
        (1, 0),
        (1, 1),
        (1, 3),
        *[(2, stage) for stage in range(4)],
        (4, 0),
        (4, 2),
        (4, 3),
        (4, 1, "token_dedup"),
        (2, 3, "overlap_chunks"),
        (2, 1, "top1"),
        (4, 3, "top1"),
        (2, 2, "gtopk"),
    ]
    for per_rank in run_distributed(train_moe, 4, cases):
        assert per_rank.keys() == set(cases)
        for case, (state, states_vs_formula) in per_rank.items():
            k = 1 if "top1" in case else 2
            assert state.keys() == want[k].keys(), case
            for key, value in want[k].items():
                assert relative_error(state[key], value) < 1e-5, (case, key)
            assert states_vs_formula == pytest.approx(1.0, abs=0.005), case  # padding only


def save_and_load_moe(directory: str, layouts: list[tuple[int, int]]) -> dict:
    """Train at ep 2 x dp 2 (stage 2) for two steps and save; the third step from there, and
    from the checkpoint loaded at each (ep, stage) of ``layouts``."""
    engine = moe_engine(2, 2)
    batches = moe_batches(4)
    run_moe(engine, batches[:2])
    engine.save_checkpoint(directory, tag="ep2")
    engine.save_16bit_model(directory, "model.safetensors")  # every expert, by index
    out = {"saved": engine.consolidated_state_dict()}
    run_moe(engine, batches[2:])
    out[2, 2] = engine.consolidated_state_dict()
    for ep, stage in layouts:
        engine = moe_engine(ep, stage)
        for module in engine.module.modules():  # the experts' buffers must come from the file
            if isinstance(module, Scale):
                module.factor.zero_()
        engine.load_checkpoint(directory, tag="ep2")
        loaded = engine.consolidated_state_dict()
        assert all(torch.equal(loaded[k], v) for k, v in out["saved"].items()), (ep, stage)
        run_moe(engine, batches[2:])
        out[ep, stage] = engine.consolidated_state_dict()
    return out


def test_checkpoints_of_experts_load_at_other_expert_parallel_sizes(tmp_path):
    """Experts are saved by their index: saved at ep 2 x dp 2, loaded at ep 4 (stage 3), ep 1
    (stage 1) and in one process; the weights bit for bit, the next step within 1e-6; and
    save_16bit_model's file is the whole model, every expert in it."""
    results = run_distributed(save_and_load_moe, 4, str(tmp_path), [(4, 3), (1, 1)])
    continued = results[0][2, 2]
    exported = MoEModel()  # save_16bit_model's file loads into the model with every expert
    exported.load_state_dict(load_file(tmp_path / "model.safetensors"))
    assert all(torch.equal(v, results[0]["saved"][k]) for k, v in exported.state_dict().items())
    engine = moe_engine(1, 0)  # one process, the global batch of four ranks accumulated
    for module in engine.module.modules():
        if isinstance(module, Scale):
            module.factor.zero_()
    engine.load_checkpoint(str(tmp_path), tag="ep2")
    assert all(
        torch.equal(engine.consolidated_state_dict()[k], v) for k, v in results[0]["saved"].items()
    )
    run_moe(engine, moe_batches(4)[2:])
    for layout, state in [
        *((k, v) for k, v in results[0].items() if k != "saved"),
        ("one process", engine.consolidated_state_dict()),
    ]:
        for key, value in continued.items():
            assert relative_error(state[key], value) < 1e-6, (layout, key)


def test_moe_layouts_the_engine_refuses_and_frozen_experts():
    """MoE layers in a PipelineModule are an error; experts all frozen at ep 1 stay with the
    dense parameters, which train as without them."""
    import zerotrain
    from zerotrain.pipe import PipelineModule

    config = {**MOE_CONFIG, "gradient_accumulation_steps": 1}
    pipe = PipelineModule([MoEModel().moe], num_stages=1, loss_fn=lambda out, y: out[0].sum())
    with pytest.raises(ConfigError, match="MoE layers in a PipelineModule are not supported"):
        zerotrain.initialize(model=pipe, config=config)
    model = MoEModel()
    experts = model.moe.deepspeed_moe.experts
    for param in experts.parameters():
        param.requires_grad_(False)
    before = {k: v.clone() for k, v in experts.state_dict().items()}
    engine, *_ = zerotrain.initialize(model=model, config=config)
    assert len(engine.optimizer.groups) == 1
    engine.backward(engine(torch.randn(MICRO, SEQ, WIDTH)))
    engine.step()
    assert all(torch.equal(v, before[k]) for k, v in experts.state_dict().items())


def test_stepping_the_returned_grouped_optimizer_itself_is_refused():
    """With trained experts (several shard groups) stage 0 returns their grouped optimizer:
    its own step() outside engine.step() is refused as a single optimizer's is, and step hooks
    registered on it run around the engine's steps."""
    import zerotrain
    from zerotrain.zero.optimizer import GroupedOptimizer

    config = {**MOE_CONFIG, "gradient_accumulation_steps": 1}
    engine, returned, *_ = zerotrain.initialize(model=moe_model(1), config=config)
    assert isinstance(returned, GroupedOptimizer)
    seen = []
    returned.register_step_post_hook(lambda optimizer, args, kwargs: seen.append(optimizer))
    batch = moe_batches(1)[0][:MICRO]
    engine.backward(engine(batch))
    with pytest.raises(RuntimeError, match=r"outside engine\.step\(\)"):
        returned.step()
    assert seen == []
    engine.step()
    assert seen == [returned]
