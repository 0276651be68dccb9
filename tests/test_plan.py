"""The planner's parts (zerotrain/plan/): the machine probe and its cache, the trial that
measures a candidate config."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from zerotrain.plan import probe
from zerotrain.plan.jobs import JobError
from zerotrain.plan.trial import TrialSpec, run_trial

GPT_TINY = "examples/gpt/model.py:tiny"
GPT_DEMO = "examples/gpt/model.py:demo"


def test_the_probe_measures_this_machine_once_and_caches_it(tmp_path, monkeypatch):
    """Every rate is measured and positive, the links of each collective kind over 2 ranks are
    fitted, there is no copy bandwidth without a GPU; the second call is the cache's, a
    refresh measures again, and a cache that cannot be read is measured over."""
    monkeypatch.setenv("ZEROTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    phases = []
    machine = probe.probe_machine(
        dtype="fp32", world=2, nvme_path=str(tmp_path / "nvme"), progress=phases.append
    )
    assert machine.device == "cpu" and machine.copy_bytes_per_s is None  # no GPU here
    assert machine.device_memory == machine.host_memory > 0
    assert machine.matmul_flops > 1e8 and machine.attention_flops > 1e7
    assert set(machine.adam_elements_per_s) == {"1", str(machine.threads)}
    assert min(machine.adam_elements_per_s.values()) > 1e6
    assert machine.disk_write_bytes_per_s and machine.disk_read_bytes_per_s
    assert machine.disk_write_bytes_per_s > 1e6 and machine.disk_read_bytes_per_s > 1e6
    assert not list((tmp_path / "nvme").glob("*.swap"))  # its working file is gone
    assert set(machine.links) == set(probe.COLLECTIVES)
    for fit in machine.links.values():
        assert fit.alpha >= 0 and fit.beta > 0
    assert machine.world == 2 and machine.probe_seconds > 0
    assert phases == [
        "matmul and attention",
        "the CPU optimizer step",
        f"disk under {tmp_path / 'nvme'}",
        "links over 2 ranks",
    ]

    def measured_again(*args):
        raise AssertionError("measured again")

    monkeypatch.setattr(probe, "_measure", measured_again)
    assert probe.probe_machine(dtype="fp32", world=2, nvme_path=str(tmp_path / "nvme")) == machine
    with pytest.raises(AssertionError, match="measured again"):
        probe.probe_machine(dtype="fp32", world=2, nvme_path=str(tmp_path / "nvme"), refresh=True)
    (cached,) = (tmp_path / "cache" / "machine").glob("*.json")
    assert json.loads(cached.read_text())["key"] == machine.key
    cached.write_text("{not json")
    with pytest.raises(AssertionError, match="measured again"):
        probe.probe_machine(dtype="fp32", world=2, nvme_path=str(tmp_path / "nvme"))
    # another dtype or world is another machine entry
    assert probe._key("bf16", 1, 2, None) != probe._key("fp32", 1, 2, None)
    assert probe._key("fp32", 1, 1, None) != probe._key("fp32", 1, 2, None)


def _config(stage: int, micro: int = 4, accumulation: int = 1) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }


def test_a_trial_measures_the_engine_as_the_planner_predicts_it():
    """A trial of 2 ranks reports the engine's model-state bytes (the ZeRO formula's), a peak
    above them and a step time; activation checkpointing lowers the peak."""
    from zerotrain.cli.estimate import _build_on_meta
    from zerotrain.estimate import TrainingJob, count_parameters, estimate

    spec = TrialSpec(model=GPT_DEMO, config=_config(2), world=2, seq_len=128, vocab_size=256)
    plain = run_trial(spec)
    checkpointed = run_trial(replace(spec, activation_checkpointing=True))

    count = count_parameters(_build_on_meta(GPT_DEMO), persistence_threshold=0)
    job = TrainingJob(
        trainable_params=count.trainable,
        gpus_per_node=2,
        dtype="fp32",
        stages=(2,),
        max_live_numel=10**9,
    )
    (row,) = estimate(job)
    assert plain.model_state_bytes == pytest.approx(row.model_states, abs=64)  # padding
    assert checkpointed.model_state_bytes == plain.model_state_bytes
    assert plain.peak_memory_bytes > plain.model_state_bytes
    assert checkpointed.peak_memory_bytes < plain.peak_memory_bytes
    assert 0 < plain.step_time_s < 60


def test_a_failed_trial_says_why():
    config = _config(2)
    config["optimizer"] = {"type": "NoSuchOptimizer"}
    spec = TrialSpec(model=GPT_TINY, config=config, world=1, seq_len=64, vocab_size=256)
    with pytest.raises(JobError, match="NoSuchOptimizer"):
        run_trial(spec)
