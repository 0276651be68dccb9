"""Checkpoints written by an earlier zerotrain (kept under ``tests/golden/checkpoints``) load into
this one and training continues bit for bit as it did in the version that wrote them.

The fixture was made with ``.venv/bin/python tests/test_old_checkpoint.py`` at zerotrain 0.1.0
(commit ed7a439): K steps, save, K more steps whose losses and final parameters it records.
Never regenerate it to make the test pass: the point is that old files keep working.

A second fixture (``golden/checkpoints/00078d0``) holds checkpoints of the layouts issue 41's
restructuring touches (tensor, pipeline and expert parallelism, NVMe and parameter offload, a
gradient codec's and 0/1 Adam's local-step state, besides the two above), written by zerotrain at
00078d0 from the feature grid's cases (test_golden.py): ``git worktree add --detach /tmp/wt00078
00078d0`` then ``PYTHONPATH=/tmp/wt00078 .venv/bin/python tests/test_old_checkpoint.py
--layouts``. Each records what 00078d0 computed after its save, in the same process.

The continuation's bits depend on the platform as the golden losses' do (test_golden.py), so
``continuation.json`` keeps one record per platform. On a new platform, record what 0.1.0 itself
computes there from these files: ``git worktree add /tmp/v0.1.0 850ac9f`` (0.1.0 and this
test), then ``.venv/bin/python tests/test_old_checkpoint.py --add-platform /tmp/v0.1.0``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import test_golden as golden
import torch
from distributed import run_distributed
from models import SEQ, VOCAB, DropoutModel, make_batches, param_groups
from test_golden import (
    Case,
    agreed_cases,
    assert_one_matches,
    build_engine,
    case_name,
    float_bits,
    moved_cases,
    nvme_directory,
    platform,
    platform_record,
    records_to_hold,
    state_hash,
    train_steps,
    zerotrain_commit,
)
from torch.utils.data import TensorDataset

FIXTURE = Path(__file__).parent / "golden" / "checkpoints"
CONTINUATION = FIXTURE / "continuation.json"
WORLD, K, MICRO, ACCUM = 2, 2, 2, 2
LAYOUTS = {"stage2-bf16": (2, {"bf16": {"enabled": True}}), "stage3-fp16": (3, {"fp16": {}})}


LAYOUT_FIXTURE = FIXTURE / "00078d0"
LAYOUT_CASES: list[Case] = [
    ("awkward", "bf16", 2, None),
    ("awkward", "fp16", 3, None),
    ("awkward", "fp32", 2, "offload_nvme"),
    ("awkward", "fp32", 3, "offload_param_cpu"),
    ("awkward", "fp32", 2, "powersgd"),
    ("awkward", "fp32", 0, "local_steps"),
    ("gpt", "fp32", 1, "tp2"),
    ("gpt", "fp32", 3, "tp2"),
    ("moe", "fp32", 2, None),
    ("pipeline", "fp32", 1, None),
]
"""The feature grid's cases whose checkpoints 00078d0 wrote (test_golden.feature_cases)."""
HALF = 2  # optimizer steps before the save, and after it
LAYOUT_WRITER = {"written_by": "00078d0"}


def _layout_batches() -> tuple[torch.Tensor, torch.Tensor]:
    return make_batches(2 * HALF, golden.MICRO * golden.ACCUM * golden.WORLD)


def _each_layout(start: Callable[[object, str], None]) -> dict:
    """Each case's engine through ``start(engine, name)`` (which brings it to step HALF), then
    trained HALF more steps: the losses and the final parameters' hash."""
    nvme, out = nvme_directory(), {}
    for case in LAYOUT_CASES:
        engine = build_engine(case, nvme)
        start(engine, case_name(*case))
        idx, tgt = _layout_batches()
        out[case_name(*case)] = {
            "losses": train_steps(engine, idx[HALF:], tgt[HALF:]),
            "params": state_hash(engine.consolidated_state_dict()),
        }
    if nvme is not None:
        shutil.rmtree(nvme, ignore_errors=True)
    return out


def _write_layouts(root: str) -> dict:
    """Each case trained HALF steps and saved, then trained on in the same process."""
    from zerotrain.comm import Communicator

    def train_and_save(engine, name: str) -> None:
        torch.manual_seed(100 + Communicator().rank)  # each rank draws its own dropout masks
        idx, tgt = _layout_batches()
        train_steps(engine, idx[:HALF], tgt[:HALF])
        engine.save_checkpoint(f"{root}/{name}", client_state=LAYOUT_WRITER)

    return _each_layout(train_and_save)


def _continue_layouts(root: str) -> dict:
    """Each case loaded from its checkpoint (which restores every rank's generator), then
    trained on."""

    def load(engine, name: str) -> None:
        path, client = engine.load_checkpoint(f"{root}/{name}")
        assert path is not None and client == LAYOUT_WRITER, (path, client)
        assert engine.global_steps == HALF

    return _each_layout(load)


def test_checkpoints_of_00078d0_resume_every_layout_bit_for_bit(tmp_path):
    records = json.loads((LAYOUT_FIXTURE / "continuation.json").read_text())["records"]
    held = records_to_hold(records)
    root = tmp_path / "old"
    shutil.copytree(LAYOUT_FIXTURE, root)
    got = agreed_cases(run_distributed(_continue_layouts, golden.WORLD, str(root), timeout=600))
    assert_one_matches(held, lambda record: moved_cases(got, record["cases"]))


def _build(layout: str):
    import zerotrain

    stage, precision = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(7)
    data = TensorDataset(
        torch.randint(0, VOCAB, (40, SEQ), generator=gen),
        torch.randint(0, VOCAB, (40, SEQ), generator=gen),
    )
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-2, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}},
        "gradient_clipping": 0.5,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 10**6,
        "seed": 11,
        **precision,
    }
    torch.manual_seed(0)
    model = DropoutModel()
    engine, *_ = zerotrain.initialize(
        model=model, model_parameters=param_groups(model, 0.1), training_data=data, config=config
    )
    return engine


def _train(engine, steps: int) -> list[str]:
    losses = []
    batches = iter(engine.training_dataloader)
    for _ in range(steps * ACCUM):
        idx, tgt = next(batches)
        loss = engine(idx, tgt)
        engine.backward(loss)
        engine.step()
        losses.append(float_bits(loss))
    return losses


def _continue(root: str) -> dict:
    out = {}
    for layout in LAYOUTS:
        engine = _build(layout)
        path, client = engine.load_checkpoint(f"{root}/{layout}")
        assert path is not None and client == {"written_by": "0.1.0"}, (path, client)
        assert engine.global_steps == K
        losses = _train(engine, K)
        params = state_hash(engine.consolidated_state_dict())
        out[layout] = {"losses": losses, "params": params, "loss_scale": engine.loss_scale}
    return out


def test_checkpoints_of_0_1_0_resume_bit_for_bit(tmp_path):
    held = records_to_hold(json.loads(CONTINUATION.read_text())["records"])
    root = tmp_path / "old"
    shutil.copytree(FIXTURE, root)  # loading must not need to write, but keep the fixture safe
    got = run_distributed(_continue, WORLD, str(root))
    assert_one_matches(held, lambda record: differences(got, record["layouts"]))


def differences(got: list[dict], want: dict) -> list[str]:
    """Where each rank's continuation differs from the recorded one."""
    return [
        f"rank {rank}, {layout}: {key}"
        for rank, per_layout in enumerate(got)
        for layout, record in want.items()
        for key in ("losses", "params", "loss_scale")
        if per_layout[layout][key] != (record[key][rank] if key == "losses" else record[key])
    ]


def continuation_record(per_rank: list[dict]) -> dict:
    """The record of one continuation per rank, for this platform."""
    layouts = {
        layout: {
            "losses": [r[layout]["losses"] for r in per_rank],
            "params": per_rank[0][layout]["params"],
            "loss_scale": per_rank[0][layout]["loss_scale"],
        }
        for layout in LAYOUTS
    }
    return platform_record(layouts=layouts)


def _write_fixture(root: str) -> dict:
    out = {}
    for layout in LAYOUTS:
        engine = _build(layout)
        _train(engine, K)
        engine.save_checkpoint(f"{root}/{layout}", client_state={"written_by": "0.1.0"})
        losses = _train(engine, K)
        params = state_hash(engine.consolidated_state_dict())
        out[layout] = {"losses": losses, "params": params, "loss_scale": engine.loss_scale}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description="Write the fixture, or record a platform's.")
    parser.add_argument(
        "--layouts",
        action="store_true",
        help="write the layouts' fixture (golden/checkpoints/00078d0) with the zerotrain first "
        "on PYTHONPATH, and what it computes after each save",
    )
    parser.add_argument(
        "--add-platform",
        metavar="TREE_0_1_0",
        help="a checkout of 850ac9f: record the continuation its zerotrain computes from the "
        "fixture on this platform (the fixture stays as it is)",
    )
    args = parser.parse_args()
    if args.layouts:
        shutil.rmtree(LAYOUT_FIXTURE, ignore_errors=True)
        cases = agreed_cases(run_distributed(_write_layouts, golden.WORLD, str(LAYOUT_FIXTURE)))
        record = platform_record(cases=cases, commit=zerotrain_commit())
        (LAYOUT_FIXTURE / "continuation.json").write_text(
            json.dumps({"records": [record]}, indent=1) + "\n"
        )
        print(f"wrote {len(cases)} checkpoints to {LAYOUT_FIXTURE}")
        return
    if args.add_platform is None:  # the 0.1.0 tree itself wrote the fixture this way
        shutil.rmtree(FIXTURE, ignore_errors=True)
        per_rank = run_distributed(_write_fixture, WORLD, str(FIXTURE))
        CONTINUATION.write_text(
            json.dumps({"records": [continuation_record(per_rank)]}, indent=1) + "\n"
        )
        print(f"wrote {FIXTURE}")
        return
    sys.path.insert(0, str(Path(args.add_platform).resolve()))  # the ranks import 0.1.0
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(FIXTURE, f"{tmp}/old")
        per_rank = run_distributed(_continue, WORLD, f"{tmp}/old")
    records = json.loads(CONTINUATION.read_text())["records"]
    kept = [r for r in records if r["platform"] != platform()]
    CONTINUATION.write_text(
        json.dumps({"records": [*kept, continuation_record(per_rank)]}, indent=1) + "\n"
    )
    print(f"recorded 0.1.0's continuation on {platform()} in {CONTINUATION}")


if __name__ == "__main__":
    main()
