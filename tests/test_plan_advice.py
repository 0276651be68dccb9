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
from distributed import run_distributed

import zerotrain
import zerotrain.utils.logging  # noqa: F401 (sets the logger up as a training script has it)
from zerotrain.accelerator import usable_cpus
from zerotrain.plan import probe

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt.model import tiny  # noqa: E402

MB = 10**6
HOST = 20 * MB


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


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def zerotrain_log():
    """The ``zerotrain`` logger's records (it does not propagate to pytest's own capture once
    zerotrain.utils.logging has set it up)."""
    log = logging.getLogger("zerotrain")
    handler, level = _Records(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    yield handler
    log.removeHandler(handler)
    log.setLevel(level)


def _warnings(zerotrain_log) -> list[str]:
    return [r.getMessage() for r in zerotrain_log.records if r.levelno == logging.WARNING]


def test_a_config_predicted_not_to_fit_is_named_with_the_plan_s_choice(
    tmp_path, monkeypatch, zerotrain_log
):
    # the tiny GPT at micro-batch 8 of 64 tokens is predicted at 19.7 MB on this probe (7 MB
    # of it the process's own): with 20 MB free (18 MB a rank may use) it does not fit, a
    # micro-batch of 1 does
    _cache_machine(monkeypatch, tmp_path, host=HOST)
    _train(_config(stage=0, micro=8), steps=2)
    (warning,) = _warnings(zerotrain_log)
    assert warning.startswith(
        "zerotrain: this config (stage 0, micro-batch 8 x 1) is predicted to need "
    ), warning
    assert "per rank at 64 tokens a sample, more than the 18.00 MB a rank may use here; " in warning
    assert "is predicted to fit" in warning and "`zerotrain plan` shows the table" in warning
    # a typed config (load_config's) is advised on alike
    from zerotrain.config import load_config

    zerotrain_log.records.clear()
    engine, *_ = zerotrain.initialize(
        model=tiny(), config=load_config(_config(stage=0, micro=8), world_size=1)
    )
    tokens = torch.randint(0, 256, (8, 65))
    engine(tokens[:, :-1], tokens[:, 1:])
    assert _warnings(zerotrain_log) == [warning]


def test_a_config_far_slower_than_the_plan_s_choice_is_named(tmp_path, monkeypatch, zerotrain_log):
    # a disk of 1 MB/s: NVMe's reads and writes of the optimizer state dominate the step
    nvme = str(tmp_path / "nvme")
    _cache_machine(monkeypatch, tmp_path, nvme_path=nvme, disk=1e6)
    config = _config(stage=2, offload={"device": "nvme", "nvme_path": nvme})
    _train(config, steps=1)
    (warning,) = _warnings(zerotrain_log)
    assert warning.startswith(
        "zerotrain: this config (stage 2, offload nvme, micro-batch 8 x 1) is predicted to take "
    ), warning
    assert "optimizer-bound" in warning and "compute-bound" in warning


def test_the_advice_is_silent_without_a_probe_and_training_is_the_same(
    tmp_path, monkeypatch, zerotrain_log
):
    monkeypatch.setenv("ZEROTRAIN_CACHE_DIR", str(tmp_path / "empty"))
    unadvised = _train(_config(stage=1), steps=3)
    assert not _warnings(zerotrain_log)
    assert any("no probe cached" in r.getMessage() for r in zerotrain_log.records)
    zerotrain_log.records.clear()
    _cache_machine(monkeypatch, tmp_path, host=HOST)  # now a warning, once
    advised = _train(_config(stage=1), steps=3)
    assert len(_warnings(zerotrain_log)) == 1  # the first forward only
    assert advised == unadvised  # bit for bit: the advice computes nothing of the model


def test_no_advice_where_the_planner_does_not_plan(tmp_path, monkeypatch, zerotrain_log):
    """An optimizer whose state the cost model does not price: no advice, not a wrong one."""
    _cache_machine(monkeypatch, tmp_path, host=HOST)
    config = _config(stage=1)
    config["optimizer"] = {"type": "SGD", "params": {"lr": 1e-3}}
    _train(config, steps=1)
    assert not _warnings(zerotrain_log)


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


# -- "auto" micro-batches ------------------------------------------------------------------------
def _auto_config(**keys):
    config = _config(stage=1)
    config.update({"train_micro_batch_size_per_gpu": "auto", "train_batch_size": 16, **keys})
    return config


def test_an_auto_micro_batch_is_the_largest_predicted_to_fit(tmp_path, monkeypatch, capsys):
    """The tiny GPT (block_size 64): 16 samples a step on one rank. With memory to spare the
    whole batch is one micro-batch; with 20 MB free a smaller one, the largest that fits; the
    choice is said once, and training takes it."""
    _cache_machine(monkeypatch, tmp_path)
    engine, *_ = zerotrain.initialize(model=tiny(), config=_auto_config())
    assert engine.train_micro_batch_size_per_gpu() == 16
    assert engine.gradient_accumulation_steps() == 1
    _cache_machine(monkeypatch, tmp_path / "small", host=HOST)
    engine, *_ = zerotrain.initialize(
        model=tiny(), config=_auto_config(gradient_accumulation_steps="auto")
    )
    micro = engine.train_micro_batch_size_per_gpu()
    assert micro < 16 and micro * engine.gradient_accumulation_steps() == 16
    lines = [line for line in capsys.readouterr().out.splitlines() if '"auto" ->' in line]
    assert lines[-1].startswith(
        f'zerotrain: train_micro_batch_size_per_gpu "auto" -> {micro} ({16 // micro} '
        "micro-batches a step on each of 1 rank(s)): the largest predicted to fit"
    ), lines
    assert "of the 18.00 MB a rank may use at 64 tokens a sample" in lines[-1]


def test_an_auto_micro_batch_takes_the_sequence_length_of_the_training_data():
    from zerotrain.plan.auto_batch import sequence_length

    model = tiny()
    assert sequence_length(model, None) == 64  # the model's block_size
    data = [torch.zeros(32, dtype=torch.long)] * 4
    assert sequence_length(model, data) == 32
    assert sequence_length(model, [{"input_ids": torch.zeros(20)}]) == 20
    assert sequence_length(model, [(torch.zeros(24), torch.zeros(24))]) == 24


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"train_batch_size": "auto"}, "needs train_batch_size (samples per optimizer step"),
        ({"train_batch_size": 15, "gradient_accumulation_steps": 4}, "does not divide"),
        ({"sequence_parallel_size": 2}, '"auto" is chosen for data parallelism only'),
        ({"autotuning": {"metric": "speed"}}, "autotuning.metric: must be one of"),
    ],
)
def test_an_auto_micro_batch_that_cannot_be_chosen_says_why(tmp_path, monkeypatch, keys, message):
    _cache_machine(monkeypatch, tmp_path)
    with pytest.raises(zerotrain.ConfigError, match=message.replace("(", r"\(")):
        zerotrain.initialize(model=tiny(), config=_auto_config(**keys))


def test_an_auto_micro_batch_that_fits_nowhere_names_the_smallest(tmp_path, monkeypatch):
    _cache_machine(monkeypatch, tmp_path, host=8 * MB)
    with pytest.raises(zerotrain.ConfigError) as error:
        zerotrain.initialize(model=tiny(), config=_auto_config())
    message = str(error.value)
    assert '"auto" finds no micro-batch that fits: even 1 is predicted to need' in message
    assert "more than the 7.20 MB a rank may use" in message


def test_an_auto_micro_batch_without_a_probe_uses_the_memory_there_is(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROTRAIN_CACHE_DIR", str(tmp_path / "empty"))
    monkeypatch.setattr(probe, "available_host_memory", lambda: HOST)
    engine, *_ = zerotrain.initialize(model=tiny(), config=_auto_config())
    assert engine.train_micro_batch_size_per_gpu() < 16


def choose_on_two_ranks(cache: str) -> tuple[int, int]:
    """Rank 0 has 20 MB free, rank 1 memory to spare: both take rank 0's choice."""
    patch = pytest.MonkeyPatch()
    rank = torch.distributed.get_rank()
    _cache_machine(patch, Path(cache) / str(rank), host=HOST if rank == 0 else 10_000 * MB)
    engine, *_ = zerotrain.initialize(model=tiny(), config=_auto_config(train_batch_size=32))
    return engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()


def test_every_rank_takes_rank_0_s_auto_micro_batch(tmp_path):
    first, second = run_distributed(choose_on_two_ranks, 2, str(tmp_path))
    assert first == second and first[0] < 16 and first[0] * first[1] == 16


def refuse_on_two_ranks(cache: str) -> str:
    patch = pytest.MonkeyPatch()
    _cache_machine(patch, Path(cache) / str(torch.distributed.get_rank()))
    try:
        zerotrain.initialize(model=tiny(), config=_auto_config(train_batch_size="auto"))
    except zerotrain.ConfigError as error:
        return str(error)
    return "chosen"


def test_every_rank_refuses_when_rank_0_cannot_choose(tmp_path):
    """Rank 0 raises its own error; the others say it was rank 0's (none waits for it)."""
    first, second = run_distributed(refuse_on_two_ranks, 2, str(tmp_path))
    assert '"auto" chooses how a rank\'s share of the global batch is split' in first
    assert second.startswith('rank 0 could not choose the "auto" micro-batch: ')
    assert first in second
