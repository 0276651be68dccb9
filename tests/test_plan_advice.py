"""``initialize``'s advice (zerotrain/plan/advice.py): one rank-0 warning in the first forward
when the config is predicted not to fit or to be far slower than the plan's choice, on this
machine's cached probe; silent without one, and training is the same either way."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch

import zerotrain
from zerotrain.accelerator import usable_cpus
from zerotrain.plan import probe

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt.model import tiny  # noqa: E402

MB = 10**6
HOST = 55 * MB


def _cache_machine(monkeypatch, tmp_path, *, nvme_path=None, disk=None, host=10_000 * MB):
    """A probe in the cache, with the rates given (no measuring: the advice reads the cache),
    and ``host`` bytes of memory free now."""
    monkeypatch.setenv("ZEROTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(probe, "available_host_memory", lambda: host)
    threads = max(1, usable_cpus())
    machine = probe.Machine(
        key=probe._key("fp32", threads, 1, nvme_path),
        device="cpu",
        device_memory=host,
        host_memory=host,
        dtype="fp32",
        threads=threads,
        matmul_flops=1e10,
        attention_flops=1e9,
        adam_elements_per_s={"1": 1e8, str(threads): 1e8},
        copy_bytes_per_s=None,
        disk_write_bytes_per_s=disk,
        disk_read_bytes_per_s=disk,
    )
    path = tmp_path / "cache" / "machine" / f"{machine.key}.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(machine.to_json()))


def _config(stage=0, micro=8, offload=None):
    zero: dict = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = offload
    return {
        "train_micro_batch_size_per_gpu": micro,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }


def _train(config, steps=2) -> list[float]:
    torch.manual_seed(0)
    engine, *_ = zerotrain.initialize(model=tiny(), config=config)
    tokens = torch.randint(0, 256, (config["train_micro_batch_size_per_gpu"], 65))
    losses = []
    for _ in range(steps):
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_config_predicted_not_to_fit_is_named_with_the_plan_s_choice(
    tmp_path, monkeypatch, caplog
):
    # the tiny GPT at micro-batch 8 of 64 tokens is predicted at 53.6 MB on this probe (40 MB
    # of it the process's own): with 55 MB free (49.5 MB a rank may use) it does not fit, a
    # micro-batch of 1 does
    _cache_machine(monkeypatch, tmp_path, host=HOST)
    with caplog.at_level(logging.INFO, logger="zerotrain"):
        _train(_config(stage=0, micro=8), steps=2)
    (warning,) = _warnings(caplog)
    assert warning.startswith(
        "zerotrain: this config (stage 0, micro-batch 8 x 1) is predicted to need "
    ), warning
    assert "per rank at 64 tokens a sample, more than the 49.50 MB a rank may use here; " in warning
    assert "is predicted to fit" in warning and "`zerotrain plan` shows the table" in warning


def test_a_config_far_slower_than_the_plan_s_choice_is_named(tmp_path, monkeypatch, caplog):
    # a disk of 1 MB/s: NVMe's reads and writes of the optimizer state dominate the step
    nvme = str(tmp_path / "nvme")
    _cache_machine(monkeypatch, tmp_path, nvme_path=nvme, disk=1e6)
    config = _config(stage=2, offload={"device": "nvme", "nvme_path": nvme})
    with caplog.at_level(logging.INFO, logger="zerotrain"):
        _train(config, steps=1)
    (warning,) = _warnings(caplog)
    assert warning.startswith(
        "zerotrain: this config (stage 2, offload nvme, micro-batch 8 x 1) is predicted to take "
    ), warning
    assert "optimizer-bound" in warning and "compute-bound" in warning


def test_the_advice_is_silent_without_a_probe_and_training_is_the_same(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("ZEROTRAIN_CACHE_DIR", str(tmp_path / "empty"))
    with caplog.at_level(logging.INFO, logger="zerotrain"):
        unadvised = _train(_config(stage=1), steps=3)
    assert not _warnings(caplog)
    assert any("no probe cached" in r.getMessage() for r in caplog.records)
    caplog.clear()
    _cache_machine(monkeypatch, tmp_path, host=HOST)  # now a warning, once
    with caplog.at_level(logging.INFO, logger="zerotrain"):
        advised = _train(_config(stage=1), steps=3)
    assert len(_warnings(caplog)) == 1  # the first forward only
    assert advised == unadvised  # bit for bit: the advice computes nothing of the model


def test_no_advice_where_the_planner_does_not_plan(tmp_path, monkeypatch, caplog):
    """An optimizer whose state the cost model does not price: no advice, not a wrong one."""
    _cache_machine(monkeypatch, tmp_path, host=HOST)
    config = _config(stage=1)
    config["optimizer"] = {"type": "SGD", "params": {"lr": 1e-3}}
    with caplog.at_level(logging.INFO, logger="zerotrain"):
        _train(config, steps=1)
    assert not _warnings(caplog)


@pytest.mark.parametrize(
    ("args", "kwargs", "expected"),
    [
        ((torch.zeros(2, 7, dtype=torch.long),), {}, 7),
        ((), {"input_ids": torch.zeros(3, 5, dtype=torch.long)}, 5),
        ((torch.zeros(2, 7),), {}, None),  # floats: no token ids
    ],
)
def test_the_sequence_length_is_read_from_the_token_ids(args, kwargs, expected):
    from zerotrain.plan.advice import _sequence_length

    assert _sequence_length(args, kwargs) == expected
