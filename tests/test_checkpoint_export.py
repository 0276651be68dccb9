"""Consolidated export, loading into a plain model, inspection and the `checkpoint` CLI.

One training run (world 2, ZeRO stage 3, the awkward model: tied embedding/head, a frozen
layer, a buffer) saves two checkpoints; every test reads them, and damages only copies.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from models import AwkwardModel, make_batches, param_groups, run_steps
from safetensors.torch import load_file
from torch import nn

import zerotrain
from zerotrain import cli
from zerotrain.checkpoint import (
    CheckpointError,
    consolidate,
    inspect_checkpoints,
    load_consolidated,
)
from zerotrain.checkpoint.manifest import manifest_checksum
from zerotrain.cli.arguments import size_argument

WORLD, STAGE, MICRO = 2, 3, 2


def _train_and_save(save_dir: str):
    torch.manual_seed(0)
    model = AwkwardModel()
    engine, *_ = zerotrain.initialize(
        model=model,
        model_parameters=param_groups(model, 0.1),
        config={
            "train_micro_batch_size_per_gpu": MICRO,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": STAGE},
            "steps_per_print": 10**6,
            "seed": 3,
        },
    )
    idx, tgt = make_batches(2, MICRO * WORLD)
    run_steps(
        engine,
        idx,
        tgt,
        MICRO,
        1,
        WORLD,
        engine.global_rank,
        lambda _: engine.save_checkpoint(save_dir),
    )
    return engine.consolidated_state_dict()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(save directory holding global_step1 and global_step2, the final full state dict)."""
    save_dir = tmp_path_factory.mktemp("ckpt")
    state = run_distributed(_train_and_save, WORLD, str(save_dir))[0]
    return save_dir, state


def _fresh_model() -> nn.Module:
    torch.manual_seed(123)  # other values than the trained ones
    return AwkwardModel()


def _assert_same_state(actual: dict, expected: dict, dtype=None) -> None:
    assert list(actual) == list(expected)
    for key, value in expected.items():
        want = value.to(dtype) if dtype is not None and value.is_floating_point() else value
        assert actual[key].dtype == want.dtype, key
        assert torch.equal(actual[key], want), key


def _read_export(out: Path) -> dict:
    index = out / "model.safetensors.index.json"
    if not index.exists():
        return load_file(out / "model.safetensors")
    weight_map = json.loads(index.read_text())["weight_map"]
    files = {name: load_file(out / name) for name in dict.fromkeys(weight_map.values())}
    return {key: files[name][key] for key, name in weight_map.items()}


def test_consolidate_fp32_is_the_engines_state_dict_bitwise(trained, tmp_path):
    save_dir, state = trained
    written = consolidate(save_dir, tmp_path / "out", progress=False)
    assert written == [tmp_path / "out" / "model.safetensors"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]
    _assert_same_state(load_file(written[0]), state)
    # the tied head is written under both keys
    assert {"embed.weight", "head.weight", "frozen.weight", "mix"} <= set(state)


def test_consolidate_bf16_in_shards_with_an_index(trained, tmp_path):
    save_dir, state = trained
    out = tmp_path / "out"
    written = consolidate(save_dir, out, dtype=torch.bfloat16, max_shard_size=300, progress=False)
    names = [p.name for p in written]
    shards = len(names) - 1
    assert shards > 2
    assert names == [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)] + [
        "model.safetensors.index.json"
    ]
    index = json.loads(written[-1].read_text())
    assert list(index["weight_map"]) == list(state)
    total = sum(
        v.numel() * (2 if v.is_floating_point() else v.element_size()) for v in state.values()
    )
    assert index["metadata"]["total_size"] == total
    for path in written[:-1]:  # a shard passes the limit only when it holds one tensor
        tensors = load_file(path)
        assert len(tensors) == 1 or sum(t.nbytes for t in tensors.values()) <= 300
    _assert_same_state(_read_export(out), state, dtype=torch.bfloat16)

    # exporting again with another split leaves no stale shards or index behind
    consolidate(save_dir, out, tag="global_step2", progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]


def test_a_failed_export_leaves_nothing_under_the_final_names(trained, tmp_path, monkeypatch):
    from zerotrain.checkpoint import export

    real, calls = export.write_safetensors, []

    def fail_on_second_file(path, entries, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(path, entries, metadata)

    monkeypatch.setattr(export, "write_safetensors", fail_on_second_file)
    with pytest.raises(OSError, match="disk full"):
        consolidate(trained[0], tmp_path / "out", max_shard_size=300, progress=False)
    assert list((tmp_path / "out").iterdir()) == []


def test_load_consolidated_from_a_checkpoint_and_from_an_export(trained, tmp_path):
    save_dir, state = trained
    for source in (save_dir, save_dir / "global_step2"):
        model = load_consolidated(_fresh_model(), source)
        _assert_same_state(model.state_dict(), state)
        assert model.head.weight is model.embed.weight  # loading kept the tie

    consolidate(save_dir, tmp_path / "single", progress=False)
    consolidate(save_dir, tmp_path / "sharded", max_shard_size=300, progress=False)
    for source in (tmp_path / "single", tmp_path / "sharded"):
        _assert_same_state(load_consolidated(_fresh_model(), source).state_dict(), state)

    # an older tag, into a model of another dtype: cast on the way in
    step1 = load_consolidated(_fresh_model().double(), save_dir, tag="global_step1")
    assert step1.up.weight.dtype == torch.float64
    assert not torch.equal(step1.up.weight.float(), state["up.weight"])


def test_load_consolidated_checks_names_and_shapes_before_changing_anything(trained):
    save_dir, state = trained
    model = _fresh_model()
    model.odd = nn.Parameter(torch.zeros(3, 7))  # saved as 5 x 7
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"odd: shape \[5, 7\] in the checkpoint, \[3, 7\]"):
        load_consolidated(model, save_dir)
    with pytest.raises(CheckpointError, match="odd"):  # strict=False still refuses a mismatch
        load_consolidated(model, save_dir, strict=False)
    _assert_same_state(model.state_dict(), before)

    model = _fresh_model()
    model.extra = nn.Linear(2, 2)
    del model.mix
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as error:
        load_consolidated(model, save_dir)
    message = str(error.value)
    assert "missing from the checkpoint: extra.weight, extra.bias" in message
    assert "in the checkpoint but not in the model: mix" in message
    _assert_same_state(model.state_dict(), before)

    load_consolidated(model, save_dir, strict=False)
    loaded = model.state_dict()
    _assert_same_state(
        {k: loaded[k] for k in state if k != "mix"}, {k: v for k, v in state.items() if k != "mix"}
    )
    assert torch.equal(loaded["extra.weight"], before["extra.weight"])


def _damaged_copy(save_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the save directory with an unfinished save and a corrupted newest checkpoint;
    returns (the copy, the corrupted file)."""
    copy = tmp_path / "damaged"
    shutil.copytree(save_dir, copy)
    unfinished = copy / "unfinished"
    shutil.copytree(copy / "global_step2", unfinished)
    (unfinished / "manifest.json").unlink()

    corrupt = copy / "corrupt"
    shutil.copytree(copy / "global_step2", corrupt)
    manifest = json.loads((corrupt / "manifest.json").read_text())
    manifest["commit_time"] += 1  # the newest commit; latest still names global_step2
    manifest["checksum"] = manifest_checksum(manifest)  # as its save committed it
    (corrupt / "manifest.json").write_text(json.dumps(manifest))
    rank_file = corrupt / manifest["roles"]["shard"][1]
    data = bytearray(rank_file.read_bytes())
    data[-1] ^= 0xFF  # same size, other contents: only the SHA-256 tells
    rank_file.write_bytes(bytes(data))
    return copy, rank_file


def test_inspect_reports_complete_incomplete_and_corrupt_checkpoints(trained, tmp_path):
    copy, rank_file = _damaged_copy(trained[0], tmp_path)
    text = inspect_checkpoints(copy)
    lines = text.split("\n")
    assert lines[1] == "latest: global_step2"
    tags = re.findall(r"^(\S+): (?:complete|INCOMPLETE|CORRUPT)$", text, flags=re.MULTILINE)
    assert tags == ["global_step1", "global_step2", "corrupt", "unfinished"]  # oldest first
    assert "global_step1: complete" in text and "global_step2: complete" in text
    assert "global step 2 (8 samples), world size 2, ZeRO stage 3, precision fp32" in text
    assert "optimizer FusedAdam (state: exp_avg, exp_avg_sq)" in text
    assert "dtypes: float32" in text and "committed: 20" in text
    assert "unfinished: INCOMPLETE" in text and "a save that did not finish" in text
    assert "corrupt: CORRUPT" in text and f"{rank_file}: corrupted" in text
    assert lines[-1] == "newest complete: corrupt (CORRUPT; newest intact: global_step2)"

    unverified = inspect_checkpoints(copy, verify=False)
    assert "CORRUPT" not in unverified and "corrupt: complete" in unverified
    single = inspect_checkpoints(copy / "unfinished")
    assert "unfinished: INCOMPLETE" in single and single.endswith("newest complete: none")

    # what reads the corrupted checkpoint refuses it, naming the file
    with pytest.raises(CheckpointError, match=f"{rank_file}: corrupted"):
        consolidate(copy, tmp_path / "out", tag="corrupt", progress=False)
    assert not (tmp_path / "out").exists()
    model = _fresh_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match="corrupted"):
        load_consolidated(model, copy / "corrupt")
    _assert_same_state(model.state_dict(), before)
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        consolidate(copy / "unfinished", tmp_path / "out", progress=False)


def test_cli_consolidate_and_inspect(trained, tmp_path, capsys):
    save_dir, state = trained
    out = tmp_path / "out"
    argv = ["checkpoint", "consolidate", str(save_dir), str(out), "--dtype", "bf16"]
    assert cli.main([*argv, "--max-shard-size", "1KB", "--tag", "global_step2"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed[-1] == str(out / "model.safetensors.index.json") and len(printed) > 2
    _assert_same_state(_read_export(out), state, dtype=torch.bfloat16)

    assert cli.main(["checkpoint", "inspect", str(save_dir), "--no-verify"]) == 0
    assert "newest complete: global_step2" in capsys.readouterr().out

    missing = tmp_path / "nowhere"
    assert cli.main(["checkpoint", "consolidate", str(missing), str(out)]) == 1
    assert capsys.readouterr().err == (
        f"zerotrain checkpoint consolidate: {missing}: no such checkpoint directory\n"
    )
    assert cli.main(["checkpoint", "inspect", str(missing)]) == 1
    assert str(missing) in capsys.readouterr().err
    assert cli.main(["checkpoint", "consolidate", str(save_dir), str(out), "--tag", "step9"]) == 1
    assert "step9: no such checkpoint (checkpoints in " in (err := capsys.readouterr().err)
    assert err.endswith(": global_step1, global_step2)\n")

    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--max-shard-size", "5XB"])
    assert exit_info.value.code == 2
    assert "'5XB' is not a size" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("1000000", 1_000_000),
        ("500MB", 500 * 10**6),
        ("5GB", 5 * 10**9),
        ("5gb", 5 * 10**9),
        ("5GiB", 5 * 2**30),
        ("1.5KiB", 1536),
        ("300 KB", 300_000),
    ],
)
def test_shard_sizes_are_read_like_huggingface(text, size):
    assert size_argument(text) == size


@pytest.mark.parametrize("text", ["", "GB", "5XB", "-1GB", "0", "inf"])
def test_bad_shard_sizes_are_usage_errors(text):
    with pytest.raises(argparse.ArgumentTypeError, match="is not a size"):
        size_argument(text)
