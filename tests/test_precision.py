"""bf16 and fp16: dtypes of each copy, agreement across stages, dynamic loss scaling."""

from __future__ import annotations

import math

import torch
from distributed import run_distributed
from models import (
    AwkwardModel,
    make_batches,
    micro_batch,
    param_groups,
    relative_error,
    run_steps,
)

from zerotrain.precision import LossScaler

STEPS, MICRO = 3, 2


def _config(stage: int, precision: dict, accum: int = 1, clip: float = 1.0) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-6}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 60,
            "stage3_param_persistence_threshold": 0,
        },
        "steps_per_print": 10**6,
        **precision,
    }


def train_bf16(stages):
    import zerotrain
    from zerotrain.comm import Communicator

    comm = Communicator()
    out = {}
    for stage in stages:
        torch.manual_seed(0)
        model = AwkwardModel()
        engine, optimizer, *_ = zerotrain.initialize(
            model=model,
            model_parameters=param_groups(model, 0.1),
            # No clipping: stage 0 sums the norm over full buffers, stages 1-3 over shards, so
            # the clip coefficient may differ in its last bit (fp32 parity covers clipping).
            config=_config(stage, {"bf16": {"enabled": True}}, clip=0.0),
        )
        idx, tgt = make_batches(STEPS, MICRO * comm.world_size)
        run_steps(engine, idx, tgt, MICRO, 1, comm.world_size, comm.rank)
        masters = optimizer.optimizer.param_groups[0]["params"]
        out[stage] = {
            "state": engine.consolidated_state_dict(),
            "module_dtypes": {p.dtype for p in model.parameters()} | {model.mix.dtype},
            "master_dtypes": {m.dtype for m in masters},
            "bytes": {op: s.bytes for op, s in engine.comm.stats.items()},
        }
    return out


def test_bf16_stages_agree_bitwise_and_track_fp32():
    results = run_distributed(train_bf16, 2, [0, 1, 2, 3])
    # fp32 reference of the same run (single process, whole batch)
    torch.manual_seed(0)
    ref = AwkwardModel()
    opt = torch.optim.AdamW(param_groups(ref, 0.1), lr=1e-2, eps=1e-6)
    idx, tgt = make_batches(STEPS, MICRO * 2)
    for step in range(STEPS):
        ref(idx[step], tgt[step]).backward()
        opt.step()
        opt.zero_grad()
    for per_stage in results:
        base = per_stage[0]["state"]
        for stage, got in per_stage.items():
            assert got["module_dtypes"] == {torch.bfloat16}
            assert got["master_dtypes"] == {torch.float32}
            # Two ranks: a+b rounds the same in an all-reduce and a reduce-scatter, and the
            # 1/2 pre-division is exact, so every stage computes bit-identical bf16 updates.
            for key, value in got["state"].items():
                assert torch.equal(value, base[key]), (stage, key)
            for key, value in ref.state_dict().items():
                assert relative_error(got["state"][key], value) < 3e-2, (stage, key)
        # Gradients travel in bf16: stage 0 all-reduces 2 bytes per padded element.
        padded = sum(-(-n // 2) * 2 for n in _bucket_sizes())
        assert per_stage[0]["bytes"]["all_reduce"] >= STEPS * padded * 2
        assert per_stage[0]["bytes"]["all_reduce"] < STEPS * padded * 4


def _bucket_sizes():
    # reduce_bucket_size 60 over the awkward model's groups, reverse order (see partition.py)
    torch.manual_seed(0)
    groups = param_groups(AwkwardModel(), 0.1)
    sizes = []
    for group in groups:
        current = 0
        for p in reversed(group["params"]):
            if current and current + p.numel() > 60:
                sizes.append(current)
                current = 0
            current += p.numel()
        sizes.append(current)
    return sizes


def train_fp16_with_overflow(
    stage: int, overflow_rank: int, overflow_step: int, zero: dict | None = None
):
    import zerotrain
    from zerotrain.comm import Communicator

    comm = Communicator()
    torch.manual_seed(0)
    model = AwkwardModel()
    config = _config(
        stage,
        {"fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}},
        accum=2,
    )
    config["zero_optimization"].update(zero or {})
    config["scheduler"] = {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2, "warmup_num_steps": 10},
    }
    engine, *_ = zerotrain.initialize(
        model=model, model_parameters=param_groups(model, 0.1), config=config
    )
    idx, tgt = make_batches(4, MICRO * 2 * comm.world_size)
    log = []
    for step in range(4):
        before = {k: v.clone() for k, v in engine.consolidated_state_dict().items()}
        scale_before, lr_before = engine.loss_scale, engine.get_lr()
        for micro in range(2):
            x = micro_batch(idx[step], micro, comm.rank, comm.world_size, MICRO)
            y = micro_batch(tgt[step], micro, comm.rank, comm.world_size, MICRO)
            loss = engine(x, y)
            if step == overflow_step and micro == 1 and comm.rank == overflow_rank:
                loss = loss * float("inf")  # this rank's gradients overflow
            engine.backward(loss)
            engine.step()
        after = engine.consolidated_state_dict()
        changed = any(not torch.equal(after[k], before[k]) for k in after)
        log.append(
            {
                "changed": changed,
                "applied": engine.was_step_applied(),
                "scale": (scale_before, engine.loss_scale),
                "lr": (lr_before, engine.get_lr()),
                "skipped": engine.skipped_steps,
                "dtype": next(model.parameters()).dtype,
                "finite": all(torch.isfinite(v).all() for v in after.values()),
            }
        )
    return log


def test_fp16_overflow_on_one_rank_skips_step_everywhere():
    for stage in (0, 2, 3):
        for rank_log in run_distributed(train_fp16_with_overflow, 2, stage, 1, 1):
            assert [e["changed"] for e in rank_log] == [True, False, True, True], stage
            assert [e["applied"] for e in rank_log] == [True, False, True, True]
            assert rank_log[1]["scale"] == (256.0, 128.0)  # halved (hysteresis 1)
            assert rank_log[2]["scale"] == (128.0, 128.0)
            assert rank_log[1]["lr"][0] == rank_log[1]["lr"][1]  # scheduler did not advance
            assert rank_log[2]["lr"][1] != rank_log[2]["lr"][0]
            assert rank_log[-1]["skipped"] == 1
            assert rank_log[0]["dtype"] == torch.float16
            assert all(e["finite"] for e in rank_log)


def test_dynamic_loss_scaler_follows_deepspeed_rules():
    scaler = LossScaler(scale=2.0**4, dynamic=True, scale_window=3, hysteresis=2, min_scale=2)
    scaler.update(True)  # absorbed by hysteresis
    assert scaler.scale == 16
    scaler.update(True)  # hysteresis exhausted: halve
    assert scaler.scale == 8
    for _ in range(2):
        scaler.update(False)
    assert scaler.scale == 8
    scaler.update(False)  # 3 clean steps since the last overflow: double
    assert scaler.scale == 16
    for _ in range(10):
        scaler.update(True)
    assert scaler.scale == 2  # floor
    static = LossScaler(scale=128)
    static.update(True)
    assert static.scale == 128
    state = scaler.state_dict()
    clone = LossScaler(dynamic=True, scale_window=3, hysteresis=2, min_scale=2)
    clone.load_state_dict(state)
    for s in (scaler, clone):
        s.update(False)
        s.update(False)
    assert clone.scale == scaler.scale and not math.isnan(clone.scale)
