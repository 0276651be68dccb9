"""Ulysses sequence parallelism composed with ZeRO trains the model one process trains on the
same global batch: a transformers Llama (grouped-query attention, RoPE), sp 2 on 2 ranks and
sp 2 x dp 2 on 4, every ZeRO stage, the zerotrain way (the config key) and DeepSpeed's ALST
way (registration, the adapter, the script's own loss aggregation), with tiled MLPs and loss,
LoRA-FA, CPU offload and bf16; sequences sp does not divide, and shares holding different
numbers of valid labels (one none at all). Then memory, checkpoints and refusals."""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed

STEPS, ACCUM, SEQ, VOCAB = 2, 2, 13, 61  # 13 tokens: sp 2 pads one
# SGD: the parameters move by the gradients themselves (Adam's first steps move every
# coordinate by about lr whatever its gradient, which would hide a gradient off by a factor)
LR, MOMENTUM = 0.5, 0.9


def build(
    attention: str = "sdpa", kv_heads: int = 2, lora: bool = False, peft: bool = False
) -> torch.nn.Module:
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    from zerotrain.lora import apply_lora_fa

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation=attention,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    if lora:  # as initialize applies the config's lora_fa section, with the same generator
        apply_lora_fa(model, LORA["target_modules"], r=LORA["r"])
    if peft:  # peft's LoRA on q, B made non-zero so the first steps move the loss
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
        torch.manual_seed(1)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.1)
    return model


LORA = {"enabled": True, "target_modules": ["q_proj", "v_proj", "gate_proj"], "r": 4}
TILED = {"mlp": True, "mlp_tile_tokens": 3, "loss": True, "loss_tile_tokens": 4}


def case(stage: int, attention: str = "sdpa", kv_heads: int = 2, **switches: bool) -> tuple:
    """A run: stage, core attention, key/value heads (1: repeated for sp 2), and which of
    "tiled" (MLPs and loss), "lora" (LoRA-FA), "peft" (peft's LoRA), "offload" (to the CPU),
    "tp" (tensor parallelism of degree 2), "checkpointing" (transformers' gradient
    checkpointing, with the config's cpu_checkpointing) and "rows2" (micro-batches of two
    samples) are on."""
    return (stage, attention, kv_heads, tuple(sorted(k for k, on in switches.items() if on)))


def samples(count: int) -> list[dict[str, torch.Tensor]]:
    """Samples of SEQ tokens whose labels are partly ignored: sample 0 has no valid label in
    its second half, so its second share (at sp 2) holds none."""
    gen = torch.Generator().manual_seed(5)
    out = []
    for i in range(count):
        ids = torch.randint(1, VOCAB, (1, SEQ), generator=gen)
        labels = ids.clone()
        labels[torch.rand(1, SEQ, generator=gen) < 0.3] = -100
        if i == 0:
            labels[:, SEQ // 2 :] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def batches(count: int, rows: int = 1) -> list[dict[str, torch.Tensor]]:
    """``count`` micro-batches of ``rows`` of the samples each."""
    data = samples(count * rows)
    return [
        {k: torch.cat([d[k] for d in data[i * rows : (i + 1) * rows]]) for k in data[0]}
        for i in range(count)
    ]


def reference(
    order: list[list[dict]],
    attention: str = "sdpa",
    kv_heads: int = 2,
    lora: bool = False,
    peft: bool = False,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process: for each step, the mean over its samples of each sample's token mean."""
    model = build(attention, kv_heads, lora, peft)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trained, lr=LR, momentum=MOMENTUM)
    losses = []
    for step in order:
        total = 0.0
        for sample in step:
            loss = model(**sample).loss / len(step)
            loss.backward()
            total += loss.item()
        losses.append(total)
        opt.step()
        opt.zero_grad()
    return model.state_dict(), losses


def config(stage: int, sp: int | None, switches: tuple[str, ...] = ()) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 10**6,
    }
    if sp is not None:
        cfg["sequence_parallel_size"] = sp
    if "tiled" in switches:
        cfg["tiled_compute"] = TILED
    if "lora" in switches:
        cfg["lora_fa"] = LORA
    if "checkpointing" in switches:
        cfg["activation_checkpointing"] = {"cpu_checkpointing": True}
    if "tp" in switches:  # each rank 1/2 of the heads, which Ulysses then shares
        cfg["tensor_parallel"] = {"autotp_size": 2}
    if "rows2" in switches:
        cfg["train_micro_batch_size_per_gpu"] = 2
    if "offload" in switches:  # the optimizer states on the CPU; at stage 3 the parameters too
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    return cfg


def zerotrain_way(cases: list[tuple]):
    """The config key; each data-parallel rank takes its samples, every sequence-parallel
    rank its share of them; the model's own loss."""
    import zerotrain
    from zerotrain.sequence import shard_batch

    out = {}
    for stage, attention, kv_heads, switches in cases:
        model = build(attention, kv_heads, peft="peft" in switches)
        if "checkpointing" in switches:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        trained = [p for p in model.parameters() if p.requires_grad]
        settings = config(stage, 2, switches)
        engine, *_ = zerotrain.initialize(model=model, model_parameters=trained, config=settings)
        dp, dp_rank = engine.dp_world_size, engine.layout.dp.rank
        sp = engine.layout.sequence
        data = batches(STEPS * ACCUM * dp, rows=2 if "rows2" in switches else 1)
        losses = []
        for step in range(STEPS):
            total = 0.0
            for micro in range(ACCUM):
                sample = data[(step * ACCUM + micro) * dp + dp_rank]
                batch = shard_batch(sample, sp.rank, sp.world_size)
                loss = engine(**batch).loss
                engine.backward(loss)
                engine.step()
                total += loss.item() / ACCUM
            losses.append(engine.layout.dp.all_gather_object(total))
        state = engine.consolidated_state_dict()
        out[(stage, attention, kv_heads, switches)] = (state, losses, engine.dp_world_size)
        zerotrain.sequence.hf.unregister_attention()
    return out


def alst_way(stages: list[int]):
    """DeepSpeed's ALST script: register, initialize(mpu=...), the adapter over a loader of
    this rank's own samples, the loss aggregated by the script over the sequence-parallel
    group with differentiable all-gathers."""
    import torch.distributed as dist
    import torch.distributed.nn.functional as dist_fn

    import zerotrain
    from zerotrain.runtime.sequence_parallel.ulysses_sp import (
        UlyssesSPAttentionHF,
        UlyssesSPDataLoaderAdapter,
    )

    out = {}
    rank, world = dist.get_rank(), dist.get_world_size()
    for stage in stages:
        model = build()
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model, core_attn_implementation="sdpa",
            sequence_parallel_size=2, micro_batch_size=1, seq_length_is_variable=True,
        )  # fmt: skip
        engine, *_ = zerotrain.initialize(model=model, config=config(stage, None), mpu=mpu)
        group = mpu.get_sequence_parallel_group()
        sp_rank, sp_world = mpu.get_sequence_parallel_rank(), mpu.get_sequence_parallel_world_size()
        mine = samples(STEPS * ACCUM * world)[rank::world]  # this rank's own samples
        loader = torch.utils.data.DataLoader(mine, batch_size=None)
        adapter = UlyssesSPDataLoaderAdapter(
            loader, sp_rank=sp_rank, sp_group=group, sp_world_size=sp_world, device="cpu"
        )
        model_losses = []
        for _ in range(STEPS * ACCUM):
            batch = next(adapter)
            shift_labels = batch["shift_labels"]
            outputs = engine(**batch)
            loss = engine.module.loss_function(
                logits=outputs.logits, labels=None, shift_labels=shift_labels,
                vocab_size=engine.module.config.vocab_size,
            )  # fmt: skip
            losses_per_rank = dist_fn.all_gather(loss, group=group)
            good = (shift_labels != -100).view(-1).sum()
            good_per_rank = dist_fn.all_gather(good, group=group)
            total = sum(losses_per_rank[r] * good_per_rank[r] for r in range(sp_world))
            loss = total / sum(good_per_rank)
            engine.backward(loss)
            engine.step()
            model_losses.append(loss.item())
        out[stage] = (engine.consolidated_state_dict(), model_losses)
        UlyssesSPAttentionHF.unregister_from_transformers()
    return out


def _close(state: dict, ref: dict) -> float:
    return max(
        ((state[k].float() - ref[k]).norm() / ref[k].norm().clamp(min=1e-12)).item() for k in ref
    )


CASES = {
    2: [
        *(case(stage) for stage in range(4)),
        case(2, "eager"),
        case(3, "eager", kv_heads=1),
        case(1, tiled=True),
        case(3, tiled=True),
        case(2, lora=True),
        case(3, lora=True, tiled=True),
        case(2, offload=True),
        case(3, offload=True, tiled=True),
        case(2, peft=True),
        case(3, peft=True, checkpointing=True),
        case(1, checkpointing=True, tiled=True),
        case(3, rows2=True),  # micro-batches of 2 samples
        case(2, rows2=True, tiled=True),
    ],
    4: [
        *(case(stage) for stage in range(4)),
        case(3, tiled=True),
        case(2, lora=True),
        *(case(stage, tp=True) for stage in range(4)),  # tp 2 x sp 2: one data-parallel rank
        case(3, tp=True, tiled=True),
    ],
}


@pytest.mark.parametrize("world", [2, 4])
def test_zerotrain_way_equals_one_process(world):
    results = run_distributed(zerotrain_way, world, CASES[world], timeout=400)
    references = {}
    for key, (state, losses, dp) in results[0].items():
        _, attention, kv_heads, switches = key
        assert dp == world // 2 // (2 if "tp" in switches else 1)
        rows = 2 if "rows2" in switches else 1
        data = batches(STEPS * ACCUM * dp, rows=rows)
        order = [data[s * ACCUM * dp : (s + 1) * ACCUM * dp] for s in range(STEPS)]
        made = (attention, kv_heads, "lora" in switches, "peft" in switches)
        if (made, dp, rows) not in references:
            references[made, dp, rows] = reference(order, *made)
        ref_state, ref_losses = references[made, dp, rows]
        assert _close(state, ref_state) < 1e-5, key
        per_step = [sum(step) / dp for step in losses]
        assert per_step == pytest.approx(ref_losses, rel=1e-5), key
        for rank in range(1, world):  # every rank holds the same model
            assert _close(results[rank][key][0], ref_state) < 1e-5, (rank, key)


def test_alst_script_equals_one_process():
    """DeepSpeed's ALST script at every stage (DeepSpeed's own gradients are sp times too large
    at stages 0 and 2 with it): each step's micro-batches are rank 0's and rank 1's samples."""
    results = run_distributed(alst_way, 2, [0, 1, 2, 3], timeout=400)
    data = samples(STEPS * ACCUM * 2)
    mine = [data[r::2] for r in range(2)]
    # step s: the adapter yields sample s of rank 0, then sample s of rank 1
    order = [[mine[0][s], mine[1][s]] for s in range(STEPS)]
    ref_state, ref_losses = reference(order)
    for stage, (state, losses) in results[0].items():
        assert _close(state, ref_state) < 1e-5, stage
        per_step = [sum(losses[s * ACCUM : (s + 1) * ACCUM]) / ACCUM for s in range(STEPS)]
        assert per_step == pytest.approx(ref_losses, rel=1e-5), stage


def wrong_uses():
    """What a sequence-parallel run refuses, each with the reason (sp 2 on 2 ranks)."""
    import transformers

    import zerotrain
    from zerotrain.sequence import shard_batch

    errors = {}
    config3 = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=24, intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=3, num_key_value_heads=3, attn_implementation="sdpa",
    )  # fmt: skip
    try:
        zerotrain.initialize(model=transformers.LlamaForCausalLM(config3), config=config(0, 2))
    except ValueError as error:
        errors["heads"] = str(error)
    engine, *_ = zerotrain.initialize(model=build(), config=config(0, 2))
    sp = engine.layout.sequence
    batch = shard_batch(samples(1)[0], sp.rank, sp.world_size)
    unnumbered = {k: v for k, v in batch.items() if k != "position_ids"}
    try:  # transformers numbers each rank's share from 0
        engine(**unnumbered)
    except ValueError as error:
        errors["positions"] = str(error)
    zerotrain.sequence.hf.unregister_attention()
    return errors


def test_refusals_name_the_reason():
    errors = run_distributed(wrong_uses, 2)[0]
    assert "3 attention heads do not divide into sequence_parallel_size 2" in errors["heads"]
    assert "do not continue those before them" in errors["positions"]
    assert "position" in errors["positions"]


def test_the_batch_keys_count_data_parallel_ranks_and_sp_must_divide_the_world():
    from zerotrain.config import ConfigError, load_config

    base = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}
    cfg = load_config({**base, "sequence_parallel_size": 2}, world_size=4)
    assert cfg.train_batch_size == 2 * 3 * 2  # 4 ranks: 2 data-parallel x 2 sequence
    with pytest.raises(ConfigError, match="sequence_parallel_size: 3 does not divide the 4"):
        load_config({**base, "sequence_parallel_size": 3}, world_size=4)
    # an mpu's group sets the degree where the config leaves it at 1, and must agree with it
    assert load_config(base, world_size=4, sequence_parallel_size=2).sequence_parallel_size == 2
    with pytest.raises(ConfigError, match="mpu passed to initialize"):
        load_config({**base, "sequence_parallel_size": 4}, world_size=4, sequence_parallel_size=2)


def test_shard_batch_shifts_before_cutting_and_pads_to_a_multiple():
    from zerotrain.sequence import shard_batch

    ids = torch.arange(1, 6)[None]  # 5 tokens, 2 ranks: padded to 6
    labels = torch.tensor([[-100, 12, 13, 14, 15]])
    first, second = (shard_batch({"input_ids": ids, "labels": labels}, r, 2) for r in (0, 1))
    assert first["input_ids"].tolist() == [[1, 2, 3]]
    assert second["input_ids"].tolist() == [[4, 5, 0]]
    # token 3's target (14) is the first label of the second share: kept by shifting first
    assert first["shift_labels"].tolist() == [[12, 13, 14]]
    assert second["shift_labels"].tolist() == [[15, -100, -100]]
    assert second["position_ids"].tolist() == [[3, 4, 5]]
    assert "labels" not in first
    # a right-padding mask is dropped (causal attention never lets real tokens see the tail)
    tail = torch.tensor([[1, 1, 1, 0, 0]])
    assert "attention_mask" not in shard_batch(
        {"input_ids": ids, "labels": labels, "attention_mask": tail}, 0, 2
    )
    left = torch.tensor([[0, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match="ALST requires position_ids"):
        shard_batch({"input_ids": ids, "labels": labels, "attention_mask": left}, 0, 2)
    with pytest.raises(ValueError, match="no `labels`"):
        shard_batch({"input_ids": ids}, 0, 2)


def test_heads_that_cannot_be_shared_are_refused():
    from zerotrain.sequence.attention import check_heads

    assert check_heads(8, 4, 2) == 1  # key/value heads cut
    assert check_heads(8, 2, 4) == 2  # each repeated twice
    with pytest.raises(ValueError, match="8 attention heads do not divide"):
        check_heads(8, 8, 3)
    with pytest.raises(ValueError, match="must divide one another"):
        check_heads(12, 3, 4)


def saved_activation_bytes(model: torch.nn.Module, run) -> int:
    """Bytes of the non-parameter tensors autograd keeps for backward while ``run()`` runs its
    forward (each storage once)."""
    from zerotrain.checkpointing import count_saved_activations

    with count_saved_activations(model.parameters()) as saved:
        run()
    return saved.nbytes


LONG = 256  # tokens: the per-token activations dwarf the per-rank constants


def long_sample() -> dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (1, LONG), generator=torch.Generator().manual_seed(6))
    return {"input_ids": ids, "labels": ids.clone()}


def activations_per_rank(stage: int) -> int:
    import zerotrain
    from zerotrain.sequence import shard_batch

    engine, *_ = zerotrain.initialize(model=build(), config=config(stage, 2))
    sp = engine.layout.sequence
    batch = shard_batch(long_sample(), sp.rank, sp.world_size)
    measured = saved_activation_bytes(engine.module, lambda: engine.backward(engine(**batch).loss))
    zerotrain.sequence.hf.unregister_attention()
    return measured


def test_activations_kept_for_backward_fall_by_sp():
    """The bytes autograd keeps per rank at sp 2 are half one process's for the whole sample
    (every saved activation is per token; attention's are the whole sequence for half the
    heads), plus one copy of the attention's output per layer: one process keeps the core
    attention's output and the output projection's input in one storage, Ulysses in two (the
    second all-to-all makes a new tensor), each 1/sp of the sample. Within 1% (positions,
    the loss's scalars)."""
    model = build()
    sample = long_sample()
    whole = saved_activation_bytes(model, lambda: model(**sample).loss.backward())
    layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    expected = whole / 2 + layers * LONG * hidden * 4 / 2
    for stage in (0, 2):  # (stage 3's gathered parameters would count as activations here)
        for measured in run_distributed(activations_per_rank, 2, stage):
            assert measured == pytest.approx(expected, rel=0.01), (stage, measured, whole)


def resume(save_dir: str, steps: list[int], save_at: int | None):
    """Train ``steps`` (indices into the data, one sample per step, accumulated over ACCUM
    micro-batches on one data-parallel rank) at this world's sequence-parallel degree, loading
    ``save_dir`` first when it holds a checkpoint and saving after step ``save_at``."""
    import zerotrain
    from zerotrain.sequence import shard_batch

    world = torch.distributed.get_world_size()
    engine, *_ = zerotrain.initialize(model=build(), config=config(3, world))
    if save_at is None:
        engine.load_checkpoint(save_dir)
    sp = engine.layout.sequence
    data = samples(10 * ACCUM)
    for step in steps:
        for micro in range(ACCUM):
            batch = data[step * ACCUM + micro]
            if world > 1:  # one process takes the sample whole
                batch = shard_batch(batch, sp.rank, sp.world_size)
            engine.backward(engine(**batch).loss)
            engine.step()
        if step == save_at:
            engine.save_checkpoint(save_dir, tag="mid")
    state = engine.consolidated_state_dict()
    zerotrain.sequence.hf.unregister_attention()
    return state


def test_checkpoints_do_not_depend_on_sp(tmp_path):
    """Saved at sp 2 after step 0; resumed at sp 2 the run is the uninterrupted one bit for bit,
    resumed at sp 1 (one process) and at sp 4 it equals it within float rounding."""
    save_dir = str(tmp_path / "ckpt")
    straight = run_distributed(resume, 2, save_dir, [0, 1, 2], 0)[0]
    again = run_distributed(resume, 2, save_dir, [1, 2], None)[0]
    alone = run_distributed(resume, 1, save_dir, [1, 2], None)[0]
    wider = run_distributed(resume, 4, save_dir, [1, 2], None)[0]  # sp 4: one head per rank
    for key, value in straight.items():
        assert torch.equal(again[key], value), key
    assert _close(alone, straight) < 1e-5
    assert _close(wider, straight) < 1e-5


def bf16_run(stage: int):
    """Two steps in bf16 at this world's sequence-parallel degree (1 on one rank)."""
    import zerotrain
    from zerotrain.sequence import shard_batch

    world = torch.distributed.get_world_size()
    settings = {**config(stage, world if world > 1 else None), "bf16": {"enabled": True}}
    engine, *_ = zerotrain.initialize(model=build(), config=settings)
    sp = engine.layout.sequence
    data, losses = samples(STEPS * ACCUM), []
    for sample in data:
        batch = shard_batch(sample, sp.rank, sp.world_size) if world > 1 else sample
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = {k: v.float() for k, v in engine.consolidated_state_dict().items()}
    zerotrain.sequence.hf.unregister_attention()
    return state, losses


def test_bf16_trains_as_one_bf16_process():
    """bf16 composes: sp 2 trains what one bf16 process trains on the same samples, within
    bf16's rounding (the exchanges move bf16 values exactly; the matmuls see other shapes)."""
    for stage in (1, 3):
        alone = run_distributed(bf16_run, 1, stage)[0]
        shared = run_distributed(bf16_run, 2, stage)
        for state, losses in shared:
            assert losses == pytest.approx(alone[1], rel=2e-2), stage
            assert _close(state, alone[0]) < 2e-2, stage


def loader_shares():
    """initialize's own dataloader with sp 2: both ranks take the same samples, each its share
    (the data is split over the data-parallel ranks only: here one)."""
    import zerotrain

    dataset = [{k: v[0] for k, v in sample.items()} for sample in samples(4)]  # 1-D samples
    engine, _, loader, _ = zerotrain.initialize(
        model=build(), config=config(0, 2), training_data=dataset
    )
    batches = [{k: v.tolist() for k, v in batch.items()} for batch in loader]
    zerotrain.sequence.hf.unregister_attention()
    return batches, len(loader), sorted(loader.state_dict())


def test_initializes_dataloader_gives_each_rank_its_share():
    first, second = run_distributed(loader_shares, 2)
    assert len(first[0]) == first[1] == 4  # every sample, on both ranks
    for a, b in zip(first[0], second[0], strict=True):
        assert a["position_ids"][0][-1] + 1 == b["position_ids"][0][0]  # halves of one sample
        assert len(a["input_ids"][0]) == len(b["input_ids"][0]) == (SEQ + 1) // 2
    assert first[2]  # the resumable loader's state passes through


def tokens_counted():
    """The throughput line's token count of one step at sp 2."""
    import contextlib
    import io

    import zerotrain
    from zerotrain.sequence import shard_batch

    settings = {**config(2, 2), "steps_per_print": 1}
    engine, *_ = zerotrain.initialize(model=build(), config=settings)
    sp = engine.layout.sequence
    records, finish_step = [], engine.metrics.finish_step
    engine.metrics.finish_step = lambda **kw: records.append(finish_step(**kw)) or records[-1]
    with contextlib.redirect_stdout(io.StringIO()):
        for sample in samples(ACCUM):
            engine.backward(engine(**shard_batch(sample, sp.rank, sp.world_size)).loss)
            engine.step()
    return [r.tokens for r in records if r is not None]


def test_the_throughput_line_counts_every_share_of_a_sample():
    tokens = run_distributed(tokens_counted, 2)[0]
    assert tokens == [ACCUM * (SEQ + 1)]  # each rank's input is half of 14 (13, padded)
