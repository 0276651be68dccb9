"""Lightning Fabric and the Lightning Trainer on zerotrain's native strategies
(zerotrain/integrations/lightning/).

2 gloo ranks; the awkward model of the parity tests at stage 1, a tiny HF GPT-2 from a config
at stages 2 and 3: Fabric's training loop and the Trainer's fit (accumulation 2, clipping on)
must equal zerotrain called directly on the same batches, parameters bit for bit; checkpoints
resume exactly; validation runs; the registered names resolve; bf16-mixed becomes zerotrain's
bf16; a ZeRO-3 checkpoint exports a plain model.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from models import AwkwardModel, make_batches

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None
    or importlib.util.find_spec("transformers") is None,
    reason="needs lightning and transformers",
)

MICRO, ACCUM, STEPS = 2, 2, 4
CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": ACCUM,
    "gradient_clipping": 0.05,  # active: the global norm is above it
    "zero_optimization": {"stage3_param_persistence_threshold": 0},
    "steps_per_print": 10**6,
}


RUNS = [("awkward", 1), ("gpt2", 2), ("gpt2", 3)]  # (model, stage)


class GPT2Loss(torch.nn.Module):
    """A tiny HF GPT-2 called as the awkward model is: ``(idx, targets) -> loss``."""

    def __init__(self):
        super().__init__()
        from models import tiny_hf_gpt2

        self.gpt2 = tiny_hf_gpt2()
        for module in self.gpt2.modules():  # the runs compared would draw different masks
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0

    def forward(self, idx, targets):
        return self.gpt2(input_ids=idx, labels=targets).loss


def _model_and_optimizer(kind: str = "awkward"):
    torch.manual_seed(0)
    model = AwkwardModel() if kind == "awkward" else GPT2Loss()
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
    from zerotrain.integrations.lightning.fabric import ZeroTrainStrategy

    out = {}
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    for kind, stage in RUNS:
        fabric = _fabric(ZeroTrainStrategy(CONFIG, stage=stage))
        model, optimizer = fabric.setup(*_model_and_optimizer(kind))
        losses = _train(model, optimizer, fabric.backward, _batches(rank, world))
        engine = fabric.strategy.model
        direct = _direct(stage, kind)
        direct_losses = _train(direct, direct, direct.backward, _batches(rank, world))
        mine, theirs = engine.consolidated_state_dict(), direct.consolidated_state_dict()
        out[stage] = {
            "losses": losses,
            "direct_losses": direct_losses,
            "equal": all(torch.equal(mine[k], theirs[k]) for k in mine),
            "stage": engine.zero_optimization_stage(),
        }
    return out


def _direct(stage: int, kind: str):
    import zerotrain

    model, optimizer = _model_and_optimizer(kind)
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
    import zerotrain.integrations.lightning  # noqa: F401 (registers the strategy names)

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    batches = list(_batches(rank, world))
    half = len(batches) // 2

    def fresh(strategy: str, precision: str = "32-true"):
        from zerotrain.integrations.lightning.fabric import ZeroTrainStrategy

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


def _lightning_module(batches_seen: list, kind: str):
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net, self.optimizer = _model_and_optimizer(kind)

        def forward(self, idx, tgt):
            return self.net(idx, tgt)

        def training_step(self, batch, batch_index):
            batches_seen.append((batch[0].clone(), batch[1].clone()))
            loss = self(*batch)
            self.losses.append(loss.item())
            return loss

        def validation_step(self, batch, batch_index):
            loss = self(*batch)
            self.log("val_loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return self.optimizer

    module = Module()
    module.losses = []
    return module


def _loader(rank: int, world: int):
    """This rank's micro-batches (the Trainer's sampler is replaced: the order is the test's)."""
    batches = list(_batches(rank, world))
    data = [(i, t) for idx, tgt in batches for i, t in zip(idx, tgt, strict=True)]
    return torch.utils.data.DataLoader(data, batch_size=MICRO, shuffle=False)


def _trainer(stage: int, root: str, max_steps: int, monitor: str | None = None):
    import lightning.pytorch as pl

    from zerotrain.integrations.lightning.trainer import ZeroTrainStrategy

    config: dict = {"steps_per_print": 10**6}
    if monitor is not None:  # the engine's reported loss per step, read by the test
        config["csv_monitor"] = {"enabled": True, "output_path": root, "job_name": monitor}
    return pl.Trainer(
        strategy=ZeroTrainStrategy(stage=stage, config=config),
        accelerator="cpu",
        devices=2,
        max_steps=max_steps,
        accumulate_grad_batches=ACCUM,
        gradient_clip_val=CONFIG["gradient_clipping"],
        use_distributed_sampler=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=root,
        num_sanity_val_steps=0,
    )


def trainer_versus_direct(root: str) -> dict:
    from zerotrain.engine import ZeroTrainEngine

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out = {}
    for kind, stage in RUNS:
        seen: list = []
        module = _lightning_module(seen, kind)
        trainer = _trainer(stage, root, STEPS, monitor=f"stage{stage}")
        trainer.fit(module, train_dataloaders=_loader(rank, world))
        engine = trainer.model
        direct = _direct(stage, kind)
        direct_losses = _train(direct, direct, direct.backward, seen)
        mine, theirs = engine.consolidated_state_dict(), direct.consolidated_state_dict()
        validated = trainer.validate(module, dataloaders=_loader(rank, world), verbose=False)
        # a checkpoint after 2 of the 4 steps, restored by fit(ckpt_path=...) in a new Trainer
        # (which then has no step left to take); both engines then go on by hand over the last
        # batches: the restored one (model, optimizer state, step count) as the original
        half = _trainer(stage, root, STEPS // 2)
        half.fit(_lightning_module([], kind), train_dataloaders=_loader(rank, world))
        half.save_checkpoint(f"{root}/half-{stage}")
        resumed = _lightning_module([], kind)
        again = _trainer(stage, root, STEPS // 2)
        again.fit(resumed, train_dataloaders=_loader(rank, world), ckpt_path=f"{root}/half-{stage}")
        rest = seen[STEPS // 2 * ACCUM :]
        original_tail = _train(half.model, half.model, half.model.backward, rest)
        resumed_tail = _train(again.model, again.model, again.model.backward, rest)
        after = again.model.consolidated_state_dict()
        out[stage] = {
            "engine": isinstance(engine, ZeroTrainEngine),
            "stage": engine.zero_optimization_stage(),
            "losses": module.losses,
            "direct_losses": direct_losses,
            "equal": all(torch.equal(mine["net." + k], v) for k, v in theirs.items()),
            "val_loss": validated[0]["val_loss"],
            "steps_after_restore": len(resumed.losses),
            "original_tail": original_tail,
            "resumed_tail": resumed_tail,
            "resumed_equal": all(torch.equal(after[k], mine[k]) for k in mine),
            "global_step": again.global_step,
        }
    return out


def _reported_losses(root: Path, job: str) -> list[float]:
    rows = (root / job / "Train_loss.csv").read_text().splitlines()[1:]
    return [float(row.split(",")[1]) for row in rows]


def test_lightning_trainer_trains_as_zerotrain_called_directly(tmp_path):
    ranks = run_distributed(trainer_versus_direct, 2, str(tmp_path), timeout=400)
    for stage in ranks[0]:
        # the engine reports the loss training_step returned, averaged over the step's
        # micro-batches and ranks, although Lightning hands backward that loss / ACCUM
        user = [
            sum(r[stage]["losses"][s * ACCUM + i] for r in ranks for i in range(ACCUM))
            / (ACCUM * len(ranks))
            for s in range(STEPS)
        ]
        assert _reported_losses(tmp_path, f"stage{stage}") == pytest.approx(user, rel=1e-6)
    for rank in ranks:
        for stage, got in rank.items():
            assert got["engine"] and got["stage"] == stage
            assert len(got["losses"]) == STEPS * ACCUM
            assert got["losses"] == got["direct_losses"], stage
            assert got["equal"], stage
            assert got["val_loss"] > 0
            assert got["steps_after_restore"] == 0 and got["global_step"] == STEPS // 2
            assert got["resumed_tail"] == got["original_tail"], stage
            assert got["resumed_tail"] == got["losses"][STEPS * ACCUM // 2 :], stage
            assert got["resumed_equal"], stage


def _gpt2_module():
    import lightning.pytorch as pl
    from models import tiny_hf_gpt2

    class GPT(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = tiny_hf_gpt2()

        def training_step(self, ids, batch_index):
            return self.net(input_ids=ids, labels=ids).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return GPT()


def gpt2_trainer_export(root: str) -> dict:
    import lightning.pytorch as pl

    import zerotrain.integrations.lightning  # noqa: F401 (registers the strategy names)
    from zerotrain.checkpoint import load_consolidated

    tokens = [
        torch.randint(0, 101, (16,), generator=torch.Generator().manual_seed(i)) for i in range(8)
    ]
    trainer = pl.Trainer(
        strategy="zerotrain_stage_3",
        accelerator="cpu",
        devices=2,
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(_gpt2_module(), torch.utils.data.DataLoader(tokens, batch_size=2))
    trained = trainer.model.consolidated_state_dict()
    trainer.save_checkpoint(f"{root}/gpt2")
    plain = load_consolidated(_gpt2_module(), f"{root}/gpt2")  # no process group needed
    exported = plain.state_dict()
    return {
        "stage": trainer.model.zero_optimization_stage(),
        "equal": all(torch.equal(exported[k], v) for k, v in trained.items()),
        "moved": any(
            not torch.equal(v, _gpt2_module().state_dict()[k]) for k, v in trained.items()
        ),
    }


def test_lightning_trainer_gpt2_at_zero3_exports_a_plain_model(tmp_path):
    for got in run_distributed(gpt2_trainer_export, 2, str(tmp_path), timeout=300):
        assert got["stage"] == 3 and got["moved"] and got["equal"]


def test_both_strategies_wait_zerotrain_s_timeout_for_a_stalled_rank(monkeypatch):
    from datetime import timedelta

    from zerotrain.comm import DEFAULT_TIMEOUT
    from zerotrain.integrations.lightning.fabric import ZeroTrainStrategy as FabricStrategy
    from zerotrain.integrations.lightning.trainer import ZeroTrainStrategy as TrainerStrategy

    for strategy in (FabricStrategy, TrainerStrategy):
        assert strategy(stage=1)._timeout == DEFAULT_TIMEOUT < timedelta(minutes=30)
        assert strategy(stage=1, timeout=timedelta(hours=2))._timeout == timedelta(hours=2)
    monkeypatch.setenv("ZEROTRAIN_TIMEOUT", "0.1")
    assert FabricStrategy(stage=1)._timeout == timedelta(seconds=6)


STALLED_SCRIPT = """
import os, time, torch
from lightning.fabric import Fabric
from zerotrain.integrations.lightning.fabric import ZeroTrainStrategy

fabric = Fabric(accelerator="cpu", devices=2, strategy=ZeroTrainStrategy(stage=2))
fabric.launch()
torch.manual_seed(0)
model = torch.nn.Linear(8, 8)
model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters()))
if fabric.global_rank == 1:
    time.sleep(120)  # stalls: never joins the gradient reduction
loss = model(torch.ones(2, 8)).sum()
fabric.backward(loss)
"""


@pytest.mark.slow
def test_a_stalled_rank_under_fabric_fails_the_others_after_zerotrain_s_timeout(tmp_path):
    import os
    import subprocess
    import sys
    import time

    script = tmp_path / "stalled.py"
    script.write_text(STALLED_SCRIPT)
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(repo), ZEROTRAIN_TIMEOUT="0.1")  # 6 seconds
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "zerotrain.cli", "run", "--nproc-per-node", "2", str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=110,  # Lightning's own 30 minutes would end it here
    )
    assert run.returncode != 0 and time.monotonic() - started < 100
    assert "rank 0" in run.stderr and "timed out" in run.stderr.lower(), run.stderr[-3000:]
