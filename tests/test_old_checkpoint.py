"""Checkpoints written by an earlier zerotrain (kept under ``tests/golden/checkpoints``) load into
this one and training continues bit for bit as it did in the version that wrote them.

The fixture was made with ``.venv/bin/python tests/test_old_checkpoint.py`` at zerotrain 0.1.0
(commit ed7a439): K steps, save, K more steps whose losses and final parameters it records.
Never regenerate it to make the test pass: the point is that old files keep working.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from models import SEQ, VOCAB, DropoutModel, param_groups
from test_golden import float_bits, state_hash
from torch.utils.data import TensorDataset

FIXTURE = Path(__file__).parent / "golden" / "checkpoints"
WORLD, K, MICRO, ACCUM = 2, 2, 2, 2
LAYOUTS = {"stage2-bf16": (2, {"bf16": {"enabled": True}}), "stage3-fp16": (3, {"fp16": {}})}


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
    expected = json.loads((FIXTURE / "continuation.json").read_text())
    if expected["torch"] != torch.__version__:
        pytest.skip(f"the continuation was recorded with torch {expected['torch']}")
    root = tmp_path / "old"
    shutil.copytree(FIXTURE, root)  # loading must not need to write, but keep the fixture safe
    got = run_distributed(_continue, WORLD, str(root))
    for rank, per_layout in enumerate(got):
        for layout, want in expected["layouts"].items():
            assert per_layout[layout]["losses"] == want["losses"][rank], (rank, layout)
            assert per_layout[layout]["params"] == want["params"], (rank, layout)
            assert per_layout[layout]["loss_scale"] == want["loss_scale"], (rank, layout)


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


if __name__ == "__main__":
    shutil.rmtree(FIXTURE, ignore_errors=True)
    per_rank = run_distributed(_write_fixture, WORLD, str(FIXTURE))
    layouts = {
        layout: {
            "losses": [r[layout]["losses"] for r in per_rank],
            "params": per_rank[0][layout]["params"],
            "loss_scale": per_rank[0][layout]["loss_scale"],
        }
        for layout in LAYOUTS
    }
    record = {"torch": torch.__version__, "layouts": layouts}
    (FIXTURE / "continuation.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {FIXTURE}")
