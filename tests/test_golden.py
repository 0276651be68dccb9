"""Golden losses: every rank's per-micro-step loss, as exact float bits, and a hash of every
parameter after training, compared bit for bit with files recorded before a change.

A change that claims to be numerically neutral (a refactor, a new strategy that is off by
default) keeps this test passing unchanged. A change that means to move numerics regenerates
the files with ``.venv/bin/python tests/test_golden.py`` and says why in its commit.

The bits depend on torch's CPU kernels, so the files record the torch version they were made
with; on another version the comparison is skipped with the reason (parity tests still run).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from models import AwkwardModel, DropoutModel, make_batches, param_groups, run_steps

GOLDEN = Path(__file__).parent / "golden" / "losses.json"
WORLD, STEPS, MICRO, ACCUM = 2, 3, 2, 2
MODELS = {"awkward": AwkwardModel, "dropout": DropoutModel}
PRECISIONS = {
    "fp32": {},
    "bf16": {"bf16": {"enabled": True}},
    "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8}},
}


def cases() -> list[tuple[str, str, int, bool]]:
    """(model, precision, stage, overlap_param_gather): both models x fp32/bf16 x stages 0-3,
    plus fp16 and the stages 1-2 parameter-gather overlap on the awkward model."""
    grid = [(m, p, s, False) for m in MODELS for p in ("fp32", "bf16") for s in range(4)]
    grid += [("awkward", "fp16", s, False) for s in (0, 2, 3)]
    grid += [("awkward", "fp32", s, True) for s in (1, 2)]
    return grid


def case_name(model: str, precision: str, stage: int, overlap: bool) -> str:
    return f"{model}-{precision}-stage{stage}" + ("-overlap_param_gather" if overlap else "")


def float_bits(value: torch.Tensor) -> str:
    """The loss as the hex of its fp32 bits (bf16 and fp16 convert to fp32 exactly)."""
    return f"{value.detach().float().view(torch.int32).item() & 0xFFFFFFFF:08x}"


def state_hash(state: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for key in sorted(state):
        digest.update(key.encode())
        digest.update(state[key].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def train_cases(grid):
    import os

    import zerotrain

    os.environ["ZEROTRAIN_DEBUG"] = "1"  # lifecycle checks on: they must not change a bit
    from zerotrain.comm import Communicator

    rank = Communicator().rank
    out = {}
    for model_name, precision, stage, overlap in grid:
        torch.manual_seed(0)
        model = MODELS[model_name]()
        zero = {
            "stage": stage,
            "reduce_bucket_size": 60,  # several buckets
            "stage3_param_persistence_threshold": 0,  # stage 3: shard every unit
        }
        if overlap:
            zero["overlap_param_gather"] = True
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": ACCUM,
            "gradient_clipping": 0.5,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-2, "eps": 1e-6}},
            "zero_optimization": zero,
            "steps_per_print": 10**6,
            **PRECISIONS[precision],
        }
        engine, *_ = zerotrain.initialize(
            model=model, model_parameters=param_groups(model, 0.1), config=config
        )
        torch.manual_seed(100 + rank)  # each rank draws its own dropout masks
        idx, tgt = make_batches(STEPS, MICRO * ACCUM * WORLD)
        losses = []

        def backward(loss, engine=engine, losses=losses):
            losses.append(float_bits(loss))
            engine.backward(loss)

        run_steps(engine, idx, tgt, MICRO, ACCUM, WORLD, rank, backward=backward)
        out[case_name(model_name, precision, stage, overlap)] = {
            "losses": losses,
            "params": state_hash(engine.consolidated_state_dict()),
        }
    return out


def measure() -> dict:
    """{case: {"losses": [per rank: [bits per micro-step]], "params": hash}}."""
    per_rank = run_distributed(train_cases, WORLD, cases(), timeout=600)
    out = {}
    for name in per_rank[0]:
        hashes = {r[name]["params"] for r in per_rank}
        assert len(hashes) == 1, f"{name}: ranks disagree on the trained parameters"
        out[name] = {"losses": [r[name]["losses"] for r in per_rank], "params": hashes.pop()}
    return out


def test_losses_and_parameters_match_golden_bits():
    golden = json.loads(GOLDEN.read_text())
    if golden["torch"] != torch.__version__:
        pytest.skip(f"golden bits were recorded with torch {golden['torch']}, not this version")
    got = measure()
    assert got.keys() == golden["cases"].keys()
    moved = [
        f"{name}: losses {'moved' if got[name]['losses'] != want['losses'] else 'same'}, "
        f"parameters {'moved' if got[name]['params'] != want['params'] else 'same'}"
        for name, want in golden["cases"].items()
        if got[name] != want
    ]
    assert not moved, "numerics changed:\n" + "\n".join(moved)


if __name__ == "__main__":
    GOLDEN.parent.mkdir(exist_ok=True)
    record = {"torch": torch.__version__, "world": WORLD, "cases": measure()}
    GOLDEN.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {len(record['cases'])} cases to {GOLDEN}")
