"""The `comms_logger` config section and `engine.comms_summary()`."""

from __future__ import annotations

import contextlib
import io

import torch

from tests.distributed import run_distributed
from tests.test_comm_volume import WIDTH, VolumeModel


def _logged_runs():
    import zerotrain

    out = {}
    for name, logger in {
        "all": {"enabled": True, "debug": True, "verbose": True},
        "only_rs": {"enabled": True, "prof_all": False, "prof_ops": ["reduce_scatter_tensor"]},
        "off": {},
    }.items():
        torch.manual_seed(0)
        engine, *_ = zerotrain.initialize(
            model=VolumeModel(),
            config={
                "train_micro_batch_size_per_gpu": 4,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                "comms_logger": logger,
                "steps_per_print": 10**6,
            },
        )
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            for _ in range(2):
                engine.backward(engine(torch.randn(4, WIDTH)))
                engine.step()
        lines = engine.comm.log.lines if engine.comm.log is not None else {}
        out[name] = {
            "summary": engine.comms_summary(),
            "stats_sent": {op: s.sent for op, s in engine.comm.stats.items()},
            "log": {key: (v.calls, v.sent) for key, v in lines.items()},
            "printed": printed.getvalue(),
        }
    return out


def test_comms_logger_records_per_operation_and_size():
    rank0 = run_distributed(_logged_runs, 2)[0]
    logged = rank0["all"]
    # debug: each line names the zerotrain function that issued the collective
    functions = {label.split(" | ")[1].split(".")[-1] for label, _ in logged["log"]}
    # the reduction, the parameter gathers, the optimizer's norm
    assert {"_launch", "issue", "sum_over_ranks"} <= functions, functions
    # the per-size lines add up to the per-operation totals (stage 3's two groups included)
    for op, sent in logged["stats_sent"].items():
        logged_sent = sum(s for (label, _), (_, s) in logged["log"].items() if label.startswith(op))
        if op != "all_gather_object":
            assert logged_sent == sent, (op, logged_sent, sent)
    assert "reduce_scatter | ReduceScatterInBackward._launch" in logged["summary"]
    assert "GB/s" in logged["summary"]
    assert "[zerotrain comm] all_gather | " in logged["printed"]  # verbose, rank 0
    only = rank0["only_rs"]["log"]
    assert only and {label for label, _ in only} == {"reduce_scatter"}
    off = rank0["off"]
    assert off["log"] == {} and "reduce_scatter" in off["summary"] and "GB/s" not in off["summary"]
