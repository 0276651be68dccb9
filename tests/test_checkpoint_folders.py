"""Every checkpoint tool accepts the folder a user has, and a load that finds no checkpoint
says why (zerotrain/checkpoint/locate.py, [Note: when there is no checkpoint to load]).

The tools' cases read copies of the committed 0.1.0 checkpoint (a save directory: ``latest``
and ``global_step2/``), with no process group; the engine's run on 2 ranks. The HuggingFace
Trainer's ``checkpoint-N`` folder is built here as the Trainer writes it (the listing of a real
one, from tests/test_integration_hf.py, which also reads a real one).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from models import DropoutModel
from safetensors.torch import load_file, save_file

from zerotrain import cli
from zerotrain.checkpoint import (
    CheckpointError,
    NoCheckpoint,
    consolidate,
    inspect_checkpoints,
    load_consolidated,
    read_state_dict,
    resolve,
)
from zerotrain.utils.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)

GOLDEN = Path(__file__).parent / "golden" / "checkpoints" / "stage2-bf16"  # latest, global_step2/


def hf_trainer_folder(save_dir: Path, folder: Path) -> Path:
    """``folder`` as the HuggingFace Trainer writes ``checkpoint-N`` with DeepSpeed: its
    ``save_model`` export (``model.safetensors``, ``config.json``, ``generation_config.json``),
    the engine's ``save_checkpoint`` (``latest``, ``global_stepN/``: a copy of ``save_dir``),
    and its own state. The export holds zeros, so a tool that reads it instead of the
    checkpoint's fp32 masters is caught."""
    shutil.copytree(save_dir, folder)
    state = read_state_dict(save_dir)
    save_file({k: torch.zeros_like(v) for k, v in state.items()}, folder / "model.safetensors")
    for name in ("config.json", "generation_config.json"):
        (folder / name).write_text("{}")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    for name in ("training_args.bin", "rng_state_0.pth", "rng_state_1.pth"):
        torch.save({}, folder / name)
    return folder


def _assert_equal(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(actual[key].to(value.dtype), value), key


def _model_state(model: torch.nn.Module, keys) -> dict:
    state = model.state_dict()
    return {key: state[key] for key in keys}


def test_every_tool_reads_the_hf_trainer_checkpoint_folder(tmp_path, capsys):
    expected = read_state_dict(GOLDEN)
    folder = hf_trainer_folder(GOLDEN, tmp_path / "out" / "checkpoint-2")

    assert resolve(folder).directory == folder / "global_step2"
    _assert_equal(read_state_dict(folder), expected)
    _assert_equal(get_fp32_state_dict_from_zero_checkpoint(folder), expected)
    model = load_state_dict_from_zero_checkpoint(DropoutModel(), folder)  # HF's recovery path
    _assert_equal(_model_state(model, expected), expected)
    model = load_consolidated(DropoutModel(), folder)  # the masters, not the zeros beside them
    _assert_equal(_model_state(model, expected), expected)
    consolidate(folder, tmp_path / "export", progress=False)
    _assert_equal(load_file(tmp_path / "export" / "model.safetensors"), expected)
    convert_zero_checkpoint_to_fp32_state_dict(folder, tmp_path / "bin")
    _assert_equal(torch.load(tmp_path / "bin" / "pytorch_model.bin", weights_only=True), expected)

    text = inspect_checkpoints(folder)
    assert "latest: global_step2\nglobal_step2: complete" in text
    assert "INCOMPLETE" not in text and text.endswith("newest complete: global_step2")
    assert cli.main(["checkpoint", "inspect", str(folder)]) == 0
    assert "global_step2: complete" in capsys.readouterr().out
    assert cli.main(["checkpoint", "consolidate", str(folder), str(tmp_path / "cli")]) == 0
    _assert_equal(load_file(tmp_path / "cli" / "model.safetensors"), expected)


def _copy(source: Path, target: Path, drop: tuple[str, ...] = ()) -> Path:
    shutil.copytree(source, target)
    for name in drop:
        (target / name).unlink()
    return target


def test_tag_none_reads_the_tag_latest_names_as_deepspeed(tmp_path):
    expected = read_state_dict(GOLDEN)
    frozen = "frozen_scale"  # DropoutModel's frozen parameter
    # a newer save that did not move latest (save_latest=False), with files that fail to read
    save = _copy(GOLDEN, tmp_path / "save")
    folder = hf_trainer_folder(GOLDEN, tmp_path / "out" / "checkpoint-2")
    for path in (save, folder):
        newer = _copy(GOLDEN / "global_step2", path / "global_step5")
        manifest = json.loads((newer / "manifest.json").read_text())
        manifest.update(tag="global_step5", commit_time=manifest["commit_time"] + 100)
        (newer / "manifest.json").write_text(json.dumps(manifest))
        for shard in newer.glob("*-rank*.safetensors"):
            shard.write_bytes(b"")

    for path in (save, folder):  # DeepSpeed reads latest's tag; so does every tool here
        assert resolve(path).directory == path / "global_step2"
        _assert_equal(get_fp32_state_dict_from_zero_checkpoint(path), expected)
        model = load_state_dict_from_zero_checkpoint(DropoutModel(), path)  # HF's recipe
        _assert_equal(_model_state(model, expected), expected)
        consolidate(path, tmp_path / "export" / path.name, progress=False)
        _assert_equal(load_file(tmp_path / "export" / path.name / "model.safetensors"), expected)
        trained = get_fp32_state_dict_from_zero_checkpoint(path, exclude_frozen_parameters=True)
        _assert_equal(trained, {k: v for k, v in expected.items() if k != frozen})
        with pytest.raises(CheckpointError, match="global_step5"):  # a tag asked for by name
            get_fp32_state_dict_from_zero_checkpoint(path, tag="global_step5")
    assert "latest: global_step2" in inspect_checkpoints(save, verify=False)

    # latest naming no complete checkpoint: the newest complete one (DeepSpeed would raise),
    # with a warning naming both
    (save / "latest").write_text("global_step9\n")
    with pytest.warns(UserWarning, match="latest names 'global_step9'.*'global_step5'"):
        assert resolve(save).directory.name == "global_step5"


def test_save_directories_tag_directories_and_the_folders_around_them(tmp_path):
    expected = read_state_dict(GOLDEN)
    _assert_equal(read_state_dict(GOLDEN / "global_step2"), expected)  # a tag directory itself

    # tag directories without latest: the newest complete one; other folders are not saves
    tags = _copy(GOLDEN, tmp_path / "tags", drop=("latest",))
    _copy(GOLDEN / "global_step2", tags / "global_step9", drop=("manifest.json",))
    (tags / "runs").mkdir()
    (tags / "runs" / "events.out.tfevents").write_text("")
    assert resolve(tags).directory.name == "global_step2"
    text = inspect_checkpoints(tags)
    assert "global_step9: INCOMPLETE" in text and "runs" not in text

    # the Trainer's output directory: which checkpoint-N is the user's choice, as in DeepSpeed
    out = tmp_path / "out"
    for step in (2, 10):
        hf_trainer_folder(GOLDEN, out / f"checkpoint-{step}")
    for tool in (resolve, read_state_dict, inspect_checkpoints):
        with pytest.raises(CheckpointError) as error:
            tool(out)
        message = str(error.value)
        assert "save directories one level down (checkpoint-2, checkpoint-10)" in message
        assert f"pass one of them, e.g. {out / 'checkpoint-10'}" in message

    # a consolidated export is read as one, and named as one where a checkpoint is expected
    consolidate(GOLDEN, tmp_path / "export", progress=False)
    _assert_equal(
        _model_state(load_consolidated(DropoutModel(), tmp_path / "export"), expected), expected
    )
    with pytest.raises(CheckpointError, match=r"export: holds no zerotrain checkpoint but a "):
        inspect_checkpoints(tmp_path / "export")

    # DeepSpeed's own files: named, with the way to read them
    deepspeed = tmp_path / "deepspeed"
    (deepspeed / "global_step2").mkdir(parents=True)
    (deepspeed / "latest").write_text("global_step2")
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        (deepspeed / "global_step2" / name).write_bytes(b"")
    with pytest.raises(NoCheckpoint) as error:
        consolidate(deepspeed, tmp_path / "none", progress=False)
    assert error.value.kind == "unusable"
    assert "DeepSpeed checkpoint files (global_step2/mp_rank_00_model_states.pt" in str(error.value)

    with pytest.raises(CheckpointError, match="a file, not a checkpoint directory"):
        resolve(GOLDEN / "latest")
    with pytest.raises(CheckpointError, match="is a checkpoint directory itself"):
        resolve(GOLDEN / "global_step2", tag="global_step2")


def test_no_checkpoint_says_which_of_five_cases(tmp_path):
    def kind_and_message(path: Path) -> tuple[str, str]:
        with pytest.raises(NoCheckpoint) as error:
            resolve(path)
        return error.value.kind, str(error.value)

    (tmp_path / "ckpt").mkdir()
    _copy(GOLDEN, tmp_path / "rck")
    typo = tmp_path / "rck_typo"  # the issue's: beside a folder of checkpoints
    assert kind_and_message(typo) == (
        "missing",
        f"{typo}: no such checkpoint directory (did you mean {tmp_path / 'rck'}?)",
    )
    # nothing alike beside it, in a folder that exists: a first run's, made by its first save
    kind, message = kind_and_message(tmp_path / "new_run")
    assert kind == "absent" and message == f"{tmp_path / 'new_run'}: no such checkpoint directory"
    # ... but not where its parent is missing too (an unmounted disk, a wrong root)
    kind, message = kind_and_message(tmp_path / "nowhere" / "sub")
    assert kind == "missing" and message.endswith("no such checkpoint directory")
    # a name that differs only in its numbers is another run, not a typo; a folder that holds
    # no checkpoint is no suggestion
    _copy(GOLDEN, tmp_path / "exp1")
    assert kind_and_message(tmp_path / "exp2")[0] == "absent"
    assert kind_and_message(tmp_path / "ckpt_typo")[0] == "absent"  # ckpt holds nothing
    kind, message = kind_and_message(tmp_path / "ckpt")
    assert kind == "empty" and "expected a checkpoint directory" in message

    broken = tmp_path / "broken"
    _copy(GOLDEN / "global_step2", broken / "global_step2", drop=("manifest.json",))
    kind, message = kind_and_message(broken)
    assert kind == "incomplete"
    assert message.endswith("saves that did not finish: global_step2 (no manifest.json)")
    kind, message = kind_and_message(broken / "global_step2")  # the tag directory itself
    assert kind == "incomplete" and "a save that did not finish" in message

    shutil.rmtree(_copy(GOLDEN, tmp_path / "gone") / "global_step2")
    kind, message = kind_and_message(tmp_path / "gone")
    assert kind == "unusable" and "a latest file naming global_step2, which is not there" in message


# -- the engine ----------------------------------------------------------------------------------
def _load(engine, path) -> dict:
    """What ``load_checkpoint(path)`` returned or raised, warned and printed."""
    out = io.StringIO()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(out):
        warnings.simplefilter("always")
        try:
            returned, error = engine.load_checkpoint(path)[0], None
        except CheckpointError as exc:
            returned, error = None, str(exc)
    return {
        "returned": returned,
        "error": error,
        "warned": [str(w.message) for w in caught],
        "printed": out.getvalue(),
    }


NO_CHECKPOINT = ("ckpt_typo", "fresh", "new_run", "broken", "out")


def _engine_loads(root: str) -> dict:
    from tests.test_checkpoint import _block_engine, _train_block
    from zerotrain import comm

    root_path = Path(root)
    engine = _block_engine()
    _train_block(engine, 1)
    engine.save_checkpoint(root_path / "ckpt")
    saved = engine.consolidated_state_dict()
    if engine.global_rank == 0:
        hf_trainer_folder(root_path / "ckpt", root_path / "out" / "checkpoint-1")
        (root_path / "fresh").mkdir()
        (root_path / "bad_latest").mkdir()
        (root_path / "bad_latest" / "latest").write_bytes(b"\xff\xfe")
        _copy(root_path / "ckpt" / "global_step1", root_path / "broken" / "global_step1")
        (root_path / "broken" / "global_step1" / "manifest.json").unlink()
    comm.barrier()

    fresh = _block_engine()
    results = {}
    for case in ("ckpt", "ckpt/global_step1", "out/checkpoint-1"):
        results[case] = _load(fresh, root_path / case)
        state = fresh.consolidated_state_dict()
        results[case]["same"] = all(torch.equal(state[k], v) for k, v in saved.items())
    for case in (*NO_CHECKPOINT, "bad_latest"):  # they change nothing: one engine for all
        results[case] = _load(fresh, root_path / case)
    required = _block_engine(checkpoint={"require_resume": True})
    results["required"] = {case: _load(required, root_path / case) for case in NO_CHECKPOINT}
    if engine.global_rank == 0:  # rank 0 decides for every rank
        os.environ["ZEROTRAIN_REQUIRE_RESUME"] = "1"
    results["environment"] = _load(fresh, root_path / "fresh")
    os.environ.pop("ZEROTRAIN_REQUIRE_RESUME", None)
    return results


def test_engine_loads_every_folder_and_says_why_it_found_nothing(tmp_path):
    ranks = run_distributed(_engine_loads, 2, str(tmp_path))
    rank0 = ranks[0]
    loaded = {
        "ckpt": tmp_path / "ckpt" / "global_step1",
        "ckpt/global_step1": tmp_path / "ckpt" / "global_step1",
        "out/checkpoint-1": tmp_path / "out" / "checkpoint-1" / "global_step1",
    }
    for case, directory in loaded.items():
        assert rank0[case]["returned"] == str(directory), case
        assert rank0[case]["same"] and not rank0[case]["warned"], case

    def only_warning(case: str) -> str:
        result = rank0[case]
        assert result["returned"] is None and result["error"] is None, case
        assert len(result["warned"]) == 1, (case, result["warned"])
        return result["warned"][0]

    assert f"{tmp_path / 'ckpt_typo'}: no such checkpoint directory (did you mean " in only_warning(
        "ckpt_typo"
    )
    assert "global_step1 (no manifest.json)" in only_warning("broken")
    assert f"e.g. {tmp_path / 'out' / 'checkpoint-1'}" in only_warning("out")
    # a first run: one line, nothing alarming
    fresh = rank0["fresh"]
    assert fresh["returned"] is None and fresh["error"] is None and not fresh["warned"]
    assert f"no checkpoint in {tmp_path / 'fresh'} yet" in fresh["printed"]
    # ... and one whose folder its first save makes (nothing of a similar name beside it)
    new = rank0["new_run"]
    assert new["returned"] is None and new["error"] is None and not new["warned"]
    assert f"no checkpoint in {tmp_path / 'new_run'} yet (a first run)" in new["printed"]
    # a latest file that is not text: an error on every rank, not rank 0's alone (a hang)
    for rank in ranks:
        assert "UnicodeDecodeError" in rank["bad_latest"]["error"], rank["bad_latest"]

    for rank in ranks:
        assert all(rank[case]["same"] and not rank[case]["warned"] for case in loaded)
        for case, result in rank["required"].items():
            assert result["error"] and "require_resume" in result["error"], (case, result)
        # set on rank 0 only, and every rank raised
        assert "ZEROTRAIN_REQUIRE_RESUME=1" in (rank["environment"]["error"] or "")
    for case in NO_CHECKPOINT:  # rank 1 neither warns nor prints, and returns the same
        assert ranks[1][case]["returned"] is None and not ranks[1][case]["warned"]
        assert not ranks[1][case]["printed"]
        assert ranks[1]["required"][case]["error"] == rank0["required"][case]["error"]
