"""Tensor parallelism composed with ZeRO trains the model a single process trains on the same
global batch: tp x dp meshes at every stage, on zerotrain's example GPT and a transformers
GPT-2, against a reference that accumulates the same micro-batches."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from distributed import run_cases, run_distributed
from models import relative_error

from zerotrain.config import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

STEPS, MICRO, ACCUM, SEQ, VOCAB = 3, 2, 2, 12, 61
LR, CLIP = 1e-3, 0.05  # a small clip threshold: every step clips, so the norm must be global


def build(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt":
        from gpt.model import GPT, GPTConfig

        # odd vocabulary, 4 heads of width 6: padding in every ZeRO bucket
        config = GPTConfig(
            block_size=SEQ, vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=24, bias=True
        )
        return GPT(config)
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    if kind == "llama":  # grouped-query attention: 4 query heads, 2 key/value heads
        return LlamaForCausalLM(
            LlamaConfig(
                vocab_size=VOCAB,
                hidden_size=24,
                intermediate_size=40,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=SEQ,
                bos_token_id=0,
                eos_token_id=0,
                pad_token_id=0,
            )  # fmt: skip
        )
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=24, n_layer=2, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def loss_of(kind: str, model, x: torch.Tensor) -> torch.Tensor:
    if kind == "gpt":
        return model(x[:, :-1], x[:, 1:])
    return model(input_ids=x, labels=x).loss


def batches(dp: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (STEPS, MICRO * ACCUM * dp, SEQ), generator=gen)


def reference(kind: str, dp: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    model = build(kind)
    # eps 1e-5: both GPTs have attention key biases with analytically zero gradients (STYLE.md,
    # Tests), and the tiny clipped gradients of the example GPT's output biases meet eps too
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-5, weight_decay=0.01)
    data = batches(dp)
    chunks = ACCUM * dp
    norms = []
    for step in range(STEPS):
        for chunk in range(chunks):
            x = data[step][chunk * MICRO : (chunk + 1) * MICRO]
            (loss_of(kind, model, x) / chunks).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
    return model.state_dict(), norms


def config(stage: int, tp: int, world: int | None = None, sequence: bool = False) -> dict:
    """With ``world``: the global batch of ``world // tp`` data-parallel ranks accumulating
    ACCUM micro-batches, whatever the degree (the accumulation follows the degree)."""
    batch = {"gradient_accumulation_steps": ACCUM}
    if world is not None:
        batch = {"train_batch_size": MICRO * ACCUM * world // 2}
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        **batch,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": 1e-5, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "tensor_parallel": {"autotp_size": tp, "sequence_parallel": sequence},
        "steps_per_print": 10**6,
    }


def torch_plan() -> dict:
    """transformers' Llama planned for torch's ``parallelize_module`` as torchtitan plans its
    Llama: q/k/v and gate/up column-wise, the outputs row-wise into a sequence-sharded result,
    the norms ``SequenceParallel``, the attention and MLP gathering their input."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    block = "model.layers.*."
    return {
        block + "input_layernorm": SequenceParallel(),
        block + "self_attn": PrepareModuleInput(  # called with hidden_states=...
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
        ),
        **{block + f"self_attn.{n}_proj": ColwiseParallel() for n in "qkv"},
        block + "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        block + "post_attention_layernorm": SequenceParallel(),
        block + "mlp": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        block + "mlp.gate_proj": ColwiseParallel(),
        block + "mlp.up_proj": ColwiseParallel(),
        block + "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }


def train(
    kind: str,
    tp: int,
    stages: list[int],
    sequence: bool = False,
    plan: str = "auto",
    gradients: dict | None = None,
):
    """``plan``: "auto" or "torch" (``torch_plan()``); ``gradients``: the data-parallel
    reduction's comm_compression.gradients section."""
    import zerotrain

    out = {}
    for stage in stages:
        settings = config(stage, tp, sequence=sequence)
        if plan == "torch":
            settings["tensor_parallel"]["tp_plan"] = torch_plan()
        if gradients is not None:
            settings["comm_compression"] = {"gradients": {"min_numel": 0, **gradients}}
        engine, *_ = zerotrain.initialize(model=build(kind), config=settings)
        engine.comm.reset_stats()
        try:
            norms = run_steps(engine, kind, batches(engine.dp_world_size))
        except ValueError as error:  # a sequence the degree does not divide
            out[stage] = str(error)
            continue
        bytes_of = {op: stats.bytes for op, stats in engine.comm.stats.items()}
        local = {n: p.shape for n, p in engine.module.named_parameters()}
        state = engine.consolidated_state_dict()
        layout = (engine.mp_world_size, engine.dp_world_size)
        out[stage] = (state, norms, local, layout, bytes_of)
    return out


def run_steps(engine, kind: str, data: torch.Tensor) -> list[float]:
    """One optimizer step per entry of ``data`` (global batches), this rank's micro-batches
    (tensor-parallel peers take the same ones); the global gradient norm of each."""
    dp, dp_rank = engine.dp_world_size, engine.optimizer.comm.rank
    norms = []
    for batch in data:
        for micro in range(engine.gradient_accumulation_steps()):
            chunk = micro * dp + dp_rank
            x = batch[chunk * MICRO : (chunk + 1) * MICRO]
            engine.backward(loss_of(kind, engine, x))
            engine.step()
        norms.append(engine.get_global_grad_norm())
    return norms


def tensor_parallel_bytes(kind: str, stage: int, dp: int) -> int:
    """All-reduce bytes per rank of a run of ``train``: per block and micro-batch, the
    activations (micro x tokens x width, fp32) after the attention output and the MLP in
    forward, and in backward the input gradient of each column-split layer (GPT-2 and the
    example GPT: the fused q/k/v and the MLP's first layer; Llama: q, k, v, gate, up); per step
    the squared gradient norm (one fp32 scalar) over the tensor-parallel group, and over the
    data-parallel group where gradients are sharded (stages 1-3; stage 0 all-reduces the
    gradients themselves over it, so its count is left out)."""
    blocks, width, tokens = 2, 24, SEQ - 1 if kind == "gpt" else SEQ
    columns = 5 if kind == "llama" else 2
    activations = blocks * (2 + columns) * MICRO * tokens * width * 4 * ACCUM * STEPS
    return activations + STEPS * 4 * (2 if stage > 0 and dp > 1 else 1)


def sequence_parallel_bytes(kind: str) -> tuple[int, int]:
    """All-gather + reduce-scatter bytes per rank of a ``train`` run with sequence parallelism
    at dp 1 (ZeRO moves nothing there): per block and micro-batch, the attention and the MLP
    each gather their input and reduce-scatter their output in forward, and the reverse in
    backward; per micro-batch, the gather after the last block and, in backward, the one
    before the first; each counted whole (micro x tokens x width, fp32). And the all-reduce
    bytes: per step the squared norm and the gradients of the norms and row-parallel biases of
    the blocks (summed over the tensor-parallel group; GPT-2: 6 x width per block, Llama: its
    two norms)."""
    blocks, width = 2, 24
    whole = MICRO * SEQ * width * 4
    gathered = (blocks * 8 + 2) * whole * ACCUM * STEPS
    summed = blocks * width * (2 if kind == "llama" else 6)
    return gathered, STEPS * 4 * (1 + summed)


def check_against_reference(results, reference, tp, kind, sequence=False):
    want, want_norms = reference
    for per_stage in results:
        for stage, (state, norms, _, (mp, dp), bytes_of) in per_stage.items():
            assert mp == tp
            all_reduced = bytes_of.get("all_reduce", 0)
            if sequence and dp == 1:
                gathered = bytes_of.get("all_gather", 0) + bytes_of.get("reduce_scatter", 0)
                assert (gathered, all_reduced) == sequence_parallel_bytes(kind), stage
            elif not sequence and (stage > 0 or dp == 1):
                assert all_reduced == tensor_parallel_bytes(kind, stage, dp), stage
            # the global norm, over the tensor-parallel pieces and the data-parallel shards
            assert norms == pytest.approx(want_norms, rel=1e-5), stage
            assert state.keys() == want.keys()
            for key, value in want.items():
                assert relative_error(state[key], value) < 1e-5, (stage, key)
    first = results[0][next(iter(results[0]))][2]
    split = [n for n, shape in first.items() if shape != want[n].shape]
    assert split, "no parameter was split"
    return split


def test_tp2_matches_single_process_on_three_models():
    # per block: the column-split layers' weights and biases (q/k/v, MLP in), the row-split
    # layers' weights (their biases are added once, after the sum); Llama's have no biases
    split_per_block = {"gpt": 6, "gpt2": 6, "llama": 7}
    kinds = list(split_per_block)
    results = run_cases(train, 2, [(kind, 2, [0, 3]) for kind in kinds])
    for index, kind in enumerate(kinds):
        want = reference(kind, dp=1)
        per_rank = [per_kind[index] for per_kind in results]
        split = check_against_reference(per_rank, want, tp=2, kind=kind)
        assert len(split) == 2 * split_per_block[kind], kind


def reshard(directory: str, layouts: list[tuple[int, int]]):
    """Train at tp 2 x dp 2, stage 2, save; then load into each (tp, stage) of ``layouts``:
    the whole model and the next step must be the saved run's."""
    import zerotrain

    world = 4
    engine, *_ = zerotrain.initialize(model=build("gpt"), config=config(2, 2, world))
    run_steps(engine, "gpt", batches(2))
    engine.save_checkpoint(directory, tag="tp2")
    saved = engine.consolidated_state_dict()
    more = batches(2)[:1]  # one more global batch (tp 2 x dp 2's), the same for every layout
    out = {"saved": saved}
    for tp, stage in [(2, 2), *layouts]:
        if (tp, stage) != (2, 2):
            engine, *_ = zerotrain.initialize(model=build("gpt"), config=config(stage, tp, world))
            engine.load_checkpoint(directory, tag="tp2")
            loaded = engine.consolidated_state_dict()
            assert all(torch.equal(loaded[k], v) for k, v in saved.items()), (tp, stage)
        run_steps(engine, "gpt", more)
        out[tp, stage] = engine.consolidated_state_dict()
    return out


def test_checkpoint_of_tp2_dp2_loads_at_other_degrees_and_stages(tmp_path):
    layouts = [(1, 3), (4, 1)]
    results = run_distributed(reshard, 4, str(tmp_path), layouts)
    continued = results[0][2, 2]
    for tp, stage in layouts:
        for key, value in results[0][tp, stage].items():
            assert relative_error(value, continued[key]) < 1e-5, (tp, stage, key)
    # the manifest records logical shapes: one process reads (and exports) the whole model
    from zerotrain.checkpoint.export import read_state_dict

    exported = read_state_dict(tmp_path, tag="tp2")
    assert exported.keys() == results[0]["saved"].keys()
    for key, value in results[0]["saved"].items():
        assert torch.equal(exported[key], value), key


def test_sequence_parallel_tp2_matches_single_process():
    """GPT-2 and Llama (12 tokens) at stages 0 and 3, Llama also with torchtitan's plan written
    for torch's parallelize_module; the example GPT's 11 tokens do not divide into 2 ranks: an
    error with the shape."""
    cases = [
        ("gpt2", 2, [0, 3], True),
        ("llama", 2, [0, 3], True),
        ("llama", 2, [3], True, "torch"),
        ("gpt", 2, [0], True),
    ]
    results = run_cases(train, 2, cases)
    for index, kind in enumerate(["gpt2", "llama", "llama"]):
        per_rank = [per_kind[index] for per_kind in results]
        check_against_reference(per_rank, reference(kind, dp=1), tp=2, kind=kind, sequence=True)
    for per_kind in results:
        assert "shape (2, 11, 24)" in per_kind[3][0] and "2 tensor-parallel" in per_kind[3][0]


def test_tp2_dp2_matches_single_process_at_every_stage():
    """Also with sequence parallelism (GPT-2, stages 1 and 2), and with the data-parallel
    gradients compressed at the limit where compression is exact (gTop-k of every element:
    the sparse exchange and an Adam catching up with counts of 1)."""
    every = {"method": "gtopk", "ratio": 1.0}
    cases = [
        ("gpt", 2, [0, 1, 2, 3]),
        ("gpt2", 2, [1, 2], True),
        ("gpt", 2, [2], False, "auto", every),
    ]
    results = run_cases(train, 4, cases)
    want = reference("gpt", dp=2)
    for case in (0, 2):
        check_against_reference([r[case] for r in results], want, tp=2, kind="gpt")
    assert all(r[2][2][4]["gtopk"] > 0 for r in results)  # the compressed exchange ran
    per_rank = [r[1] for r in results]
    check_against_reference(per_rank, reference("gpt2", dp=2), 2, "gpt2", sequence=True)


class _Peers:
    """What apply_plan reads of a tensor-parallel communicator, for rank 0 of ``world_size``
    (its errors come before any collective)."""

    def __init__(self, world_size: int):
        self.world_size, self.rank = world_size, 0


def _apply(model, tp: int, plan=None, sequence_parallel: bool = False):
    from zerotrain.tensor_parallel.plan import apply_plan, check_matched, resolve_plan

    resolved, unmatched = resolve_plan(model, plan)
    check_matched(model, bool(resolved), unmatched, automatic=plan is None)
    apply_plan(model, resolved, _Peers(tp), sequence_parallel)


def test_sequence_parallelism_needs_blocks_holding_the_split_modules():
    """Layers split directly inside a ModuleList (no attention or MLP module around them), or
    at the top of the model, leave no block whose input could be cut: an error naming them."""
    flat = torch.nn.Module()
    flat.blocks = torch.nn.ModuleList(
        torch.nn.ModuleDict({"fc": torch.nn.Linear(8, 8), "proj": torch.nn.Linear(8, 8)})
        for _ in range(2)
    )
    plan = {"blocks.*.fc": "colwise", "blocks.*.proj": "rowwise"}
    with pytest.raises(ConfigError, match="split layers of 'blocks.0' are not inside"):
        _apply(flat, 2, plan, sequence_parallel=True)
    flat.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
    with pytest.raises(ConfigError, match="split layers of 'blocks' are not inside"):
        _apply(flat, 2, {"blocks.0": "colwise", "blocks.1": "rowwise"}, sequence_parallel=True)


def test_head_count_the_degree_does_not_divide_names_the_module():
    with pytest.raises(ConfigError, match=r"blocks.0.attn.n_head is 4, which tp degree 3"):
        _apply(build("gpt"), 3)


def test_width_the_degree_does_not_divide_names_the_layer():
    model = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.ReLU(), torch.nn.Linear(9, 6))
    with pytest.raises(ConfigError, match=r"'0' has 9 output features, which tp degree 2"):
        _apply(model, 2, {"0": "colwise", "2": "rowwise"})
    fused = torch.nn.Sequential(torch.nn.Linear(6, 12))  # 3 blocks of 4: 4 = 2 x 2 per rank
    _apply(fused, 2, {"0": "colwise:3"})
    assert fused[0].weight.shape == (6, 6)
    with pytest.raises(ConfigError, match=r"15 output features, which tp degree 2 x 3 fused"):
        _apply(torch.nn.Sequential(torch.nn.Linear(6, 15)), 2, {"0": "colwise:3"})


def test_heads_of_a_plan_without_divide_are_checked():
    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.num_heads = 3
            self.q = torch.nn.Linear(6, 6)

    with pytest.raises(ConfigError, match=r"'' has num_heads 3, which tp degree 2"):
        _apply(Attention(), 2, {"q": "colwise"})


def test_plans_that_match_nothing_are_errors():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ConfigError, match="no layer of Sequential matches the automatic plan"):
        _apply(model, 2)
    with pytest.raises(ConfigError, match=r"\['blocks.\*.mlp'\] match no module"):
        _apply(model, 2, {"blocks.*.mlp": "colwise"})
    with pytest.raises(ConfigError, match="not a tensor-parallel style"):
        _apply(model, 2, {"0": "columnwise"})
    with pytest.raises(ConfigError, match="not a tensor-parallel style"):
        _apply(model, 2, {"0": "divide:a,,b"})
    with pytest.raises(ConfigError, match="tp_plan: empty"):
        _apply(model, 2, {})


def test_llama_key_value_heads_the_degree_does_not_divide_name_the_layer():
    model = build("llama")  # 2 key/value heads of 6
    with pytest.raises(ConfigError, match=r"k_proj' would give each rank 3 of its outputs"):
        _apply(model, 4)


def test_torch_parallel_styles_are_read_by_their_layouts():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    from zerotrain.tensor_parallel import Colwise, Rowwise, parallelize, parse_style
    from zerotrain.tensor_parallel.plan import SequenceSharded

    assert parse_style(ColwiseParallel(), "x") == Colwise()
    assert parse_style(ColwiseParallel(input_layouts=Shard(1)), "x") == Colwise()
    assert parse_style(RowwiseParallel(output_layouts=Shard(1)), "x") == Rowwise()
    assert parse_style(SequenceParallel(), "x") == SequenceSharded()
    gather = PrepareModuleInput(
        input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
    )
    assert parse_style(gather, "x") == SequenceSharded()
    unsupported = {  # what each would run that zerotrain does not
        "use_local_output=False": ColwiseParallel(use_local_output=False),
        r"output_layouts=\('replicate',\)": ColwiseParallel(output_layouts=Replicate()),
        r"input_layouts=\('replicate',\)": RowwiseParallel(input_layouts=Replicate()),
        "PrepareModuleOutput is not supported": PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1)
        ),
        "only gathers a sequence-sharded input": PrepareModuleInput(
            input_layouts=Replicate(), desired_input_layouts=Shard(1)
        ),
    }
    for message, style in unsupported.items():
        with pytest.raises(ConfigError, match=rf"tp_plan.l: .*{message}"):
            parse_style(style, "tensor_parallel.tp_plan.l")
    # torchtitan's plan shards the sequence: it needs sequence parallelism on
    with pytest.raises(ConfigError, match="set tensor_parallel.sequence_parallel: true"):
        parallelize(build("llama"), _Peers(2), torch_plan())


def test_config_checks_the_degree():
    from zerotrain.config import load_config

    base = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}
    cfg = load_config({**base, "tensor_parallel": {"autotp_size": 2}}, world_size=4)
    assert cfg.train_batch_size == 2 * 3 * 2  # the batch counts data-parallel ranks only
    with pytest.raises(ConfigError, match="autotp_size: 3 does not divide the 4 ranks"):
        load_config({**base, "tensor_parallel": {"autotp_size": 3}}, world_size=4)
    with pytest.raises(ConfigError, match="data_parallel_size: 4, but the mesh has 2"):
        load_config(
            {**base, "data_parallel_size": 4, "tensor_parallel": {"autotp_size": 2}}, world_size=4
        )


def different_batches() -> str:
    import zerotrain

    engine, *_ = zerotrain.initialize(model=build("gpt"), config=config(0, 2, 2))
    x = torch.randint(0, VOCAB, (MICRO, SEQ), generator=torch.Generator().manual_seed(1))
    loss_of("gpt", engine, x).backward()  # the same batch on both ranks: fine
    other = engine.global_rank == 1
    with pytest.raises(ValueError) as shorter:  # a rank given another batch length
        loss_of("gpt", engine, x[:, : SEQ - 2] if other else x)
    with pytest.raises(ValueError) as shifted:  # the same shape, other tokens (data sharded
        loss_of("gpt", engine, (x + 1) % VOCAB if other else x)  # over the world)
    return str(shorter.value), str(shifted.value)


def test_tp_ranks_given_different_batches_raise_naming_what_each_got():
    for shorter, shifted in run_distributed(different_batches, 2):
        assert shorter.startswith(
            "tensor parallelism: the 2 ranks of a tensor-parallel group got different inputs "
            "(rank 0: [((2, 11), 'int64'), ((2, 11), 'int64')], integer sum "
        ), shorter
        assert "rank 1: [((2, 9), 'int64'), ((2, 9), 'int64')], integer sum " in shorter
        assert shifted.startswith("tensor parallelism: the 2 ranks"), shifted
        sums = [int(part.split(";")[0].rstrip(")")) for part in shifted.split("integer sum ")[1:]]
        assert len(sums) == 2 and sums[0] != sums[1], shifted
