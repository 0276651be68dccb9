"""Tied weights stay one tensor in every export, and loading them keeps the tie
(zerotrain/checkpoint/export.py, [Note: tied parameters in exports]).

A HuggingFace GPT-2 (``transformer.wte.weight`` is ``lm_head.weight``) trains a step at ZeRO
stage 3 on 2 ranks and is saved; every export is then read as a client does: DeepSpeed's
``zero_to_fp32`` functions, HF's recovery recipe on a Trainer ``checkpoint-N`` folder,
``load_state_dict(strict=True)`` and ``from_pretrained``. As with DeepSpeed (its
``shared_params``), the in-memory state dicts and the ``torch.save`` files hold the tied keys as
one tensor; safetensors, which cannot share, holds a copy under each key.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from safetensors.torch import load_file
from test_checkpoint_folders import hf_trainer_folder

from zerotrain.checkpoint import consolidate, read_state_dict
from zerotrain.utils.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)

pytest.importorskip("transformers")

WTE, HEAD = "transformer.wte.weight", "lm_head.weight"


def _engine(model, stage: int, **zero):
    import zerotrain

    engine, *_ = zerotrain.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-6}},
            "zero_optimization": {"stage": stage, **zero},
            "steps_per_print": 10**6,
        },
    )
    return engine


def _save_tied(root: str) -> dict:
    from tests.models import tiny_hf_gpt2

    out = Path(root)
    torch.manual_seed(0)
    engine = _engine(tiny_hf_gpt2(), 3, stage3_gather_16bit_weights_on_model_save=True)
    ids = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(engine.global_rank))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()  # the head's value is now the trained one, not the initial one
    engine.save_checkpoint(out / "ckpt")
    engine.save_16bit_model(out / "16bit")
    engine.save_16bit_model(out / "16bit", "model.safetensors")
    full = engine.consolidated_state_dict()
    z3 = engine._zero3_consolidated_16bit_state_dict()

    # a frozen tied embedding (LoRA on GPT-2): the tie is the manifest's tied_keys
    frozen = tiny_hf_gpt2()
    frozen.transformer.wte.weight.requires_grad_(False)
    _engine(frozen, 2).save_checkpoint(out / "frozen")
    return {"full": full, "z3": z3}


def _shared(state: dict) -> bool:
    return state[WTE].untyped_storage().data_ptr() == state[HEAD].untyped_storage().data_ptr()


def _assert_equal(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(actual[key].to(value.dtype), value), key


def _assert_model(model, expected: dict) -> None:
    assert model.lm_head.weight is model.transformer.wte.weight  # the tie survived the load
    state = model.state_dict()
    _assert_equal({k: state[k] for k in expected}, expected)


def test_tied_weights_stay_one_tensor_in_every_export(tmp_path):
    from transformers import GPT2LMHeadModel

    from tests.models import tiny_hf_gpt2

    rank0 = run_distributed(_save_tied, 2, str(tmp_path))[0]
    expected = rank0["full"]
    assert _shared(expected) and _shared(rank0["z3"])  # the engine's gathers
    _assert_equal(rank0["z3"], expected)
    ckpt = tmp_path / "ckpt"

    state = get_fp32_state_dict_from_zero_checkpoint(ckpt)
    assert _shared(state) and _shared(read_state_dict(ckpt, dtype=torch.bfloat16))
    _assert_equal(state, expected)
    assert _shared(read_state_dict(tmp_path / "frozen"))

    convert_zero_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "bin")
    loaded = torch.load(tmp_path / "bin" / "pytorch_model.bin", weights_only=True)
    assert _shared(loaded)
    _assert_equal(loaded, expected)
    convert_zero_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "safe", safe_serialization=True)
    safe = load_file(tmp_path / "safe" / "model.safetensors")  # a copy each: it cannot share
    _assert_equal(safe, expected)
    for export in (loaded, safe):
        model = GPT2LMHeadModel(tiny_hf_gpt2().config)
        model.load_state_dict(export, strict=True)
        _assert_model(model, expected)

    # sharded: a tied key goes with its tensor, counted once in the index's total
    convert_zero_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "shards", max_shard_size=40_000)
    index = json.loads((tmp_path / "shards" / "pytorch_model.bin.index.json").read_text())
    weight_map = index["weight_map"]
    assert len(set(weight_map.values())) > 1 and weight_map[HEAD] == weight_map[WTE]
    nbytes = {k: v.numel() * v.element_size() for k, v in expected.items()}
    assert index["metadata"]["total_size"] == sum(nbytes.values()) - nbytes[HEAD]
    shard = torch.load(tmp_path / "shards" / weight_map[HEAD], weights_only=True)
    assert _shared(shard)

    # HF's from_pretrained on either file, and HF's recovery recipe on a Trainer folder
    for directory in ("bin", "safe"):
        tiny_hf_gpt2().config.save_pretrained(tmp_path / directory)
        _assert_model(GPT2LMHeadModel.from_pretrained(tmp_path / directory), expected)
    folder = hf_trainer_folder(ckpt, tmp_path / "out" / "checkpoint-1")
    model = load_state_dict_from_zero_checkpoint(GPT2LMHeadModel(tiny_hf_gpt2().config), folder)
    _assert_model(model, expected)

    # the 16-bit exports and zerotrain checkpoint consolidate
    sixteen = torch.load(tmp_path / "16bit" / "pytorch_model.bin", weights_only=True)
    assert _shared(sixteen)
    _assert_equal(sixteen, expected)
    _assert_equal(load_file(tmp_path / "16bit" / "model.safetensors"), expected)
    consolidate(ckpt, tmp_path / "consolidated", progress=False)
    _assert_equal(load_file(tmp_path / "consolidated" / "model.safetensors"), expected)
