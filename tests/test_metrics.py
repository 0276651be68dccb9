"""Step metrics: the record of each step, the throughput line, and what they cost."""

from __future__ import annotations

import contextlib
import io
import types

import pytest
import torch
from distributed import run_distributed
from models import SEQ, AwkwardModel, make_batches, micro_batch

import zerotrain
from zerotrain.comm import Communicator, OpStats
from zerotrain.fmt import MB
from zerotrain.observability import metrics
from zerotrain.observability.metrics import StepMetrics, sequence_length

MICRO, ACCUM = 2, 2


def train_steps(engine, steps: int, before_step=None, after_step=None) -> list[list[float]]:
    """``steps`` optimizer steps of AwkwardModel batches, this rank's ACCUM micro-batches of
    MICRO each; ``before_step(step)`` / ``after_step(step)`` run around each. Returns every
    step's micro-step losses."""
    comm = engine.comm
    idx, tgt = make_batches(steps, MICRO * ACCUM * comm.world_size)
    losses = []
    for step in range(steps):
        if before_step is not None:
            before_step(step)
        losses.append([])
        for micro in range(ACCUM):
            x = micro_batch(idx[step], micro, comm.rank, comm.world_size, MICRO)
            y = micro_batch(tgt[step], micro, comm.rank, comm.world_size, MICRO)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses[-1].append(loss.item())
        if after_step is not None:
            after_step(step)
    return losses


def awkward_forward_flops(batch: int) -> int:
    """2·m·n·k for AwkwardModel's four Linear layers (up, frozen, down, head)."""
    return 2 * batch * SEQ * (7 * 13 + 13 * 13 + 13 * 7 + 7 * 11)


def test_sequence_length_is_dim_1_of_integer_token_ids():
    ids = torch.zeros(4, 9, dtype=torch.long)
    assert sequence_length((ids, torch.zeros(4)), {}) == 9
    assert sequence_length((torch.zeros(4, 9), ids), {}) is None  # first tensor is float
    assert sequence_length((), {"input_ids": ids.int()}) == 9
    assert sequence_length((torch.zeros(4, dtype=torch.long),), {}) is None  # no sequence
    assert sequence_length(("text",), {"attention_mask": ids}) is None


def test_rates_are_averaged_over_the_steps_since_the_last_line(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    step_metrics = StepMetrics(
        Communicator(), torch.device("cpu"), train_batch_size=8, micro_steps=1
    )
    step_metrics.forward_flops = 10**12
    records = []
    # two steps of 1 s and 3 s (+ 0.125 s of one-time set-up left out), then one of 2 s
    for end, loss, excluded in ((1.0, 2.0, 0.0), (4.125, 4.0, 0.125), (6.125, 1.0, 0.0)):
        step_metrics.start_micro_step(clock[0])
        step_metrics.observe_forward((torch.zeros(8, 16, dtype=torch.long),), {}, 0.25)
        step_metrics.exclude(excluded, "forward")
        step_metrics.observe_loss(torch.tensor(loss))
        step_metrics.add_time("backward", 0.5)
        clock[0] = end
        records.append(
            step_metrics.finish_step(
                step=len(records) + 1,
                lr=[0.1, 0.01],
                grad_norm=1.5,
                loss_scale=1.0,
                skipped_steps=0,
                report=True,
            )
        )
        if len(records) == 2:
            line = step_metrics.throughput_line(records[-1], wall_clock_breakdown=True)
    first, second, third = records
    assert (first.seconds, second.seconds, third.seconds) == (1.0, 3.0, 2.0)
    assert (second.loss, second.samples_per_second, second.tokens_per_second) == (
        4.0,
        8 / 3,
        128 / 3,
    )
    assert second.tflops_per_rank == 1.0  # 3 x 1e12 FLOPs in 3 s
    parts = line.split(" | ")
    assert parts[:6] == [
        "[zerotrain] step 2",
        "loss 4",
        "lr [0.1, 0.01]",
        "4 samples/s",  # 16 samples in 4 s, not the mean of 8 and 2.67
        "64 tokens/s",
        "1.5 TFLOP/s per rank",
    ]
    assert parts[6].startswith("RSS ") and "(peak " in parts[6]
    assert parts[7:11] == ["grad norm 1.5", "loss scale 1", "skipped 0", "2.000 s/step"]
    # forward: (0.25 + 0.25 - 0.125) / 2 steps
    assert parts[11] == "forward 187.5 ms, backward 500.0 ms, step 0.0 ms"
    assert parts[12] == "communication: 0.0 ms exposed, 0.00 MB sent per step"
    # the next line's window holds the third step only
    assert "| 4 samples/s |" in step_metrics.throughput_line(third)
    scalars = second.scalars()
    assert scalars["Train/lr"] == 0.1 and scalars["Train/lr_group1"] == 0.01
    assert scalars["Train/memory_rss_gb"] > 0 and scalars["Train/memory_peak_rss_gb"] > 0


def _reported_steps():
    torch.manual_seed(0)
    engine, *_ = zerotrain.initialize(
        model=AwkwardModel(),
        config={
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": ACCUM,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 2},
            "steps_per_print": 2,
        },
    )
    records = []
    finish_step = engine.metrics.finish_step

    def keep(**kwargs):
        records.append(finish_step(**kwargs))
        return records[-1]

    engine.metrics.finish_step = keep
    marks = []  # (calls, bytes sent) of all-reduces before and after each step

    def mark(step):
        stats = engine.comm.stats.get("all_reduce", OpStats())
        marks.append((stats.calls, stats.sent))

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        losses = train_steps(engine, 4, before_step=mark, after_step=mark)
    all_reduces = [
        (c1 - c0, s1 - s0) for (c0, s0), (c1, s1) in zip(marks[::2], marks[1::2], strict=True)
    ]
    return {
        "losses": losses,
        "all_reduces": all_reduces,
        "records": records,
        "printed": printed.getvalue(),
        "forward_flops": engine.metrics.forward_flops,
    }


def test_loss_is_averaged_over_micro_steps_and_ranks_with_one_all_reduce():
    rank0, rank1 = run_distributed(_reported_steps, 2)
    world = 2
    for step, record in enumerate(rank0["records"], start=1):
        if step % 2:
            assert record is None, step  # not reported: nothing read, nothing reduced
            continue
        expected = sum(rank0["losses"][step - 1] + rank1["losses"][step - 1]) / (ACCUM * world)
        assert record.loss == pytest.approx(expected, rel=1e-12), step
        assert record.step == step and record.samples == MICRO * ACCUM * world
        assert record.tokens == MICRO * ACCUM * world * SEQ
        assert record.model_flops == 3 * awkward_forward_flops(MICRO) * ACCUM * world
        assert record.memory.kind == "rss" and record.memory.current_bytes > 0
        assert rank1["records"][step - 1].loss == record.loss  # every rank joins the reduction
    assert rank0["forward_flops"] == awkward_forward_flops(MICRO) and rank1["forward_flops"] is None
    # a printing step adds exactly one all-reduce, of (sum, count) in float64; others none
    (quiet, quiet_sent), (printing, print_sent), *rest = rank0["all_reduces"]
    assert rest == [(quiet, quiet_sent), (printing, print_sent)], rank0["all_reduces"]
    assert printing == quiet + 1 and print_sent - quiet_sent == 2 * (world - 1) / world * 16
    lines = [line for line in rank0["printed"].splitlines() if line.startswith("[zerotrain]")]
    assert [line.split(" | ")[0] for line in lines] == ["[zerotrain] step 2", "[zerotrain] step 4"]
    assert all("tokens/s" in line and "TFLOP/s per rank" in line for line in lines)
    assert "[zerotrain]" not in rank1["printed"]


def test_count_model_flops_false_leaves_tflops_out(capsys):
    torch.manual_seed(0)
    engine, *_ = zerotrain.initialize(
        model=AwkwardModel(),
        config={
            "train_micro_batch_size_per_gpu": MICRO,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "steps_per_print": 1,
            "count_model_flops": False,
        },
    )
    idx, tgt = make_batches(1, MICRO)
    engine.backward(engine(idx[0], tgt[0]))
    engine.step()
    line = capsys.readouterr().out.strip()
    assert line.startswith("[zerotrain] step 1 | loss ") and "tokens/s" in line, line
    assert "TFLOP/s" not in line and engine.metrics.forward_flops is None


def test_link_probes_are_not_counted_as_the_steps_traffic():
    from zerotrain.comm.link import PROBE

    comm = Communicator()
    step_metrics = StepMetrics(comm, torch.device("cpu"), train_batch_size=8, micro_steps=1)
    comm.stats["all_reduce"] = OpStats(calls=1, bytes=2 * MB, sent=2 * MB)
    comm.stats[PROBE] = OpStats(calls=8, bytes=16 * MB, sent=16 * MB)  # comm_compression.auto's
    step_metrics.start_micro_step(0.0)
    step_metrics.observe_loss(torch.tensor(1.0))
    record = step_metrics.finish_step(
        step=1, lr=[0.1], grad_norm=1.0, loss_scale=1.0, skipped_steps=0, report=True
    )
    line = step_metrics.throughput_line(record, wall_clock_breakdown=True)
    assert line.endswith("2.00 MB sent per step")


def test_a_link_too_fast_for_the_probe_is_not_given_a_rate():
    from zerotrain.comm.link import Link

    assert Link(alpha=2e-5, beta=5e8).describe() == "20 us per hop, 4 Gb/s"
    # the probe's clamp (4 MiB in 1e-9 s) once read "3.35e+07 Gb/s"
    unresolved = Link(alpha=2e-5, beta=4.2e15, resolved=False).describe()
    assert unresolved == (
        "20 us per hop, bandwidth beyond what the probe resolves (a 4 MiB all-reduce took no "
        "longer than a 1 KiB one)"
    )


def test_with_a_total_the_line_says_step_n_of_total_and_the_time_left(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    step_metrics = StepMetrics(
        Communicator(), torch.device("cpu"), train_batch_size=8, micro_steps=1
    )
    for step, end in ((1, 2.0), (2, 5.0)):  # 2.5 s per step over the window
        step_metrics.start_micro_step(clock[0])
        step_metrics.observe_loss(torch.tensor(1.0))
        clock[0] = end
        record = step_metrics.finish_step(
            step=step, lr=[0.1], grad_norm=1.0, loss_scale=1.0, skipped_steps=0, report=True
        )
    parts = step_metrics.throughput_line(record, total_steps=50).split(" | ")
    assert parts[:2] == ["[zerotrain] step 2/50", "ETA 2:00"]  # 48 steps x 2.5 s
    # a schedule that ended before the run (a resumed run given more steps) is no total
    step_metrics.observe_loss(torch.tensor(1.0))
    clock[0] = 6.0
    record = step_metrics.finish_step(
        step=3, lr=[0.1], grad_norm=1.0, loss_scale=1.0, skipped_steps=0, report=True
    )
    past = step_metrics.throughput_line(record, total_steps=1).split(" | ")
    assert past[:2] == ["[zerotrain] step 3", "loss 1"]


def test_the_engine_takes_its_total_from_the_schedule_unless_told(capsys):
    engine, *_ = zerotrain.initialize(
        model=AwkwardModel(),
        config={
            "train_batch_size": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "scheduler": {
                "type": "WarmupDecayLR",
                "params": {"total_num_steps": 40, "warmup_num_steps": 1},
            },
            "steps_per_print": 1,
        },
    )
    assert engine.total_steps == 40
    engine.total_steps = 3
    idx, targets = make_batches(1, 2)
    engine.backward(engine(idx[0], targets[0]))
    engine.step()
    assert "[zerotrain] step 1/3 | ETA " in capsys.readouterr().out
