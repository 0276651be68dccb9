"""The planner's parts (zerotrain/plan/): the machine probe and its cache, the trial that
measures a candidate config."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from distributed import run_distributed

from zerotrain.plan import probe
from zerotrain.plan.jobs import JobError
from zerotrain.plan_trial import TrialSpec, measure_memory, run_trial

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt.model import tiny  # noqa: E402

GPT_TINY = "examples/gpt/model.py:tiny"
GPT_DEMO = "examples/gpt/model.py:demo"


def test_the_probe_measures_this_machine_once_and_caches_it(tmp_path, monkeypatch):
    """Every rate is measured and positive, the links of each collective kind over 2 ranks (and
    of an all-reduce after compute) are fitted, there is no copy bandwidth without a GPU; the
    second call is the cache's, a refresh measures again, and a cache that cannot be read is
    measured over."""
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
    assert machine.adam_streaming_elements_per_s and machine.adam_streaming_elements_per_s > 1e6
    assert machine.disk_write_bytes_per_s and machine.disk_read_bytes_per_s
    assert machine.disk_write_bytes_per_s > 1e6 and machine.disk_read_bytes_per_s > 1e6
    assert not list((tmp_path / "nvme").glob("*.swap"))  # its working file is gone
    assert set(machine.links) == set(probe.COLLECTIVES)
    assert machine.interleaved is not None  # an all-reduce after compute
    for fit in [*machine.links.values(), machine.interleaved]:
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


def _raise(what: str, why: str):
    raise AssertionError(f"{what}: {why}")


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
    above them and a step time; a pipeline's trial (the tiny GPT cut in 2, as the planner
    cuts it) the largest stage's model states, as the cost model predicts them."""
    from zerotrain.estimate import TrainingJob, count_parameters, estimate
    from zerotrain.estimate.factory import build_on_meta, load_factory
    from zerotrain.plan.candidates import Candidate
    from zerotrain.plan.cost import Corrections, predict
    from zerotrain.plan.planner import model_facts, with_profiles

    spec = TrialSpec(model=GPT_DEMO, config=_config(2), world=2, seq_len=128, vocab_size=256)
    # the memory job alone (the verify test below runs the timed one too, through the CLI)
    plain = measure_memory(spec)
    count = count_parameters(build_on_meta(GPT_DEMO), persistence_threshold=0)
    job = TrainingJob(
        trainable_params=count.trainable,
        gpus_per_node=2,
        dtype="fp32",
        stages=(2,),
        max_live_numel=10**9,
    )
    (row,) = estimate(job)
    assert plain.model_state_bytes == pytest.approx(row.model_states, abs=64)  # padding
    assert plain.peak_memory_bytes > plain.model_state_bytes
    assert 0 < plain.step_time_s < 60

    machine = probe.memory_only_machine(dtype="fp32", world=2)
    facts = model_facts(build_on_meta(GPT_TINY), seq_len=64, dtype="fp32")
    facts = with_profiles(
        load_factory(GPT_TINY),
        facts,
        machine,
        sizes=lambda *_: [2],
        vocab=256,
        failed=_raise,
        whole=False,
        pipeline_degrees=(2,),
    )
    candidate = Candidate(1, None, False, 2, 2, 2, pp=2, split_points=("blocks.2",))
    config = candidate.config({"steps_per_print": 10**9})
    predicted = predict(candidate, facts, machine, Corrections(), config)
    piped = measure_memory(TrialSpec(GPT_TINY, config, 2, 64, 256, split_points=("blocks.2",)))
    assert piped.model_state_bytes == pytest.approx(predicted.model_state_bytes, abs=64)
    assert piped.peak_memory_bytes > piped.model_state_bytes


# bases whose model states hang on more than the stage: the optimizer, the precision policy,
# the offloaded share (with the stage each is tried at)
PRICED_BASES = {
    "SGD with momentum": (
        1,
        {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}},
    ),
    "Muon": (2, {"optimizer": {"type": "Muon", "params": {"lr": 0.02}}}),
    "Adagrad": (1, {"optimizer": {"type": "Adagrad", "params": {"lr": 1e-2}}}),
    "bf16 optimizer states": (2, {"bf16": {"enabled": True, "bf16_optimizer_states": True}}),
    "bf16 masters": (1, {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}),
    "fp32 gradient accumulation": (
        3,
        {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}},
    ),
    "half the optimizer offloaded": (
        2,
        {"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
    ),
}


def _priced_configs() -> dict[str, dict]:
    from zerotrain.plan.candidates import Candidate

    out = {}
    for name, (stage, base) in PRICED_BASES.items():
        offload = "cpu" if "offload" in name else None
        candidate = Candidate(stage, offload, False, 2, 1, 2)
        out[name] = candidate.config({**base, "steps_per_print": 10**9})
    return out


def _measured_states(configs: dict[str, dict]) -> dict[str, float]:
    import zerotrain

    out = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        engine, *_ = zerotrain.initialize(model=tiny(), config=config)
        ids = torch.randint(0, 256, (2, 16))
        engine.backward(engine(ids, ids))
        engine.step()  # the optimizer's state exists after its first step
        out[name] = engine.memory_breakdown()["total"]
    return out


def test_the_planner_prices_the_config_s_optimizer_precision_and_offloaded_share():
    """The model states the cost model predicts for a config are what the engine holds, for
    optimizers other than AdamW, narrower masters or optimizer states, fp32 gradient
    accumulation and a share of the optimizer offloaded: the planner reads a config as
    ``initialize``'s memory preflight does."""
    from zerotrain.estimate.factory import build_on_meta
    from zerotrain.plan.candidates import Candidate
    from zerotrain.plan.cost import Corrections, predict
    from zerotrain.plan.planner import model_facts, with_optimizer

    configs = _priced_configs()
    measured = run_distributed(_measured_states, 2, configs)[0]
    machine = probe.memory_only_machine(dtype="fp32", world=2)
    predicted = {}
    for name, config in configs.items():
        stage, base = PRICED_BASES[name]
        dtype = "bf16" if "bf16" in base else "fp32"
        facts = model_facts(build_on_meta(GPT_TINY), seq_len=16, dtype=dtype)
        facts = with_optimizer(facts, config, threads=None)
        offload = config["zero_optimization"].get("offload_optimizer", {}).get("device")
        candidate = Candidate(stage, offload, False, 2, 1, 2)
        predicted[name] = predict(candidate, facts, machine, Corrections(), config)
    for name, states in measured.items():
        assert predicted[name].model_state_bytes == pytest.approx(states, abs=64), name
    # each changes the bytes from AdamW's in the training dtype: none is priced as the default
    for name, (stage, base) in PRICED_BASES.items():
        dtype = "bf16" if "bf16" in base else "fp32"
        facts = model_facts(build_on_meta(GPT_TINY), seq_len=16, dtype=dtype)
        candidate = Candidate(stage, None, False, 2, 1, 2)
        plain = {"bf16": {"enabled": True}} if dtype == "bf16" else {}
        config = candidate.config({**plain, "steps_per_print": 10**9})
        default = predict(candidate, facts, machine, Corrections(), config)
        assert predicted[name].model_state_bytes != default.model_state_bytes, name


def test_a_trial_reports_the_cpu_time_the_hypervisor_took(monkeypatch):
    """The steal of /proc/stat over the timed steps: its share of the CPU time they took."""
    from zerotrain import plan_trial

    start = [10, 0, 5, 80, 0, 0, 0, 5]  # user, nice, system, idle, iowait, irq, softirq, steal
    monkeypatch.setattr(plan_trial, "_cpu_times", lambda: [20, 0, 10, 160, 0, 0, 0, 10])
    assert plan_trial._steal_since(start) == pytest.approx(5 / 100)
    assert plan_trial._steal_since(None) == 0.0  # unknown where /proc/stat cannot be read
    monkeypatch.undo()
    now = plan_trial._cpu_times()
    assert now is None or (len(now) == 8 and all(v >= 0 for v in now))


def test_a_failed_trial_says_why():
    config = _config(2)
    config["optimizer"] = {"type": "NoSuchOptimizer"}
    spec = TrialSpec(model=GPT_TINY, config=config, world=1, seq_len=64, vocab_size=256)
    with pytest.raises(JobError, match="NoSuchOptimizer"):
        run_trial(spec)


# (stage, offload, activation checkpointing, micro-batch, ranks, tensor-parallel degree,
# pipeline degree): every stage, offload tier, checkpointing, two micro-batches, 1-2 ranks, tp 2
# and pp 2 (its micro-batches a step: 2), on the demo GPT
MEMORY_CONFIGS = [
    (0, None, False, 8, 1, 1, 1),
    (0, None, True, 4, 1, 1, 1),
    (1, None, True, 8, 1, 1, 1),
    (2, None, False, 4, 1, 1, 1),
    (2, None, True, 4, 1, 1, 1),
    (3, None, False, 8, 1, 1, 1),
    (1, "cpu", True, 4, 1, 1, 1),
    (3, "cpu", False, 8, 1, 1, 1),
    (2, "nvme", False, 8, 1, 1, 1),
    (3, "nvme", True, 4, 1, 1, 1),
    (0, None, False, 8, 2, 1, 1),
    (0, None, True, 4, 2, 1, 1),
    (1, None, False, 4, 2, 1, 1),
    (2, None, False, 8, 2, 1, 1),
    (3, None, False, 4, 2, 1, 1),
    (3, None, True, 8, 2, 1, 1),
    (1, "cpu", False, 8, 2, 1, 1),
    (2, "cpu", True, 4, 2, 1, 1),
    (3, "cpu", True, 4, 2, 1, 1),
    (1, "nvme", False, 4, 2, 1, 1),
    (2, "nvme", True, 4, 2, 1, 1),
    (3, "nvme", True, 8, 2, 1, 1),
    (0, None, False, 8, 2, 2, 1),
    (2, None, True, 4, 2, 2, 1),
    (3, "cpu", False, 8, 2, 2, 1),
    (1, None, False, 4, 2, 1, 2),
    (2, None, False, 8, 2, 1, 2),
]


# (stage, comm_compression) on 2 ranks at micro-batch 8: top-k's error feedback and counts,
# int8's quantized gather with its masters apart
COMPRESSED_MEMORY = [
    (1, {"gradients": {"method": "topk", "ratio": 0.01}}),
    (2, {"gradients": {"method": "int8"}, "parameters": {"method": "int8"}}),
]


@pytest.mark.slow
@pytest.mark.timeout(1500)  # 29 jobs of 2 steps, each a torchrun start
def test_predicted_peak_memory_is_within_5_percent_of_a_trial(tmp_path, monkeypatch):
    """The cost model's peak memory per rank against a trial's, over a fixed list of configs
    (bench/plan.py also times them, and adds a larger GPT)."""
    from zerotrain.estimate.factory import build_on_meta, load_factory
    from zerotrain.plan.candidates import Candidate
    from zerotrain.plan.cost import Corrections, predict
    from zerotrain.plan.planner import model_facts, with_compression, with_profiles

    monkeypatch.setenv("ZEROTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    nvme = str(tmp_path / "nvme")
    base = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "steps_per_print": 10**9}
    facts = model_facts(build_on_meta(GPT_DEMO), seq_len=128, dtype="fp32", tp_degrees=(2,))
    errors = []
    for world in (1, 2):
        machine = probe.probe_machine(dtype="fp32", world=world, nvme_path=nvme, threads=1)
        if facts.profile is None:  # one process's forward and backward: the same at any world
            facts = with_profiles(
                load_factory(GPT_DEMO),
                facts,
                machine,
                sizes=lambda *_: [4, 8],
                vocab=256,
                failed=_raise,
                pipeline_degrees=(2,),
            )
        for stage, offload, checkpointing, micro, ranks, tp, pp in MEMORY_CONFIGS:
            if ranks != world:
                continue
            points = facts.pipelines[pp].split_points if pp > 1 else ()
            candidate = Candidate(stage, offload, checkpointing, micro, pp, world, tp, pp, points)
            config = candidate.config(base, nvme)
            predicted = predict(candidate, facts, machine, Corrections(), config)
            spec = TrialSpec(GPT_DEMO, config, world, 128, 256, checkpointing, points)
            measured = measure_memory(spec)
            label = f"{candidate.label()}, {world} ranks"
            # the model states exactly (the ZeRO formula over a rank's share), within padding
            assert measured.model_state_bytes == pytest.approx(predicted.model_state_bytes, abs=64)
            errors.append((label, predicted.peak_memory_bytes / measured.peak_memory_bytes - 1))
    for stage, compression in COMPRESSED_MEMORY:  # the codecs' kept state and masters too
        compressed = {**base, "comm_compression": compression}
        candidate = Candidate(stage, None, False, 8, 1, 2)
        config = candidate.config(compressed, nvme)
        priced = with_compression(facts, build_on_meta(GPT_DEMO), compressed, machine)
        predicted = predict(candidate, priced, machine, Corrections(), config)
        measured = measure_memory(TrialSpec(GPT_DEMO, config, 2, 128, 256))
        assert measured.model_state_bytes == pytest.approx(predicted.model_state_bytes, abs=64)
        label = f"{candidate.label()}, {compression['gradients']['method']}"
        errors.append((label, predicted.peak_memory_bytes / measured.peak_memory_bytes - 1))
    assert len(errors) == len(MEMORY_CONFIGS) + len(COMPRESSED_MEMORY)
    off = [f"{label}: {error:+.1%}" for label, error in errors if abs(error) > 0.05]
    assert not off, off


# -- the plan ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory) -> str:
    """One probe cache for the plans below that neither refine nor inspect it (a probe costs
    seconds: it starts a 2-rank job to measure the links)."""
    return str(tmp_path_factory.mktemp("plan-cache"))


def _plan_cli(capsys, tmp_path, *extra) -> tuple[int, dict | str, str]:
    from zerotrain import cli

    argv = [
        "plan", "--model", GPT_TINY, "--seq-len", "64", "--global-batch", "16",
        "--nproc-per-node", "2", "--out", str(tmp_path / "chosen.json"), *extra,
    ]  # fmt: skip
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, (json.loads(out) if "--json" in extra and code == 0 else out), err


def test_plan_prices_every_candidate_and_writes_the_fastest_that_fits(
    capsys, tmp_path, monkeypatch, shared_cache
):
    """Every candidate of the space (tensor-parallel degree 1 and 2, stages 0-3, offload none /
    cpu, checkpointing, every micro-batch of the samples a data-parallel rank takes) is in the
    JSON with its config and predictions; each trains the global batch; the chosen one fits,
    is the fastest that fits, and is the config written."""
    monkeypatch.setenv("ZEROTRAIN_CACHE_DIR", shared_cache)
    batch = ("--global-batch", "8")  # fewer micro-batches for the model probe to time
    code, plan, err = _plan_cli(capsys, tmp_path, "--json", *batch)
    assert code == 0, err
    candidates = plan["candidates"]
    # (4 stages + 3 offloaded) x checkpointing x micro-batch: 3 of the 4 samples of each of
    # 2 data-parallel ranks, 4 of the 8 of one at tensor-parallel degree 2
    assert len(candidates) == 7 * 2 * 3 + 7 * 2 * 4
    for candidate in candidates:
        config = candidate["config"]
        assert config["train_batch_size"] == 8
        tp = config.get("tensor_parallel", {}).get("autotp_size", 1)
        assert candidate["label"].startswith("tp 2, ") == (tp == 2)
        assert (
            config["train_micro_batch_size_per_gpu"]
            * config["gradient_accumulation_steps"]
            * (2 // tp)
            == 8
        )
        assert candidate["peak_memory_bytes"] > candidate["model_state_bytes"] > 0
        assert candidate["step_time_s"] > 0
        assert ("activation_checkpointing" in config) == candidate["activation_checkpointing"]
    chosen = candidates[plan["chosen"]]
    assert chosen["fits"]
    fastest = min((c for c in candidates if c["fits"]), key=lambda c: c["step_time_s"])
    assert chosen["step_time_s"] == fastest["step_time_s"]
    assert json.loads((tmp_path / "chosen.json").read_text()) == chosen["config"]
    # the table says the same, with each row's reason
    code, table, _ = _plan_cli(capsys, tmp_path, *batch)
    assert code == 0 and "chosen: the fastest that fits" in table
    assert f"{len(candidates)} candidates" in table


def test_plan_with_pipeline_weighs_the_model_cut_into_stages(
    capsys, tmp_path, monkeypatch, shared_cache
):
    """``--pipeline``: the tiny GPT cut in 2 at its blocks is a candidate of its own (the
    stages it runs on, where it is cut, its predictions), beside the undivided model's."""
    monkeypatch.setenv("ZEROTRAIN_CACHE_DIR", shared_cache)
    code, plan, err = _plan_cli(capsys, tmp_path, "--json", "--pipeline", "--global-batch", "4")
    assert code == 0, err
    assert "cut into 2 pipeline stages" in err
    candidates = plan["candidates"]
    piped = [c for c in candidates if c["pipeline"]]
    # stages 0-2 x micro-batches 1 and 2 (2 or more a step); its stages share the tied embedding
    assert len(piped) == 3 * 2
    for candidate in piped:
        assert candidate["pipeline"] == {"stages": 2, "split_points": ["blocks.2"]}
        assert candidate["config"]["pipeline"] == {"schedule": "1f1b"}
        assert candidate["config"]["train_batch_size"] == 4
        assert candidate["peak_memory_bytes"] > candidate["model_state_bytes"] > 0
        assert candidate["step_time_s"] > 0
    assert all(c["pipeline"] is None for c in candidates if not c["label"].startswith("pp "))
    # a base whose fixed keys no pipeline candidate has is told so, before any model is cut
    (tmp_path / "base.json").write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    extra = ("--json", "--pipeline", "--config", str(tmp_path / "base.json"))
    code, plan, err = _plan_cli(capsys, tmp_path, *extra)
    assert code == 0, err
    assert "pipelines not planned: --config fixes ZeRO stage 3, which a pipeline refuses" in err
    assert "pipeline stages" not in err and not any(c["pipeline"] for c in plan["candidates"])


def test_plan_keeps_what_the_base_config_fixes(capsys, tmp_path, monkeypatch, shared_cache):
    monkeypatch.setenv("ZEROTRAIN_CACHE_DIR", shared_cache)
    base = {
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 10**6},
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 1.0,
    }
    (tmp_path / "base.json").write_text(json.dumps(base))
    code, plan, err = _plan_cli(capsys, tmp_path, "--json", "--config", str(tmp_path / "base.json"))
    assert code == 0, err
    assert len(plan["candidates"]) == 2 * 2 * 2  # tp 1 / 2 x offload none / cpu x checkpointing
    for candidate in plan["candidates"]:
        config = candidate["config"]
        assert config["zero_optimization"]["stage"] == 2
        assert config["zero_optimization"]["reduce_bucket_size"] == 10**6
        assert config["train_micro_batch_size_per_gpu"] == 4
        assert config["gradient_clipping"] == 1.0


def test_a_model_that_fits_nowhere_names_the_nearest_config(tmp_path, monkeypatch):
    from zerotrain.estimate.factory import build_on_meta
    from zerotrain.plan.planner import PlanError, make_plan, model_facts

    monkeypatch.setenv("ZEROTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    machine = probe.probe_machine(dtype="fp32", world=1)
    small = replace(machine, device_memory=50 * 10**6, host_memory=50 * 10**6)
    facts = model_facts(build_on_meta(GPT_DEMO), seq_len=128, dtype="fp32")
    with pytest.raises(PlanError) as error:
        make_plan(facts, small, world=1, ranks_per_node=1, global_batch=8, base={})
    # one rank on a CPU: no stage or offload moves memory off it; the smallest micro-batch with
    # checkpointing comes closest
    message = str(error.value)
    nearest = "no config fits: the nearest, stage 0, checkpointing, micro-batch 1 x 8, needs "
    assert message.startswith(nearest), message
    assert "more than the 45.00 MB a rank may use (90% of 50.00 MB)" in message


def test_on_a_gpu_offload_must_fit_the_host_too():
    """A GPU box's host holds what optimizer offload moves off the device: a candidate whose
    offload needs more host memory than the node's ranks may each use does not fit (the
    planner had offered CPU offload of a 22B model to a 128 GB host), and with every
    candidate that fits the device over the host, the refusal names the host."""
    from zerotrain.estimate.factory import build_on_meta
    from zerotrain.plan.planner import PlanError, make_plan, model_facts

    facts = model_facts(build_on_meta(GPT_DEMO), seq_len=128, dtype="bf16")
    machine = probe.memory_only_machine(dtype="bf16", world=2)
    machine = replace(machine, device="NVIDIA H200", matmul_flops=1e14, attention_flops=1e13)
    machine = replace(machine, adam_elements_per_s={"1": 1e9}, threads=1)
    options = {
        "world": 2,
        "ranks_per_node": 2,
        "global_batch": 8,
        "base": {"bf16": {"enabled": True}},
    }
    roomy = replace(machine, device_memory=10**11, host_memory=10**11)
    plan = make_plan(facts, roomy, **options)
    hosted = [p for p in plan.candidates if p.candidate.offload]
    assert hosted and all(p.fits and p.predicted.host_memory_bytes > 0 for p in hosted)
    assert all(
        p.predicted.host_memory_bytes == 0 for p in plan.candidates if not p.candidate.offload
    )
    need = max(p.predicted.host_memory_bytes for p in hosted)
    # a host of less than the ranks' offload needs: only the candidates in memory fit
    tight = replace(roomy, host_memory=int(need * 2 / 0.9) - 2)
    plan = make_plan(facts, tight, **options)
    for planned in plan.candidates:
        over = planned.predicted.host_memory_bytes > int(tight.host_memory * 0.9) // 2
        assert planned.fits == (not over), planned.candidate.label()
        if over:
            assert "of host memory per rank" in planned.reason, planned.reason
    assert any(not p.fits for p in plan.candidates)
    # a device that holds only what offload frees, and a host too small for that
    in_memory = min(
        p.predicted.peak_memory_bytes for p in plan.candidates if not p.candidate.offload
    )
    small = replace(tight, device_memory=int(in_memory / 0.9) - 2, host_memory=10**6)
    with pytest.raises(PlanError) as error:
        make_plan(facts, small, **options)
    assert "fits the device but needs" in str(error.value), error.value
    assert "of host memory per rank" in str(error.value)


def test_nvme_offload_must_fit_the_free_space_under_nvme_path(tmp_path, monkeypatch):
    """NVMe offload's working files count against the space free under ``nvme_path`` now,
    shared by the node's ranks (the planner had offered NVMe offload of a 22B model, 265 GB of
    files, on a 64 GB disk)."""
    import collections

    from zerotrain.estimate.factory import build_on_meta
    from zerotrain.plan import planner
    from zerotrain.plan.planner import make_plan, model_facts

    facts = model_facts(build_on_meta(GPT_DEMO), seq_len=128, dtype="bf16")
    machine = probe.memory_only_machine(dtype="bf16", world=2)
    machine = replace(machine, device="NVIDIA H200", matmul_flops=1e14, attention_flops=1e13)
    machine = replace(machine, adam_elements_per_s={"1": 1e9}, threads=1)
    machine = replace(machine, device_memory=10**11, host_memory=10**11)
    options = {
        "world": 2,
        "ranks_per_node": 2,
        "global_batch": 8,
        "base": {"bf16": {"enabled": True}},
    }
    nvme = str(tmp_path / "nvme" / "not-yet")  # its nearest existing folder's disk counts
    plan = make_plan(facts, machine, nvme_path=nvme, **options)
    on_disk = [p for p in plan.candidates if p.candidate.offload == "nvme"]
    assert on_disk and all(p.fits and p.predicted.disk_bytes > 0 for p in on_disk)
    need = max(p.predicted.disk_bytes for p in on_disk)
    usage = collections.namedtuple("usage", "total used free")
    seen = []

    def small_disk(path):
        seen.append(path)
        return usage(10**12, 10**12, int(need * 2 / 0.9) - 2)  # 2 ranks: each a byte short

    monkeypatch.setattr(planner.shutil, "disk_usage", small_disk)
    plan = make_plan(facts, machine, nvme_path=nvme, **options)
    assert seen == [tmp_path]
    for planned in plan.candidates:
        short = planned.predicted.disk_bytes == need
        assert planned.fits == (not short), planned.candidate.label()
        if short:
            assert "of NVMe space per rank" in planned.reason, planned.reason


def test_the_model_probe_runs_where_the_training_dtype_fits_a_gpu():
    """On a GPU the model probe holds the model as the training dtype has it (built on the
    host): a model whose fp32 copy and gradients would not fit half the device is probed
    there in bf16 (a 2.7B GPT-2 went unprobed on an H200: 16 bytes a parameter)."""
    from zerotrain.estimate.factory import build_on_meta
    from zerotrain.plan.planner import buildable_sizes, model_facts

    facts = model_facts(build_on_meta(GPT_DEMO), seq_len=128, dtype="bf16")
    psi = facts.count.trainable
    machine = probe.memory_only_machine(dtype="bf16", world=1)
    # half of it holds 12 bytes a parameter: 8 (bf16 model and gradients, twice) and a
    # micro-batch's activations (a few MB), not 16 and them
    gpu = replace(machine, device="NVIDIA H200", device_memory=2 * 12 * psi)
    assert buildable_sizes(facts, gpu, [1]) == [1]
    cpu = replace(machine, device="cpu", host_memory=gpu.device_memory)
    assert buildable_sizes(facts, cpu, [1]) == []  # fp32 on the host: 16 bytes a parameter


def test_the_cpu_optimizer_rate_follows_the_working_set():
    """Fused AdamW on the CPU runs at the cached probe's rate over a small partition, at the
    streaming probe's over a large one (a 2.7B model's offloaded step), geometrically between."""
    machine = probe.memory_only_machine(dtype="fp32", world=1)
    machine = replace(
        machine,
        threads=4,
        adam_elements_per_s={"1": 1e8, "4": 4e9},
        adam_streaming_elements_per_s=1e9,
    )
    small, large = probe.ADAM_ELEMENTS, probe.ADAM_STREAMING_ELEMENTS
    assert machine.cpu_adam_rate(small // 2) == 4e9
    assert machine.cpu_adam_rate(large * 40) == 1e9
    assert machine.cpu_adam_rate((small * large) ** 0.5) == pytest.approx(2e9)
    assert replace(machine, adam_streaming_elements_per_s=None).cpu_adam_rate(large) == 4e9


def test_verify_measures_the_top_candidate_and_refines_the_constants(
    capsys, tmp_path, monkeypatch, shared_cache
):
    """A trial of the chosen config, tensor-parallel over the 2 ranks, measures the model-state
    bytes predicted for a rank's share, and refines the constants kept with the probe."""
    import shutil

    from zerotrain.plan.cost import Corrections
    from zerotrain.plan.planner import load_corrections

    # the shared probe (when an earlier test made it), not the corrections this test writes
    shutil.copytree(shared_cache, tmp_path / "cache")
    monkeypatch.setenv("ZEROTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    base = {
        "zero_optimization": {"stage": 1},
        "train_micro_batch_size_per_gpu": 8,
        "tensor_parallel": {"autotp_size": 2},
    }
    (tmp_path / "base.json").write_text(json.dumps(base))
    extra = ("--json", "--config", str(tmp_path / "base.json"), "--verify", "1")
    code, plan, err = _plan_cli(capsys, tmp_path, *extra)
    assert code == 0, err
    chosen = plan["candidates"][plan["chosen"]]
    assert chosen["label"].startswith("tp 2, stage 1")
    measured = chosen["measured"]
    assert measured["model_state_bytes"] == pytest.approx(chosen["model_state_bytes"], abs=64)
    assert measured["peak_memory_bytes"] > 0 and measured["step_time_s"] > 0
    (cached,) = (tmp_path / "cache" / "machine").glob("*.json")
    machine = probe.Machine.from_json(json.loads(cached.read_text()))
    corrections = load_corrections(machine)
    assert corrections.verified == 1
    # refined to what this trial measured: the next plan predicts it (its compute and memory)
    predicted_memory = (
        chosen["peak_memory_bytes"] - Corrections().memory_overhead + corrections.memory_overhead
    )
    assert predicted_memory == pytest.approx(measured["peak_memory_bytes"], rel=1e-6)


def test_refine_moves_each_constant_to_what_was_measured():
    from zerotrain.plan.cost import Corrections, Prediction
    from zerotrain.plan.planner import refine

    predicted = Prediction(
        100, 10, step_time_s=1.6, compute_s=1.0, engine_s=0.1, comm_s=0.3, optimizer_s=0.2
    )
    measured = {"peak_memory_bytes": 130, "step_time_s": 2.5}
    once = refine(Corrections(memory_overhead=40.0), [(predicted, measured)])
    assert once.compute_scale == pytest.approx(1.9)  # 2.5 - 0.6 of compute, predicted 1.0
    assert once.memory_overhead == pytest.approx(70.0) and once.verified == 1
    # a second trial weighs as much as the first
    twice = refine(once, [(predicted, {"peak_memory_bytes": 100, "step_time_s": 1.6})])
    assert twice.compute_scale == pytest.approx((1.9 + 1.9) / 2)  # that trial: 1.0 x 1.9
    assert twice.verified == 2


def test_a_tensor_parallel_share_holds_a_rank_s_piece_of_each_split_layer():
    """Rank 0's share of the demo GPT at tp 2, counted on the meta device: half of each
    attention and MLP matrix (and of the column-wise layers' biases), the rest whole; per block
    two all-reduces of the residual width each way."""
    from zerotrain.estimate.factory import build_on_meta
    from zerotrain.plan.tensor_share import tensor_shares

    model = build_on_meta(GPT_DEMO)
    split = ("attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "mlp.fc.weight")
    split += ("mlp.fc.bias", "mlp.proj.weight")
    halved = sum(p.numel() for n, p in model.named_parameters() if n.endswith(split))
    whole = sum(p.numel() for p in model.parameters())  # the head is tied: once
    layers, width = model.config.n_layer, model.config.n_embd
    skipped = []
    shares = tensor_shares(model, [2, 3], lambda tp, why: skipped.append((tp, why)))
    assert list(shares) == [2]
    ((degree, why),) = skipped
    assert degree == 3 and "has 768 output features, which tp degree 3" in why, why
    share = shares[2]
    assert share.count.trainable == whole - halved // 2
    assert (share.forward_calls, share.forward_elements) == (2 * layers, 2 * layers * width)
    assert (share.backward_calls, share.backward_elements) == (2 * layers, 2 * layers * width)
    assert sum(p.numel() for p in model.parameters()) == whole  # the model given is untouched


def test_tensor_parallel_all_reduces_are_priced_as_they_follow_compute():
    """A tp 2 candidate's all-reduces (per micro-batch, per block two each way, of the residual
    width) are priced on the probe's ``interleaved`` fit, an all-reduce after each rank's
    compute; a probe without one prices them back to back."""
    from zerotrain.estimate.factory import build_on_meta
    from zerotrain.plan.candidates import Candidate
    from zerotrain.plan.cost import Corrections, predict
    from zerotrain.plan.planner import model_facts

    model = build_on_meta(GPT_DEMO)
    facts = model_facts(model, seq_len=128, dtype="fp32", tp_degrees=(2,))
    machine = probe.memory_only_machine(dtype="fp32", world=2)
    machine = replace(machine, adam_elements_per_s={"1": 1e8}, threads=1)
    machine = replace(machine, matmul_flops=1e10, attention_flops=1e9)
    back_to_back = probe.LinkFit(alpha=1e-4, beta=1e9)
    after_compute = probe.LinkFit(alpha=2e-3, beta=5e8)
    links = {op: back_to_back for op in probe.COLLECTIVES}
    candidate = Candidate(0, None, False, 4, 2, 2, tp=2)
    config = candidate.config({})

    def comm_s(interleaved):
        priced = replace(machine, links=links, interleaved=interleaved)
        return predict(candidate, facts, priced, Corrections(), config).comm_s

    calls = 4 * model.config.n_layer  # two row-wise forward, two column-wise backward
    sent = 4 * 128 * model.config.n_embd * 4  # tokens x width x fp32; a 2-rank ring sends it all
    hops = 2  # a 2-rank all-reduce: a reduce-scatter's message, then an all-gather's
    more = hops * (2e-3 - 1e-4) + sent * (1 / 5e8 - 1 / 1e9)  # per all-reduce
    priced = comm_s(after_compute) - comm_s(None)
    assert priced == pytest.approx(2 * calls * more, rel=1e-6)  # 2 micro-batches


def test_offload_s_host_copies_are_priced_where_they_outlast_compute():
    """On a GPU, optimizer offload copies each step's gradients of its partition to the host
    (fp32) beside the backward and the parameters back (bf16) beside the forward: a slow copy
    adds what outlasts them, a fast one nothing; a CPU-only machine copies nothing."""
    from zerotrain.estimate.factory import build_on_meta
    from zerotrain.plan.candidates import Candidate
    from zerotrain.plan.cost import Corrections, predict
    from zerotrain.plan.planner import model_facts

    facts = model_facts(build_on_meta(GPT_DEMO), seq_len=128, dtype="bf16")
    machine = probe.memory_only_machine(dtype="bf16", world=2)
    machine = replace(machine, adam_elements_per_s={"1": 1e8}, threads=1)
    machine = replace(machine, matmul_flops=1e12, attention_flops=1e11)
    candidate = Candidate(2, "cpu", False, 4, 2, 2)
    config = candidate.config({"bf16": {"enabled": True}})

    def optimizer_s(device: str, copy: float | None):
        priced = replace(machine, device=device, copy_bytes_per_s=copy)
        return predict(candidate, facts, priced, Corrections(), config)

    cpu = optimizer_s("cpu", 1e3)
    assert cpu.optimizer_s == optimizer_s("NVIDIA H200", None).optimizer_s
    assert optimizer_s("NVIDIA H200", 1e15).optimizer_s == cpu.optimizer_s  # hidden by compute
    slow = optimizer_s("NVIDIA H200", 1e6)
    micro = slow.compute_s / 2  # 2 micro-batches a step
    hosted = -(-facts.count.trainable // 2)  # stage 2 over 2 ranks, all of it offloaded
    copies = (hosted * 4 / 1e6 - 2 * micro / 3) + (hosted * 2 / 1e6 - micro / 3)
    assert slow.optimizer_s - cpu.optimizer_s == pytest.approx(copies, rel=1e-6)


def test_a_gpu_steps_and_works_its_buckets_at_its_own_probed_rates():
    """On a GPU the optimizer steps what is not offloaded at the device's fused-AdamW rate and
    what offload puts on the host at the CPU's, and the engine's passes over the buckets run
    at the device's copy rate; a CPU-only machine (no device rates) keeps its CPU constants."""
    from zerotrain.estimate.factory import build_on_meta
    from zerotrain.plan.candidates import Candidate
    from zerotrain.plan.cost import DEVICE_ENGINE_BYTES, Corrections, predict
    from zerotrain.plan.planner import model_facts

    facts = model_facts(build_on_meta(GPT_DEMO), seq_len=128, dtype="bf16")
    machine = probe.memory_only_machine(dtype="bf16", world=1)
    machine = replace(machine, adam_elements_per_s={"1": 1e8}, threads=1)
    machine = replace(machine, matmul_flops=1e12, attention_flops=1e11)
    gpu = replace(
        machine,
        device="NVIDIA H200",
        device_adam_elements_per_s=4e9,
        device_copy_bytes_per_s=2e12,
        copy_bytes_per_s=1e15,  # offload's copies hidden by compute
    )
    psi = facts.count.trainable

    def priced(candidate, on):
        config = candidate.config({"bf16": {"enabled": True}})
        return predict(candidate, facts, on, Corrections(), config)

    in_memory = Candidate(0, None, False, 4, 1, 1)
    assert priced(in_memory, gpu).optimizer_s == pytest.approx(psi / 4e9, rel=1e-9)
    assert priced(in_memory, gpu).engine_s == pytest.approx(psi * DEVICE_ENGINE_BYTES / 2e12)
    assert priced(in_memory, machine).optimizer_s == pytest.approx(psi / 1e8, rel=1e-9)
    assert priced(in_memory, machine).engine_s == pytest.approx(
        psi * Corrections().engine_seconds_per_parameter
    )
    half = Candidate(2, "cpu", False, 4, 1, 1)
    config = half.config({"bf16": {"enabled": True}})
    zero = config["zero_optimization"]
    zero["offload_optimizer"]["ratio"] = 0.5
    zero["reduce_bucket_size"] = psi // 8  # several buckets: a ratio offloads a share of them
    step = predict(half, facts, gpu, Corrections(), config).optimizer_s
    assert step == pytest.approx(psi / 2 / 1e8 + psi / 2 / 4e9, rel=1e-6)


def test_candidates_take_each_tensor_parallel_degree_and_keep_a_fixed_one():
    from zerotrain.plan.candidates import enumerate_candidates, without_choices

    both = enumerate_candidates(world=4, global_batch=8, base={}, nvme=False, tp_degrees=(1, 2))
    pairs = {(c.tp, c.dp) for c in both}
    assert pairs == {(1, 4), (2, 2)}
    for candidate in both:
        config = candidate.config({})
        assert candidate.global_batch == config["train_batch_size"] == 8
        assert config.get("tensor_parallel", {}).get("autotp_size", 1) == candidate.tp
    for base in ({"tensor_parallel": {"autotp_size": 2}}, {"autotuning": {"mp_size": 2}}):
        fixed = enumerate_candidates(
            world=4, global_batch=8, base=base, nvme=False, tp_degrees=(1, 2)
        )
        assert fixed and {c.tp for c in fixed} == {2}
        assert fixed[0].config(base)["tensor_parallel"] == {"autotp_size": 2}
    # a batch the data-parallel ranks cannot share leaves that degree out
    odd = enumerate_candidates(world=4, global_batch=6, base={}, nvme=False, tp_degrees=(1, 2))
    assert {c.tp for c in odd} == {2}
    kept = without_choices({"tensor_parallel": {"autotp_size": 2, "sequence_parallel": False}})
    assert kept == {"tensor_parallel": {"sequence_parallel": False}}


def test_the_plan_names_what_its_base_turns_on_and_it_does_not_price(tmp_path, monkeypatch):
    """Each feature of a base config the cost model leaves out is named with its key, in the
    plan (and its JSON); a base without any names none. Activation offload is left out on a
    GPU; on a CPU device it moves nothing, and is priced as it runs."""
    from zerotrain.estimate.factory import build_on_meta
    from zerotrain.moe.layer import MoE
    from zerotrain.plan.planner import make_plan, model_facts, with_optimizer

    monkeypatch.setenv("ZEROTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    machine = probe.memory_only_machine(dtype="fp32", world=1)
    machine = replace(machine, adam_elements_per_s={"1": 1e8}, matmul_flops=1e10)
    machine = replace(machine, attention_flops=1e9, threads=1)
    facts = model_facts(build_on_meta(GPT_DEMO), seq_len=128, dtype="fp32")
    bases = {
        "comm_compression": {"comm_compression": {"gradients": {"method": "int8"}}},
        "OneBitAdam": {"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}},
        "cpu_checkpointing": {"activation_checkpointing": {"cpu_checkpointing": True}},
        "lora_fa": {"lora_fa": {"enabled": True, "target_modules": ["fc"]}},
        "torch_autocast": {"torch_autocast": {"enabled": True}},
    }
    options = {"world": 1, "ranks_per_node": 1, "global_batch": 8}
    on_cpu = make_plan(facts, machine, base=bases["cpu_checkpointing"], **options)
    assert machine.device == "cpu" and on_cpu.unpriced == []
    machine = replace(machine, device="NVIDIA H100 80GB HBM3")
    for key, base in bases.items():
        plan = make_plan(with_optimizer(facts, base, threads=1), machine, base=base, **options)
        (what,) = plan.unpriced
        assert key in what and what in plan.as_json()["unpriced"], (key, what)
        if key == "OneBitAdam":  # which initialize refuses at stage 3: left out, and said
            assert {p.candidate.stage for p in plan.candidates} == {0, 1, 2}
            refused = plan.as_json()["refused"]
            assert refused and all(r["label"].startswith("stage 3") for r in refused)
            assert "OneBitAdam compresses" in refused[0]["reason"]
    assert make_plan(facts, machine, base={}, **options).unpriced == []
    # experts are priced (below); their dispatch's options are not
    moe = MoE(hidden_size=8, expert=torch.nn.Linear(8, 8), num_experts=2)
    experts = model_facts(moe, seq_len=4, dtype="fp32").experts
    assert experts is not None and experts.trainable == 2 * 8 * 9
    with_experts = replace(facts, experts=experts)
    assert make_plan(with_experts, machine, base={}, **options).unpriced == []
    base = {"moe": {"token_dedup": True}}
    (what,) = make_plan(with_experts, machine, base=base, **options).unpriced
    assert what.startswith("moe.token_dedup"), what


def test_compression_is_priced_as_its_codecs_run_and_keep():
    """A base's ``comm_compression`` is priced from its codecs, run on the model's shapes:
    the state they keep is in the peak (top-k's error feedback and its counts, 4 + 4 bytes per
    compressed element), their compute and the bytes they send in the step, so int8 wins on a
    slow link and loses on a fast one, and ``auto`` is priced as the one that wins; the masters
    a quantized parameter gather keeps apart are in the model states, as a trial measures
    them."""
    from zerotrain.estimate.factory import build_on_meta
    from zerotrain.plan.candidates import Candidate
    from zerotrain.plan.compression_cost import compressed_seconds
    from zerotrain.plan.cost import Corrections, predict, typed_config, unpriced
    from zerotrain.plan.planner import model_facts, with_compression

    model = build_on_meta(GPT_TINY)
    machine = replace(probe.memory_only_machine(dtype="fp32", world=2), threads=1)
    facts = model_facts(model, seq_len=64, dtype="fp32")
    int8 = {"gradients": {"method": "int8"}, "parameters": {"method": "int8"}}
    bases = {
        "none": {},
        "topk": {"comm_compression": {"gradients": {"method": "topk", "ratio": 0.01}}},
        "int8": {"comm_compression": int8},
        "auto": {"comm_compression": {"auto": True}},
    }

    def priced(name: str, candidate: Candidate, beta: float = 1e9):
        links = {op: probe.LinkFit(alpha=1e-5, beta=beta) for op in probe.COLLECTIVES}
        config = candidate.config({**bases[name], "steps_per_print": 10**9})
        known = with_compression(facts, model, bases[name], machine)
        assert unpriced(typed_config(config, known), known) == []
        return predict(candidate, known, replace(machine, links=links), Corrections(), config)

    stage1, stage2 = Candidate(1, None, False, 2, 1, 2), Candidate(2, None, False, 2, 1, 2)
    compressed = sum(p.numel() for p in model.parameters() if p.numel() >= 1024)
    kept = priced("topk", stage1).peak_memory_bytes - priced("none", stage1).peak_memory_bytes
    assert kept == pytest.approx(8 * compressed, rel=1e-3)
    for beta, wins in ((1e6, True), (1e13, False)):  # a slow link, and one that costs nothing
        faster = priced("int8", stage2, beta).comm_s < priced("none", stage2, beta).comm_s
        assert faster is wins, beta
        links = {op: probe.LinkFit(alpha=1e-5, beta=beta) for op in probe.COLLECTIVES}
        profile = with_compression(facts, model, bases["auto"], machine).compression
        assert profile is not None
        counts = {"reduce_scatter": 2, "all_gather": 1}
        *_, policy = compressed_seconds(profile, counts, [(compressed, 2)], links)
        assert (policy.name == "int8 + int8 params") is wins, policy.name

    config = stage2.config({"comm_compression": int8, "steps_per_print": 10**9})
    measured = measure_memory(TrialSpec(GPT_TINY, config, 2, 64, 256))
    predicted = priced("int8", stage2).model_state_bytes
    assert measured.model_state_bytes == pytest.approx(predicted, abs=64)


def test_lamb_is_not_offered_nvme_offload_and_sgd_is_priced_at_its_measured_ratio(tmp_path):
    """An optimizer that needs whole parameters (Lamb) gets no NVMe candidate, which its store
    refuses; SGD with momentum is priced at its own step time, measured against AdamW's."""
    from zerotrain.estimate.factory import build_on_meta
    from zerotrain.plan.planner import make_plan, model_facts, with_optimizer

    machine = probe.memory_only_machine(dtype="fp32", world=1)
    machine = replace(machine, adam_elements_per_s={"1": 1e8}, matmul_flops=1e10)
    machine = replace(machine, attention_flops=1e9, threads=1)
    facts = model_facts(build_on_meta(GPT_DEMO), seq_len=128, dtype="fp32")
    options = {"world": 1, "ranks_per_node": 1, "global_batch": 8, "nvme_path": str(tmp_path)}
    adamw = make_plan(facts, machine, base={}, **options)
    assert any(p.candidate.offload == "nvme" for p in adamw.candidates)
    lamb = {"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}
    plan = make_plan(with_optimizer(facts, lamb, threads=1), machine, base=lamb, **options)
    assert {p.candidate.offload for p in plan.candidates} == {None, "cpu"}
    sgd = {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}
    priced = with_optimizer(facts, sgd, threads=1)
    assert priced.optimizer.name == "SGD" and priced.optimizer.state_bytes == 4
    relative = priced.optimizer.relative_time  # timed here (bench/plan.py checks the price)
    assert 0 < relative < float("inf")
    plan = make_plan(priced, machine, base=sgd, **options)
    by_label = {p.candidate.label(): p.predicted for p in adamw.candidates}
    for p in plan.candidates:
        adamw_s = by_label[p.candidate.label()].optimizer_s
        assert p.predicted.optimizer_s == pytest.approx(adamw_s * relative)
    # a GPU machine names its device by model: the plan prices there too
    gpu = replace(machine, device="NVIDIA H200", device_memory=80 * 2**30)
    on_gpu = make_plan(priced, gpu, base=sgd, **options)
    assert on_gpu.best.predicted.model_state_bytes > 0


def test_muon_s_step_counts_its_newton_schulz_products():
    """Muon's step: its matrices orthogonalised, ns_steps iterations of products whose FLOPs
    the model's shapes give (m x n, m <= n: 4·m²·n + 2·m³ each), shared by the ranks."""
    from zerotrain.estimate import count_parameters
    from zerotrain.plan.optimizer_cost import optimizer_cost

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4, bias=False))
    count = count_parameters(model, persistence_threshold=0)
    assert count.muon_iteration_flops == (4 * 8**2 * 16 + 2 * 8**3) + (4 * 4**2 * 16 + 2 * 4**3)
    muon = optimizer_cost({"type": "Muon", "params": {"ns_steps": 3}}, count, threads=None)
    assert (muon.kind, muon.ns_steps) == ("muon", 3)
    one_rank = muon.step_seconds(0, count=count, adam_rate=1.0, matmul_flops=1e3, ranks=1)
    assert one_rank == pytest.approx(3 * count.muon_iteration_flops / 1e3)
    two = muon.step_seconds(0, count=count, adam_rate=1.0, matmul_flops=1e3, ranks=2)
    assert two == pytest.approx(one_rank / 2)


def test_muon_s_matrices_travel_to_the_ranks_that_orthogonalise_them():
    """On 2 data-parallel ranks Muon's step adds its matrices' exchange on the all-to-all link:
    on shards each rank sends half of its half to the other's matrices and gets it back (two
    all-to-alls), at stage 0 each rank sends the results of its half (one); one rank sends
    nothing."""
    from zerotrain.estimate.factory import build_on_meta
    from zerotrain.plan.candidates import Candidate
    from zerotrain.plan.cost import Corrections, predict
    from zerotrain.plan.planner import model_facts, with_optimizer

    base = {"optimizer": {"type": "Muon", "params": {"lr": 0.02}}}
    facts = model_facts(build_on_meta(GPT_DEMO), seq_len=128, dtype="fp32")
    facts = with_optimizer(facts, base, 1)
    machine = probe.memory_only_machine(dtype="fp32", world=2)
    machine = replace(machine, adam_elements_per_s={"1": 1e8}, threads=1)
    machine = replace(machine, matmul_flops=1e10, attention_flops=1e9)
    links = {op: probe.LinkFit(alpha=1e-3, beta=1e8) for op in probe.COLLECTIVES}

    def exchange(stage: int, world: int) -> float:
        candidate = Candidate(stage, None, False, 4, 4 // world, world)
        config = candidate.config(base)
        priced = [
            predict(candidate, facts, replace(machine, links=on), Corrections(), config)
            for on in (links, {})
        ]
        return priced[0].optimizer_s - priced[1].optimizer_s

    matrices = facts.count.muon_matrices * 4  # bytes of fp32 updates
    assert matrices > 0
    assert exchange(2, 2) == pytest.approx(2 * (1e-3 + matrices / 4 / 1e8), rel=1e-6)
    assert exchange(0, 2) == pytest.approx(1e-3 + matrices / 2 / 1e8, rel=1e-6)
    assert exchange(2, 1) == 0.0


def test_the_model_probe_s_median_run_is_priced_and_ranks_share_the_disk(tmp_path, monkeypatch):
    """The model probe prices a micro-batch at the median of its runs, as a trial reports its
    steps (not the fastest, nor the mean), and so does a pipeline's; the ranks of a node share
    its disk for NVMe offload."""
    from zerotrain.estimate.factory import build_on_meta, load_factory
    from zerotrain.plan import model_probe
    from zerotrain.plan.candidates import Candidate
    from zerotrain.plan.cost import Corrections, predict
    from zerotrain.plan.pipeline_share import StageProfile, median_run
    from zerotrain.plan.planner import model_facts

    runs = iter([3.0, 1.0, 8.0, 6.0, 4.0, 11.0])  # without checkpointing, then with
    monkeypatch.setattr(model_probe, "timed_runs", lambda step: [next(runs) for _ in range(3)])
    options = {"seq_len": 32, "vocab_size": 256, "dtype": torch.float32, "threads": 1}
    profile = model_probe.profile_model(load_factory(GPT_TINY), micro_batches=[4], **options)
    measured = profile.micro_batches[4]
    assert (measured.forward_backward_s, measured.checkpointed_forward_backward_s) == (3.0, 6.0)
    facts = model_facts(build_on_meta(GPT_TINY), seq_len=32, dtype="fp32")
    facts = replace(facts, profile=profile)
    machine = probe.memory_only_machine(dtype="fp32", world=2)
    machine = replace(machine, adam_elements_per_s={"1": 1e8}, threads=1)
    machine = replace(machine, disk_read_bytes_per_s=1e8, disk_write_bytes_per_s=2e8)

    def predicted(world: int, offload: str | None = None):
        candidate = Candidate(2, offload, False, 4, max(1, 4 // world), world)
        config = candidate.config({}, str(tmp_path))
        return predict(candidate, facts, machine, Corrections(), config)

    assert predicted(1).compute_s == pytest.approx(4 * 3.0)
    for world in (1, 2, 4):  # 4 ranks: 2 nodes of the probed 2
        priced_io = predicted(world, "nvme").optimizer_s - predicted(world).optimizer_s
        partition = -(-facts.count.trainable // world)
        io = partition * (4 + 8) * (1 / 1e8 + 1 / 2e8)  # fp32 masters and Adam's two moments
        assert priced_io == pytest.approx(min(world, 2) * io, rel=1e-6)  # a node's ranks, one disk
    # a pipeline stage's profile is the run whose whole is the median, its stages kept together
    runs = [(StageProfile(1.0, 2.0, 0), StageProfile(t, t, 0)) for t in (5.0, 1.0, 2.0)]
    assert median_run(runs) == runs[2]


def test_a_pipeline_cut_counts_each_stage_and_times_its_share():
    """The tiny GPT (4 blocks, its head tied to its embedding) cut in 2 before blocks.2: each
    stage holds its layers, both the tied embedding; the stages' saved bytes add up to the
    whole model's (the model probe's count); the residual stream crosses the cut."""
    from zerotrain.estimate.factory import load_factory
    from zerotrain.plan.model_probe import profile_model
    from zerotrain.plan.pipeline_share import cut_points, pipeline_share

    tiny = load_factory(GPT_TINY)
    model = tiny()
    assert cut_points(model, 2) == (("blocks.2",), 4)
    assert cut_points(model, 3) == (("blocks.1", "blocks.2"), 4)
    with pytest.raises(ValueError, match="its 4 blocks .blocks. are fewer than 5 stages"):
        cut_points(model, 5)
    with pytest.raises(ValueError, match="no list of blocks"):
        cut_points(torch.nn.Linear(2, 2), 2)
    options = {"seq_len": 32, "vocab_size": 256, "dtype": torch.float32, "threads": 1}
    share = pipeline_share(tiny, 2, micro_batches=[1, 2], **options)
    embedding = model.token_embedding.weight.numel()
    whole = sum(p.numel() for p in model.parameters())  # the tied head once
    assert share.split_points == ("blocks.2",) and share.blocks == 4
    assert share.shared_elements == embedding
    assert sum(c.trainable for c in share.counts) == whole + embedding  # held by both stages
    assert share.boundary_elements == model.config.n_embd
    whole_profile = profile_model(tiny, micro_batches=[1, 2], **options)
    for micro in (1, 2):
        stages = share.stages[micro]
        assert len(stages) == 2 and all(s.forward_s > 0 and s.backward_s > 0 for s in stages)
        saved = sum(s.saved_bytes for s in stages)
        assert saved == whole_profile.micro_batches[micro].saved_bytes


def test_pipeline_candidates_run_1f1b_over_stages_0_to_2():
    """A pipeline of 2 over 2 ranks: one data-parallel rank per stage, stages 0-2 (the engine
    refuses 3), no offload (its stages share the tied embedding), no checkpointing, and at
    least 2 micro-batches a step; its config asks for 1F1B."""
    from zerotrain.plan.candidates import enumerate_candidates
    from zerotrain.plan.pipeline_share import PipelineShare, StageProfile

    stage = StageProfile(1.0, 2.0, 10)
    share = PipelineShare(2, ("blocks.2",), (), 64, 8, 4, {m: (stage, stage) for m in (1, 2, 4)})
    found = enumerate_candidates(world=2, global_batch=4, base={}, nvme=True, pipelines={2: share})
    piped = [c for c in found if c.pp == 2]
    assert {(c.stage, c.micro_batch, c.accumulation) for c in piped} == {
        (stage, micro, 4 // micro) for stage in (0, 1, 2) for micro in (1, 2)
    }
    assert not any(c.offload or c.activation_checkpointing for c in piped)
    for candidate in piped:
        assert candidate.dp == 1 and candidate.split_points == ("blocks.2",)
        assert candidate.label().startswith("pp 2, stage ")
        assert candidate.config({})["pipeline"] == {"schedule": "1f1b"}
    untied = replace(share, shared_elements=0)
    found = enumerate_candidates(
        world=2, global_batch=4, base={}, nvme=False, pipelines={2: untied}
    )
    assert {c.offload for c in found if c.pp == 2} == {None, "cpu"}


@pytest.mark.parametrize(
    ("argv", "base", "message"),
    [
        (
            ["--global-batch", "15"],
            {"tensor_parallel": {"autotp_size": 1}},
            "--global-batch 15 is not a multiple of the 2 data-parallel ranks",
        ),
        (
            [],
            {"autotuning": {"mp_size": 4}},
            "--config fixes tensor-parallel degree 4 (tensor_parallel.autotp_size or "
            "autotuning.mp_size); the planner weighs degrees [1, 2] here",
        ),
        (
            [],
            {"tensor_parallel": {"autotp_size": 2, "sequence_parallel": True}},
            "remove tensor_parallel.tp_plan and sequence_parallel to plan",
        ),
        ([], {"train_batch_size": 32}, "--config sets train_batch_size 32, --global-batch 16"),
        (
            [],
            {"zero_optimization": {"offload_optimizer": {"device": "nvme"}}},
            "offloads to nvme without an nvme_path: give --nvme-path",
        ),
        (["--model", "no_such_module_xyz:build"], {}, "cannot import 'no_such_module_xyz'"),
        ([], {"zero_optimization": {"stage": 7}}, "--config: zero_optimization.stage"),
        (
            [],
            {"optimizer": {"type": "NoSuchOptimizer"}},
            "optimizer.type: unknown optimizer 'NoSuchOptimizer'",
        ),
        (
            [],
            {"sequence_parallel_size": 2},
            "--config sets sequence_parallel_size 2, not planned here: Ulysses is planned for "
            "transformers causal LMs",
        ),
        (
            [],
            {"sequence_parallel_size": 4},
            "--config sets sequence_parallel_size 4: the planner keeps a sample's "
            "sequence-parallel ranks on one node, and a node here has 2",
        ),
    ],
)
def test_plan_refuses_bad_input_before_probing(capsys, tmp_path, monkeypatch, argv, base, message):
    from zerotrain import cli

    def probed(*args, **kwargs):
        raise AssertionError("probed")

    monkeypatch.setattr(probe, "probe_machine", probed)
    (tmp_path / "base.json").write_text(json.dumps(base))
    args = ["--model", GPT_DEMO, "--seq-len", "128", "--global-batch", "16"]
    args += ["--nproc-per-node", "2", "--config", str(tmp_path / "base.json"), *argv]
    code = cli.main(["plan", *args])
    _, err = capsys.readouterr()
    assert code == 2 and message in err and "Traceback" not in err, err


# -- DeepSpeed's autotuning section --------------------------------------------------------------
def test_the_autotuning_section_reads_as_deepspeed_defines_it():
    from zerotrain.plan.autotuning import Autotuning, read_autotuning

    assert read_autotuning({}) == Autotuning()
    tuning = read_autotuning(
        {
            "autotuning": {
                "enabled": True,
                "metric": "FLOPS",
                "fast": False,
                "tuner_type": "model_based",
                "min_train_micro_batch_size_per_gpu": 2,
                "max_train_micro_batch_size_per_gpu": 4,
                "max_train_batch_size": 64,
                "start_profile_step": 3,
                "end_profile_step": 5,
                "results_dir": "tuned",
            }
        }
    )
    assert tuning.metric == "flops"
    assert [m for m in range(1, 9) if tuning.allows_micro_batch(m)] == [2, 3, 4]
    assert (tuning.start_profile_step, tuning.end_profile_step) == (3, 5)
    assert tuning.results_dir == "tuned"
    assert [note.split(":")[0] for note in tuning.notes] == [
        "autotuning.fast",
        "autotuning.tuner_type",
    ]
    tuning.check_global_batch(64)
    with pytest.raises(ValueError, match=r"--global-batch 128 lies outside .* limits \(1\.\.64,"):
        tuning.check_global_batch(128)
    # fast mode (DeepSpeed's default) is what the planner does: no note
    assert read_autotuning({"autotuning": {"fast": True}}).notes == []
    # one profile key given: DeepSpeed's default for the other (steps 3-5)
    only_end = read_autotuning({"autotuning": {"end_profile_step": 4}})
    assert (only_end.start_profile_step, only_end.end_profile_step) == (3, 4)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"metric": "speed"}, "autotuning.metric: must be one of throughput, latency, flops"),
        ({"mp_size": 0}, "autotuning.mp_size: must be a whole number of at least 1, got 0"),
        ({"max_train_micro_batch_size_per_gpu": 0}, "at least 1, got 0"),
        (
            {"start_profile_step": 1},
            "autotuning.start_profile_step: must be a whole number of at least 2",
        ),
        (
            {"min_train_micro_batch_size_per_gpu": 8, "max_train_micro_batch_size_per_gpu": 4},
            "min_train_micro_batch_size_per_gpu: above max",
        ),
        ({"max_trials": 3}, "autotuning.max_trials: not a key of DeepSpeed's autotuning section"),
    ],
)
def test_a_bad_autotuning_section_is_refused_naming_the_key(section, message):
    from zerotrain.plan.autotuning import read_autotuning

    with pytest.raises(ValueError, match=message):
        read_autotuning({"autotuning": section})


def test_plan_serves_the_autotuning_section_and_auto_batch_keys(
    capsys, tmp_path, monkeypatch, shared_cache
):
    """A HuggingFace-style base (the batch keys "auto", train_batch_size given) with an
    autotuning section: the micro-batches stay in its limits, the global batch comes from the
    base, the choice is written to results_dir under DeepSpeed's name without the section,
    the keys that do not act are named, and metric flops ranks by FLOPs a second."""
    from zerotrain import cli

    monkeypatch.setenv("ZEROTRAIN_CACHE_DIR", shared_cache)
    base = {
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": 1},
        "autotuning": {
            "enabled": True,
            "metric": "flops",
            "tuner_num_trials": 10,
            "min_train_micro_batch_size_per_gpu": 2,
            "max_train_micro_batch_size_per_gpu": 4,
            "results_dir": str(tmp_path / "tuned"),
        },
    }
    (tmp_path / "base.json").write_text(json.dumps(base))
    argv = ["plan", "--model", GPT_TINY, "--seq-len", "64", "--nproc-per-node", "2"]
    code = cli.main([*argv, "--config", str(tmp_path / "base.json"), "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "autotuning.tuner_num_trials: no effect; the planner prices every candidate" in err
    plan = json.loads(out)
    candidates = plan["candidates"]
    assert {c["config"]["train_micro_batch_size_per_gpu"] for c in candidates} == {2, 4}
    # tp 1 / 2 x offload none / cpu x checkpointing x micro 2, 4
    assert len(candidates) == 2 * 2 * 2 * 2
    for candidate in candidates:
        assert candidate["config"]["train_batch_size"] == 16
        assert "autotuning" not in candidate["config"]
    fitting = [c for c in candidates if c["fits"]]

    def seconds_per_pass(c):  # the inverse of FLOPs a second: 4 passes with recomputation
        return c["step_time_s"] / (4 if c["activation_checkpointing"] else 3)

    chosen = candidates[plan["chosen"]]
    assert seconds_per_pass(chosen) == min(map(seconds_per_pass, fitting))
    written = json.loads((tmp_path / "tuned" / "ds_config_optimal.json").read_text())
    assert written == chosen["config"]


def test_plan_needs_a_global_batch_from_the_flag_or_the_base(capsys, tmp_path, monkeypatch):
    from zerotrain import cli

    def probed(*args, **kwargs):
        raise AssertionError("probed")

    monkeypatch.setattr(probe, "probe_machine", probed)
    base = {"train_batch_size": "auto", "autotuning": {"max_train_batch_size": 8}}
    (tmp_path / "base.json").write_text(json.dumps(base))
    argv = [
        "plan",
        "--model",
        GPT_DEMO,
        "--seq-len",
        "128",
        "--config",
        str(tmp_path / "base.json"),
    ]
    assert cli.main(argv) == 2
    assert "give --global-batch (samples per optimizer step" in capsys.readouterr().err
    assert cli.main([*argv, "--global-batch", "16"]) == 2
    err = capsys.readouterr().err
    assert "--config: --global-batch 16 lies outside autotuning's train batch limits" in err


# -- sequence parallelism ------------------------------------------------------------------------
LLAMA_TINY = "examples/llama/model.py:tiny"


def test_candidates_take_each_sequence_parallel_degree_and_shard_over_its_ranks():
    """A sequence-parallel candidate splits the batch over world / sp data-parallel ranks and
    ZeRO over all of them (a sample's sequence-parallel ranks hold the same parameters); a
    degree the base fixes is kept, and a plan's base for the same job drops it."""
    from zerotrain.plan.candidates import enumerate_candidates, without_choices

    found = enumerate_candidates(world=4, global_batch=4, base={}, nvme=False, sp_degrees=(2,))
    ulysses = [c for c in found if c.sp == 2]
    assert ulysses and {(c.dp, c.shards) for c in ulysses} == {(2, 4)}
    assert {(c.dp, c.shards) for c in found if c.sp == 1} == {(4, 4)}
    for candidate in ulysses:
        config = candidate.config({})
        assert config["sequence_parallel_size"] == 2
        assert candidate.global_batch == config["train_batch_size"] == 4
        assert candidate.label().startswith("sp 2, stage ")
    assert "sequence_parallel_size" not in next(c for c in found if c.sp == 1).config({})
    fixed = enumerate_candidates(
        world=4, global_batch=4, base={"sequence_parallel_size": 2}, nvme=False, sp_degrees=(2,)
    )
    assert fixed and {c.sp for c in fixed} == {2}
    unset = enumerate_candidates(
        world=4, global_batch=4, base={"sequence_parallel_size": 1}, nvme=False, sp_degrees=(2,)
    )
    assert {c.sp for c in unset} == {1}
    assert without_choices({"sequence_parallel_size": 2, "bf16": {"enabled": True}}) == {
        "bf16": {"enabled": True}
    }


def test_a_sequence_parallel_share_exchanges_a_share_of_the_tokens_of_every_head():
    """Ulysses' share of the tiny Llama (4 query heads, 2 key/value heads of 16): at degree 2 a
    rank holds half the tokens and exchanges q, k, v and the output at their widths; at 4 the
    key/value heads are repeated to one a rank; 3 does not divide the heads, and a model that
    is not a transformers causal LM has no attention to register."""
    from zerotrain.estimate.factory import build_on_meta
    from zerotrain.plan.sequence_share import sequence_shares

    skipped = []
    shares = sequence_shares(
        build_on_meta(LLAMA_TINY), [2, 3, 4], 255, lambda sp, why: skipped.append((sp, why))
    )
    assert list(shares) == [2, 4]
    assert (shares[2].tokens, shares[2].layers) == (128, 2)
    assert shares[2].exchanged_elements == (64, 32, 32, 64)
    assert shares[4].tokens == 64 and shares[4].exchanged_elements == (64, 64, 64, 64)
    ((degree, why),) = skipped
    assert degree == 3 and "4 attention heads do not divide into sequence_parallel_size 3" in why
    skipped.clear()
    assert sequence_shares(build_on_meta(GPT_TINY), [2], 64, lambda *a: skipped.append(a)) == {}
    assert "transformers causal LMs" in skipped[0][1]


def test_the_model_probe_runs_a_sequence_parallel_rank_s_share(monkeypatch):
    """The probe of an sp 2 share runs the tiny Llama as rank 0 of its group would: Ulysses
    registered (its all-to-alls called, four per layer, on that rank's half of the tokens) and
    undone afterwards, and the loss over the share's shifted labels; the activations it saves
    are those of a 128-token sample's half with attention over all 128 tokens, between the
    model's at 64 and at 128 tokens."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from zerotrain.estimate.factory import build_on_meta, load_factory
    from zerotrain.plan.model_probe import AloneInGroup, profile_model
    from zerotrain.plan.sequence_share import profile_sequence_share, sequence_shares
    from zerotrain.sequence import hf

    exchanged = []
    copy = AloneInGroup.all_to_all

    def counted(self, output, input, *args, **kwargs):
        exchanged.append(tuple(input.shape))
        copy(self, output, input)

    monkeypatch.setattr(AloneInGroup, "all_to_all", counted)
    before = ALL_ATTENTION_FUNCTIONS.get("sdpa")
    (share,) = sequence_shares(build_on_meta(LLAMA_TINY), [2], 128).values()
    options = {"vocab_size": 1000, "dtype": torch.float32, "threads": 1}
    timed = profile_sequence_share(
        load_factory(LLAMA_TINY), share, micro_batches=[2], seq_len=128, **options
    )
    assert ALL_ATTENTION_FUNCTIONS.get("sdpa") is before and not hf._registered
    # q: [2 ranks, 2 samples, 2 heads, 64 tokens, 16] (its halves of the heads, to each rank)
    assert (2, 2, 2, 64, 16) in exchanged
    layers, steps = 2, 4  # a warm-up and 3 timed steps, without checkpointing and with
    per_layer = 4 + 4 + (4 + 4 + 4)  # forward, backward; and the recomputed forward's too
    assert len(exchanged) == steps * layers * per_layer
    measured = timed.profile.micro_batches[2]
    plain = {
        seq: profile_model(load_factory(LLAMA_TINY), micro_batches=[2], seq_len=seq, **options)
        for seq in (64, 128)
    }
    low, high = (plain[seq].micro_batches[2].saved_bytes for seq in (64, 128))
    assert low < measured.saved_bytes < high
    assert measured.forward_backward_s > 0


def test_sequence_parallelism_is_priced_as_its_share_and_its_exchanges():
    """An sp 2 candidate's compute and activations are its share's profile; its collectives
    add per layer and pass four all-to-alls of half of the rank's q, k, v and output, with
    the loss's all-reduces and the position check; its model states are ZeRO's over both
    ranks, as two data-parallel ranks' are."""
    from zerotrain.estimate.factory import build_on_meta
    from zerotrain.plan.candidates import Candidate
    from zerotrain.plan.cost import Corrections, predict
    from zerotrain.plan.model_probe import MicroBatchProfile, ModelProfile
    from zerotrain.plan.planner import model_facts

    facts = model_facts(build_on_meta(LLAMA_TINY), seq_len=256, dtype="fp32", sp_degrees=(2,))
    share = facts.sequences[2]
    profile = ModelProfile({2: MicroBatchProfile(0.5, 10**6, 0.7, 2 * 10**5)}, layers=2)
    facts = replace(facts, sequences={2: replace(share, profile=profile)}, profile=profile)
    machine = probe.memory_only_machine(dtype="fp32", world=2)
    machine = replace(machine, adam_elements_per_s={"1": 1e8}, threads=1)
    link = probe.LinkFit(alpha=1e-4, beta=1e9)
    machine = replace(machine, links={op: link for op in probe.COLLECTIVES})

    def priced(candidate, machine=machine):
        return predict(candidate, facts, machine, Corrections(), candidate.config({}))

    for checkpointing in (False, True):
        ulysses = priced(Candidate(1, None, checkpointing, 2, 3, 2, sp=2))
        plain = priced(Candidate(1, None, checkpointing, 2, 3, 2))  # 2 data-parallel ranks
        assert ulysses.compute_s == pytest.approx(3 * (0.7 if checkpointing else 0.5))
        assert ulysses.model_state_bytes == plain.model_state_bytes
        # the loss's first gradients over a rank's 128 tokens of logits, not 256
        assert plain.peak_memory_bytes - ulysses.peak_memory_bytes == 2 * 2 * 128 * 1000 * 4
        passes = 3 if checkpointing else 2
        tokens = 2 * 128  # micro-batch x the rank's tokens
        layer = sum(link.seconds("all_to_all", tokens * e * 4 // 2, 2) for e in (64, 32, 32, 64))
        checks = 3 * link.seconds("all_reduce", 0, 2) + 2 * (passes - 1) * link.seconds(
            "all_gather", 0, 2
        )
        assert ulysses.comm_s - plain.comm_s == pytest.approx(3 * (passes * 2 * layer + checks))
    # after compute, the exchanges wait for the slower rank: the probe's interleaved fit
    after = probe.LinkFit(alpha=2e-3, beta=5e8)
    candidate = Candidate(1, None, False, 2, 3, 2, sp=2)
    waited = priced(candidate, replace(machine, interleaved=after))
    slower = waited.comm_s - priced(candidate).comm_s
    assert slower == pytest.approx(
        3 * sum(after.seconds("all_to_all", 256 * e * 2, 2) - link.seconds("all_to_all", 256 * e * 2, 2)
                for e in (64, 32, 32, 64)) * 2 * 2
        + 3 * (3 * (after.seconds("all_reduce", 0, 2) - link.seconds("all_reduce", 0, 2))
               + 2 * (after.seconds("all_gather", 0, 2) - link.seconds("all_gather", 0, 2))),
        rel=1e-9,
    )  # fmt: skip


def _prediction(spec: str, seq: int, candidate, machine):
    """``candidate``'s config for ``spec`` at ``seq`` tokens, and its prediction, the model
    probed here at the candidate's micro-batch."""
    from zerotrain.estimate.factory import build_on_meta, load_factory
    from zerotrain.plan.cost import Corrections, predict
    from zerotrain.plan.planner import model_facts, with_profiles

    sp = (candidate.sp,) * (candidate.sp > 1)
    facts = model_facts(build_on_meta(spec), seq_len=seq, dtype="fp32", sp_degrees=sp)
    facts = with_profiles(
        load_factory(spec),
        facts,
        machine,
        sizes=lambda *_: [candidate.micro_batch],
        vocab=256,
        failed=_raise,
        whole=candidate.sp == 1,
    )
    config = candidate.config({"steps_per_print": 10**9})
    return config, predict(candidate, facts, machine, Corrections(), config)


def test_a_sequence_parallel_trial_trains_each_rank_s_share():
    """A trial at sp 2 cuts every sample between the two ranks and trains it: the model
    states it measures are ZeRO's over both ranks, as the planner predicts them."""
    from zerotrain.plan.candidates import Candidate

    machine = probe.memory_only_machine(dtype="fp32", world=2)
    candidate = Candidate(2, None, True, 2, 1, 2, sp=2)
    config, predicted = _prediction(LLAMA_TINY, 128, candidate, machine)
    measured = measure_memory(TrialSpec(LLAMA_TINY, config, 2, 128, 256, True))
    assert measured.model_state_bytes == pytest.approx(predicted.model_state_bytes, abs=64)
    assert measured.peak_memory_bytes > measured.model_state_bytes


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sequence_parallel_peak_memory_is_within_5_percent_of_a_trial(tmp_path, monkeypatch):
    """The cost model's peak memory per rank against a trial's for the Llama of bench/plan.py
    at 1024 tokens: Ulysses at sp 2, and data parallelism (whose rows measured transformers'
    import as training memory, and missed the loss's gradients over a vocabulary of 8000)."""
    from zerotrain.plan.candidates import Candidate

    monkeypatch.setenv("ZEROTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    spec = "examples/llama/model.py:small"
    machine = probe.probe_machine(dtype="fp32", world=2, threads=1)
    errors = []
    for candidate in (
        Candidate(1, None, False, 1, 1, 2, sp=2),
        Candidate(3, None, True, 2, 1, 2, sp=2),
        Candidate(1, None, False, 1, 1, 2),
    ):
        config, predicted = _prediction(spec, 1024, candidate, machine)
        measured = measure_memory(
            TrialSpec(spec, config, 2, 1024, 256, candidate.activation_checkpointing)
        )
        assert measured.model_state_bytes == pytest.approx(predicted.model_state_bytes, abs=64)
        errors.append(
            (candidate.label(), predicted.peak_memory_bytes / measured.peak_memory_bytes - 1)
        )
    off = [f"{label}: {error:+.1%}" for label, error in errors if abs(error) > 0.05]
    assert not off, off


def test_plan_weighs_sequence_parallelism_for_a_transformers_causal_lm(
    capsys, tmp_path, monkeypatch, shared_cache
):
    """For the tiny Llama on 2 ranks the plan holds sp 2 candidates beside the others: each
    config says the degree, trains the global batch on one data-parallel rank, and is priced;
    a base that fixes the degree keeps only those."""
    from zerotrain import cli

    monkeypatch.setenv("ZEROTRAIN_CACHE_DIR", shared_cache)
    argv = ["plan", "--model", LLAMA_TINY, "--seq-len", "128", "--global-batch", "4"]
    argv += ["--nproc-per-node", "2", "--out", "", "--json"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert "sequence-parallel share at 2" in err
    candidates = json.loads(out)["candidates"]
    ulysses = [c for c in candidates if c["label"].startswith("sp 2, ")]
    assert ulysses and len(ulysses) < len(candidates)
    for candidate in ulysses:
        config = candidate["config"]
        assert config["sequence_parallel_size"] == 2 and config["train_batch_size"] == 4
        micro = config["train_micro_batch_size_per_gpu"]
        assert micro * config["gradient_accumulation_steps"] == 4  # one data-parallel rank
        assert candidate["peak_memory_bytes"] > candidate["model_state_bytes"] > 0
        assert candidate["step_time_s"] > 0 and candidate["comm_s"] > 0
    (tmp_path / "base.json").write_text(json.dumps({"sequence_parallel_size": 2}))
    assert cli.main([*argv, "--config", str(tmp_path / "base.json")]) == 0
    out, err = capsys.readouterr()
    fixed = json.loads(out)["candidates"]
    assert {c["label"] for c in fixed} == {c["label"] for c in ulysses}


def test_tiled_compute_is_priced_as_the_probe_runs_it(capsys, tmp_path):
    """A base with tiled_compute: the model probe runs the tiny Llama with its MLPs and loss
    tiled as initialize tiles them (fewer saved activations than untiled), and the peak holds
    one 64-token tile of the loss's logits, their softmax and gradient, and the gradients the
    fused loss keeps for the backward, not the whole micro-batch's logits twice; a GPT, which
    has no gated MLP, is refused before anything is probed."""
    from zerotrain import cli
    from zerotrain.config.schema import TiledComputeConfig
    from zerotrain.estimate.factory import build_on_meta, load_factory
    from zerotrain.plan.candidates import Candidate
    from zerotrain.plan.cost import Corrections, predict
    from zerotrain.plan.planner import model_facts, with_profiles

    section = {"mlp": True, "loss": True, "loss_tile_tokens": 64}
    machine = probe.memory_only_machine(dtype="fp32", world=1)
    facts = model_facts(build_on_meta(LLAMA_TINY), seq_len=128, dtype="fp32")
    options = {"sizes": lambda *_: [2], "vocab": 256, "failed": _raise}
    plain = with_profiles(load_factory(LLAMA_TINY), facts, machine, **options)
    tiled = with_profiles(
        load_factory(LLAMA_TINY), facts, machine, tiles=TiledComputeConfig(**section), **options
    )
    assert plain.profile is not None and tiled.profile is not None
    saved = [f.profile.micro_batches[2].saved_bytes for f in (plain, tiled)]  # type: ignore[union-attr]
    assert saved[1] < saved[0]
    candidate = Candidate(1, None, False, 2, 1, 1)
    untiled, fused = (
        predict(candidate, f, machine, Corrections(), candidate.config(base))
        for f, base in ((plain, {}), (tiled, {"tiled_compute": section}))
    )
    vocab, hidden, tokens = 1000, 64, 2 * 128
    loss = 2 * tokens * vocab * 4, 3 * 64 * vocab * 4 + (tokens + vocab) * hidden * 4
    assert untiled.peak_memory_bytes - fused.peak_memory_bytes == pytest.approx(
        saved[0] - saved[1] + loss[0] - loss[1], abs=8
    )
    (tmp_path / "tiled.json").write_text(json.dumps({"tiled_compute": {"mlp": True}}))
    argv = ["plan", "--model", GPT_TINY, "--seq-len", "64", "--global-batch", "4"]
    assert cli.main([*argv, "--config", str(tmp_path / "tiled.json"), "--out", ""]) == 2
    assert "tiled_compute.mlp: GPT has no gated MLP" in capsys.readouterr().err


MOE_DEMO = "examples/gpt/model.py:moe_demo"


def test_the_model_probe_runs_an_expert_parallel_rank_s_share(monkeypatch):
    """The MoE GPT at ep_size 2: a rank holds 2 of each MoE layer's 4 experts (its share), and
    the probe runs the model as rank 0 of the expert-parallel group would, placed on a group of
    itself whose exchanges return every row: per layer the counts, the rows, their slots and
    the outputs back in the forward (again in a checkpointed backward's recomputation), the
    three reversed in the backward; its 2 local experts take all of its tokens' choices."""
    import functools

    from zerotrain.estimate.factory import build_on_meta, load_factory
    from zerotrain.plan.expert_share import expert_share, place_alone
    from zerotrain.plan.model_probe import AloneInGroup, profile_model

    share = expert_share(build_on_meta(MOE_DEMO))
    assert share is not None
    assert (share.degree, share.layers, share.choices, share.hidden) == (2, 3, 2, 256)
    assert share.trainable == 3 * 2 * (256 * 1024 * 2) and share.frozen == 0  # fc and proj
    assert share.shards(4) == 2 and share.shards(2) == 1

    rows = []
    echo = AloneInGroup.all_to_all

    def counted(self, output, input, *args, **kwargs):
        rows.append(input.shape[0] if input.dim() == 2 and input.shape[1] == 256 else None)
        return echo(self, output, input, *args, **kwargs)

    monkeypatch.setattr(AloneInGroup, "all_to_all", counted)
    options = {"seq_len": 32, "vocab_size": 256, "dtype": torch.float32, "threads": 1}
    profile = profile_model(
        load_factory(MOE_DEMO),
        micro_batches=[2],
        prepare=functools.partial(place_alone, degree=2),
        **options,
    )
    steps, layers = 4, 3  # a warm-up and 3 timed steps, without checkpointing and with
    assert len(rows) == steps * layers * ((4 + 3) + (4 + 4 + 3))
    tokens = 2 * 32
    hidden = [r for r in rows if r is not None]  # the rows there and back, forward and backward
    assert all(0.5 * tokens * 2 <= r <= tokens * 2 for r in hidden)  # top-2, less any dropped
    assert profile.micro_batches[2].forward_backward_s > 0


def test_expert_parallelism_is_priced_over_two_shard_groups_and_its_exchanges():
    """The MoE GPT on 4 ranks: its experts' optimizer state sharded over the 2 ranks holding
    the same experts (the dense parameters over all 4), their gradients reduced over those 2;
    and per micro-batch and MoE layer the counts, the rows of a top-2 choice per token, their
    slots and the outputs back, half of each to the other rank of the group, forward and
    reversed in the backward."""
    from zerotrain.comm.communicator import ring_sent
    from zerotrain.estimate.factory import build_on_meta
    from zerotrain.plan.candidates import Candidate
    from zerotrain.plan.cost import Corrections, predict
    from zerotrain.plan.model_probe import MicroBatchProfile, ModelProfile
    from zerotrain.plan.planner import model_facts

    facts = model_facts(build_on_meta(MOE_DEMO), seq_len=128, dtype="fp32")
    experts = facts.experts
    assert experts is not None
    profile = ModelProfile({4: MicroBatchProfile(0.5, 10**6, 0.7, 2 * 10**5)}, layers=6)
    facts = replace(facts, profile=profile)
    machine = probe.memory_only_machine(dtype="fp32", world=4)
    machine = replace(machine, adam_elements_per_s={"1": 1e8}, threads=1)
    link = probe.LinkFit(alpha=1e-4, beta=1e9)
    machine = replace(machine, links={op: link for op in probe.COLLECTIVES})
    candidate = Candidate(1, None, False, 4, 2, 4)

    def priced(facts):
        return predict(candidate, facts, machine, Corrections(), candidate.config({}))

    moe, dense = priced(facts), priced(replace(facts, experts=None))
    e, psi = experts.trainable, facts.count.trainable
    # AdamW's 8 bytes an element over 2 ranks, not 4 (fp32: the masters are the parameters)
    assert moe.model_state_bytes - dense.model_state_bytes == pytest.approx(8 * e / 4, abs=64)
    assert moe.optimizer_s - dense.optimizer_s == pytest.approx((e // 2 - e // 4) / 1e8, rel=1e-3)

    def reduce(elements: int, ranks: int) -> float:
        return sum(
            link.seconds(op, ring_sent(op, elements * 4, ranks), ranks)
            for op in ("reduce_scatter", "all_gather")
        )

    units = 4 * 128 * 2  # tokens of a micro-batch, 2 choices each
    rows = link.seconds("all_to_all", units * 256 * 4 // 2, 2)
    slots = link.seconds("all_to_all", units * 8 // 2, 2)
    exchanges = 2 * 3 * (link.seconds("all_to_all", 0, 2) + 2 * (2 * rows + slots))
    expected = reduce(psi - e, 4) + reduce(e, 2) + exchanges
    assert moe.comm_s == pytest.approx(expected, rel=1e-9)


def test_an_expert_parallel_trial_holds_the_model_states_predicted():
    """A trial of the MoE GPT on 2 ranks at stage 2 measures the engine's two shard groups,
    the dense parameters over both ranks and each rank's experts whole, as the cost model
    predicts them."""
    from zerotrain.plan.candidates import Candidate

    machine = probe.memory_only_machine(dtype="fp32", world=2)
    candidate = Candidate(2, None, False, 2, 1, 2)
    config, predicted = _prediction(MOE_DEMO, 64, candidate, machine)
    measured = measure_memory(TrialSpec(MOE_DEMO, config, 2, 64, 256))
    assert measured.model_state_bytes == pytest.approx(predicted.model_state_bytes, abs=64)
    assert measured.peak_memory_bytes > measured.model_state_bytes


def test_plan_weighs_an_moe_model_with_its_experts_spread_as_it_asks(
    capsys, monkeypatch, shared_cache
):
    """The MoE GPT (ep_size 2) on 2 ranks: every candidate trains it with data and expert
    parallelism (the tensor-parallel split is not planned, and says why) and prices the
    experts' exchanges; on one rank initialize would refuse every candidate, and the plan
    says so."""
    from zerotrain import cli

    monkeypatch.setenv("ZEROTRAIN_CACHE_DIR", shared_cache)
    argv = ["plan", "--model", MOE_DEMO, "--seq-len", "64", "--global-batch", "8", "--out", ""]
    assert cli.main([*argv, "--nproc-per-node", "2", "--json"]) == 0
    out, err = capsys.readouterr()
    assert "tensor parallelism at degree 2 not planned: the model's MoE layers" in err
    candidates = json.loads(out)["candidates"]
    assert candidates and all(not c["label"].startswith("tp") for c in candidates)
    assert all(c["comm_s"] > 0 and c["step_time_s"] > 0 for c in candidates)
    assert cli.main([*argv, "--nproc-per-node", "1"]) == 2
    _, err = capsys.readouterr()
    assert "initialize would refuse every candidate config: MoE: ep_size 2" in err
