"""Per-rank model-state bytes, measured from the allocated tensors, follow the ZeRO formula."""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from torch import nn

PRECISIONS = {"fp32": {}, "bf16": {"bf16": {"enabled": True}}}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(193, 257), nn.Tanh(), nn.Linear(257, 193), nn.Linear(193, 3))


def measure(stages, precisions):
    import zerotrain

    out = {}
    for precision in precisions:
        for stage in stages:
            model = _model()
            config = {
                "train_micro_batch_size_per_gpu": 2,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "zero_optimization": {
                    "stage": stage,
                    "reduce_bucket_size": 40_000,
                    "stage3_param_persistence_threshold": 0,
                },
                "steps_per_print": 10**6,
                **PRECISIONS[precision],
            }
            engine, *_ = zerotrain.initialize(model=model, config=config)
            dtype = next(model.parameters()).dtype
            engine.backward(engine(torch.randn(2, 193, dtype=dtype)).float().square().mean())
            engine.step()  # optimizer state exists only after the first step
            out[(precision, stage)] = engine.memory_breakdown()
    return out


def formula(precision: str, stage: int, psi: int, n: int) -> dict[str, float]:
    """ZeRO (arXiv:1910.02054) §5, written out independently of the engine's own figure."""
    if precision == "bf16":  # 2-byte params and grads; fp32 master (4) + Adam m, v (8)
        p, g, o = 2 * psi, 2 * psi, 12 * psi
    else:  # fp32: the master weights are the parameters themselves
        p, g, o = 4 * psi, 4 * psi, 8 * psi
    return {
        "parameters": p / n if stage >= 3 else p,
        "gradients": g / n if stage >= 2 else g,
        "optimizer_states": o / n if stage >= 1 else o,
    }


@pytest.mark.parametrize("world", [1, 2, 4])
def test_model_state_bytes_match_zero_formula(world):
    psi = sum(p.numel() for p in _model().parameters())
    results = run_distributed(measure, world, [0, 1, 2, 3], list(PRECISIONS))
    for rank_result in results:
        for (precision, stage), got in rank_result.items():
            want = formula(precision, stage, psi, world)
            for key, value in want.items():
                assert abs(got[key] - value) / value < 0.05, (precision, stage, key, got, want)
            total = sum(want.values())
            assert abs(got["total"] - total) / total < 0.05
            assert abs(got["formula_total"] - total) / total < 1e-9
    if world > 1:  # the point of ZeRO: stage 2 holds far less than stage 0
        by_key = results[0]
        assert by_key[("bf16", 2)]["total"] < 0.6 * by_key[("bf16", 0)]["total"]
        assert by_key[("bf16", 3)]["total"] < by_key[("bf16", 2)]["total"]
