"""Lightning Fabric on zerotrain's native strategy (zerotrain/integrations/lightning.py).

2 gloo ranks, the awkward model of the parity tests: Fabric's training loop at stages 1-3 (by
registered name, accumulation 2, clipping on) must equal zerotrain called directly on the same
batches, parameters bit for bit; a Fabric checkpoint resumes exactly; bf16-mixed becomes
zerotrain's bf16.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from distributed import run_distributed
from models import AwkwardModel, make_batches

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None, reason="needs lightning"
)

MICRO, ACCUM, STEPS = 2, 2, 4
CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": ACCUM,
    "gradient_clipping": 0.05,  # active: the global norm is above it
    "zero_optimization": {"stage3_param_persistence_threshold": 0},
    "steps_per_print": 10**6,
}


def _model_and_optimizer():
    torch.manual_seed(0)
    model = AwkwardModel()
    params = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(params, lr=1e-2)


def _fabric(strategy, precision: str = "32-true"):
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, precision=precision)
    fabric.launch()  # torchrun-style environment: the processes exist already
    return fabric


def _batches(rank: int, world: int):
    idx, tgt = make_batches(STEPS, MICRO * ACCUM * world)
    for step in range(STEPS):
        for micro in range(ACCUM):
            chunk = (micro * world + rank) * MICRO
            yield idx[step][chunk : chunk + MICRO], tgt[step][chunk : chunk + MICRO]


def _train(model, optimizer, backward, batches) -> list[float]:
    losses = []
    for idx, tgt in batches:
        loss = model(idx, tgt)
        backward(loss)
        optimizer.step()  # every micro-step: the engine counts them against ACCUM
        losses.append(loss.item())
    return losses


def fabric_versus_direct(root: str) -> dict:
    from zerotrain.integrations.lightning import ZeroTrainStrategy

    out = {}
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    for stage in (1, 2, 3):
        fabric = _fabric(ZeroTrainStrategy(CONFIG, stage=stage))
        model, optimizer = fabric.setup(*_model_and_optimizer())
        losses = _train(model, optimizer, fabric.backward, _batches(rank, world))
        engine = fabric.strategy.model
        direct = _direct(stage)
        direct_losses = _train(direct, direct, direct.backward, _batches(rank, world))
        mine, theirs = engine.consolidated_state_dict(), direct.consolidated_state_dict()
        out[stage] = {
            "losses": losses,
            "direct_losses": direct_losses,
            "equal": all(torch.equal(mine[k], theirs[k]) for k in mine),
            "stage": engine.zero_optimization_stage(),
        }
    return out


def _direct(stage: int):
    import zerotrain

    model, optimizer = _model_and_optimizer()
    zero = {**CONFIG["zero_optimization"], "stage": stage}
    engine, *_ = zerotrain.initialize(
        model=model, optimizer=optimizer, config={**CONFIG, "zero_optimization": zero}
    )
    return engine


def test_fabric_trains_as_zerotrain_called_directly(tmp_path):
    for rank in run_distributed(fabric_versus_direct, 2, str(tmp_path), timeout=300):
        for stage, got in rank.items():
            assert got["stage"] == stage
            assert len(got["losses"]) == STEPS * ACCUM
            assert got["losses"] == got["direct_losses"], stage
            assert got["equal"], stage


def fabric_checkpoint_and_names(root: str) -> dict:
    import zerotrain.integrations.lightning  # noqa: F401

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    batches = list(_batches(rank, world))
    half = len(batches) // 2

    def fresh(strategy: str, precision: str = "32-true"):
        from zerotrain.integrations.lightning import ZeroTrainStrategy

        fabric = _fabric(strategy, precision)
        assert isinstance(fabric.strategy, ZeroTrainStrategy)
        fabric.strategy.config.update({k: v for k, v in CONFIG.items() if k != "zero_optimization"})
        model, optimizer = fabric.setup(*_model_and_optimizer())
        return fabric, model, optimizer

    fabric, model, optimizer = fresh("zerotrain_stage_3")
    straight = _train(model, optimizer, fabric.backward, batches)
    want = fabric.strategy.model.consolidated_state_dict()
    fabric, model, optimizer = fresh("zerotrain_stage_3")
    _train(model, optimizer, fabric.backward, batches[:half])
    fabric.save(f"{root}/ckpt", {"model": model, "optimizer": optimizer, "step": half})
    fabric, model, optimizer = fresh("zerotrain_stage_3")
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(f"{root}/ckpt", state)
    resumed = _train(model, optimizer, fabric.backward, batches[state["step"] :])
    got = fabric.strategy.model.consolidated_state_dict()
    fabric, model, optimizer = fresh("zerotrain_stage_2_offload", precision="bf16-mixed")
    engine = fabric.strategy.model
    return {
        "resumed": resumed,
        "straight": straight[half:],
        "step": state["step"],
        "equal": all(torch.equal(want[k], got[k]) for k in want),
        "bf16": engine.bfloat16_enabled(),
        "offload": engine.zero_offload_optimizer() is not None,
        "stage": engine.zero_optimization_stage(),
    }


def test_fabric_checkpoint_resumes_exactly_and_names_resolve(tmp_path):
    for got in run_distributed(fabric_checkpoint_and_names, 2, str(tmp_path), timeout=300):
        assert got["step"] == STEPS * ACCUM // 2
        assert got["resumed"] == got["straight"]
        assert got["equal"]
        assert got["bf16"] and got["offload"] and got["stage"] == 2
