"""Step time and memory of zerotrain against torch DDP, torch FSDP2 and DeepSpeed, in one run.

    python bench/step_time.py [--model demo 30m] [--systems floor ddp ...] [--rounds 3]
                              [--steps 3] [--launch once|per-round] [--deepspeed-optimizer torch]
                              [--reference COMMIT]

Trains the GPT of examples/gpt/model.py on 2 ranks (torchrun, gloo, fp32, CPU) under every system
(`--systems`, default all): the compute floor (forward + backward on every rank, no communication,
no optimizer step), torch DDP, torch FSDP2, DeepSpeed ZeRO stages 0-3 and zerotrain stages 0-3.
Every system starts from the same initial weights, sees the same tokens and uses the same AdamW
with gradient clipping at 1.0, so their final losses agree in fp32; a loss more than 1e-3
(relative) away from DDP's is flagged. Prints a table of median step times, ratios, peak RSS,
model-state bytes and bytes sent per rank per step ([Note: the warm-up round]
Every job takes one step when it starts; the round after it was still slow on this machine
(first-round steps 20-100% above the row's median for most systems, zerotrain stage 0's 1046
ms against 509 ms, in a run of 14 resident systems), so a median of 16 steps moved by up to
10% between runs. `--warmup-rounds` (default 1) runs whole rounds first, alternating as the
timed ones do, and discards their times.

[Note: the reference commit]
`--reference COMMIT` adds zerotrain stages 0-3 at another commit (rows ref0-ref3, labelled
`zt@<hash> stage N`) to the same interleaved run, so each stage's step time is compared with the
reference's (column `vs ref`) and both with DeepSpeed's, under the same machine noise: the guard
for changes that touch the step path (bench/README.md keeps a row per release against a pinned
commit). The parent checks the commit out into a temporary git worktree, removed afterwards;
the reference rows' ranks put it first on `sys.path` (environment `STEP_TIME_REFERENCE_TREE`)
and refuse to run if `import zerotrain` still finds this checkout. Everything else, this script,
the models and the data, is this checkout's, so only the library differs.

[Note: bytes sent per step]), and writes
bench/results/step_time.json. `--model` takes one GPT preset or several
(`python bench/step_time.py --model demo 30m`): the whole benchmark runs for each model in turn,
with one table per model and one JSON entry per model. The default is "demo" alone: "30m" takes
several times as long (bench/README.md: 787 s with `--rounds 2 --steps 2`, demo 140 s with the
defaults). A system that cannot run is listed with the reason: a zerotrain stage whose config
zerotrain rejects (found by validating it), a DeepSpeed row when `import deepspeed` fails
(DeepSpeed is optional: requirements-bench.txt), a job that fails to start.

DeepSpeed gets torch's fused AdamW, the kernel of every other row, by default. Its own config
AdamW (`--deepspeed-optimizer deepspeed`) is, on CPU without offload, its FusedAdam C++ op,
compiled on first use (about 100 s on 2 cores), as is the shared-memory all-reduce op that
`deepspeed.init_distributed` builds on CPU in any case (half a minute; training never uses it).

[Note: one torchrun job per system, driven over a socket]
Peak RSS (`ru_maxrss`) is process-wide and never falls, so two systems trained in one process
would each report the larger peak. Each system therefore runs in its own torchrun job, and the
parent process (this script without `--worker`) drives the jobs over Unix sockets: it tells one
job at a time to time a round of `--steps` steps, then the next, for `--rounds` rounds, so that
machine noise (other processes, thermal drift) falls on every system alike. A job waiting for its
turn blocks on a socket read and uses no CPU. With `--launch once` (the default for models under
10M parameters) every job starts once, warms up, and stays up between rounds: start-up (imports,
DeepSpeed's op loading) is paid once and training continues across rounds, but all systems are
resident at once (about 0.5-0.8 GB per rank per system for "demo"). With `--launch per-round`
(the default for larger models, "30m" among them, where resident jobs would not fit in memory;
chosen per model when `--launch` is not given) each round starts every job anew and stops it
after: one system in memory at a time, each launch warms up on the first batch and trains from
the initial weights, so the final loss is the one after 1 + `--steps` steps. Either way a
system's peak RSS is the maximum over its ranks and launches.

[Note: bytes sent per step]
ZeRO (arXiv:1910.02054 §7) counts communication in passes of a bandwidth-optimal ring over the Ψ
trainable parameters: in a reduce-scatter or an all-gather each of N ranks sends (N-1)/N of the
buffer, in an all-reduce twice that. Data parallelism and stages 0-2 need 2Ψ(N-1)/N values per rank
per step (gradients reduce-scattered, then all-gathered: gradients for DDP, updated parameters for
stages 1-2), the ring minimum. Stage 3 all-gathers the parameters in forward instead and, as ZeRO
describes it, again in backward: 3Ψ(N-1)/N, 1.5 times the minimum. Both DeepSpeed and zerotrain
skip that second all-gather for parameters used again within `stage3_max_reuse_distance` elements
(default 1e9: all of a model this size; DeepSpeed once it has traced a step), which leaves 2Ψ.
zerotrain rows report what each rank actually sent (`engine.comm.stats`, see [Note: bytes sent] in
zerotrain/comm/communicator.py), reset after the warm-up and at each round, max over ranks, mean
over the timed steps; every collective counts, the gradient-norm all-reduce included. DDP, FSDP2
and DeepSpeed cannot be counted from outside, so their rows show the volume their algorithm implies
(`Spec.formula_passes`), marked `*`: DDP and DeepSpeed stages 0-2 2Ψ, FSDP2 3Ψ (it reshards every
block after forward; the root module's parameters, the embeddings and final norm, stay gathered, so
it sends slightly less), DeepSpeed stage 3 ZeRO's 3Ψ (an upper bound: with the reuse above it may
send 2Ψ). Everything is fp32: 4 bytes per value.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
REFERENCE_TREE = os.environ.get("STEP_TIME_REFERENCE_TREE")
"""Set in the ranks of a reference row: the worktree whose zerotrain they import."""
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, REFERENCE_TREE or str(ROOT))


def _load_fmt() -> Any:
    """This checkout's zerotrain/fmt.py (it imports nothing), without importing the zerotrain
    package: a reference row's ranks import the reference's, which may have no fmt."""
    spec = importlib.util.spec_from_file_location("step_time_fmt", ROOT / "zerotrain" / "fmt.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_fmt_module = _load_fmt()
MB, count, quantity = _fmt_module.MB, _fmt_module.count, _fmt_module.quantity

# One AdamW for every system, every setting spelled out: torch's AdamW defaults to weight_decay
# 0.01, DeepSpeed's (and so zerotrain's) config AdamW to 0.
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
CLIP = 1.0
LOSS_RTOL = 1e-3
RESIDENT_MAX_PARAMS = 10_000_000  # --launch defaults to "once" below this model size
STARTED = time.monotonic()
LAUNCH_TIMEOUT_S = 1800  # covers DeepSpeed's first-time C++ op builds (minutes on 2 cores)


@dataclass(frozen=True)
class Spec:
    """One system of the table: `--systems` name, row label, library and ZeRO stage."""

    key: str
    label: str
    family: str  # "floor", "ddp", "fsdp2", "deepspeed" or "zerotrain"
    stage: int | None = None
    formula_passes: int | None = None
    """Ring passes over the parameters per step that the system's algorithm implies, for systems
    whose bytes cannot be counted ([Note: bytes sent per step]); None for zerotrain, which
    counts them."""
    overlap_param_gather: bool = False
    """zerotrain: `zero_optimization.overlap_param_gather` (stages 1-2)."""
    reference: bool = False
    """zerotrain at the `--reference` commit instead of this checkout ([Note: the reference
    commit])."""


SPECS = {
    spec.key: spec
    for spec in [
        Spec("floor", "compute floor", "floor", formula_passes=0),
        Spec("ddp", "torch DDP", "ddp", formula_passes=2),
        Spec("fsdp2", "torch FSDP2", "fsdp2", formula_passes=3),
        *(
            Spec(
                f"ds{s}", f"DeepSpeed stage {s}", "deepspeed", s, formula_passes=3 if s == 3 else 2
            )
            for s in range(4)
        ),
        *(Spec(f"zt{s}", f"zerotrain stage {s}", "zerotrain", s) for s in range(4)),
        *(
            Spec(f"zt{s}o", f"zerotrain {s} +AG ovl", "zerotrain", s, overlap_param_gather=True)
            for s in (1, 2)
        ),
        *(
            Spec(f"ref{s}", f"reference stage {s}", "zerotrain", s, reference=True)
            for s in range(4)
        ),
    ]
}
REFERENCE_KEYS = [key for key, spec in SPECS.items() if spec.reference]


# --- the models ---------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchModel:
    """A model `--model` names: how to build it, and the token ids and sequence length it takes.
    Built models are called as `model(x, y)` -> mean loss and list their blocks in
    `model.blocks` (FSDP2 shards each block)."""

    build: Callable[[], torch.nn.Module]
    vocab_size: int
    seq_len: int
    family: str  # "GPT" (examples/gpt/model.py) or "transformers GPT-2"


class HFGPT2(torch.nn.Module):
    """transformers' GPT2LMHeadModel with the demo GPT's call: `model(x, y)` -> mean loss."""

    def __init__(self, config) -> None:
        super().__init__()
        from transformers import GPT2LMHeadModel

        self.lm = GPT2LMHeadModel(config)

    @property
    def blocks(self) -> torch.nn.ModuleList:  # a property: a second registration would alias
        return self.lm.transformer.h

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.lm(input_ids=x).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def hf_gpt2_34m() -> torch.nn.Module:
    """The issue's reference job: GPT-2's vocabulary (50257, so the tied embedding is 57% of the
    33.9M parameters), width 384, 8 blocks of 6 heads; no dropout, so every system's loss agrees."""
    import transformers
    from transformers import GPT2Config

    transformers.logging.set_verbosity_error()
    config = GPT2Config(
        n_embd=384,
        n_layer=8,
        n_head=6,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )
    return HFGPT2(config)


def bench_models() -> dict[str, BenchModel]:
    from gpt.model import GPT, PRESETS

    models = {
        name: BenchModel(lambda cfg=cfg: GPT(cfg), cfg.vocab_size, cfg.block_size, "GPT")
        for name, cfg in PRESETS.items()
    }
    models["gpt2-34m"] = BenchModel(hf_gpt2_34m, 50257, 128, "transformers GPT-2")
    return models


def ring_bytes(passes: float, params: int, nproc: int) -> float:
    """Bytes one rank sends in `passes` ring passes over `params` fp32 values: passes x Ψ(N-1)/N
    x 4 ([Note: bytes sent per step])."""
    return passes * params * (nproc - 1) / nproc * 4


def print_header(columns: list[tuple[str, int]]) -> None:
    """A table's header line, ``(name, width)`` per column (the first left-aligned), and a rule."""
    header = " ".join(
        f"{name:<{w}}" if i == 0 else f"{name:>{w}}" for i, (name, w) in enumerate(columns)
    )
    print(header)
    print("-" * len(header))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(
        parser,
        list(SPECS),
        model_help="GPT presets of examples/gpt/model.py, or gpt2-34m (transformers' GPT-2, "
        "sequence 128); the benchmark runs for each in turn",
        launch_help="start each system's job once (resident between rounds) or anew every round",
        default_systems=[key for key in SPECS if key not in REFERENCE_KEYS],
    )
    parser.add_argument(
        "--reference",
        default=None,
        metavar="COMMIT",
        help="also time zerotrain stages 0-3 at this git commit (rows ref0-ref3, from a "
        "temporary worktree) in the same run: the guard against step-time regressions",
    )
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "step_time.json"))
    args = parser.parse_args(argv)
    if args.reference and "--systems" not in (argv if argv is not None else sys.argv):
        args.systems += REFERENCE_KEYS
    return args


def add_run_arguments(
    parser: argparse.ArgumentParser,
    systems: list[str],
    *,
    model_help: str,
    launch_help: str,
    default_systems: list[str] | None = None,
) -> None:
    """The options every benchmark built on this machinery takes (bench/offload.py too);
    `--systems` chooses among `systems`, by default `default_systems` (all of them)."""
    parser.add_argument(
        "--model",
        dest="models",
        nargs="+",
        default=["demo"],
        choices=list(bench_models()),
        help=model_help,
    )
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="alternating timing rounds")
    parser.add_argument(
        "--warmup-rounds",
        type=int,
        default=1,
        help="alternating rounds run first and not timed (see [Note: the warm-up round])",
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps per system per round")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument(
        "--systems", nargs="+", default=list(default_systems or systems), choices=systems
    )
    parser.add_argument(
        "--launch",
        choices=["once", "per-round"],
        default=None,
        help=f"{launch_help}; default: once for models under "
        f"{RESIDENT_MAX_PARAMS / 1e6:g}M parameters",
    )
    parser.add_argument(
        "--deepspeed-optimizer",
        choices=["torch", "deepspeed"],
        default="torch",
        help="torch: pass torch.optim.AdamW(fused=True) to deepspeed.initialize; deepspeed: "
        "DeepSpeed's own AdamW from the config (on CPU a C++ op built on first use; "
        "DeepSpeedCPUAdam under offload)",
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--control", default=None, help=argparse.SUPPRESS)


def import_deepspeed() -> Any:
    """`import deepspeed`, on its CPU accelerator when there is no GPU."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    return deepspeed


def zerotrain_config(stage: int, args: argparse.Namespace, overlap_gather: bool = False) -> dict:
    zero = {"stage": stage}
    if overlap_gather:  # a zerotrain key: the DeepSpeed rows never get it
        zero["overlap_param_gather"] = True
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"])}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }


def deepspeed_config(stage: int, args: argparse.Namespace) -> dict:
    config = zerotrain_config(stage, args)  # DeepSpeed's own key names
    if args.deepspeed_optimizer == "torch":
        del config["optimizer"]
        config["zero_allow_untested_optimizer"] = True
    return config


# --- the worker: one system on one rank ----------------------------------------------------


Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Built:
    """A system ready to train: its step, its model-state bytes and its communicator where it
    reports them."""

    step: Step
    model_state: Callable[[], dict[str, float]] | None = None
    comm: Any = None  # zerotrain's Communicator: counts the bytes this rank sends
    round_start: Callable[[], None] | None = None
    """Called on every rank before a round's first timed step (a benchmark's own counters)."""
    round_stats: Callable[[], dict[str, Any]] | None = None
    """Called on every rank after a round's timed steps; the parent gets every rank's dict, in
    rank order, as the round's "ranks"."""


def fused_adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, **ADAMW, fused=True)


def build_floor(model, spec, args) -> Built:
    def step(x, y):
        loss = model(x, y)
        loss.backward()
        model.zero_grad(set_to_none=False)
        return loss

    return Built(step)


def build_ddp(model, spec, args) -> Built:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)
    optimizer = fused_adamw(model.parameters())

    def step(x, y):
        loss = ddp(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        return loss

    return Built(step)


def build_fsdp2(model, spec, args) -> Built:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root: embeddings (tied to the LM head), final norm
    optimizer = fused_adamw(model.parameters())

    def step(x, y):
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)  # DTensor grads, global norm
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return Built(step)


def build_deepspeed(model, spec, args) -> Built:
    deepspeed = import_deepspeed()
    optimizer = fused_adamw(model.parameters()) if args.deepspeed_optimizer == "torch" else None
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=deepspeed_config(spec.stage, args)
    )
    return Built(engine_step(engine))


def build_zerotrain(model, spec, args) -> Built:
    import zerotrain

    if spec.reference:  # measuring this checkout twice would hide any difference
        tree = Path(REFERENCE_TREE or "-").resolve()
        if not Path(zerotrain.__file__).resolve().is_relative_to(tree):
            raise RuntimeError(f"reference row imported {zerotrain.__file__}, not from {tree}")

    config = zerotrain_config(spec.stage, args, spec.overlap_param_gather)
    engine, *_ = zerotrain.initialize(model=model, config=config)
    return Built(engine_step(engine), engine.memory_breakdown, engine.comm)


def engine_step(engine) -> Step:
    """The training step of DeepSpeed's engine API, which zerotrain shares."""

    def step(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss

    return step


# Spec.family -> builder of that system around a fresh model, on an initialized process group.
BUILDERS = {
    "floor": build_floor,
    "ddp": build_ddp,
    "fsdp2": build_fsdp2,
    "deepspeed": build_deepspeed,
    "zerotrain": build_zerotrain,
}


class Channel:
    """JSON lines over a connected socket."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.file = sock.makefile("rwb")

    def send(self, message: dict) -> None:
        self.file.write(json.dumps(message).encode() + b"\n")
        self.file.flush()

    def recv(self) -> dict:
        line = self.file.readline()
        if not line:
            raise ConnectionError("the other side closed the connection")
        return json.loads(line)

    def close(self) -> None:
        self.file.close()
        self.sock.close()


def run_worker(
    args: argparse.Namespace,
    specs: dict[str, Spec] = SPECS,
    builders: dict[str, Callable[[torch.nn.Module, Spec, argparse.Namespace], Built]] = BUILDERS,
) -> None:
    """One rank of one system's job: build, warm up, then time the rounds the parent asks for.
    Another benchmark passes its own `specs` and `builders` (bench/offload.py)."""
    import torch.distributed as dist

    spec = specs[args.worker]
    rank = int(os.environ["RANK"])
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(args.control)
    channel = Channel(sock)
    channel.send({"system": spec.key, "rank": rank})

    model = bench_models()[args.model]
    gen = torch.Generator().manual_seed(1234 + rank)
    total = 1 + (args.warmup_rounds + args.rounds) * args.steps  # batch 0: the first step's
    tokens = torch.randint(
        0, model.vocab_size, (total, args.micro_batch, model.seq_len + 1), generator=gen
    )
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
    try:
        dist.init_process_group("gloo")
        torch.manual_seed(0)
        built = builders[spec.family](model.build(), spec, args)
        built.step(*batches[0])  # allocations, first optimizer state
    except Exception as exc:
        channel.send({"error": f"{type(exc).__name__}: {exc}"})
        raise
    channel.send({"ready": True})

    while (order := channel.recv())["round"] is not None:
        first = 1 + order["round"] * args.steps
        if built.comm is not None:
            built.comm.reset_stats()  # count the timed steps: not the warm-up, not the last round
        if built.round_start is not None:
            built.round_start()
        times = []
        for x, y in batches[first : first + args.steps]:
            dist.barrier()
            start = time.perf_counter()
            loss = built.step(x, y)
            times.append(time.perf_counter() - start)
        # A step's time is the slowest rank's; memory is the largest rank's.
        times_t = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(times_t, op=dist.ReduceOp.MAX)
        sent = sum(s.sent for s in built.comm.stats.values()) if built.comm is not None else -1.0
        state = built.model_state() if built.model_state else {}
        peaks = torch.tensor(
            [
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0,  # KiB on Linux
                state.get("total", -1.0),  # -1: the system does not report it
                state.get("formula_total", -1.0),
                sent,
            ],
            dtype=torch.float64,
        )
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        loss_t = loss.detach().double().reshape(1)
        dist.all_reduce(loss_t)
        per_rank: list[Any] = [None] * dist.get_world_size()
        if built.round_stats is not None:
            dist.all_gather_object(per_rank, built.round_stats())
        if rank == 0:
            rss, state_total, formula_total, sent = peaks.tolist()
            channel.send(
                {
                    "times_s": times_t.tolist(),
                    "loss": loss_t.item() / dist.get_world_size(),
                    "peak_rss": rss,
                    "model_state": state_total if state_total >= 0 else None,
                    "formula": formula_total if formula_total >= 0 else None,
                    "sent_bytes": sent if sent >= 0 else None,  # over this round's steps
                    **({"ranks": per_rank} if built.round_stats is not None else {}),
                }
            )
    channel.close()
    dist.destroy_process_group()


# --- the parent: launches and alternation ----------------------------------------------------


class LaunchError(RuntimeError):
    """A system's job failed to start or died; the message ends with its log's last lines."""


class Job:
    """One system's torchrun job, reached over its own socket, one connection per rank.

    The constructor only launches it; `wait_ready` returns once every rank has built the system
    and taken the warm-up step, so several jobs can start side by side.
    """

    def __init__(
        self, spec: Spec, args: argparse.Namespace, logs: Path, script: str | Path = __file__
    ):
        self.spec, self.nproc = spec, args.nproc
        self.log_path = logs / f"{spec.key}.log"
        self.ranks: list[Channel] = []
        self.address = logs / f"{spec.key}.sock"
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(self.address))
        self.server.listen()
        self.server.settimeout(1.0)  # accept() wakes up to notice a job that died
        threads = max(1, (os.cpu_count() or 2) // args.nproc)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc-per-node", str(args.nproc), "--monitor-interval", "1", str(script)]
        # The job's own model goes last: argparse keeps the last --model.
        cmd += [*sys.argv[1:], "--model", args.model, "--worker", spec.key]
        cmd += ["--control", self.server.getsockname()]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        if getattr(spec, "reference", False):  # its ranks import the reference's zerotrain
            env["STEP_TIME_REFERENCE_TREE"] = args.reference_tree
        with open(self.log_path, "ab") as log:
            # Own session: stop() can end the whole job (torchrun and its ranks) by group id.
            self.proc = subprocess.Popen(
                cmd,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_ready(self) -> None:
        try:
            self.ranks = self._accept()
            for channel in self.ranks:
                reply = channel.recv()
                if "error" in reply:
                    raise LaunchError(reply["error"])
        except (LaunchError, ConnectionError, OSError) as exc:
            self.close(grace_s=10)
            raise LaunchError(f"{exc}\n{self._log_tail()}") from None

    def _accept(self) -> list[Channel]:
        channels: dict[int, Channel] = {}
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while len(channels) < self.nproc:
            if self.proc.poll() is not None:
                raise LaunchError(f"torchrun exited with code {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise LaunchError(f"ranks did not connect within {LAUNCH_TIMEOUT_S} s")
            try:
                sock, _ = self.server.accept()
            except TimeoutError:
                continue
            sock.settimeout(LAUNCH_TIMEOUT_S)
            channel = Channel(sock)
            channels[channel.recv()["rank"]] = channel
        return [channels[r] for r in range(self.nproc)]

    def _log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(f"    {line}" for line in text[-lines:])

    def run_round(self, round_index: int) -> dict:
        try:
            for channel in self.ranks:
                channel.send({"round": round_index})
            return self.ranks[0].recv()
        except (ConnectionError, OSError) as exc:
            self.close(grace_s=10)
            raise LaunchError(f"{exc}\n{self._log_tail()}") from None

    def stop(self) -> None:
        """Ask the ranks to leave; `close` waits for them."""
        for channel in self.ranks:
            try:
                channel.send({"round": None})
            except OSError:
                pass  # already gone: close() finds out

    def close(self, grace_s: float = 120) -> None:
        """Wait up to `grace_s` for the job to exit (torchrun stops every rank when one fails,
        and logs why), then end it."""
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait()
        for channel in self.ranks:
            channel.close()
        self.server.close()
        self.address.unlink()


@dataclass
class Row:
    """What the parent gathers for one system over all rounds."""

    spec: Spec
    status: str = ""  # empty when measured; else why not ("not available: ...")
    times_s: list[float] = field(default_factory=list)
    loss: float = float("nan")
    peak_rss: float = 0.0
    model_state: float | None = None
    formula: float | None = None
    sent_bytes: float | None = None  # over all timed steps; None: the system does not count them

    def add(self, result: dict) -> None:
        self.times_s += result["times_s"]
        self.loss = result["loss"]
        self.peak_rss = max(self.peak_rss, result["peak_rss"])
        self.model_state, self.formula = result["model_state"], result["formula"]
        if result["sent_bytes"] is not None:
            self.sent_bytes = (self.sent_bytes or 0.0) + result["sent_bytes"]

    def sent_per_step(self, params: int, nproc: int) -> tuple[float | None, bool]:
        """Bytes one rank sends per step, and whether that is by formula rather than counted
        ([Note: bytes sent per step]); None where neither is known."""
        if self.sent_bytes is not None:
            return self.sent_bytes / len(self.times_s), False
        if self.spec.formula_passes is not None:
            return ring_bytes(self.spec.formula_passes, params, nproc), True
        return None, False


def unavailable(spec: Spec, args: argparse.Namespace) -> str:
    """Why `spec` cannot run here, or "" if it can."""
    if spec.family == "deepspeed":
        try:
            import_deepspeed()
        except Exception as exc:  # any import-time failure: missing package, broken op setup
            return f"skipped: import deepspeed failed ({type(exc).__name__}: {exc})"
    if getattr(spec, "reference", False):
        return "" if args.reference else "skipped: pass --reference COMMIT"
    if spec.family == "zerotrain":
        from zerotrain import ConfigError
        from zerotrain.config import load_config

        try:
            config = zerotrain_config(spec.stage, args, spec.overlap_param_gather)
            load_config(config, world_size=args.nproc)
        except ConfigError as exc:
            return f"not available: {str(exc).splitlines()[0]}"
    return ""


def progress(message: str) -> None:
    name = Path(sys.argv[0]).stem  # the benchmark that imported this machinery, or step_time
    print(f"[{name} {time.monotonic() - STARTED:5.0f} s] {message}", file=sys.stderr, flush=True)


def ready(row: Row, job: Job, launched: float) -> bool:
    try:
        job.wait_ready()
    except LaunchError as exc:
        row.status = f"failed: {str(exc).splitlines()[0]}"
        progress(f"{row.spec.label} failed to start: {exc}")
        return False
    progress(f"{row.spec.label}: up and warmed {time.perf_counter() - launched:.1f} s after launch")
    return True


def run_round(row: Row, job: Job, round_index: int, warmup_rounds: int = 0) -> bool:
    """One round of `job`; its times count from round `warmup_rounds` on."""
    try:
        result = job.run_round(round_index)
        if round_index >= warmup_rounds:
            row.add(result)
        return True
    except LaunchError as exc:
        row.status = f"failed in round {round_index + 1}: {str(exc).splitlines()[0]}"
        progress(f"{row.spec.label} {row.status}\n{exc}")
        return False


def measure(rows: list[Row], args: argparse.Namespace, script: str | Path = __file__) -> None:
    """Time every runnable row, alternating systems within each round (see the Note above);
    `script` is the benchmark whose `--worker` the jobs run."""
    runnable = [row for row in rows if not row.status]
    with tempfile.TemporaryDirectory(prefix="step_time_") as tmp:
        logs = Path(tmp)
        if args.launch == "once":
            # All jobs start together: start-up is not timed, and side by side they fill both cores.
            launched = time.perf_counter()
            pending = [(row, Job(row.spec, args, logs, script)) for row in runnable]
            jobs = [(row, job) for row, job in pending if ready(row, job, launched)]
            for round_index in range(args.warmup_rounds + args.rounds):
                progress(round_name(round_index, args))
                for row, job in jobs:
                    if not row.status:
                        run_round(row, job, round_index, args.warmup_rounds)
            live = [job for row, job in jobs if not row.status]  # failed ones are closed
            for job in live:  # all at once: each takes seconds to wind down
                job.stop()
            for job in live:
                job.close()
        else:
            for round_index in range(args.warmup_rounds + args.rounds):
                progress(round_name(round_index, args))
                for row in runnable:
                    if row.status:
                        continue
                    launched = time.perf_counter()
                    job = Job(row.spec, args, logs, script)  # appends to the same log
                    if ready(row, job, launched) and run_round(
                        row, job, round_index, args.warmup_rounds
                    ):
                        job.stop()
                        job.close()


def round_name(round_index: int, args: argparse.Namespace) -> str:
    if round_index < args.warmup_rounds:
        return f"warm-up round {round_index + 1}/{args.warmup_rounds}"
    return f"round {round_index - args.warmup_rounds + 1}/{args.rounds}"


# --- the table -----------------------------------------------------------------------------


def report(
    rows: list[Row], args: argparse.Namespace, params: int, model: BenchModel, load: float
) -> dict:
    """Print one model's table and notes; return its JSON entry."""
    ring_min = ring_bytes(2, params, args.nproc)
    medians = {row.spec.key: statistics.median(row.times_s) for row in rows if row.times_s}
    floor, ddp = medians.get("floor"), medians.get("ddp")
    ddp_loss = next((r.loss for r in rows if r.spec.key == "ddp" and r.times_s), None)
    tokens_per_step = args.micro_batch * model.seq_len * args.nproc
    print(
        f"\n{model.family} '{args.model}' ({count(params)} params), {args.nproc} ranks, fp32, "
        f"gloo, micro-batch {args.micro_batch}x{model.seq_len}, {args.warmup_rounds} warm-up + "
        f"{args.rounds} rounds x "
        f"{args.steps} steps, --launch {args.launch}; load average before the run {load:.2f}\n"
    )
    columns = [
        ("system", 20),
        ("median s/step", 13),
        ("vs DDP", 7),
        ("vs DS", 6),
        ("vs ref", 6),
        ("efficiency", 10),
        ("tokens/s", 8),
        ("state MB", 8),
        ("state/formula", 13),
        ("peak RSS MB", 11),
        ("sent MB/step", 12),
        ("sent/ring", 9),
        ("final loss", 10),
        ("Δloss/DDP", 10),
    ]
    print_header(columns)
    flagged = by_formula_shown = False
    records = []
    for row in rows:
        label = row.spec.label
        if row.spec.reference and args.reference_sha:
            label = f"zt@{args.reference_sha[:7]} stage {row.spec.stage}"
        out: dict[str, Any] = {"system": label, "key": row.spec.key}
        if not row.times_s:
            out["status"] = row.status
            print(f"{label:<20} {row.status}")
            records.append(out)
            continue
        median = medians[row.spec.key]
        zerotrain = row.spec.family == "zerotrain"
        same_stage_ds = medians.get(f"ds{row.spec.stage}") if zerotrain else None
        same_stage_ref = (
            medians.get(f"ref{row.spec.stage}") if zerotrain and not row.spec.reference else None
        )
        rel_loss = None
        if ddp_loss is not None and row.spec.key != "floor":  # the floor never steps
            rel_loss = abs(row.loss - ddp_loss) / abs(ddp_loss)
        flag = rel_loss is not None and rel_loss > LOSS_RTOL
        flagged |= flag
        sent, by_formula = row.sent_per_step(params, args.nproc)
        by_formula_shown |= by_formula
        mark = "*" if by_formula else " "  # the blank keeps the digits of both kinds aligned
        out.update(
            status=row.status or "measured",
            median_s=median,
            times_s=row.times_s,
            vs_ddp=median / ddp if ddp else None,
            vs_deepspeed=median / same_stage_ds if same_stage_ds else None,
            vs_reference=median / same_stage_ref if same_stage_ref else None,
            efficiency=floor / median if floor else None,
            tokens_per_s=tokens_per_step / median,
            peak_rss_bytes=row.peak_rss,
            model_state_bytes=row.model_state,
            formula_bytes=row.formula,
            sent_bytes_per_step=sent,
            sent_by_formula=by_formula,
            sent_vs_ring=sent / ring_min if sent is not None and ring_min else None,
            loss=row.loss,
            rel_loss_vs_ddp=rel_loss,
            loss_mismatch=flag,
        )
        cells = [
            f"{median:.4f}",
            _fmt(out["vs_ddp"], ".3f"),
            _fmt(out["vs_deepspeed"], ".3f"),
            _fmt(out["vs_reference"], ".3f"),
            _fmt(out["efficiency"], ".3f"),
            f"{out['tokens_per_s']:.0f}",
            _fmt(row.model_state and row.model_state / MB, ".1f"),
            _fmt(row.model_state and row.formula and row.model_state / row.formula, ".4f"),
            f"{row.peak_rss / MB:.0f}",
            _fmt(sent and sent / MB, ".2f", mark),
            _fmt(out["sent_vs_ring"], ".3f", mark),
            f"{row.loss:.5f}",
            "-" if rel_loss is None else f"{rel_loss:.1e}" + (" !" if flag else ""),
        ]
        if row.status:  # measured, then failed in a later round
            cells[-1] += f"  ({row.status})"
        line = f"{label:<20} " + " ".join(
            f"{cell:>{w}}" for cell, (_, w) in zip(cells, columns[1:], strict=True)
        )
        print(line)
        records.append(out)
    print()
    for note in footer(rows, args, flagged, by_formula_shown, ring_min):
        print(note)
    return {
        "model": args.model,
        "params": params,
        "launch": args.launch,
        "load_average_before": load,
        "ring_min_bytes_per_step": ring_min,
        "rows": records,
    }


def write_json(args: argparse.Namespace, models: list[dict]) -> None:
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    versions = {"torch": torch.__version__, "deepspeed": _deepspeed_version()}
    path.write_text(
        json.dumps({"args": vars(args), "versions": versions, "models": models}, indent=2)
    )
    print(f"\nwritten {path}")


def _fmt(value: float | None, spec: str, mark: str = "") -> str:
    return "-" if value is None else format(value, spec) + mark


def _deepspeed_version() -> str | None:
    try:
        return import_deepspeed().__version__
    except Exception:
        return None


def footer(
    rows: list[Row],
    args: argparse.Namespace,
    flagged: bool,
    by_formula_shown: bool,
    ring_min: float,
) -> list[str]:
    adamw = ", ".join(f"{k} {v}" for k, v in ADAMW.items())
    notes = [
        f"AdamW ({adamw}), gradient clipping {CLIP}; torch {torch.__version__}"
        + (f", DeepSpeed {v}" if (v := _deepspeed_version()) else "")
        + ".",
        "vs DS: zerotrain's step time over DeepSpeed's at the same stage. vs ref: over "
        "zerotrain's at the same stage at the --reference commit"
        + (f" {args.reference_sha}" if args.reference_sha else " (not given)")
        + ". efficiency: compute floor / step time. Δloss/DDP: |final loss - DDP's| / DDP's.",
        "peak RSS: ru_maxrss, max over ranks (each system in its own processes). state: "
        "zerotrain's engine.memory_breakdown()['total'], max over ranks; state/formula: over "
        "['formula_total'].",
        "sent: bytes one rank sends per step, zerotrain's engine.comm.stats, max over ranks, "
        "mean over the timed steps; "
        f"sent/ring: over the ring minimum 2Ψ(N-1)/N x 4 B = {quantity(ring_min, 'B', prefix='M')} "
        "(ZeRO's stage 3 volume 3Ψ is 1.5 of it).",
    ]
    if by_formula_shown:
        notes.append(
            "*: by formula, not measured: the volume the system's algorithm implies, "
            "2Ψ(N-1)/N x 4 B for DDP and DeepSpeed stages 0-2, 3Ψ(N-1)/N x 4 B for FSDP2 and "
            "DeepSpeed stage 3 (an upper bound there: stage3_max_reuse_distance may leave 2Ψ); "
            "the compute floor sends nothing."
        )
    if any(r.spec.family == "deepspeed" and r.times_s for r in rows):
        notes.append(
            "DeepSpeed optimizer: "
            + (
                "torch.optim.AdamW(fused=True) passed to deepspeed.initialize "
                "(zero_allow_untested_optimizer), the same kernel as every other row."
                if args.deepspeed_optimizer == "torch"
                else "DeepSpeed's own AdamW from the config (FusedAdam; on CPU its C++ CPU-Adam "
                "kernel)."
            )
        )
    if flagged:
        notes.append(f"!: final loss differs from DDP's by more than {LOSS_RTOL:g} relative.")
    return notes


def main() -> None:
    args = parse_args()
    if args.worker:
        args.model = args.models[-1]  # Job passes the job's model last
        run_worker(args)
        return
    # a SIGTERM (timeout, kill) unwinds as an exit does: jobs stopped, the worktree removed
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    with contextlib.ExitStack() as stack:
        args.reference_tree = args.reference_sha = None
        if args.reference and any(SPECS[key].reference for key in args.systems):
            tree, args.reference_sha = stack.enter_context(reference_tree(args.reference))
            args.reference_tree = str(tree)
        results = [run_model(model, args) for model in args.models]
    write_json(args, results)
    progress("done")


@contextlib.contextmanager
def reference_tree(commit: str) -> Iterator[tuple[Path, str]]:
    """A temporary git worktree of this repository at `commit`, and the commit's hash: the
    zerotrain the reference rows import ([Note: the reference commit])."""
    found = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"],
        capture_output=True,
        text=True,
    )
    if found.returncode:
        raise SystemExit(f"--reference {commit}: not a commit of the repository at {ROOT}")
    sha = found.stdout.strip()
    with tempfile.TemporaryDirectory(prefix="step_time_reference_") as tmp:
        tree = Path(tmp) / sha[:10]
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(tree), sha],
            check=True,
        )
        try:
            yield tree, sha
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)])


def for_model(model: str, args: argparse.Namespace) -> tuple[Any, int, argparse.Namespace]:
    """``model``'s preset, its trainable parameters (Ψ of [Note: bytes sent per step]: every
    parameter trains here, the tied embedding once), and ``args`` for it with the launch mode
    resolved (see [Note: one torchrun job per system, driven over a socket])."""
    spec = bench_models()[model]
    params = sum(p.numel() for p in spec.build().parameters() if p.requires_grad)
    launch = args.launch or ("once" if params < RESIDENT_MAX_PARAMS else "per-round")
    return spec, params, argparse.Namespace(**{**vars(args), "model": model, "launch": launch})


def run_model(model: str, args: argparse.Namespace) -> dict:
    """The whole benchmark for one model: print its table, return its JSON entry."""
    spec, params, model_args = for_model(model, args)
    rows = [Row(SPECS[key]) for key in args.systems]
    for row in rows:
        row.status = unavailable(row.spec, model_args)
    load = os.getloadavg()[0]  # other work on the machine: the timings are only as quiet as it
    measure(rows, model_args)
    return report(rows, model_args, params, spec, load)


if __name__ == "__main__":
    main()
