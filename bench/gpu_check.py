"""Every GPU path of zerotrain on one GPU, in one command that fits a few minutes of GPU time:
tests/test_cuda.py, then a short benchmark of each path (a few training steps of the example GPT,
or a few calls of a compression codec), written to one results file.

    python bench/gpu_check.py --out DIR        # one GPU: estimated 5 minutes, at most 10
    python bench/gpu_check.py --dry-run        # the same cases on the CPU, tiny sizes
    python bench/gpu_check.py --show DIR/results.json

The GPU machine needs no network: packages its Python lacks (pydantic, tqdm, pytest-timeout)
are installed from the wheels scripts/gpu_wheels.sh downloaded (--wheels) into a folder of their
own put first on the path (--site). Each case runs in a process of its own (forked from one
that imported torch and zerotrain once) with its own timeout, so a hang or a crash costs that
case only, and the whole run stops starting cases when --budget-s is spent. DIR/results.json is
rewritten after every case (a run stopped from outside keeps what it finished); DIR/logs holds
each case's output, DIR/test_cuda.log and test_cuda.xml the tests'. The exit status is 0 when
the tests passed and every case is ok, 1 otherwise. See bench/README.md#gpu_checkpy.

This process imports no torch: the cases run in the forked ones (bench/gpu_cases.py).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
DEFAULT_WHEELS = ROOT / "build" / "gpu-wheels"
DEFAULT_OUT = ROOT / "bench" / "results" / "gpu_check"

# What zerotrain (pydantic, tqdm) and pyproject's pytest options (--timeout: pytest-timeout)
# need beyond the GPU image's torch, pytest, safetensors, pyyaml and transformers: import name
# -> distribution.
NEEDED = {"pydantic": "pydantic", "tqdm": "tqdm", "pytest_timeout": "pytest-timeout"}


@dataclass(frozen=True)
class Case:
    """One GPU path: ``body`` (a function of gpu_cases.BODIES) called with ``kwargs``."""

    name: str
    reaches: str  # the path, in a few words
    body: str
    kwargs: dict = field(default_factory=dict)
    timeout_s: float = 90.0


def _train(name: str, reaches: str, stage: int, timeout_s: float = 90.0, **kwargs) -> Case:
    return Case(name, reaches, "train", {"stage": stage, **kwargs}, timeout_s)


_CPU_OFFLOAD = {"offload_optimizer": {"device": "cpu"}}
# In this order; the slowest (compiling) last, so that a spent --budget-s cuts it alone.
CASES = [
    _train("stage0", "in memory: NCCL, fused AdamW on the device, the throughput line", 0),
    _train("stage1", "in memory: optimizer states sharded", 1),
    _train("stage2", "in memory: gradients reduce-scattered in backward", 2),
    _train("stage3", "in memory: parameters gathered per unit, prefetch", 3),
    _train("stage2-fp16", "fp16: the dynamic loss scale's overflow check", 2, precision="fp16"),
    _train(
        "offload-cpu",
        "optimizer offload: pinned host buffers, side-stream gradient copies, host threads",
        2,
        zero=_CPU_OFFLOAD,
    ),
    _train(
        "offload-cpu-auto",
        "ratio auto: the device's free memory (cudaMemGetInfo) decides",
        2,
        zero={"offload_optimizer": {"device": "cpu", "ratio": "auto"}},
    ),
    _train(
        "offload-cpu-overlap",
        "host steps deferred to the next forward (overlap_param_gather)",
        2,
        zero={**_CPU_OFFLOAD, "overlap_param_gather": True},
    ),
    _train(
        "offload-nvme",
        "NVMe optimizer offload: pinned aligned staging, direct I/O",
        2,
        nvme=["offload_optimizer"],
    ),
    _train("stage3-offload-cpu", "stage 3 with optimizer offload", 3, zero=_CPU_OFFLOAD),
    _train(
        "stage3-param-offload-cpu",
        "stage 3 parameter offload to the host: pinned buffers, CUDA events",
        3,
        zero={**_CPU_OFFLOAD, "offload_param": {"device": "cpu"}},
    ),
    _train(
        "stage3-param-offload-nvme",
        "stage 3 parameters and optimizer on NVMe (ZeRO-Infinity)",
        3,
        nvme=["offload_optimizer", "offload_param"],
    ),
    _train(
        "stage3-zero-init",
        "zero.Init: parameters partitioned as built, over NCCL",
        3,
        build="zero_init",
    ),
    _train(
        "activation-offload",
        "activation checkpointing, inputs kept in pinned host memory, synchronized timing",
        2,
        build="checkpointed",
        config={"activation_checkpointing": {"cpu_checkpointing": True, "profile": True}},
    ),
    _train(
        "flops-profiler",
        "flops profiler: synchronized module timing, the device's peak measured",
        2,
        config={"flops_profiler": {"enabled": True, "profile_step": 1, "detailed": False}},
    ),
    _train(
        "checkpoint",
        "stage 3 save (and an asynchronous one) and load on the device, the CUDA RNG state",
        3,
        checkpoint=True,
    ),
    _train(
        "tp1",
        "tensor parallelism over one rank: split layers, sequence-parallel gathers",
        2,
        build="tensor_parallel",
    ),
    _train(
        "pp1",
        "a PipelineModule of one stage: 1F1B over 2 micro-batches",
        1,
        build="pipeline",
        accum=2,
    ),
    _train("moe-ep1", "MoE, 4 experts top-2, dispatched over one rank's group", 2, build="moe"),
    Case(
        "codec-powersgd",
        "gradient codec: PowerSGD's factors, orthonormalized on the device",
        "gradient_codec",
        {"method": "powersgd"},
    ),
    Case(
        "codec-topk",
        "gradient codec: top-k selection on the device",
        "gradient_codec",
        {"method": "topk"},
    ),
    Case(
        "codec-int8",
        "gradient codec: block-wise int8 (qgZ's quantized exchange)",
        "gradient_codec",
        {"method": "int8"},
    ),
    Case(
        "param-codec-int8",
        "parameter codec: int8 parameter all-gather (ZeRO++'s qwZ)",
        "parameter_codec",
        {"method": "int8"},
    ),
    Case(
        "tiled-compute",
        "long sequences' tiled MLP (dropout replayed on the CUDA generator) and fused loss",
        "tiled_compute",
    ),
    _train(
        "muon-bf16",
        "Muon (Newton-Schulz batched by shape on the device) over bf16 masters and states",
        2,
        precision="bf16",
        config={
            "optimizer": {"type": "Muon", "params": {"lr": 1e-3, "muon_lr": 0.02}},
            "bf16": {
                "enabled": True,
                "bf16_master_weights_and_grads": True,
                "bf16_optimizer_states": True,
            },
        },
    ),
    Case(
        "plan",
        "zerotrain plan: the machine probe on the device, the model probe, a trial of the "
        "choice, a pipeline cut timed by stage",
        "plan",
        timeout_s=300.0,
    ),
    _train(
        "stage3-compiled",
        "stage 3 with model.compile() (inductor on the GPU, eager in the dry run)",
        3,
        timeout_s=240.0,
        build="compiled",
    ),
]
CASE_NAMES = [case.name for case in CASES]

# Each file of zerotrain with CUDA-only code, and the cases that reach it (or why none can on
# one GPU). tests/test_gpu_check.py fails when a file with such code is missing here.
CUDA_CODE: dict[str, tuple[str, ...] | str] = {
    "zerotrain/accelerator.py": ("stage0",),
    "zerotrain/api.py": ("stage0",),
    "zerotrain/estimate/preflight.py": ("stage0",),  # the device's free memory, at initialize
    "zerotrain/comm/setup.py": ("stage0",),
    "zerotrain/comm/functional.py": ("stage3-zero-init",),
    "zerotrain/optim/adam.py": ("stage0",),
    "zerotrain/optim/registry.py": ("stage0",),
    "zerotrain/observability/metrics.py": ("stage0",),
    "zerotrain/observability/flops_profiler.py": ("flops-profiler",),
    "zerotrain/activation_checkpointing.py": ("activation-offload",),
    "zerotrain/sequence/tiled.py": ("tiled-compute",),  # the CUDA generator's replay
    "zerotrain/optim/muon.py": ("muon-bf16",),  # Newton-Schulz batched by shape on a GPU
    "zerotrain/checkpoint/rng.py": ("checkpoint",),
    "zerotrain/checkpoint/background.py": ("checkpoint",),  # pinned buffers, side-stream copies
    "zerotrain/zero/offload.py": (
        "offload-cpu",
        "offload-cpu-auto",
        "offload-cpu-overlap",
        "offload-nvme",
        "stage3-offload-cpu",
    ),
    # pinned host tensors and the host step's cores, for the offloaded stores and the homes
    "zerotrain/zero/host.py": ("offload-cpu", "offload-nvme", "stage3-param-offload-cpu"),
    "zerotrain/zero/param_home.py": ("stage3-param-offload-cpu", "stage3-param-offload-nvme"),
    "zerotrain/zero/swap.py": ("offload-nvme", "stage3-param-offload-nvme"),
    "zerotrain/zero/init.py": ("stage3-zero-init",),
    # the planner's device rates, its model probe and trials (synchronized timing, peaks)
    "zerotrain/plan/probe.py": ("plan",),
    "zerotrain/plan/cost.py": ("plan",),  # a GPU machine's device, named by its model
    "zerotrain/plan/model_probe.py": ("plan",),
    "zerotrain/plan/pipeline_share.py": ("plan",),
    "zerotrain/plan_trial.py": ("plan",),
    "zerotrain/comm/link.py": "the link probes of comm_compression.auto run between 2+ ranks",
    "zerotrain/cli/launch.py": "counts the GPUs for --nproc-per-node: the launcher, not training",
    "zerotrain/config/params.py": "names 'nccl' among a config key's accepted values",
    "zerotrain/optim/onebit.py": "accepts DeepSpeed's comm_backend_name, without effect",
}


# -- packages ----------------------------------------------------------------------------------
def _missing(needed: dict[str, str]) -> list[str]:
    importlib.invalidate_caches()
    return [module for module in needed if importlib.util.find_spec(module) is None]


def _on_path(folder: Path, first: bool) -> None:
    """``folder`` on this process's path and its children's (PYTHONPATH), first or last."""
    if str(folder) not in sys.path:
        sys.path.insert(0 if first else len(sys.path), str(folder))
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(folder) not in paths:
        paths = [str(folder), *paths] if first else [*paths, str(folder)]
        os.environ["PYTHONPATH"] = os.pathsep.join(paths)


def ensure_packages(wheels: Path, site: Path, needed: dict[str, str] = NEEDED) -> list[str]:
    """Make the modules of ``needed`` importable: where this Python lacks them, install every
    wheel in ``wheels`` (pip, no index, no network) into ``site`` and put it first on the path,
    ahead of the image's own packages (pydantic needs a newer typing-extensions than torch
    does). Returns the distributions installed (none when all were there)."""
    if not _missing(needed):
        return []
    if site.is_dir():  # installed by an earlier run on this machine
        _on_path(site, first=True)
        if not _missing(needed):
            return []
    lacking = [needed[module] for module in _missing(needed)]
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not found:
        raise SystemExit(
            f"gpu_check: {', '.join(lacking)} not installed, and {wheels} holds no wheels: run "
            "scripts/gpu_wheels.sh on a machine with network access and carry that folder "
            "(the device tool's carry parameter), or pass --wheels"
        )
    names = sorted({wheel.name.split("-")[0] for wheel in found})
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps"]
    command += ["--find-links", str(wheels), "--target", str(site), *names]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(
            f"gpu_check: installing the wheels of {wheels} failed (this is Python "
            f"{sys.version.split()[0]}; scripts/gpu_wheels.sh takes PYTHON_VERSION):\n"
            f"$ {' '.join(command)}\n{done.stdout}{done.stderr}"
        )
    _on_path(site, first=True)
    still = _missing(needed)
    if still:
        raise SystemExit(f"gpu_check: {', '.join(still)} not importable after installing {names}")
    return names


# -- running -----------------------------------------------------------------------------------
def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class Children:
    """Runs case bodies each in a process forked from one server that imported torch,
    zerotrain and the cases once (a torch import costs seconds a process)."""

    def __init__(self, logs: Path, scratch: Path):
        self.logs, self.scratch = logs, scratch
        self.ctx = mp.get_context("forkserver")
        # the forkserver finds gpu_cases (and zerotrain, not installed on a GPU image) through
        # PYTHONPATH: Python 3.11's ignores the parent's sys.path for its preload, and a
        # preload that fails to import is skipped without a word. Last: they fill gaps only.
        for folder in (ROOT, BENCH):
            _on_path(folder, first=False)
        self.ctx.set_forkserver_preload(["gpu_cases"])

    def run(self, name: str, body: str, kwargs: dict, setting: dict, timeout_s: float) -> dict:
        """``body(**kwargs)`` in a process of its own; its result, or failed / timeout with
        why, and its seconds."""
        log = self.logs / f"{name}.log"
        log.unlink(missing_ok=True)
        result_path = self.scratch / f"{name}.result.json"
        result_path.unlink(missing_ok=True)
        setting = {**setting, "scratch": str(self.scratch / name)}
        args = (body, kwargs, setting, str(result_path), str(log))
        start = time.monotonic()
        process = self.ctx.Process(target=_in_child, args=args, name=f"gpu_check {name}")
        process.start()
        process.join(timeout_s)
        seconds = time.monotonic() - start
        killed = process.is_alive()
        if killed:
            process.kill()
            process.join(30)
        shutil.rmtree(setting["scratch"], ignore_errors=True)  # a killed case's NVMe files
        try:
            result = json.loads(result_path.read_text())
            result_path.unlink()
        except (OSError, ValueError):
            result = {
                "status": "timeout" if killed else "failed",
                "error": f"stopped after {timeout_s:g} s (its timeout); see {log.name}"
                if killed
                else f"its process ended (exit code {process.exitcode}) before writing a "
                f"result; see {log.name}",
            }
        if killed and result["status"] == "ok":  # the result came, the teardown hung
            result["note"] = f"its process did not exit after its result: killed at {timeout_s:g} s"
        if result["status"] != "ok":
            result["log_tail"] = _tail(log)
        return {**result, "seconds": seconds}


def _in_child(*args) -> None:
    """A case's process: multiprocessing imports this file there (as it does a spawned
    process's main module), and gpu_cases comes imported from the forkserver."""
    import gpu_cases

    gpu_cases.run_in_child(*args)


def run_tests(out: Path, timeout_s: float) -> dict:
    """``pytest tests/test_cuda.py`` in a process group of its own (its ranks included),
    stopped at ``timeout_s``; the outcome and each failure's first line, from its JUnit XML."""
    xml, log = out / "test_cuda.xml", out / "test_cuda.log"
    xml.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    command += [f"--junitxml={xml}", "tests/test_cuda.py"]
    start = time.monotonic()
    with open(log, "w") as output:
        process = subprocess.Popen(
            command, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code = None
    outcome: dict = {"command": " ".join(command[1:]), "seconds": time.monotonic() - start}
    if code is None:
        outcome.update(status="timeout", error=f"stopped after {timeout_s:.0f} s")
    else:
        outcome.update(status="passed" if code == 0 else "failed", exit_code=code)
    outcome.update(_junit(xml))
    if outcome["status"] != "passed":
        outcome["log_tail"] = _tail(log)
    return outcome


def _junit(xml: Path) -> dict:
    try:
        root = ElementTree.parse(xml).getroot()
    except (OSError, ElementTree.ParseError):
        return {}
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return {}
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    failures = []
    for case in suite.iter("testcase"):
        for bad in (*case.findall("failure"), *case.findall("error")):
            message = (bad.get("message") or bad.text or "").strip().splitlines()
            failures.append(f"{case.get('name')}: {message[0] if message else bad.tag}")
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "passed": passed, "failed_tests": failures}


# -- results -----------------------------------------------------------------------------------
def _mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:,.0f}"


def _note(row: dict) -> str:
    """A case's last column: why it failed, or what else it measured."""
    if row["status"] != "ok":
        return row.get("error", "")
    notes = [row["note"]] if "note" in row else []
    if "relative_error" in row:
        notes.append(f"relative error {row['relative_error']:.2g}")
    if row.get("offloaded_bytes"):
        notes.append(f"offloaded {_mib(row['offloaded_bytes'])} MiB")
    if "save_s" in row:
        notes.append(
            f"save {row['save_s']:.2f} s (async {row['async_save_s']:.2f} s), "
            f"load {row['load_s']:.2f} s"
        )
    if "recompute_s" in row:
        notes.append(f"recompute {row['recompute_s']:.3f} s")
    return ", ".join(notes)


def table(results: dict) -> str:
    """The results as a text table: the tests' line, then one row per case."""
    lines = []
    env = results.get("environment") or {}
    if env:
        what = env.get("device") or "CPU (dry run)"
        lines.append(f"{what}, torch {env.get('torch')}, CUDA {env.get('cuda', '-')}")
    setting = results["setting"]
    lines.append(
        f"GPT '{setting['model']}', micro-batch {setting['micro_batch']}, {setting['precision']}, "
        f"{setting['warmup']} warm-up + {setting['steps']} timed steps, one rank"
    )
    tests = results.get("tests")
    if tests:
        counts = ", ".join(
            f"{tests[k]} {k}" for k in ("passed", "failures", "errors", "skipped") if tests.get(k)
        )
        lines.append(
            f"tests/test_cuda.py: {tests['status']} ({counts}) in {tests['seconds']:.0f} s"
        )
        lines += [f"  {failure}" for failure in tests.get("failed_tests", [])]
        if tests["status"] == "timeout":
            lines.append(f"  {tests['error']}")
    header = ("case", "status", "s/step", "tokens/s", "device MiB", "host MiB", "loss", "note")
    rows = [header]
    for row in results["cases"]:
        ok = row["status"] == "ok"
        losses = row.get("losses")
        rows.append(
            (
                row["name"],
                row["status"],
                f"{row['step_s']:.4f}" if ok else "-",
                f"{row['tokens_per_s']:,.0f}" if ok and "tokens_per_s" in row else "-",
                _mib(row.get("peak_device_bytes")),
                _mib(row.get("peak_host_bytes")),
                f"{losses[0]:.3f}->{losses[-1]:.3f}" if ok and losses else "-",
                _note(row),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]  # the note: free
    words = {0, 1, 6}  # left-aligned; numbers to the right
    for r in rows:
        cells = [
            cell.ljust(width) if i in words else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(r[:-1], widths, strict=True))
        ]
        lines.append("  ".join([*cells, r[-1]]).rstrip())
    return "\n".join(lines)


# -- the command -------------------------------------------------------------------------------
def settings(args: argparse.Namespace) -> dict:
    """What every case runs with: the GPU's sizes, or the dry run's tiny ones on the CPU."""
    dry = args.dry_run
    return {
        "device": "cpu" if dry else "cuda",
        "model": args.model or ("tiny" if dry else "30m"),
        "micro_batch": args.micro_batch or (2 if dry else 8),
        "warmup": args.warmup if args.warmup is not None else (1 if dry else 2),
        "steps": args.steps or (1 if dry else 5),
        # bf16 matmuls on a CPU without bf16 units are 20x slower than fp32 (measured here)
        "precision": args.precision or ("fp32" if dry else "bf16"),
        # inductor's code generation on the CPU needs a C++ compiler and minutes
        "compile_backend": "eager" if dry else "inductor",
        "collective_timeout_s": 60.0,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results.json, logs/")
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, tiny sizes")
    parser.add_argument("--cases", nargs="+", choices=CASE_NAMES, help="default: all")
    parser.add_argument("--skip-tests", action="store_true", help="not tests/test_cuda.py")
    parser.add_argument("--model", help="GPT preset (default: 30m; tiny in the dry run)")
    parser.add_argument("--micro-batch", type=int, help="default: 8; 2 in the dry run")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default: 2; dry: 1)")
    parser.add_argument("--steps", type=int, help="timed steps (default: 5; dry: 1)")
    parser.add_argument("--precision", choices=("bf16", "fp16", "fp32"), help="bf16; dry: fp32")
    parser.add_argument("--budget-s", type=float, default=540, help="no case starts after")
    parser.add_argument("--tests-timeout-s", type=float, default=240)
    parser.add_argument("--case-timeout-s", type=float, help="every case's (default: its own)")
    parser.add_argument("--wheels", type=Path, default=DEFAULT_WHEELS, help="for missing packages")
    default_site = Path(tempfile.gettempdir()) / "zerotrain-gpu-check-site"
    parser.add_argument("--site", type=Path, default=default_site, help="they install here")
    default_scratch = Path(tempfile.gettempdir()) / "zerotrain-gpu-check-scratch"
    parser.add_argument("--scratch", type=Path, default=default_scratch, help="NVMe files")
    parser.add_argument("--show", type=Path, metavar="RESULTS", help="print a results file")
    parser.add_argument("--list", action="store_true", help="the cases and what they reach")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.show:
        print(table(json.loads(args.show.read_text())))
        return 0
    if args.list:
        for case in CASES:
            print(f"{case.name:28} {case.reaches}")
        return 0
    if importlib.util.find_spec("torch") is None:
        raise SystemExit(
            f"gpu_check: this Python ({sys.executable}) has no torch; run it with the one that "
            "has the CUDA build of torch"
        )
    start = time.monotonic()
    if args.dry_run:  # the children must not find a GPU: the accelerator would choose it
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    installed = ensure_packages(args.wheels, args.site)
    out, logs = args.out, args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    args.scratch.mkdir(parents=True, exist_ok=True)
    setting = settings(args)
    results: dict = {
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "dry_run": args.dry_run,
        "setting": setting,
        "installed": installed,
        "environment": None,
        "tests": None,
        "cases": [],
    }
    path = out / "results.json"

    def save() -> None:
        results["seconds"] = time.monotonic() - start
        path.write_text(json.dumps(results, indent=1) + "\n")

    children = Children(logs, args.scratch)
    env = children.run("environment", "environment", {}, setting, 120)
    results["environment"] = env
    save()
    if env["status"] != "ok":
        print(f"gpu_check: {env.get('error')}\n{env.get('log_tail', '')}", file=sys.stderr)
        return 2
    deadline = start + args.budget_s
    if not args.skip_tests:
        results["tests"] = run_tests(out, min(args.tests_timeout_s, deadline - time.monotonic()))
        save()
    for case in [c for c in CASES if args.cases is None or c.name in args.cases]:
        left = deadline - time.monotonic()
        row: dict = {"name": case.name, "reaches": case.reaches}
        if left < 10:
            row.update(status="not run", error=f"--budget-s {args.budget_s:.0f} was spent")
        else:
            timeout = min(args.case_timeout_s or case.timeout_s, left)
            row.update(children.run(case.name, case.body, case.kwargs, setting, timeout))
        results["cases"].append(row)
        print(f"{case.name}: {row['status']} ({row.get('seconds', 0):.1f} s)", flush=True)
        save()
    print(table(results))
    print(f"results: {path}")
    tests_ok = args.skip_tests or results["tests"]["status"] == "passed"
    return 0 if tests_ok and all(r["status"] == "ok" for r in results["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
