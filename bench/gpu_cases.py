"""The cases of bench/gpu_check.py, run one per process on one rank: a few training steps of the
example GPT (examples/gpt/model.py) through one GPU path of zerotrain, or a few calls of one
compression codec on its gradients, with what they measured.

gpu_check.py (which imports no torch) names each case's body and keyword arguments; its
forkserver imports this module once and forks a process per case, which calls
:func:`run_in_child`. The same bodies run on the CPU for ``--dry-run``.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import shutil
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch._dynamo  # noqa: F401  (torch's optimizers import it when first built: 3 s here)
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from gpt.model import GPT, Block, gpt_config  # noqa: E402

import zerotrain  # noqa: E402
from zerotrain.accelerator import get_accelerator, peak_rss  # noqa: E402
from zerotrain.comm import destroy_distributed  # noqa: E402


@dataclass(frozen=True, kw_only=True)
class Setting:
    """What every case runs with (gpu_check.py's options, as a dict across the fork)."""

    device: str  # "cuda", or "cpu" for the dry run
    model: str  # a GPT preset of examples/gpt/model.py
    micro_batch: int  # sequences per micro-batch, each block_size tokens
    warmup: int  # steps (or codec calls) before the timed ones
    steps: int  # timed steps
    precision: str  # fp32 | bf16 | fp16
    compile_backend: str  # torch.compile's backend for the compiled case
    scratch: str  # this case's own folder: NVMe files, checkpoints (removed after)
    collective_timeout_s: float  # a collective that hangs raises after this


# -- the child ---------------------------------------------------------------------------------
def run_in_child(body: str, kwargs: dict, setting: dict, result_path: str, log_path: str) -> None:
    """A case's process: its output into ``log_path``, its result (or its error) as JSON into
    ``result_path``. Never raises: the parent reads the file."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    result: dict[str, Any]
    try:
        s = Setting(**setting)
        Path(s.scratch).mkdir(parents=True, exist_ok=True)
        if body != "environment":
            zerotrain.init_distributed(timeout=timedelta(seconds=s.collective_timeout_s))
        result = {"status": "ok", **BODIES[body](s, **kwargs)}
    except BaseException as error:  # everything, including a failed assertion, goes to the parent
        traceback.print_exc()
        result = {"status": "failed", "error": f"{type(error).__name__}: {error}"}
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    Path(result_path).write_text(json.dumps(result, default=str))
    destroy_distributed()
    # a forked child ends by os._exit: run the exit hooks (NVMe working files) as a process
    # ending normally would, then free the scratch folder
    atexit._run_exitfuncs()
    shutil.rmtree(setting["scratch"], ignore_errors=True)


def environment(s: Setting) -> dict:
    """The machine the numbers come from."""
    out: dict[str, Any] = {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "scratch_filesystem": _filesystem(s.scratch),
    }
    if s.device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device is visible; run gpu_check.py --dry-run on a CPU")
        props = torch.cuda.get_device_properties(0)
        nccl = torch.cuda.nccl.version()  # a tuple; an int in older torch
        out.update(
            cuda=torch.version.cuda,
            device=props.name,
            device_memory_bytes=props.total_memory,
            capability=f"{props.major}.{props.minor}",
            bf16=torch.cuda.is_bf16_supported(),
            nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
        )
    return out


def _filesystem(path: str) -> str | None:
    """The type of the filesystem holding ``path`` (NVMe offload's speed depends on it)."""
    try:
        with open("/proc/mounts", encoding="utf-8") as mounts:
            entries = [line.split()[1:3] for line in mounts]
    except OSError:
        return None
    real = os.path.realpath(path)
    fits = [(mount, kind) for mount, kind in entries if real.startswith(mount.rstrip("/") + "/")]
    return max(fits, key=lambda entry: len(entry[0]))[1] if fits else None


# -- training ----------------------------------------------------------------------------------
def _config(s: Setting, stage: int, zero: dict | None, extra: dict | None, accum: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": s.micro_batch,
        "gradient_accumulation_steps": accum,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, **(zero or {})},
        "bf16": {"enabled": s.precision == "bf16"},
        "fp16": {"enabled": s.precision == "fp16"},
        # the throughput line once, at the last step: its memory column reads the device's
        "steps_per_print": s.warmup + s.steps,
        **(extra or {}),
    }


def _nvme(s: Setting) -> dict:
    return {"device": "nvme", "nvme_path": os.path.join(s.scratch, "nvme")}


def _gpt(s: Setting, config: dict, **overrides: Any) -> GPT:
    torch.manual_seed(0)
    return GPT(gpt_config(s.model, **overrides))


def _zero_init_gpt(s: Setting, config: dict) -> nn.Module:
    """The GPT built under zero.Init: partitioned as it is built (NCCL's device tensors)."""
    torch.manual_seed(0)
    with zerotrain.zero.Init(config_dict_or_path=config):
        return GPT(gpt_config(s.model))


def _checkpointed_gpt(s: Setting, config: dict) -> nn.Module:
    return zerotrain.checkpointing.wrap(_gpt(s, config), block_type=Block)


def _tensor_parallel_gpt(s: Setting, config: dict) -> nn.Module:
    """The GPT split over a tensor-parallel group of this one rank, sequence parallelism on:
    ``autotp_size: 1`` applies nothing, so the split layers and their collectives would not
    run (the same call initialize makes for autotp_size above 1)."""
    from zerotrain.comm import Communicator
    from zerotrain.tensor_parallel import parallelize

    model = _gpt(s, config).to(s.device)  # NCCL broadcasts device tensors
    parallelize(model, Communicator(device=s.device), sequence_parallel=True)
    return model


def _moe_gpt(s: Setting, config: dict) -> nn.Module:
    """The GPT with every other MLP four experts (top-2), placed on an expert-parallel group of
    this one rank: initialize places them only above one rank, and the dispatch's exchanges
    run only once placed."""
    from zerotrain.comm import Communicator

    model = _gpt(s, config, num_experts=4, moe_k=2)
    for layer in model.modules():
        if isinstance(layer, zerotrain.moe.MoE):
            layer.place(Communicator(device=s.device))
    return model


def _pipeline_gpt(s: Setting, config: dict) -> nn.Module:
    from gpt.pipeline import pipeline_gpt

    return pipeline_gpt(_gpt(s, config), 1)


def _compiled_gpt(s: Setting, config: dict) -> nn.Module:
    model = _gpt(s, config)
    model.compile(backend=s.compile_backend)
    return model


BUILDERS: dict[str, Callable[[Setting, dict], nn.Module]] = {
    "gpt": _gpt,
    "zero_init": _zero_init_gpt,
    "checkpointed": _checkpointed_gpt,
    "tensor_parallel": _tensor_parallel_gpt,
    "moe": _moe_gpt,
    "pipeline": _pipeline_gpt,
    "compiled": _compiled_gpt,
}


def train(
    s: Setting,
    *,
    stage: int,
    zero: dict | None = None,
    config: dict | None = None,
    build: str = "gpt",
    accum: int = 1,
    precision: str | None = None,
    nvme: tuple[str, ...] = (),
    checkpoint: bool = False,
) -> dict:
    """``warmup + steps`` optimizer steps of the GPT (``build``: which variant) at ZeRO
    ``stage`` on one batch of random tokens, each step timed between device synchronizations.
    ``nvme``: the zero_optimization sections that offload to NVMe under the scratch folder;
    ``checkpoint``: then save, and load into a new engine, timed."""
    if precision is not None:
        s = replace(s, precision=precision)
    zero = {**(zero or {}), **{section: _nvme(s) for section in nvme}}
    cfg = _config(s, stage, zero, config, accum)
    shape = gpt_config(s.model)
    gen = torch.Generator().manual_seed(1)
    x, y = (
        torch.randint(shape.vocab_size, (s.micro_batch, shape.block_size), generator=gen).to(
            s.device
        )
        for _ in range(2)
    )
    if s.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    model = BUILDERS[build](s, cfg)
    parameters = sum(p.numel() for p in model.parameters())  # before stage 3 partitions them
    engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    init_s = time.perf_counter() - start
    sync = get_accelerator().synchronize
    losses, seconds = [], []
    for _ in range(s.warmup + s.steps):
        sync()
        begin = time.perf_counter()
        losses.append(_step(engine, x, y, accum))
        sync()
        seconds.append(time.perf_counter() - begin)
    if not all(map(math.isfinite, losses)):
        raise RuntimeError(f"a loss is not finite: {losses}")
    step_s = statistics.median(seconds[s.warmup :])
    memory = engine.memory_breakdown()
    out = {
        "parameters": parameters,
        "init_s": init_s,
        "step_s": step_s,
        "step_s_all": seconds,
        "tokens_per_s": s.micro_batch * accum * shape.block_size / step_s,
        "losses": losses,
        "model_states_bytes": memory["total"],
        "offloaded_bytes": memory.get("offloaded", 0),
    }
    if build == "checkpointed":
        out["recompute_s"] = zerotrain.checkpointing.recompute_stats().recompute_seconds
    if checkpoint:
        out.update(_save_and_load(s, engine, cfg, build, x, y))
    out.update(_peaks(s))
    return out


def _step(engine, x: torch.Tensor, y: torch.Tensor, accum: int) -> float:
    if hasattr(engine, "train_batch"):  # a PipelineModule: the schedule runs the micro-batches
        return engine.train_batch(iter([(x, y)] * accum)).item()
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    return loss.item()


def _save_and_load(s: Setting, engine, cfg: dict, build: str, x, y) -> dict:
    """Save ``engine``, load the save into a new engine, and take one step on each: the same
    loss (the device's RNG state travels too)."""
    folder = os.path.join(s.scratch, "checkpoint")
    start = time.perf_counter()
    path = engine.save_checkpoint(folder)
    save_s = time.perf_counter() - start
    # the same state saved asynchronously (pinned buffers, side-stream copies): the same files
    start = time.perf_counter()
    later = engine.save_checkpoint(os.path.join(s.scratch, "async"), async_save=True)
    async_s = time.perf_counter() - start
    engine.wait_for_checkpoint()
    if _hashes(later) != _hashes(path):
        raise RuntimeError(f"the asynchronous save {later} differs from the synchronous {path}")
    model = BUILDERS[build](s, cfg)
    resumed, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    start = time.perf_counter()
    resumed.load_checkpoint(folder)
    load_s = time.perf_counter() - start
    size = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
    after = [_step(e, x, y, 1) for e in (engine, resumed)]
    if after[0] != after[1]:
        raise RuntimeError(
            f"the loaded engine's next loss {after[1]} is not the saved one's {after[0]}"
        )
    return {"save_s": save_s, "async_save_s": async_s, "load_s": load_s, "checkpoint_bytes": size}


def _hashes(directory) -> list[str]:
    """The SHA-256 of each file of a committed checkpoint, by role (names hold the save id)."""
    manifest = json.loads((Path(directory) / "manifest.json").read_text())
    names = [
        n
        for names in manifest["roles"].values()
        for n in (names if isinstance(names, list) else [names])
    ]
    return [manifest["files"][n]["sha256"] if n else "" for n in names]


def _peaks(s: Setting) -> dict:
    return {
        "peak_device_bytes": torch.cuda.max_memory_allocated() if s.device == "cuda" else None,
        "peak_host_bytes": peak_rss(),
    }


# -- codecs ------------------------------------------------------------------------------------
def _gradients(s: Setting):
    """The GPT's gradients of one batch, as one flat fp32 bucket on the device, and its
    BucketShape (the embedding table marked, as the engine marks it)."""
    from zerotrain.compression import BucketShape

    model = _gpt(s, {}).to(s.device)
    shape = gpt_config(s.model)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(shape.vocab_size, (s.micro_batch, shape.block_size), generator=gen)
    model(x.to(s.device), x.to(s.device)).backward()
    params, offset, embeddings = [], 0, set()
    for param in model.parameters():
        params.append((offset, tuple(param.shape)))
        if param is model.token_embedding.weight:
            embeddings.add(offset)
        offset += param.numel()
    flat = torch.cat([p.grad.flatten() for p in model.parameters()])
    return flat, BucketShape(flat.numel(), params, frozenset(embeddings))


def _timed_calls(s: Setting, call: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, list[float]]:
    """``call`` warmup + steps times, each between device synchronizations; the first output."""
    sync, seconds, first = get_accelerator().synchronize, [], None
    for _ in range(s.warmup + s.steps):
        sync()
        begin = time.perf_counter()
        out = call()
        sync()
        seconds.append(time.perf_counter() - begin)
        first = out if first is None else first
    assert first is not None
    return first, seconds


def gradient_codec(s: Setting, *, method: str) -> dict:
    """A gradient codec's all-reduce of the GPT's gradients, over a group of this one rank
    (its collectives are local copies; encoding and decoding run as over many). make_codec
    gives one rank the uncompressed codec, so the codec is built directly."""
    from zerotrain.comm import Communicator
    from zerotrain.compression import GradientCompression, LowRankCodec, SparseCodec
    from zerotrain.compression.encoded import QuantizedCodec

    if s.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    flat, bucket = _gradients(s)
    kinds = {"powersgd": LowRankCodec, "topk": SparseCodec, "int8": QuantizedCodec}
    comm = Communicator(device=s.device)
    codec = kinds[method](comm, [bucket], GradientCompression(method=method, min_numel=0))

    def call() -> torch.Tensor:
        out = flat.clone()
        codec.all_reduce(0, out).wait()
        codec.catch_up(0)
        codec.end_step()
        return out

    out, seconds = _timed_calls(s, call)
    return _codec_result(s, flat, out, seconds)


def parameter_codec(s: Setting, *, method: str) -> dict:
    """The quantized parameter all-gather of the GPT's parameters (stage 3's and the
    parameter gathers of stages 1-2), over a group of this one rank. One rank turns
    quantization off (nothing travels between ranks), so it is turned on here: the check
    wants its kernels on the device."""
    from zerotrain.comm import Communicator
    from zerotrain.compression import ParameterCompression, ParameterGather

    if s.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model = _gpt(s, {}).to(s.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(s.precision, torch.float32)
    shard = torch.cat([p.detach().flatten() for p in model.parameters()]).to(dtype)
    comm = Communicator(device=s.device)
    gather = ParameterGather(comm)
    gather.compression = gather.options = ParameterCompression(method=method)

    def call() -> torch.Tensor:
        out = torch.empty_like(shard)
        gather.all_gather(out, shard).wait()
        return out

    out, seconds = _timed_calls(s, call)
    return _codec_result(s, shard, out, seconds)


def _codec_result(s: Setting, exact: torch.Tensor, out: torch.Tensor, seconds: list) -> dict:
    """The first call's relative error and the timing. (One rank's collectives are local
    copies that the communicator does not count: no bytes to report.)"""
    error = ((out.float() - exact.float()).norm() / exact.float().norm()).item()
    if not math.isfinite(error):
        raise RuntimeError(f"the decoded values are not finite (relative error {error})")
    return {
        "elements": exact.numel(),
        "step_s": statistics.median(seconds[s.warmup :]),
        "step_s_all": seconds,
        "relative_error": error,
        **_peaks(s),
    }


def tiled_compute(s: Setting) -> dict:
    """Long sequences' tiled compute on the device (zerotrain/sequence/tiled.py): dropout over
    tiles (the recomputation must replay the forward's CUDA generator: the masks are checked),
    and the fused logits loss against the whole logits: errors, time and the loss's peak
    memory."""
    import torch.nn.functional as F

    from zerotrain.sequence import TiledFusedLogitsLoss, TiledMLP

    torch.manual_seed(0)
    # on the GPU 32K tokens of a 32K vocabulary: 4 GiB of whole fp32 logits; tiny on the CPU
    tokens, width, vocab = (32768, 256, 32000) if s.device == "cuda" else (512, 32, 1000)
    x = torch.randn(1, tokens, width, device=s.device, requires_grad=True)

    def dropped(module, tile):  # 4 x tile where dropout kept it: the gradient shows the mask
        return F.dropout(tile, 0.5, training=True) * 2

    out = TiledMLP.apply(dropped, None, x, 8, None)
    torch.rand(100, device=s.device)  # other draws between forward and backward
    out.sum().backward()
    if not torch.equal(x.grad, 4.0 * (out != 0)):
        raise RuntimeError("the tiled recomputation drew other dropout masks than the forward")
    head = nn.Linear(width, vocab, bias=False, device=s.device)
    hidden = torch.randn(1, tokens, width, device=s.device, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens), device=s.device)

    def loss_sum(module, xs, ys):
        return F.cross_entropy(module(xs).float(), ys, reduction="sum")

    peaks = {}
    results = {}
    for kind in ("whole", "tiled"):
        hidden.grad = None
        if s.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        begin = time.perf_counter()
        if kind == "whole":
            loss = loss_sum(head, hidden[0], labels[0])
        else:
            loss = TiledFusedLogitsLoss.apply(loss_sum, head, hidden, labels, None, 16, None, "sum")
        loss.backward()
        get_accelerator().synchronize()
        results[kind] = (loss.item(), hidden.grad.clone(), time.perf_counter() - begin)
        if s.device == "cuda":
            peaks[kind] = torch.cuda.max_memory_allocated() - base
    (whole, whole_grad, whole_s), (tiled, tiled_grad, tiled_s) = results["whole"], results["tiled"]
    error = ((tiled_grad - whole_grad).norm() / whole_grad.norm()).item()
    if not (math.isfinite(error) and error < 1e-4 and abs(tiled - whole) <= 1e-4 * abs(whole)):
        raise RuntimeError(f"the tiled loss differs: loss {tiled} vs {whole}, grad error {error}")
    return {
        "relative_error": error,
        "loss_relative_error": abs(tiled - whole) / abs(whole),
        "step_s": tiled_s,
        "whole_s": whole_s,
        "whole_loss_peak_bytes": peaks.get("whole"),
        "tiled_loss_peak_bytes": peaks.get("tiled"),
        **_peaks(s),
    }


def plan(s: Setting) -> dict:
    """`zerotrain plan` on the device (zerotrain/plan/): the machine probe (matmul and attention
    rates, pinned copies, disk under the scratch folder), the model probe, the plan of the
    example GPT on one rank and a trial of its choice: predicted against measured; and the
    model cut into 2 pipeline stages, each stage's share timed."""
    from zerotrain.estimate.factory import build_on_meta, load_factory
    from zerotrain.plan.candidates import micro_batches
    from zerotrain.plan.pipeline_share import pipeline_share
    from zerotrain.plan.planner import make_plan, model_facts, profile_if_fits
    from zerotrain.plan.probe import probe_machine
    from zerotrain.plan_trial import TrialSpec, run_trial
    from zerotrain.precision import DTYPES

    factories = {"tiny": "tiny", "demo": "demo", "30m": "gpt_30m", "100m": "gpt_100m"}
    spec = f"{ROOT}/examples/gpt/model.py:{factories[s.model]}"
    seq, batch = gpt_config(s.model).block_size, 2 * s.micro_batch
    base = {"bf16": {"enabled": s.precision == "bf16"}, "fp16": {"enabled": s.precision == "fp16"}}
    os.environ["ZEROTRAIN_CACHE_DIR"] = os.path.join(s.scratch, "cache")
    nvme = os.path.join(s.scratch, "nvme")
    machine = probe_machine(dtype=s.precision, world=1, nvme_path=nvme, refresh=True)
    facts = model_facts(build_on_meta(spec), seq_len=seq, dtype=s.precision)
    sizes = micro_batches(world=1, global_batch=batch, base=base)
    profile = profile_if_fits(load_factory(spec), facts, machine, sizes=sizes, vocab=256)
    facts = replace(facts, profile=profile)
    chosen = make_plan(
        facts, machine, world=1, ranks_per_node=1, global_batch=batch, base=base, nvme_path=nvme
    ).best
    trial = TrialSpec(spec, chosen.config, 1, seq, 256, chosen.candidate.activation_checkpointing)
    measured = run_trial(trial, timeout=240).as_dict()
    # a pipeline of 2 cut and timed by stage on the device (one process: its trial needs 2)
    cut = pipeline_share(
        load_factory(spec),
        2,
        micro_batches=sizes[:1],
        seq_len=seq,
        vocab_size=256,
        dtype=DTYPES[s.precision],
        threads=machine.threads,
    )
    return {
        "step_s": measured["step_time_s"],
        "chosen": chosen.candidate.label(),
        "predicted": chosen.predicted.as_dict(),
        "measured": measured,
        "matmul_flops": machine.matmul_flops,
        "attention_flops": machine.attention_flops,
        "copy_bytes_per_s": machine.copy_bytes_per_s,
        "probe_seconds": machine.probe_seconds,
        "pipeline_stage_s": [st.forward_s + st.backward_s for st in cut.stages[sizes[0]]],
        **_peaks(s),
    }


BODIES: dict[str, Callable[..., dict]] = {
    "environment": environment,
    "train": train,
    "gradient_codec": gradient_codec,
    "parameter_codec": parameter_codec,
    "tiled_compute": tiled_compute,
    "plan": plan,
}
