"""Monitors: TensorBoard and CSV read back after a 2-rank run, wandb through a fake module,
missing packages, and nothing lost when a script ends without closing the engine."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from models import AwkwardModel, make_batches
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_metrics import ACCUM, MICRO, train_steps

import zerotrain
from zerotrain.comm import Communicator

REPO = Path(__file__).resolve().parents[1]
STEPS = 5
SCALARS = {
    "Train/loss",
    "Train/lr",
    "Train/grad_norm",
    "Train/loss_scale",
    "Train/samples_per_second",
    "Train/tokens_per_second",
    "Train/tflops_per_rank",
    "Train/memory_rss_gb",
    "Train/memory_peak_rss_gb",
}


def monitored_config(out_dir: str, **extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 4, "warmup_type": "linear"},
        },
        "steps_per_print": 3,  # flushed at step 3; steps 4-5 only by destroy()
        "tensorboard": {"enabled": True, "output_path": out_dir, "job_name": "tb"},
        "csv_monitor": {"enabled": True, "output_path": out_dir, "job_name": "csv"},
        **extra,
    }


def _monitored_run(tmp: str):
    comm = Communicator()
    out_dir = Path(tmp) / f"rank{comm.rank}"
    torch.manual_seed(0)
    engine, *_ = zerotrain.initialize(model=AwkwardModel(), config=monitored_config(str(out_dir)))
    lrs, norms, rows_at_print = [], [], []

    def after_step(step):
        norms.append(engine.get_global_grad_norm())
        if step + 1 == 3 and comm.rank == 0:  # a print step flushes: readable during training
            rows_at_print.extend((out_dir / "csv" / "Train_loss.csv").read_text().splitlines())

    # the rate each step's update uses
    losses = train_steps(engine, STEPS, lambda step: lrs.append(engine.get_lr()[0]), after_step)
    engine.destroy()
    files = (
        sorted(str(p.relative_to(out_dir)) for p in out_dir.rglob("*")) if out_dir.exists() else []
    )
    return {"losses": losses, "lrs": lrs, "norms": norms, "files": files, "rows": rows_at_print}


def test_tensorboard_and_csv_hold_every_step_written_by_rank_0_only(tmp_path):
    rank0, rank1 = run_distributed(_monitored_run, 2, str(tmp_path))
    per_step = ACCUM * 2
    # the mean over the step's micro-steps on both ranks
    losses = [sum(a + b) / per_step for a, b in zip(rank0["losses"], rank1["losses"], strict=True)]
    steps = list(range(1, STEPS + 1))
    assert rank1["files"] == []  # rank 1 creates no directory and no file
    assert len(set(rank0["lrs"])) > 2  # the warm-up moves the rate

    events = EventAccumulator(str(tmp_path / "rank0" / "tb"))
    events.Reload()
    assert SCALARS <= set(events.Tags()["scalars"]), events.Tags()
    # event files hold float32
    for tag, expected in (
        ("Train/loss", losses),
        ("Train/lr", rank0["lrs"]),
        ("Train/grad_norm", rank0["norms"]),
        ("Train/loss_scale", [1.0] * STEPS),
    ):
        scalars = events.Scalars(tag)
        assert [s.step for s in scalars] == steps, tag
        assert [s.value for s in scalars] == pytest.approx(expected, rel=1e-6), tag
    assert all(s.value > 0 for s in events.Scalars("Train/tokens_per_second"))

    assert [row.split(",")[0] for row in rank0["rows"]] == ["step", "1", "2", "3"]
    csv_dir = tmp_path / "rank0" / "csv"
    assert {p.name for p in csv_dir.iterdir()} == {
        name.replace("/", "_") + ".csv" for name in SCALARS
    }
    for name, expected in (("loss", losses), ("lr", rank0["lrs"]), ("grad_norm", rank0["norms"])):
        with open(csv_dir / f"Train_{name}.csv", newline="") as handle:
            rows = list(csv.reader(handle))
        assert rows[0] == ["step", name]
        assert [int(r[0]) for r in rows[1:]] == steps
        assert [float(r[1]) for r in rows[1:]] == pytest.approx(expected, rel=1e-12), name


def test_monitors_are_closed_when_a_script_ends_without_destroy(tmp_path):
    # steps_per_print 10**6: no flush during training. A fake wandb whose finish() writes what
    # it was given shows that the monitors are closed at exit although the engine is still
    # referenced (a module global) and destroy() was never called.
    marker = tmp_path / "finished.txt"
    script = textwrap.dedent(
        f"""
        import sys, types
        sys.path.insert(0, {str(REPO / "tests")!r})
        from models import AwkwardModel, make_batches
        import zerotrain

        logged = []
        wandb = types.ModuleType("wandb")
        wandb.init = lambda **kwargs: types.SimpleNamespace(finish=wandb.finish)
        wandb.log = lambda data, step=None: logged.append(step)
        wandb.finish = lambda: open({str(marker)!r}, "w").write(repr(logged))
        sys.modules["wandb"] = wandb
        config = {{
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {{"type": "SGD", "params": {{"lr": 0.1}}}},
            "steps_per_print": 10**6,
            "wandb": {{"enabled": True}},
            "csv_monitor": {{"enabled": True, "output_path": {str(tmp_path)!r}}},
        }}
        engine, *_ = zerotrain.initialize(model=AwkwardModel(), config=config)
        idx, tgt = make_batches(3, 2)
        for step in range(3):
            engine.backward(engine(idx[step], tgt[step]))
            engine.step()
        """
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=120)
    assert marker.read_text() == "[1, 2, 3]"
    job = tmp_path / "DeepSpeedJobName"  # DeepSpeed's default job_name
    rows = (job / "Train_loss.csv").read_text().splitlines()
    assert rows[0] == "step,loss" and [r.split(",")[0] for r in rows[1:]] == ["1", "2", "3"]


class FakeWandb(types.ModuleType):
    """Records what zerotrain asks of wandb."""

    def __init__(self):
        super().__init__("wandb")
        self.inits, self.logged, self.finished = [], [], 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return types.SimpleNamespace(finish=self.finish)

    def log(self, data, step=None):
        self.logged.append((step, data))

    def finish(self):
        self.finished += 1


def test_wandb_gets_init_args_and_one_dict_per_step(monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    torch.manual_seed(0)
    engine, *_ = zerotrain.initialize(
        model=AwkwardModel(),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "steps_per_print": 10**6,
            "wandb": {"enabled": True, "project": "p", "group": "g", "team": "t"},
        },
    )
    assert fake.inits == [{"project": "p", "group": "g", "entity": "t"}]
    idx, tgt = make_batches(2, 2)
    losses = []
    for step in range(2):
        loss = engine(idx[step], tgt[step])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert [step for step, _ in fake.logged] == [1, 2]
    assert all(SCALARS <= data.keys() for _, data in fake.logged)
    assert [data["Train/loss"] for _, data in fake.logged] == pytest.approx(losses, rel=1e-12)
    assert [data["Train/lr"] for _, data in fake.logged] == [0.1, 0.1]
    engine.destroy()
    engine.destroy()  # closes once
    assert fake.finished == 1


def test_missing_monitor_packages_name_the_pip_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "tensorboard": {"enabled": True},
        "wandb": {"enabled": True},
    }
    with pytest.raises(zerotrain.ConfigError) as error:
        zerotrain.initialize(model=AwkwardModel(), config=config)
    assert str(error.value).splitlines() == [
        "tensorboard.enabled: the `tensorboard` package is not installed; "
        "`pip install tensorboard`, or set tensorboard.enabled to false",
        "wandb.enabled: the `wandb` package is not installed; `pip install wandb`, or set "
        "wandb.enabled to false",
    ]
    # disabled sections need nothing
    config.update(tensorboard={"enabled": False}, wandb={"enabled": False})
    engine, *_ = zerotrain.initialize(model=AwkwardModel(), config=config)
    assert not engine.monitor.enabled and engine.monitor.backends == []
