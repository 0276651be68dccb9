"""The memory estimator (zerotrain/estimate/, `zerotrain estimate`): the ZeRO formula by hand,
against what a real run allocates, activations against autograd's saved tensors, and the CLI."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from test_activation_checkpointing import gpt_batch

from zerotrain import cli
from zerotrain.activation_checkpointing import count_saved_activations, wrap
from zerotrain.estimate import (
    ActivationAssumptions,
    TrainingJob,
    TransformerShape,
    activation_bytes,
    count_parameters,
    estimate,
    figure,
    model_state_bytes,
    stage3_gathered_numel,
)
from zerotrain.precision import DTYPES, PrecisionPolicy
from zerotrain.zero import ZeroPolicy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt.model import GPT, gpt_config  # noqa: E402

GiB = 2**30


# -- the formula, by hand ----------------------------------------------------------------------
# Ψ = 1000 parameters on N = 4 ranks, Adam. (parameters, gradients, optimizer states, step) bytes:
#   16-bit: 2 + 2 + (4 master + 8 Adam) per parameter; the step casts the gradient partition to
#   fp32 (4 per element of it). fp32: 4 + 4 + 8, the parameters are the masters, no cast.
BY_HAND = {
    ("bf16", 0): (2000, 2000, 12000, 4000),
    ("bf16", 1): (2000, 2000, 3000, 1000),
    ("bf16", 2): (2000, 500, 3000, 1000),
    ("bf16", 3): (500, 500, 3000, 1000),
    ("fp16", 2): (2000, 500, 3000, 1000),
    ("fp32", 0): (4000, 4000, 8000, 0),
    ("fp32", 1): (4000, 4000, 2000, 0),
    ("fp32", 2): (4000, 1000, 2000, 0),
    ("fp32", 3): (1000, 1000, 2000, 0),
}


def states(dtype, stage, **kwargs):
    return model_state_bytes(
        1000,
        world_size=4,
        policy=ZeroPolicy.for_stage(stage),
        precision=PrecisionPolicy(DTYPES[dtype]),
        **kwargs,
    )


@pytest.mark.parametrize(("dtype", "stage"), list(BY_HAND))
def test_model_states_by_hand(dtype, stage):
    got = states(dtype, stage)
    want = BY_HAND[(dtype, stage)]
    assert (got.parameters, got.gradients, got.optimizer_states, got.step_grads) == want
    assert got.total == sum(want[:3]) and got.offloaded == 0
    if dtype != "fp32":  # the paper's mixed-precision figures: 16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N, 16Ψ/N
        assert got.total == {0: 16000, 1: 4000 + 3000, 2: 2000 + 3500, 3: 4000}[stage]


def test_model_states_persistent_sgd_and_offload_by_hand():
    # stage 3 keeps 200 persistent elements whole: 2*200 + 2*800/4
    assert states("bf16", 3, persistent_numel=200).parameters == 400 + 400
    assert states("bf16", 1, persistent_numel=200).parameters == 2000  # only stage 3 shards
    sgd = states("fp32", 1, optimizer_state_bytes=0)  # plain SGD: no state, no master copy
    assert (sgd.optimizer_states, sgd.total) == (0, 8000)
    # Offload moves fp32 master + Adam state + an fp32 gradient partition: (4+8+4)*1000/4 = 4000
    # per rank; at stage 3 also the 2-byte parameter shards (2*1000/4 = 500).
    stage2 = states("bf16", 2, offload=1.0)
    assert (stage2.parameters, stage2.gradients, stage2.optimizer_states) == (2000, 500, 0)
    assert (stage2.offloaded, stage2.step_grads) == (4000, 0)  # the step runs on the host
    assert states("bf16", 3, offload=1.0).offloaded == 4000  # optimizer offload only
    stage3 = states("bf16", 3, offload=1.0, offload_params=True)
    assert (stage3.parameters, stage3.offloaded) == (0, 4500)
    assert states("fp32", 2, offload=1.0).offloaded == 4000  # fp32: the host needs a master
    # ratio 0.25: a quarter of the optimizer's part on the host, the rest stepped on the device
    quarter = states("bf16", 2, offload=0.25)
    assert (quarter.offloaded, quarter.optimizer_states, quarter.step_grads) == (1000, 2250, 750)


def test_stage3_gathered_bound():
    # prefetch/reuse within max_live; the root and the unit in use regardless of it
    assert (
        stage3_gathered_numel(params=5000, root_and_largest_block=700, max_live_numel=10**9) == 5000
    )
    assert stage3_gathered_numel(params=5000, root_and_largest_block=700, max_live_numel=0) == 700
    assert (
        stage3_gathered_numel(params=5000, root_and_largest_block=700, max_live_numel=2000) == 2000
    )


# -- activations -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("b", "s", "h", "a"), [(1, 4096, 4096, 32), (4, 2048, 5120, 40), (3, 7, 12, 3)]
)
def test_activations_reduce_to_korthikanti(b, s, h, a):
    """16-bit, dropout, attention keeping its softmax, no norm statistics: the paper's
    sbh(34 + 5as/h) per layer (arXiv:2205.05198 §4.1)."""
    shape = TransformerShape(batch_size=b, seq_len=s, hidden_size=h, layers=5, heads=a)
    paper = ActivationAssumptions(
        element_bytes=2, attention="eager", dropout=True, norm_stats_bytes=0
    )
    got = activation_bytes(shape, paper)
    assert got.per_layer == pytest.approx(s * b * h * (34 + 5 * a * s / h), rel=1e-12)
    assert got.layer_input == 2 * s * b * h
    assert got.checkpointed_peak == got.checkpointed_kept + got.per_layer
    assert got.without_checkpointing == 5 * got.per_layer + got.outside


GPT_SHAPES = {  # awkward: 5 heads of width 7, 3 layers; and the demo GPT
    "odd": dict(vocab_size=77, block_size=24, n_layer=3, n_head=5, n_embd=35),
    "demo": {},
}


@pytest.mark.parametrize(
    ("name", "dtype", "batch"), [("odd", "fp32", 3), ("odd", "bf16", 3), ("demo", "fp32", 1)]
)
def test_activations_match_saved_tensors_of_the_demo_gpt(name, dtype, batch):
    """The estimate against the bytes autograd keeps (``count_saved_activations``) for the demo
    GPT, without checkpointing and with every block checkpointed. The demo GPT has no dropout
    and runs SDPA (CPU flash kernel: no s x s matrix); on CPU LayerNorm keeps its statistics in
    the activation dtype. The estimate leaves out only O(s) bytes: the int64 position ids
    (8 s) and the loss's scalar weight (4), so it must sit exactly that far below."""
    cfg = gpt_config("demo", **GPT_SHAPES[name])
    element = torch.tensor([], dtype=DTYPES[dtype]).element_size()
    shape = TransformerShape(
        batch_size=batch,
        seq_len=cfg.block_size,
        hidden_size=cfg.n_embd,
        layers=cfg.n_layer,
        heads=cfg.n_head,
        vocab_size=cfg.vocab_size,
    )
    assumptions = ActivationAssumptions(
        element_bytes=element, attention="flash", dropout=False, norm_stats_bytes=element
    )
    est = activation_bytes(shape, assumptions)
    x, y = (t % cfg.vocab_size for t in gpt_batch(batch, cfg.block_size))
    measured = {}
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = GPT(cfg).to(DTYPES[dtype])
        if checkpointed:
            wrap(model)
        with count_saved_activations(model.parameters()) as saved:
            loss = model(x, y)
        loss.backward()
        measured[checkpointed] = saved.nbytes
    left_out = 8 * cfg.block_size + 4
    assert measured[False] - est.without_checkpointing == left_out
    assert measured[True] - est.checkpointed_kept == left_out


def test_swiglu_mlp_keeps_what_transformers_llama_mlp_saves():
    """A gated MLP keeps four tensors of its width (gate projection, its SiLU, up projection,
    their product) where a GeLU MLP keeps two: the estimate's difference between a Llama layer
    (SwiGLU, width 40) and a GPT layer (GeLU, 4h) is what autograd saves for transformers'
    LlamaMLP beyond a 4h GeLU MLP, byte for byte (it used to assume GeLU at 4h for both)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    b, s, h, i = 3, 7, 24, 40
    shape = TransformerShape(batch_size=b, seq_len=s, hidden_size=h, layers=1, heads=4)
    llama = TransformerShape(**{**vars(shape), "intermediate_size": i, "mlp": "swiglu"})
    gelu_mlp = torch.nn.Sequential(
        torch.nn.Linear(h, 4 * h), torch.nn.GELU(), torch.nn.Linear(4 * h, h)
    )
    swiglu_mlp = LlamaMLP(
        LlamaConfig(hidden_size=h, intermediate_size=i, num_attention_heads=4, hidden_act="silu")
    )
    measured = {}
    for name, mlp in (("gelu", gelu_mlp), ("swiglu", swiglu_mlp)):
        x = torch.randn(b, s, h, requires_grad=True)
        with count_saved_activations(mlp.parameters()) as saved:
            out = mlp(x)
        out.sum().backward()
        measured[name] = saved.nbytes
    fp32 = ActivationAssumptions(element_bytes=4)
    estimated = activation_bytes(llama, fp32).per_layer - activation_bytes(shape, fp32).per_layer
    assert estimated == measured["swiglu"] - measured["gelu"] == 4 * (4 * b * s * i - 8 * b * s * h)


def test_count_parameters_finds_the_mlp_of_llama_and_gpt2():
    from models import tiny_hf_gpt2
    from test_tensor_parallel import build

    llama = count_parameters(build("llama"), persistence_threshold=0)
    assert llama.mlp == "swiglu" and llama.config["intermediate_size"] == 40
    assert count_parameters(tiny_hf_gpt2(), persistence_threshold=0).mlp == "gelu"  # Conv1D
    assert (
        count_parameters(GPT(gpt_config("tiny", **ODD_GPT)), persistence_threshold=0).mlp == "gelu"
    )


# -- against a real run ------------------------------------------------------------------------
ODD_GPT = dict(vocab_size=77, block_size=15, n_layer=3, n_head=5, n_embd=35)  # odd Ψ: padding
RUNS = [  # (dtype, stage, stage3_max_live_parameters, stage3_param_persistence_threshold)
    *((dtype, stage, 10**9, 0) for dtype in ("fp32", "bf16") for stage in (0, 1, 2, 3)),
    ("bf16", 3, 0, 0),  # nothing prefetched or kept: the root and one block at a time
    ("bf16", 3, 10**9, 100_000),  # every unit below the threshold: all kept whole
    # bf16 masters (the parameters themselves) and/or bf16 optimizer states
    *(
        (dtype, stage, 10**9, 0)
        for dtype in ("bf16+masters+states", "bf16+states")
        for stage in (0, 3)
    ),
]


def _policy_keys(dtype: str) -> dict[str, str]:
    """A RUNS dtype (``bf16+masters+states``) as TrainingJob's dtype fields."""
    base, *narrow = dtype.split("+")
    return {
        "dtype": base,
        "master_dtype": "bf16" if "masters" in narrow else "fp32",
        "optimizer_state_dtype": "bf16" if "states" in narrow else "fp32",
    }


def measure_runs() -> dict:
    import zerotrain

    out = {}
    for dtype, stage, max_live, threshold in RUNS:
        torch.manual_seed(0)
        model = GPT(gpt_config("tiny", **ODD_GPT))
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {
                "stage": stage,
                "stage3_param_persistence_threshold": threshold,
                "stage3_max_live_parameters": max_live,
            },
            "bf16": {
                "enabled": dtype.startswith("bf16"),
                "bf16_master_weights_and_grads": "masters" in dtype,
                "bf16_optimizer_states": "states" in dtype,
            },
            "steps_per_print": 10**6,
        }
        engine, *_ = zerotrain.initialize(model=model, config=config)
        optimizer = engine.optimizer
        store = optimizer.group.store
        grad_buffers = {
            t.untyped_storage().data_ptr()
            for b in optimizer.group.buckets
            for t in (b.flat_grad, b.grad_shard)
            if t is not None
        }
        step_grads = []

        def step(
            param_shards,
            store=store,
            original=store.step,
            grad_buffers=grad_buffers,
            out=step_grads,
        ):
            # what the step holds beyond the gradient buffers: the fp32 copies
            out.append(
                sum(
                    m.grad.untyped_storage().nbytes()
                    for m in store.master_shards()
                    if m.grad.untyped_storage().data_ptr() not in grad_buffers
                )
            )
            original(param_shards)

        store.step = step
        x, y = gpt_batch(2, ODD_GPT["block_size"])
        for _ in range(2):  # the second step runs with the recorded prefetch order
            engine.backward(engine(x % 77, y % 77))
            engine.step()
        gatherer = getattr(optimizer.group.residency, "gatherer", None)
        out[(dtype, stage, max_live, threshold)] = {
            "breakdown": engine.memory_breakdown(),
            "step_grads": max(step_grads),
            "numel": sum(b.numel for b in optimizer.group.buckets),
            "numel_padded": sum(b.numel_padded for b in optimizer.group.buckets),
            "buckets": len(optimizer.group.buckets),
            "max_live_numel": gatherer.max_live_numel_seen if gatherer else None,
            "persistent_padded": sum(u.numel for u in gatherer.units if u.persistent)
            if gatherer
            else 0,
            "units_padded": [(u.is_root, u.numel) for u in gatherer.units] if gatherer else None,
        }
    return out


def test_estimate_matches_memory_breakdown_of_a_real_run():
    """Per rank after a step: parameters, gradients, optimizer states and the step's fp32
    gradient copy match the estimate exactly on the padded element count, plus Adam's 4-byte
    step counter per master tensor (one per bucket); stage 3's gathered high-water mark matches
    the bound. The user-facing estimate (true count) differs only by the padding: fewer than
    N elements per bucket, at most 16 bytes each (fp32 + Adam)."""
    world = 2
    count = count_parameters(GPT(gpt_config("tiny", **ODD_GPT)), persistence_threshold=100_000)
    results = run_distributed(measure_runs, world)
    for rank_results in results:
        for (dtype, stage, max_live, threshold), got in rank_results.items():
            key = (dtype, stage, max_live, threshold)
            assert got["numel"] == count.trainable, key
            padding = got["numel_padded"] - got["numel"]
            assert 0 < padding < world * got["buckets"], key  # odd Ψ: some padding to cover
            policy = ZeroPolicy.for_stage(stage)
            keys = _policy_keys(dtype)
            precision = PrecisionPolicy(
                DTYPES[keys["dtype"]],
                master_dtype=DTYPES[keys["master_dtype"]],
                state_dtype=DTYPES[keys["optimizer_state_dtype"]],
            )
            exact = model_state_bytes(
                got["numel_padded"],
                world_size=world,
                policy=policy,
                precision=precision,
                persistent_numel=got["persistent_padded"],
            )
            breakdown = got["breakdown"]
            assert breakdown["parameters"] == exact.parameters, key
            assert breakdown["gradients"] == exact.gradients, key
            adam_steps = 4 * got["buckets"]
            assert breakdown["optimizer_states"] == exact.optimizer_states + adam_steps, key
            assert got["step_grads"] == exact.step_grads, key

            job = TrainingJob(
                trainable_params=count.trainable,
                frozen_params=count.frozen,
                **keys,
                gpus_per_node=world,
                stages=(stage,),
                root_and_largest_block=count.root_and_largest_block,
                persistent_numel=count.persistent if threshold else 0,
                max_live_numel=max_live,
            )
            (row,) = estimate(job)
            slack = 16 * padding + adam_steps
            for measured, estimated in [
                (breakdown["parameters"], row.states.parameters),
                (breakdown["gradients"], row.states.gradients),
                (breakdown["optimizer_states"], row.states.optimizer_states),
                (breakdown["total"], row.model_states),
            ]:
                assert abs(measured - estimated) <= slack, (key, measured, estimated)
            if stage == 3:
                units = got["units_padded"]
                root = next(n for is_root, n in units if is_root)
                largest_block = max(n for is_root, n in units if not is_root)
                live = stage3_gathered_numel(
                    params=got["numel_padded"],
                    root_and_largest_block=root + largest_block,
                    max_live_numel=max_live,
                )
                # persistent units are gathered from the start: only gathers move the mark
                beyond_persistent = live - got["persistent_padded"]
                assert max(got["max_live_numel"] - got["persistent_padded"], 0) == beyond_persistent
                p = precision.param_dtype.itemsize
                assert abs(row.gathered - p * beyond_persistent) <= p * padding, key
    # the two stage-3 regimes really differ: everything gathered vs the root and one block
    rank0 = results[0]
    assert (
        rank0[("bf16", 3, 0, 0)]["max_live_numel"] < rank0[("bf16", 3, 10**9, 0)]["max_live_numel"]
    )


OFFLOAD_RUNS = [  # (offload_optimizer.device, stage, dtype, buffer_count, sub_group_size, optimizer)
    ("cpu", 1, "bf16", 3, None, "AdamW"),
    ("cpu", 2, "fp32", 4, None, "AdamW"),
    ("cpu", 3, "bf16", 2, None, "AdamW"),  # one bucket per gather unit: the ring holds the largest
    ("nvme", 2, "bf16", 3, 2048, "AdamW"),  # sub-groups smaller than the bucket
    ("nvme", 3, "fp32", 4, 10**9, "AdamW"),  # a sub-group is the whole bucket
    ("cpu", 2, "bf16+masters+states", 3, None, "AdamW"),  # bf16 masters, gradients and moments
    ("nvme", 3, "bf16+masters+states", 2, 2048, "AdamW"),
    ("nvme", 2, "bf16", 3, 2048, "Muon"),  # sub-groups of Muon's momentum and AdamW's moments
    ("nvme", 3, "bf16+masters+states", 2, 2048, "Muon"),
]


@pytest.mark.parametrize(
    ("device", "stage", "dtype", "buffer_count", "sub_group", "optimizer"), OFFLOAD_RUNS
)
def test_offload_estimate_is_what_the_preflight_counts(
    monkeypatch, tmp_path, device, stage, dtype, buffer_count, sub_group, optimizer
):
    """`zerotrain estimate --offload` gives, per rank, exactly the host bytes (and NVMe file
    bytes) that the memory preflight of ``initialize`` counts for the same model and settings,
    and the store then allocates them (up to Adam's step counters, and the alignment of NVMe's
    buffers and file slots to 4 KiB)."""
    import zerotrain
    from zerotrain.estimate import preflight

    checked = {}

    def capture(job):
        rows = estimate(job)
        checked.setdefault("row", rows[0])  # the first: the run's own, then the options'
        return rows

    monkeypatch.setattr(preflight, "estimate", capture)
    section = {"device": device, "buffer_count": buffer_count, "nvme_path": str(tmp_path)}
    zero = {"stage": stage, "offload_optimizer": section}
    if sub_group is not None:
        zero["sub_group_size"] = sub_group
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", **ODD_GPT))
    count = count_parameters(model, persistence_threshold=0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": optimizer, "params": {"lr": 1e-3}},
        "zero_optimization": zero,
        "bf16": {
            "enabled": dtype.startswith("bf16"),
            "bf16_master_weights_and_grads": "masters" in dtype,
            "bf16_optimizer_states": "states" in dtype,
        },
        "steps_per_print": 10**6,
    }
    engine, *_ = zerotrain.initialize(model=model, config=config)
    buckets = engine.optimizer.group.buckets
    assert engine.optimizer.comm.world_size == 1
    if optimizer == "AdamW":  # (Muon's and AdamW's parameters are in buckets of their own)
        assert len(buckets) == (1 if stage < 3 else ODD_GPT["n_layer"] + 1)  # the case meant
    idx = torch.randint(0, model.config.vocab_size, (2, 8))
    engine.backward(engine(idx, idx))
    engine.step()  # Adam's state exists from the first step
    measured = engine.memory_breakdown()

    muon = optimizer == "Muon"
    job = TrainingJob(
        trainable_params=count.trainable,
        **_policy_keys(dtype),
        optimizer=optimizer.lower(),
        optimizer_state_bytes=count.muon_state_bytes() if muon else None,
        offload=device,
        stages=(stage,),
        max_live_numel=10**9,
        largest_unit=count.largest_unit,
        buffer_count=buffer_count,
        **({"sub_group_size": sub_group} if sub_group is not None else {}),
    )
    (row,) = estimate(job)
    assert row.host == checked["row"].host and row.disk == checked["row"].disk
    assert row.host.total > 0 and (device == "cpu") == (row.disk == 0)
    if device == "cpu":  # masters, state, gradients; the ring
        held = row.host.masters + row.host.optimizer_state + row.host.gradients
        assert 0 <= measured["offloaded"] - held <= 4 * len(buckets)  # Adam's step counters
        assert measured["staging"] == row.host.staging
    else:  # staging sets (4 aligned buffers: master, gradient, exp_avg, exp_avg_sq); ring
        assert 0 <= measured["staging"] - row.host.total <= 4 * 4096 * buffer_count
        slots = len(engine.optimizer.group.store.swap.slot_bytes)
        assert 0 <= measured["disk"] - row.disk < 4096 * slots


def test_offload_host_memory_verdict_is_the_preflights(capsys):
    argv = ["--params", "7B", "--gpus-per-node", "8", "--offload", "cpu", "--stage", "2"]
    code, out, err = run_cli(capsys, *argv, "--json")
    assert code == 0, err
    (row,) = json.loads(out)["rows"]
    # masters, Adam, grads; the ring: 4 buffers of at most 16M elements (RING_CHUNK)
    per_rank = 16 * 7 * 10**9 // 8 + 4 * min(5 * 10**8 // 8, 1 << 24) * 2
    assert row["host_per_rank"]["total"] == per_rank
    assert row["cpu_per_node"] == 8 * per_rank
    fits, short = f"{8 * per_rank}B", f"{8 * per_rank - 1}B"
    code, out, _ = run_cli(capsys, *argv, "--host-memory", fits, "--json")
    (row,) = json.loads(out)["rows"]
    assert row["host_fits"] == "yes" and "host_preflight" not in row
    code, out, _ = run_cli(capsys, *argv, "--host-memory", short, "--json")
    (row,) = json.loads(out)["rows"]
    assert row["host_fits"] == "no"
    assert row["host_preflight"].startswith(
        "zero_optimization: this run does not fit in memory (found before allocating it): "
        "ranks 0-7 each need 13.16 GiB of host memory (offloaded fp32 masters 3.26 GiB, "
        "offloaded optimizer state 6.52 GiB, offloaded fp32 gradients 3.26 GiB, transfer ring "
        "128.00 MiB) but each have 13.16 GiB (1/8 of --host-memory: 105.31 GiB, shared by 8 "
        'ranks), 1 B short. Options that fit: offload_optimizer.device "nvme" (9.78 GiB of '
        "disk per rank); offload_optimizer.ratio 0.75; offload_optimizer.buffer_count 2; 16 "
        "data-parallel ranks or more, as many per node as now."
    ), row["host_preflight"]
    code, out, _ = run_cli(capsys, *argv, "--host-memory", short)
    assert table_rows(out)[2][-1] == "no"
    assert "- stage 2: zero_optimization: this run does not fit in memory" in out


def test_count_parameters_units_and_config():
    model = GPT(gpt_config("tiny", **ODD_GPT))
    count = count_parameters(model, persistence_threshold=100_000)
    blocks = [sum(p.numel() for p in block.parameters()) for block in model.blocks]
    assert count.trainable == model.num_parameters() and count.frozen == 0
    assert count.root_and_largest_block == count.trainable - sum(blocks) + max(blocks)
    assert count.persistent == count.trainable  # every unit below 100k elements
    assert count.largest_unit == max(count.trainable - sum(blocks), *blocks)
    assert count.largest_layer == 35 * 140  # an MLP linear (35 -> 4x35, no bias) > 77 x 35
    assert count.config == {"hidden_size": 35, "layers": 3, "heads": 5, "vocab_size": 77}
    assert count_parameters(model, persistence_threshold=0).persistent == 0


# -- the CLI -----------------------------------------------------------------------------------
def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(["estimate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def table_rows(out: str) -> dict[int, list[str]]:
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("stage"))
    rows = {}
    for line in lines[header + 1 :]:
        if not line.strip():
            break
        cells = re.split(r"\s{2,}", line.strip())
        rows[int(cells[0])] = cells
    return rows


def test_cli_params_7b_table(capsys):
    code, out, err = run_cli(
        capsys, "--params", "7B", "--nodes", "2", "--gpus-per-node", "8", "--device-memory", "80GB"
    )
    assert code == 0 and err == ""
    psi, n = 7e9, 16

    def gib(x):
        return f"{x / GiB:.2f}"

    rows = table_rows(out)
    assert sorted(rows) == [0, 1, 2, 3]
    # bf16 + Adam: parameters 2Ψ/N_p, gradients 2Ψ/N_g, optimizer 12Ψ/N_o, fp32 step copy
    for stage, (n_p, n_g, n_o) in {0: (1, 1, 1), 1: (1, 1, n), 2: (1, n, n), 3: (n, n, n)}.items():
        params, grads, optim = 2 * psi / n_p, 2 * psi / n_g, 12 * psi / n_o
        gathered = 2 * 1e9 if stage == 3 else 0  # stage3_max_live_parameters of 2-byte elements
        step = 4 * psi / n_o
        assert rows[stage][1:7] == [
            gib(params),
            gib(grads),
            gib(optim),
            gib(params + grads + optim),
            gib(gathered),
            gib(step),
        ], stage
        peak = params + grads + optim + max(gathered, step)
        assert rows[stage][7] == gib(peak)
        assert rows[stage][8] == ("yes w/o act" if peak <= 80e9 else "no")
    assert rows[0][8] == "no" and rows[3][8] == "yes w/o act"
    assert "GiB (2^30 bytes)" in out and "7.00B parameters" in out


def test_cli_activations_offload_and_json(capsys):
    argv = [
        "--params", "6.74B", "--nodes", "2", "--gpus-per-node", "8", "--stage", "3",
        "--batch-size", "1", "--seq-len", "4096", "--hidden-size", "4096", "--layers", "32",
        "--heads", "32", "--offload", "cpu", "--json",
    ]  # fmt: skip
    code, out, _ = run_cli(capsys, *argv)
    assert code == 0
    data = json.loads(out)
    (row,) = data["rows"]
    shape = TransformerShape(batch_size=1, seq_len=4096, hidden_size=4096, layers=32, heads=32)
    act = activation_bytes(shape)
    assert row["activations"] == act.without_checkpointing
    assert row["activations_checkpointed"] == act.checkpointed_peak
    psi, n = 6_740_000_000, 16
    # the optimizer partition on the host; stage 3's parameter shards stay on the device
    assert row["optimizer_states"] == 0 and row["step_grads"] == 0
    assert row["parameters"] == pytest.approx(2 * psi / n)
    ring = 4 * min(5 * 10**8 // n, 1 << 24) * 2  # buffer_count x a ring buffer x bf16
    assert row["host_per_rank"] == {
        "masters": 4 * psi // n,
        "optimizer_state": 8 * psi // n,
        "gradients": 4 * psi // n,
        "staging": ring,
        "total": 16 * psi // n + ring,
    }
    assert row["cpu_per_node"] == 8 * row["host_per_rank"]["total"]
    assert "warning" not in data
    code, out, _ = run_cli(capsys, *argv[:-1])
    assert "offload_optimizer: cpu, ratio 1, buffer_count 4" in out.split("stage")[0]
    assert "CPU/node" in out and "cannot run" not in out
    code, out, _ = run_cli(capsys, *argv[:-2], "nvme", "--sub-group-size", "1e8", "--json")
    (row,) = json.loads(out)["rows"]
    sub_group = 10**8 // 1024 * 1024
    largest = min(sub_group, 5 * 10**8 // n)  # a sub-group is at most a bucket's shard
    ring = 4 * min(largest, 1 << 24) * 2  # 4 buffers of at most 16M elements
    assert row["host_per_rank"]["total"] == 4 * largest * (4 + 8 + 4) + ring  # 4 sets
    assert row["disk_per_rank"] == (4 + 8) * psi // n
    assert row["nvme_per_node"] == 8 * row["disk_per_rank"]


def test_cli_model_on_meta_device_and_hf_config(capsys, tmp_path):
    factory = tmp_path / "huge.py"
    factory.write_text(
        "import torch\nfrom torch import nn\n\n"
        "class Huge(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.blocks = nn.ModuleList(nn.Linear(100_000, 100_000) for _ in range(7))\n"
        "        self.frozen = nn.Linear(1000, 1000)\n"
        "        self.frozen.requires_grad_(False)\n"
        "        assert self.frozen.weight.device.type == 'meta'\n"
    )
    # 70B parameters (280 GB in fp32) "built" in no memory
    code, out, err = run_cli(capsys, "--model", f"{factory}:Huge", "--json")
    assert code == 0, err
    inputs = json.loads(out)["inputs"]
    assert inputs["trainable_params"] == 7 * (100_000**2 + 100_000)
    assert inputs["frozen_params"] == 1000**2 + 1000
    assert inputs["largest_layer"] == 100_000**2 + 100_000

    from models import tiny_hf_gpt2

    real = tiny_hf_gpt2()
    code, out, err = run_cli(
        capsys, "--model", "tests.models:tiny_hf_gpt2", "--batch-size", "2", "--seq-len", "32"
    )
    assert code == 0, err
    assert f"{real.num_parameters() / 1e3:.2f}K parameters" in out  # tied head counted once
    assert "hidden 48, gelu MLP 192, 2 layers, 4 heads, vocabulary 101" in out  # GPT2Config


def test_cli_llama_config_is_estimated_with_its_swiglu_mlp(capsys, tmp_path):
    """--model reads intermediate_size and finds the gated MLP (three hidden x intermediate
    matrices), so a Llama's activations are its SwiGLU's, not a 4h GeLU's."""
    factory = tmp_path / "llama.py"
    factory.write_text(
        "from transformers import LlamaConfig, LlamaForCausalLM\n\n"
        "def tiny():\n"
        "    return LlamaForCausalLM(LlamaConfig(hidden_size=24, intermediate_size=40,\n"
        "        num_hidden_layers=2, num_attention_heads=4, vocab_size=101))\n"
    )
    argv = ["--model", f"{factory}:tiny", "--batch-size", "2", "--seq-len", "16"]
    code, out, err = run_cli(capsys, *argv, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["inputs"]["shape"]["intermediate_size"] == 40
    assert data["inputs"]["shape"]["mlp"] == "swiglu"
    shape = TransformerShape(
        batch_size=2, seq_len=16, hidden_size=24, layers=2, heads=4, vocab_size=101,
        intermediate_size=40, mlp="swiglu",
    )  # fmt: skip
    assert data["rows"][0]["activations"] == activation_bytes(shape).without_checkpointing
    code, out, err = run_cli(capsys, *argv, "--mlp", "gelu", "--intermediate-size", "96")
    assert code == 0, err
    assert "hidden 24, gelu MLP 96, 2 layers" in out  # the flags win over the model's


def test_cli_activation_note_says_what_was_assumed(capsys):
    """The note under the table names the dtype, attention, dropout and MLP the activations
    were estimated with (it used to say "16-bit, dropout, eager attention" whatever the flags)."""
    code, out, err = run_cli(
        capsys, "--params", "7B", "--dtype", "fp32", "--attention", "flash", "--no-dropout",
        "--batch-size", "1", "--seq-len", "4096", "--hidden-size", "4096", "--layers", "32",
        "--heads", "32", "--intermediate-size", "11008", "--mlp", "swiglu",
    )  # fmt: skip
    assert code == 0, err
    note = " ".join(out.split("- activations:")[1].split("\n- ")[0].split())
    assert "here with 4-byte activations, flash attention" in note
    assert "no dropout masks, a swiglu MLP of width 11008" in note
    assert "16-bit, dropout, eager" not in out
    code, out, _ = run_cli(
        capsys, "--params", "7B", "--batch-size", "1", "--seq-len", "512", "--hidden-size",
        "1024", "--layers", "8", "--heads", "16",
    )  # fmt: skip
    note = " ".join(out.split("- activations:")[1].split("\n- ")[0].split())
    assert (
        "here with 2-byte activations, eager attention (keeps the s x s softmax; with its "
        "dropout mask), 1-byte dropout masks, a gelu MLP of width 4096" in note
    )


def test_cli_fits_says_activations_are_left_out(capsys):
    """Without the batch shape the verdict says the peak fits without activations, not "yes"."""
    argv = ["--params", "1B", "--device-memory", "80GB"]
    code, out, _ = run_cli(capsys, *argv)
    assert {row[-1] for row in table_rows(out).values()} == {"yes w/o act"}
    assert "'yes w/o act': without activations, which were not estimated" in " ".join(out.split())
    code, out, _ = run_cli(capsys, *argv, "--json")
    assert {row["fits"] for row in json.loads(out)["rows"]} == {"yes w/o act"}
    code, out, _ = run_cli(capsys, *argv, "--batch-size", "1", "--seq-len", "8", "--hidden-size",
                           "64", "--layers", "2", "--heads", "2")  # fmt: skip
    assert {row[-1] for row in table_rows(out).values()} == {"yes"}


def test_cli_plot(capsys, tmp_path):
    path = tmp_path / "estimate.png"
    code, _, err = run_cli(
        capsys, "--params", "7B", "--gpus-per-node", "8", "--batch-size", "1", "--seq-len",
        "2048", "--hidden-size", "4096", "--layers", "32", "--heads", "32",
        "--device-memory", "80GB", "--plot", str(path),
    )  # fmt: skip
    assert code == 0, err
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    import matplotlib.image

    assert matplotlib.image.imread(path).shape[:2] == (450, 900)  # 9 x 4.5 in at 100 dpi

    shape = TransformerShape(batch_size=1, seq_len=2048, hidden_size=4096, layers=32, heads=32)
    job = TrainingJob(trainable_params=7 * 10**9, gpus_per_node=8, max_live_numel=10**9)
    with_act = TrainingJob(**{**vars(job), "shape": shape})
    for j, segments in ((job, 4), (with_act, 6)):
        rows = estimate(j)
        axes = figure(j, rows, 80 * 10**9).axes[0]
        assert len(axes.containers) == segments  # one stacked segment per component
        assert all(len(bars) == len(rows) for bars in axes.containers)  # one bar per stage
        tops = [sum(bars[i].get_height() for bars in axes.containers) for i in range(len(rows))]
        assert tops == pytest.approx([r.peak(checkpointing=False) / GiB for r in rows])
        assert len(axes.lines) == 1  # the device memory line
        assert_legend_covers_no_bar(axes)


def assert_legend_covers_no_bar(axes):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(axes.figure).get_renderer()
    legend = axes.get_legend().get_window_extent(renderer)
    for bars in axes.containers:
        for bar in bars:
            assert not legend.overlaps(bar.get_window_extent(renderer)), bar


def test_plot_shows_the_host_verdict_of_the_table(capsys, tmp_path):
    """With offload the chart gives each stage's host memory per node and, with
    --host-memory, the preflight's verdict that the table's last column gives."""
    argv = ["--params", "7B", "--gpus-per-node", "8", "--offload", "cpu", "--device-memory", "80GB"]
    per_node = 8 * (16 * 7 * 10**9 // 8 + 4 * (1 << 24) * 2)  # stages 1-2, as the test above
    for host, verdict in ((f"{per_node}B", "yes"), (f"{per_node - 1}B", "no")):
        code, out, err = run_cli(capsys, *argv, "--host-memory", host)
        assert code == 0, err
        assert table_rows(out)[2][-1] == verdict
        job = TrainingJob(
            trainable_params=7 * 10**9, gpus_per_node=8, offload="cpu", stages=(1, 2),
            max_live_numel=10**9,
        )  # fmt: skip
        axes = figure(
            job, estimate(job), 80 * 10**9, per_node if verdict == "yes" else per_node - 1
        ).axes[0]
        labels = [tick.get_text() for tick in axes.get_xticklabels()]
        assert labels == [
            f"stage {stage}\nCPU/node {per_node / GiB:.2f} GiB\nhost fits: {verdict}"
            for stage in (1, 2)
        ]
        assert_legend_covers_no_bar(axes)
    code, _, err = run_cli(capsys, *argv, "--host-memory", "1GB", "--plot", str(tmp_path / "o.png"))
    assert code == 0 and (tmp_path / "o.png").stat().st_size > 10_000, err


def test_cli_plot_without_matplotlib(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails
    code, _, err = run_cli(capsys, "--params", "1B", "--plot", str(tmp_path / "x.png"))
    assert code == 2 and "pip install matplotlib" in err and "Traceback" not in err


def test_cli_model_path_that_is_not_python(capsys, tmp_path):
    """A --model path Python cannot import is named as such (found by the type checker: it
    used to surface as "AttributeError: 'NoneType' object has no attribute 'loader'")."""
    target = tmp_path / "model.txt"
    target.write_text("def build(): pass\n")
    code = cli.main(["estimate", "--model", f"{target}:build"])
    _, err = capsys.readouterr()
    assert code == 2 and "is not a Python file" in err and "NoneType" not in err


def test_cli_model_file_with_dataclasses(capsys):
    """A --model file is imported as a module (registered while it runs): examples/gpt's
    GPTConfig dataclass failed with "'NoneType' object has no attribute '__dict__'"."""
    code, out, err = run_cli(capsys, "--model", "examples/gpt/model.py:demo", "--stage", "2")
    assert code == 0, err
    assert "4.8" in out  # the demo GPT's 4.82M parameters


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--params", "7Q"], "'7Q' is not a parameter count"),
        (["--params", "7B", "--device-memory", "lots"], "'lots' is not a size"),
        (["--params", "7B", "--device-memory", "80"], "'80' has no unit; write 80GB"),
        (["--params", "7B", "--offload", "cpu", "--host-memory", "5e11"], "'5e11' has no unit"),
        (["--model", "no_such_module_xyz:build"], "cannot import 'no_such_module_xyz'"),
        (["--model", "tests.models:no_such_factory"], "no function or class 'no_such_factory'"),
        (["--model", "tests.models"], "expected module.path:factory"),
        (["--params", "7B", "--stage", "0", "--offload", "cpu"], "--offload needs ZeRO stage 1"),
        (["--params", "7B", "--host-memory", "1TB"], "--host-memory: only with --offload"),
        (
            ["--params", "7B", "--offload", "cpu", "--sub-group-size", "1e8"],
            "--sub-group-size: only with --offload nvme",
        ),
        (["--params", "7B", "--offload", "nvme", "--optimizer", "lamb"], "lamb needs whole"),
        (["--params", "7B", "--batch-size", "1", "--seq-len", "8"], "missing --hidden-size"),
        (
            ["--model", "tests.models:tiny_hf_gpt2", "--largest-layer", "5"],
            "--largest-layer: measured from --model",
        ),
    ],
)
def test_cli_bad_input_exits_2_without_traceback(capsys, argv, message):
    try:
        code = cli.main(["estimate", *argv])
    except SystemExit as exit:  # argparse's own errors
        code = exit.code
    _, err = capsys.readouterr()
    assert code == 2 and message in err and "Traceback" not in err


def muon_run() -> dict:
    import zerotrain

    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", **ODD_GPT))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Muon", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
        "bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
        "steps_per_print": 10**6,
    }
    engine, *_ = zerotrain.initialize(model=model, config=config)
    idx = torch.randint(0, 77, (2, 8))
    engine.backward(engine(idx, idx))
    engine.step()
    return engine.memory_breakdown()


def test_muon_estimate_counts_its_matrices_and_the_rest():
    """Muon keeps 4 bytes of momentum per element of its matrices and AdamW's 8 for the rest:
    the estimate from --model counts both, as a real run holds them (bf16 masters: no copy)."""
    count = count_parameters(GPT(gpt_config("tiny", **ODD_GPT)), persistence_threshold=0)
    assert 0 < count.muon_matrices < count.trainable
    (breakdown,) = run_distributed(muon_run, 2)[:1]
    job = TrainingJob(
        trainable_params=count.trainable,
        gpus_per_node=2,
        optimizer="muon",
        optimizer_state_bytes=count.muon_state_bytes(),
        master_dtype="bf16",
        stages=(2,),
        max_live_numel=10**9,
    )
    (row,) = estimate(job)
    # Adam's step counters (4 bytes a bucket) and the padding (< 2 elements a bucket) aside
    assert abs(breakdown["optimizer_states"] - row.states.optimizer_states) < 200
    assert abs(breakdown["total"] - row.model_states) < 300
