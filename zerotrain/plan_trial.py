"""A planner's trial: one candidate config trained for a few steps on random tokens, in a
torchrun job of its own, and measured in the terms the planner predicts (``zerotrain plan
--verify``, tests/test_plan.py and bench/plan.py compare the two).

[Note: what a trial measures]
- ``peak_memory_bytes``: per rank, the most memory the training needed, the largest over the
  ranks. On a GPU, ``torch.cuda.max_memory_allocated``. On a CPU-only machine the device is
  host memory, which also holds the interpreter and its libraries: the rank's peak resident
  memory (``VmHWM``) above its resident memory after start-up, that is once torch and the
  modules ``initialize`` imports are loaded (90 MB on this machine, torch._dynamo's among them)
  and the process group is up, before the model is built; both without the pages files back
  (``RssFile``: the libraries' code, which the first steps page in as they first run each
  kernel: 47 MiB for the demo GPT on an AVX-512 machine, fewer where fewer kernels are
  built in; the kernel drops such pages under pressure rather than fail, so they are not
  memory a run can run out of). The peak's file pages are taken at the end, when every
  kernel of a step has run once. Measured in a job of its own (the
  first two steps, or ``first_timed``) with every host block of 256 KiB or more mapped on its
  own (``MALLOC_MMAP_THRESHOLD_``), so that resident memory follows the bytes in use as a GPU's
  allocated bytes do: with glibc's default (and still with 1 MiB, below which the demo GPT's
  activation blocks lie), freed activation blocks stay in the heap, which then grows toward the
  peak for several steps in a way no byte count predicts; and that setting slows a step by up
  to 1.3x (bench/host_allocator.py), so the time is the other job's, under the default.
- ``model_state_bytes``: ``engine.memory_breakdown()["total"]`` after the steps, the largest
  over the ranks (a pipeline's stages hold different layers).
- ``step_time_s``: the median time of an optimizer step (all its micro-batches, forward,
  backward and step) over the steps from ``first_timed`` on (the first step builds the
  optimizer state and warms the allocator); the slowest rank's.
- ``steal_fraction``: on Linux, the share of the machine's CPU time its hypervisor gave to
  other guests while those steps ran (``/proc/stat``'s steal). A shared virtual machine took
  20-24% at times on this project's 2-core CPU and the same trials then ran up to 2.7x slower:
  above a few percent a step time says more about the neighbours than about the config, so
  bench/plan.py reports it beside each time.

The model comes from a factory, as ``zerotrain estimate --model`` takes it: a module whose
``forward(ids, targets)`` returns the loss (examples/gpt), or a Hugging Face causal LM
(``forward(input_ids=..., labels=...)`` returning an output with ``.loss``; with sequence
parallelism each rank gets its share of the tokens, ``shard_batch``'s). Activation
checkpointing wraps the children of the model's outermost ``nn.ModuleList`` (its blocks;
:func:`zerotrain.checkpointing.wrap`).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from zerotrain.plan.jobs import job_arguments, run_local_job
from zerotrain.plan.model_probe import is_hf_causal_lm, loss_of

__all__ = ["Measured", "TrialSpec", "measure_memory", "run_trial"]


@dataclass(frozen=True)
class TrialSpec:
    """One candidate to run: the model, the ds_config, the launch shape and the batch."""

    model: str
    """``module.path:factory`` or ``path/to/file.py:factory``."""
    config: dict
    """The ds_config, with ``train_micro_batch_size_per_gpu`` and the accumulation steps."""
    world: int
    seq_len: int
    vocab_size: int
    activation_checkpointing: bool = False
    split_points: tuple[str, ...] = ()
    """A pipeline's cuts: the model is trained as ``split_model(model, ..., split_points)``
    with ``train_batch`` (see [Note: a pipeline stage's share] in
    zerotrain/plan/pipeline_share.py)."""
    steps: int = 3
    """Optimizer steps."""
    first_timed: int = 2
    """The first step timed (1-based): the first builds the optimizer state and warms the
    allocator (an ``autotuning`` section's ``start_profile_step``)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment of the ranks."""


@dataclass(frozen=True)
class Measured:
    """What a trial measured (see [Note: what a trial measures])."""

    peak_memory_bytes: int
    model_state_bytes: int
    step_time_s: float
    steal_fraction: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


MAPPED_BLOCK_BYTES = 1 << 18
"""On a CPU-only machine, the memory job maps every host block this large or larger (see
[Note: what a trial measures])."""


def run_trial(spec: TrialSpec, *, timeout: float = 900) -> Measured:
    """Run ``spec`` as a torchrun job of ``spec.world`` local ranks (gloo on a CPU, one thread
    each) and return what it measured; :class:`JobError` if the job failed or ran past
    ``timeout`` seconds. On a CPU-only machine, two jobs: one for the time, one for the
    memory (:func:`measure_memory`; see [Note: what a trial measures])."""
    timed = _job(spec, timeout)
    if _has_cuda():
        return timed
    memory = measure_memory(spec, timeout=timeout)
    return replace(timed, peak_memory_bytes=memory.peak_memory_bytes)


def measure_memory(spec: TrialSpec, *, timeout: float = 900) -> Measured:
    """``spec`` run for its first two steps (or ``first_timed``), for its memory: on a CPU-only
    machine with host blocks of :data:`MAPPED_BLOCK_BYTES` or more mapped on their own, which
    slows the step (see [Note: what a trial measures])."""
    steps = min(spec.steps, max(2, spec.first_timed))  # the second has state and activations
    env = (
        spec.env if _has_cuda() else {"MALLOC_MMAP_THRESHOLD_": str(MAPPED_BLOCK_BYTES), **spec.env}
    )
    return _job(replace(spec, steps=steps, env=env), timeout)


def _job(spec: TrialSpec, timeout: float) -> Measured:
    result = run_local_job(
        "zerotrain.plan_trial",
        spec.world,
        asdict(spec),
        env=spec.env,
        timeout=timeout,
        what="trial",
    )
    return Measured(**result)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# -- the ranks ---------------------------------------------------------------------------------
def _build(spec: TrialSpec):
    import torch

    from zerotrain.estimate.factory import load_factory

    model = load_factory(spec.model)()
    if spec.activation_checkpointing:
        from zerotrain.activation_checkpointing import wrap

        wrap(model)
    if spec.split_points:
        from zerotrain.pipe import split_model

        micro = spec.config["train_micro_batch_size_per_gpu"]
        example = torch.randint(0, spec.vocab_size, (micro, spec.seq_len))
        return split_model(model, (example,), list(spec.split_points), _pipeline_loss)
    return model


def _pipeline_loss(logits, labels):
    """The loss a pipeline's last stage takes of the model's logits: the language-model loss
    of ``model(ids, ids)`` (the examples' GPT's, which forward then computes itself)."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def _load_runtime(spec: TrialSpec) -> None:
    """Import what ``initialize`` imports, and what building the model imports (its model
    on the meta device: transformers' modules for a Hugging Face model, 90-110 MB the Llama's
    rows of bench/plan.py counted as training before), and for a pipeline what cutting the
    model loads (torch.export's modules and state for the model's operators, cut once and
    dropped): libraries, not training memory (see [Note: what a trial measures])."""
    import gc

    import torch
    import torch._dynamo  # noqa: F401 (pulled in by the optimizer's and DeviceMesh's code)

    import zerotrain.api  # noqa: F401
    from zerotrain.accelerator import release_free_host_memory
    from zerotrain.estimate.factory import build_on_meta, load_factory
    from zerotrain.pipe.split import cut_model

    build_on_meta(spec.model)
    if spec.split_points:
        example = torch.zeros(1, spec.seq_len, dtype=torch.long)
        cut_model(load_factory(spec.model)(), (example,), list(spec.split_points))
        gc.collect()  # its stages and the tracer's objects are reference cycles
        release_free_host_memory()  # the model it built: not a heap the training then reuses


def _worker(spec: TrialSpec, out: Path) -> None:
    import torch

    import zerotrain
    from zerotrain.accelerator import current_rss, file_backed_rss, peak_rss
    from zerotrain.comm import Communicator
    from zerotrain.pipe.engine import PipelineEngine

    zerotrain.init_distributed(verbose=False)
    comm = Communicator()
    _load_runtime(spec)
    cuda = torch.cuda.is_available()
    start_rss = (current_rss() or 0) - file_backed_rss()  # anonymous memory at start-up
    torch.manual_seed(0)
    model = _build(spec)
    engine, *_ = zerotrain.initialize(model=model, config=spec.config)
    micro = engine.train_micro_batch_size_per_gpu()
    accumulation = engine.gradient_accumulation_steps()
    # by data-parallel index: tensor- and sequence-parallel peers (neighbours) and a pipeline's
    # stages (the outermost axis) read the same samples
    tp, sp = engine.mp_world_size, engine.layout.sequence_shares
    data_index = (comm.rank // (tp * sp)) % engine.dp_world_size
    # with sequence parallelism, this rank's share of each sample's tokens
    share = ((comm.rank // tp) % sp, sp) if sp > 1 else None
    generator = torch.Generator().manual_seed(data_index)
    hf = is_hf_causal_lm(model)
    times = []
    cpu_at_start = None
    for index in range(spec.steps):
        if index == spec.first_timed - 1:
            cpu_at_start = _cpu_times()
        batches = [
            torch.randint(0, spec.vocab_size, (micro, spec.seq_len), generator=generator)
            for _ in range(accumulation)
        ]
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        if isinstance(engine, PipelineEngine):  # the first stage reads the inputs, the last
            engine.train_batch(iter([(ids, ids) for ids in batches]))  # the labels
        else:
            for ids in batches:
                loss = loss_of(engine, ids.to(engine.device), hf, share)
                engine.backward(loss)
                engine.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    if cuda:
        peak = torch.cuda.max_memory_allocated()
    else:
        # the libraries' pages the steps paged in were in by the peak (the second step's)
        peak = (peak_rss() or 0) - file_backed_rss() - start_rss
    step = statistics.median(times[spec.first_timed - 1 :] or times)
    steal = _steal_since(cpu_at_start)
    states = engine.memory_breakdown()["total"]
    mine = torch.tensor(
        [float(peak), float(states), step, steal], dtype=torch.float64, device=comm.device
    )
    comm.all_reduce(mine, op="max", name="plan_trial")
    if comm.rank == 0:
        largest = mine.tolist()  # the largest peak, model states, step and steal over the ranks
        measured = Measured(int(largest[0]), int(largest[1]), largest[2], largest[3])
        out.write_text(json.dumps(asdict(measured)))
    comm.barrier()


def _cpu_times() -> list[int] | None:
    """The machine's CPU time so far by kind (``/proc/stat``'s first line: user, nice, system,
    idle, iowait, irq, softirq, steal, in clock ticks); None where it cannot be read."""
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    return [int(value) for value in fields[1:9]]


def _steal_since(start: list[int] | None) -> float:
    """The share of the CPU time since ``start`` (:func:`_cpu_times`) that was stolen (0.0
    where unknown)."""
    end = _cpu_times()
    if start is None or end is None:
        return 0.0
    spent = [b - a for a, b in zip(start, end, strict=True)]
    return spent[7] / sum(spent) if sum(spent) > 0 else 0.0


def main() -> None:
    payload, out = job_arguments()
    _worker(TrialSpec(**payload), out)


if __name__ == "__main__":
    main()
