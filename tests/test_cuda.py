"""The CUDA paths (skipped without a GPU): one rank on one GPU, NCCL, every stage.

Run on a GPU machine with ``pytest tests/test_cuda.py``. Multi-rank NCCL needs one GPU per rank;
these tests use one, so they check the device placement of the engine, the optimizer state and
the checkpoint code (tensors written from and read back into GPU memory), not NCCL's collectives.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.models import DropoutModel, make_batches, param_groups

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _engine(stage: int, precision: str):
    import zerotrain

    torch.manual_seed(0)
    model = DropoutModel()
    engine, *_ = zerotrain.initialize(
        model=model,
        model_parameters=param_groups(model, 0.1),
        config={
            "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "fused": True}},
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "bf16": {"enabled": precision == "bf16"},
            "fp16": {"enabled": precision == "fp16", "initial_scale_power": 8},
            "steps_per_print": 10**6,
        },
    )
    return engine


def _train(engine, batches) -> list[float]:
    losses = []
    for idx, tgt in zip(*batches, strict=True):
        loss = engine(idx.to(engine.device), tgt.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _resume_on_gpu(root: str):
    """Per stage and precision: 4 steps straight vs 2, save, a new engine loads, 2 more."""
    out = {}
    idx, tgt = make_batches(4, 4, seed=3)
    for stage in (0, 1, 2, 3):
        for precision in ("fp32", "bf16", "fp16"):
            straight = _engine(stage, precision)
            assert straight.device.type == "cuda"
            first = _train(straight, (idx[:2], tgt[:2]))
            path = straight.save_checkpoint(f"{root}/{stage}-{precision}")
            rest = _train(straight, (idx[2:], tgt[2:]))
            resumed = _engine(stage, precision)
            resumed.load_checkpoint(f"{root}/{stage}-{precision}")
            again = _train(resumed, (idx[2:], tgt[2:]))
            a, b = straight.consolidated_state_dict(), resumed.consolidated_state_dict()
            out[stage, precision] = {
                "losses": (rest, again),
                "equal": all(torch.equal(a[k], b[k]) for k in a),
                "first": first,
                "path": str(path),
                "state_device": {
                    t.device.type
                    for s in resumed.optimizer.optimizer.state.values()
                    for t in s.values()
                    if torch.is_tensor(t) and t.dim() > 0
                },
            }
    return out


def test_checkpoint_resume_on_gpu_every_stage_and_precision(tmp_path):
    from zerotrain.checkpoint import load_consolidated

    results = run_distributed(_resume_on_gpu, 1, str(tmp_path))[0]
    for key, got in results.items():
        rest, again = got["losses"]
        assert rest == again and got["equal"], key  # dropout RNG on the GPU resumed too
        assert got["state_device"] == {"cuda"}, key
    plain = load_consolidated(DropoutModel(), results[3, "bf16"]["path"])
    assert all(p.device.type == "cpu" for p in plain.parameters())
