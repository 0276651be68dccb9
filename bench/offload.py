"""Optimizer offload: step time, peak RSS and NVMe bandwidth of zerotrain against DeepSpeed.

    python bench/offload.py [--model demo 100m] [--systems zt1 zt1-cpu ds1-cpu ...] [--rounds 3]
                            [--steps 3] [--launch once|per-round] [--sub-group-size 1000000]

Trains the GPT of examples/gpt/model.py on 2 ranks (torchrun, gloo, fp32, CPU) with ZeRO
stages 1-3 and `zero_optimization.offload_optimizer.device` none, cpu and nvme, under zerotrain
and under DeepSpeed on its CPU accelerator (`DS_ACCELERATOR=cpu`), with bench/step_time.py's
machinery: one torchrun job per system driven over sockets (so peak RSS is per system), the same
initial weights and tokens, AdamW with gradient clipping 1.0, the median over rounds x steps of
the slowest rank's step time, and loss parity (here against the first row). Prints one table per
model of step times as ratios to zerotrain's same stage without offload and to DeepSpeed's same
stage and offload, peak RSS, zerotrain's host bytes (`engine.memory_breakdown()['offloaded']`) and,
for nvme rows, the disk bandwidth achieved ([Note: NVMe bandwidth achieved]) next to
`zerotrain.zero.swap.measure_disk_bandwidth` of the same directory, measured in the same run
before and after the systems. Writes bench/results/offload.json.

On a CPU device "offload to cpu" moves the optimizer's fp32 masters, state and gradients from
one part of host memory to another, so the rows measure what the offload machinery costs (the
copies, the ring, the host step), not a PCIe transfer. The nvme rows put every system's working
files in a fresh directory under /tmp (one subdirectory per system), removed at the end.

A zerotrain nvme row runs only where `device: nvme` builds zerotrain's NVMe store
(`NvmeShardStore`); on a tree where the config is accepted but the optimizer state stays in host
memory, the row is listed as failed with that reason instead of giving numbers that would not
be NVMe's. DeepSpeed gets torch's fused AdamW, the kernel of every other row, with
`zero_force_ds_cpu_optimizer: false` when it offloads (else DeepSpeed refuses a client optimizer
under offload); `--deepspeed-optimizer deepspeed` gives it its config AdamW, which under offload
is DeepSpeedCPUAdam (a C++ op built on first use: about a minute on 2 cores).

[Note: stages run one at a time]
With `--launch once` (the default for models under 10M parameters) step_time.py keeps every
system's job resident; 18 systems of 2 ranks would hold about 15 GB on this 24 GB machine. The
ratios compare rows of one stage, so the benchmark times one stage at a time: the six systems of
stage 1 resident together, alternating round by round, then stage 2's, then stage 3's. With
`--launch per-round` every round starts each job anew, again stage by stage.

[Note: NVMe bandwidth achieved]
Bytes: zerotrain's NVMe store counts what it asks its swap file to read and write
(`NvmeShardStore.bytes_read`, `bytes_written`); for a store without them, and for DeepSpeed,
the bytes are what the kernel counted for each rank's process (`read_bytes` and `write_bytes` of
/proc/self/io: bytes fetched from and sent to the storage layer, every thread included; always
kept in the JSON as `proc_*`). Either is taken from before a round's first timed step to after
its last, divided by the steps. Time: how long during
those steps at least one read (or one write) call of zerotrain's swap files
(`zerotrain.zero.swap.SwapFile`, the I/O layer of NVMe offload) was in progress, measured by
wrapping its per-call `_transfer`, so calls overlapping in time count once. Achieved GB/s is
bytes over that time, per rank, the mean over ranks; the two ranks share one disk, whose own
sequential bandwidth (one process, direct I/O) is the limit it is set against. DeepSpeed's aio
calls cannot be timed from outside: its rows show bytes only.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import step_time  # bench/step_time.py: its directory is this script's sys.path[0]
import torch
from step_time import (
    ADAMW,
    CLIP,
    LOSS_RTOL,
    ROOT,
    Built,
    Row,
    Spec,
    add_run_arguments,
    engine_step,
    for_model,
    fused_adamw,
    import_deepspeed,
    print_header,
    progress,
)

from zerotrain.fmt import GB, MB, count

STAGES = (1, 2, 3)
OFFLOADS = ("none", "cpu", "nvme")
NVME_STORE = "NvmeShardStore"  # the store zerotrain builds for offload_optimizer.device nvme
NVME_ENV = "ZEROTRAIN_OFFLOAD_BENCH_NVME"  # the parent's nvme directory, passed to the jobs


@dataclass(frozen=True)
class OffloadSpec(Spec):
    """A system of the table: a library, a ZeRO stage and where the optimizer states live."""

    offload: str = "none"  # offload_optimizer.device: "none", "cpu", "nvme"; or "nvme-params"

    @property
    def uses_nvme(self) -> bool:
        return self.offload.startswith("nvme")


def _spec(family: str, stage: int, offload: str) -> OffloadSpec:
    short, name = ("zt", "zerotrain") if family == "zerotrain" else ("ds", "DeepSpeed")
    key = f"{short}{stage}" + ("" if offload == "none" else f"-{offload}")
    return OffloadSpec(key, f"{name} {stage} {offload}", family, stage, offload=offload)


# Rows in table order: per stage, zerotrain's three placements (at stage 3 a fourth: the
# parameter shards on NVMe too, offload_param, which DeepSpeed's stage-3 NVMe lacks here: no
# libaio), then DeepSpeed's.
SPECS = {
    spec.key: spec
    for spec in (
        _spec(family, stage, offload)
        for stage in STAGES
        for family in ("zerotrain", "deepspeed")
        for offload in OFFLOADS + (("nvme-params",) if (stage, family) == (3, "zerotrain") else ())
    )
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(
        parser,
        list(SPECS),
        model_help="GPT presets of examples/gpt/model.py (100m: 99.5M parameters); the "
        "benchmark runs for each in turn",
        launch_help="start each system's job once per stage (resident between rounds) or anew "
        "every round",
    )
    parser.add_argument(
        "--sub-group-size",
        type=int,
        default=1_000_000,
        help="zero_optimization.sub_group_size of the nvme rows (both systems): elements of "
        "optimizer state read, stepped and written back at a time",
    )
    parser.add_argument(
        "--disk-bytes",
        type=int,
        default=256 << 20,
        help="bytes written then read by each measure_disk_bandwidth of the nvme directory",
    )
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "offload.json"))
    return parser.parse_args(argv)


# --- configs --------------------------------------------------------------------------------


def with_offload(config: dict, spec: OffloadSpec, args: argparse.Namespace) -> dict:
    """`config` with the spec's `offload_optimizer` (DeepSpeed's keys, which zerotrain reads)."""
    if spec.offload == "none":
        return config
    section: dict[str, Any] = {"device": "nvme" if spec.uses_nvme else spec.offload}
    zero = config["zero_optimization"]
    if spec.uses_nvme:
        section["nvme_path"] = str(Path(os.environ[NVME_ENV]) / spec.key)
        zero["sub_group_size"] = args.sub_group_size
    zero["offload_optimizer"] = section
    if spec.offload == "nvme-params":
        zero["offload_param"] = dict(section)
    return config


def zerotrain_config(spec: OffloadSpec, args: argparse.Namespace) -> dict:
    return with_offload(step_time.zerotrain_config(spec.stage, args), spec, args)


def deepspeed_config(spec: OffloadSpec, args: argparse.Namespace) -> dict:
    config = with_offload(step_time.deepspeed_config(spec.stage, args), spec, args)
    if spec.offload != "none" and args.deepspeed_optimizer == "torch":
        config["zero_force_ds_cpu_optimizer"] = False  # else offload refuses torch's AdamW
    return config


# --- the worker's counters ------------------------------------------------------------------


def proc_io() -> tuple[int, int]:
    """(read_bytes, write_bytes) the kernel counted for this process: bytes fetched from and
    sent to the storage layer, all threads ([Note: NVMe bandwidth achieved])."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


class SwapTimer:
    """Seconds during which at least one swap-file read (or write) call was in progress, and the
    bytes those calls moved, in this process ([Note: NVMe bandwidth achieved])."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = {False: 0, True: 0}  # is_write -> calls in progress
        self.since = {False: 0.0, True: 0.0}  # is_write -> when the busy period began
        self.busy_s = {False: 0.0, True: 0.0}
        self.nbytes = {False: 0, True: 0}

    def install(self) -> bool:
        """Wrap `SwapFile._transfer`; False where this tree's swap module has no such call."""
        from zerotrain.zero import swap

        transfer = getattr(swap.SwapFile, "_transfer", None)
        if transfer is None:
            return False
        timer = self

        def timed_transfer(file, view, offset, is_write):
            timer._enter(is_write)
            try:
                return transfer(file, view, offset, is_write)
            finally:
                timer._leave(is_write, view.nbytes)

        swap.SwapFile._transfer = timed_transfer
        return True

    def _enter(self, is_write: bool) -> None:
        with self.lock:
            if self.active[is_write] == 0:
                self.since[is_write] = time.perf_counter()
            self.active[is_write] += 1

    def _leave(self, is_write: bool, nbytes: int) -> None:
        with self.lock:
            self.active[is_write] -= 1
            self.nbytes[is_write] += nbytes
            if self.active[is_write] == 0:
                self.busy_s[is_write] += time.perf_counter() - self.since[is_write]

    def snapshot(self) -> dict[str, float]:
        with self.lock:
            return {
                "swap_read_s": self.busy_s[False],
                "swap_write_s": self.busy_s[True],
                "swap_read_bytes": self.nbytes[False],
                "swap_write_bytes": self.nbytes[True],
            }


class RoundCounters:
    """Per round, on one rank: the disk bytes and I/O time of [Note: NVMe bandwidth achieved]
    and, for zerotrain, where its optimizer state lives."""

    def __init__(self, engine: Any = None, timer: SwapTimer | None = None):
        self.engine, self.timer = engine, timer
        self.start_values: dict[str, float] = {}

    def counters(self) -> dict[str, float]:
        read, written = proc_io()
        out = {"proc_read_bytes": read, "proc_write_bytes": written}
        if self.timer:
            out |= self.timer.snapshot()
        store = self.engine.optimizer.group.store if self.engine is not None else None
        if hasattr(store, "bytes_read"):  # NvmeShardStore counts what it reads and writes
            # and so does the parameter home with offload_param nvme
            home = self.engine.optimizer.group.residency.home
            out |= {
                f"store_{kind}_bytes": getattr(store, counter) + getattr(home, counter, 0)
                for kind, counter in (("read", "bytes_read"), ("write", "bytes_written"))
            }
        return out

    def start(self) -> None:
        self.start_values = self.counters()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: v - self.start_values[k] for k, v in self.counters().items()}
        if self.engine is not None:
            breakdown = self.engine.memory_breakdown()
            out["offloaded"] = breakdown.get("offloaded", 0.0)
            out["staging"] = breakdown.get("staging", 0.0)
            out["store"] = type(self.engine.optimizer.group.store).__name__
        return out


class NotNvmeOffload(RuntimeError):
    """zerotrain accepted `device: nvme` but kept the optimizer state in memory."""


def build_zerotrain(model: torch.nn.Module, spec: OffloadSpec, args: argparse.Namespace) -> Built:
    import zerotrain

    timer = SwapTimer()
    timed = spec.uses_nvme and timer.install()
    engine, *_ = zerotrain.initialize(model=model, config=zerotrain_config(spec, args))
    store = type(engine.optimizer.group.store).__name__
    if spec.uses_nvme and store != NVME_STORE:
        raise NotNvmeOffload(
            f"device nvme built {store}, not {NVME_STORE}: this tree keeps the optimizer "
            "state in host memory, so the row would time cpu offload"
        )
    counters = RoundCounters(engine, timer if timed else None)
    return Built(
        engine_step(engine),
        engine.memory_breakdown,
        engine.comm,
        round_start=counters.start,
        round_stats=counters.stats,
    )


def build_deepspeed(model: torch.nn.Module, spec: OffloadSpec, args: argparse.Namespace) -> Built:
    deepspeed = import_deepspeed()
    optimizer = fused_adamw(model.parameters()) if args.deepspeed_optimizer == "torch" else None
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=deepspeed_config(spec, args)
    )
    counters = RoundCounters()
    return Built(engine_step(engine), round_start=counters.start, round_stats=counters.stats)


BUILDERS: dict[str, Callable[[torch.nn.Module, Any, argparse.Namespace], Built]] = {
    "zerotrain": build_zerotrain,
    "deepspeed": build_deepspeed,
}


# --- the parent -----------------------------------------------------------------------------


@dataclass
class OffloadRow(Row):
    """A Row with every rank's round counters (RoundCounters.stats), round after round."""

    rounds: list[list[dict[str, Any]]] = field(default_factory=list)

    def add(self, result: dict) -> None:
        super().add(result)
        self.rounds.append(result["ranks"])

    def per_rank(self, key: str) -> list[float]:
        """`key` summed over the rounds, per rank."""
        return [sum(r[rank].get(key, 0.0) for r in self.rounds) for rank in range(self._nranks)]

    @property
    def _nranks(self) -> int:
        return len(self.rounds[0]) if self.rounds else 0

    def bytes_source(self) -> str:
        """Where disk bytes come from: "store" (NvmeShardStore's counters) or "proc"
        (/proc/self/io)."""
        return "store" if self.rounds and "store_read_bytes" in self.rounds[0][0] else "proc"

    def disk(self) -> dict[str, Any]:
        """Per step, mean over ranks: bytes read and written, achieved GB/s read and written
        ([Note: NVMe bandwidth achieved]; None where no swap call was timed)."""
        steps = len(self.times_s)
        source = self.bytes_source()
        out: dict[str, Any] = {"bytes_source": source}
        for kind, seconds in (("read", "swap_read_s"), ("write", "swap_write_s")):
            nbytes, busy = self.per_rank(f"{source}_{kind}_bytes"), self.per_rank(seconds)
            out[f"proc_{kind}_bytes_per_step"] = (
                statistics.mean(self.per_rank(f"proc_{kind}_bytes")) / steps
            )
            out[f"{kind}_bytes_per_step"] = statistics.mean(nbytes) / steps
            rates = [b / s / GB for b, s in zip(nbytes, busy, strict=True) if s > 0]
            out[f"{kind}_gb_s"] = statistics.mean(rates) if rates else None
            out[f"{kind}_busy_s_per_step"] = statistics.mean(busy) / steps
        return out

    def host_bytes(self, key: str) -> float | None:
        """zerotrain's memory_breakdown()[key] ("offloaded" or "staging"), max over ranks (last
        round)."""
        if self.spec.family != "zerotrain" or not self.rounds:
            return None
        return max(r.get(key, 0.0) for r in self.rounds[-1])


def unavailable(spec: OffloadSpec, args: argparse.Namespace) -> str:
    """Why `spec` cannot run here, or "" if it can."""
    if spec.family == "deepspeed":
        try:
            import_deepspeed()
        except Exception as exc:  # any import-time failure: missing package, broken op setup
            return f"skipped: import deepspeed failed ({type(exc).__name__}: {exc})"
        return ""
    from zerotrain import ConfigError
    from zerotrain.config import load_config

    try:
        load_config(zerotrain_config(spec, args), world_size=args.nproc)
    except ConfigError as exc:
        return f"not available: {str(exc).splitlines()[0]}"
    return ""


def disk_bandwidth(nbytes: int) -> tuple[float, float]:
    """measure_disk_bandwidth of the nvme directory: (write GB/s, read GB/s)."""
    from zerotrain.zero.swap import measure_disk_bandwidth

    return measure_disk_bandwidth(Path(os.environ[NVME_ENV]), nbytes)


def run_model(model: str, args: argparse.Namespace) -> dict:
    """The whole benchmark for one model, stage by stage ([Note: stages run one at a time])."""
    spec, params, model_args = for_model(model, args)
    rows = [OffloadRow(SPECS[key]) for key in args.systems]
    for row in rows:
        row.status = unavailable(row.spec, model_args)
    load = os.getloadavg()[0]
    nvme = any(row.spec.uses_nvme for row in rows)
    disk = [disk_bandwidth(args.disk_bytes)] if nvme else []
    started = time.perf_counter()
    for stage in STAGES:
        stage_rows = [row for row in rows if row.spec.stage == stage]
        if any(not row.status for row in stage_rows):
            progress(f"{model}: stage {stage}")
            step_time.measure(stage_rows, model_args, __file__)
    wall = time.perf_counter() - started
    if nvme:
        disk.append(disk_bandwidth(args.disk_bytes))
    return report(rows, model_args, params, spec.seq_len, load, disk, wall)


def report(
    rows: list[OffloadRow],
    args: argparse.Namespace,
    params: int,
    seq_len: int,
    load: float,
    disk: list[tuple[float, float]],
    wall: float,
) -> dict:
    """Print one model's table and notes; return its JSON entry."""
    measured = [row for row in rows if row.times_s]
    medians = {row.spec.key: statistics.median(row.times_s) for row in measured}
    first = measured[0] if measured else None
    disk_write = max((w for w, _ in disk), default=None)  # the limit: the best the disk showed
    disk_read = max((r for _, r in disk), default=None)
    print(
        f"\nGPT '{args.model}' ({count(params)} params), {args.nproc} ranks, fp32, gloo, "
        f"micro-batch {args.micro_batch}x{seq_len}, {args.rounds} rounds x {args.steps} steps, "
        f"--launch {args.launch} (stage by stage); load average before the run {load:.2f}; "
        f"{wall:.0f} s"
    )
    if disk:
        runs = ", ".join(f"write {w:.2f} / read {r:.2f}" for w, r in disk)
        print(f"disk under {os.environ[NVME_ENV]} (measure_disk_bandwidth, GB/s): {runs}")
    print()
    columns = [
        ("system", 23),
        ("median s/step", 13),
        ("vs zt none", 10),
        ("vs DS", 6),
        ("peak RSS GB", 11),
        ("host GB", 7),
        ("staging GB", 10),
        ("rd MB/step", 10),
        ("wr MB/step", 10),
        ("rd GB/s", 7),
        ("wr GB/s", 7),
        ("rd/disk", 7),
        ("wr/disk", 7),
        ("final loss", 10),
        ("Δloss/1st", 9),
    ]
    print_header(columns)
    records, flagged, idle_nvme = [], False, []
    sources: dict[str, list[str]] = {}  # bytes_source -> nvme rows
    for row in rows:
        spec = row.spec
        out: dict[str, Any] = {
            "system": spec.label,
            "key": spec.key,
            "family": spec.family,
            "stage": spec.stage,
            "offload": spec.offload,
        }
        if not row.times_s:
            out["status"] = row.status
            print(f"{spec.label:<23} {row.status}")
            records.append(out)
            continue
        median = medians[spec.key]
        base = medians.get(f"zt{spec.stage}")
        peer = medians.get("ds" + spec.key[2:]) if spec.family == "zerotrain" else None
        rel_loss = abs(row.loss - first.loss) / abs(first.loss) if first is not row else None
        flag = rel_loss is not None and rel_loss > LOSS_RTOL
        flagged |= flag
        io = row.disk()
        if spec.uses_nvme:
            sources.setdefault(io["bytes_source"], []).append(spec.label)
            if io["read_bytes_per_step"] + io["write_bytes_per_step"] == 0:
                idle_nvme.append(spec.label)
        rd_gb, wr_gb = io["read_gb_s"], io["write_gb_s"]
        host, staging = row.host_bytes("offloaded"), row.host_bytes("staging")
        out.update(
            status=row.status or "measured",
            median_s=median,
            min_s=min(row.times_s),  # a second view under machine noise, which only adds time
            times_s=row.times_s,
            vs_zerotrain_no_offload=median / base if base else None,
            vs_deepspeed=median / peer if peer else None,
            peak_rss_bytes=row.peak_rss,
            model_state_bytes=row.model_state,
            host_bytes=host,
            staging_bytes=staging,
            **io,
            read_vs_disk=rd_gb / disk_read if rd_gb and disk_read else None,
            write_vs_disk=wr_gb / disk_write if wr_gb and disk_write else None,
            loss=row.loss,
            rel_loss_vs_first=rel_loss,
            loss_mismatch=flag,
            ranks_per_round=row.rounds,
        )
        nvme = spec.uses_nvme
        cells = [
            f"{median:.4f}",
            _fmt(out["vs_zerotrain_no_offload"], ".3f"),
            _fmt(out["vs_deepspeed"], ".3f"),
            f"{row.peak_rss / GB:.2f}",
            _fmt(host and host / GB, ".3f"),
            _fmt(staging and staging / GB, ".3f"),
            _fmt(io["read_bytes_per_step"] / MB if nvme else None, ".1f"),
            _fmt(io["write_bytes_per_step"] / MB if nvme else None, ".1f"),
            _fmt(rd_gb, ".2f"),
            _fmt(wr_gb, ".2f"),
            _fmt(out["read_vs_disk"], ".2f"),
            _fmt(out["write_vs_disk"], ".2f"),
            f"{row.loss:.5f}",
            "-" if rel_loss is None else f"{rel_loss:.1e}" + (" !" if flag else ""),
        ]
        if row.status:  # measured, then failed in a later round
            cells[-1] += f"  ({row.status})"
        print(
            f"{spec.label:<23} "
            + " ".join(f"{cell:>{w}}" for cell, (_, w) in zip(cells, columns[1:], strict=True))
        )
        records.append(out)
    print()
    for note in footer(args, first, flagged, idle_nvme, sources):
        print(note)
    return {
        "model": args.model,
        "params": params,
        "launch": args.launch,
        "load_average_before": load,
        "wall_s": wall,
        "disk_write_read_gb_s": disk,
        "rows": records,
    }


def footer(
    args: argparse.Namespace,
    first: OffloadRow | None,
    flagged: bool,
    idle_nvme: list[str],
    sources: dict[str, list[str]],
) -> list[str]:
    adamw = ", ".join(f"{k} {v}" for k, v in ADAMW.items())
    notes = [
        f"AdamW ({adamw}), gradient clipping {CLIP}; torch {torch.__version__}"
        + (f", DeepSpeed {v}" if (v := step_time._deepspeed_version()) else "")
        + ".",
        "vs zt none: step time over zerotrain's at the same stage without offload. vs DS: "
        "zerotrain's step time over DeepSpeed's at the same stage and offload device.",
        "peak RSS: ru_maxrss, max over ranks (each system in its own processes). host GB, "
        "staging GB: zerotrain's engine.memory_breakdown()['offloaded'] (host masters, optimizer "
        "state and gradients) and ['staging'] (the buffers that carry them: the parameter ring, "
        "NVMe staging sets), max over ranks.",
    ]
    if sources:
        named = {
            "store": "NvmeShardStore's bytes_read/bytes_written",
            "proc": "/proc/self/io read_bytes/write_bytes",
        }
        notes.append(
            "rd/wr MB/step: bytes read/written per timed step, mean over ranks, from "
            + "; from ".join(f"{named[k]} for {', '.join(v)}" for k, v in sources.items())
            + ". rd/wr GB/s: those bytes over the time a swap-file read/write call was in "
            "progress (zerotrain's SwapFile, timed per call; DeepSpeed's aio cannot be timed: "
            "-), per rank, mean over ranks; rd/disk, wr/disk: over measure_disk_bandwidth "
            f"(the better of the two runs above; {args.disk_bytes >> 20} MiB, one process, "
            "direct I/O). The 2 ranks share the disk. nvme rows use sub_group_size "
            f"{args.sub_group_size:,}."
        )
    if idle_nvme:
        notes.append(
            f"No disk I/O in the timed steps of {', '.join(idle_nvme)}: the optimizer state "
            "stayed in memory."
        )
    notes.append(
        "DeepSpeed optimizer: "
        + (
            "torch.optim.AdamW(fused=True) passed to deepspeed.initialize "
            "(zero_allow_untested_optimizer; zero_force_ds_cpu_optimizer false with offload), "
            "the kernel zerotrain steps too."
            if args.deepspeed_optimizer == "torch"
            else "DeepSpeed's config AdamW (DeepSpeedCPUAdam under offload, else FusedAdam)."
        )
    )
    if first is not None:
        notes.append(f"Δloss/1st: |final loss - {first.spec.label}'s| / its.")
    if flagged:
        notes.append(f"!: final loss differs from the first row's by more than {LOSS_RTOL:g}.")
    return notes


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    args = parse_args()
    if args.worker:
        args.model = args.models[-1]  # Job passes the job's model last
        step_time.run_worker(args, SPECS, BUILDERS)
        return
    nvme_dir = tempfile.mkdtemp(prefix="zerotrain_offload_nvme_", dir="/tmp")
    os.environ[NVME_ENV] = nvme_dir  # the jobs inherit it
    try:
        results = [run_model(model, args) for model in args.models]
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)
    step_time.write_json(args, results)
    progress("done")


if __name__ == "__main__":
    main()
