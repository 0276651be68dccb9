"""The CUDA paths (skipped without a GPU): one rank on one GPU, NCCL, every stage.

Run on a GPU machine with ``pytest tests/test_cuda.py``. Multi-rank NCCL needs one GPU per rank;
these tests use one, so they check the device placement of the engine, the optimizer state and
the checkpoint code (tensors written from and read back into GPU memory), not NCCL's collectives.
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.distributed import run_distributed
from tests.models import DropoutModel, make_batches, param_groups
from tests.test_activation_checkpointing import GPT, checkpointing, gpt_batch, gpt_config
from tests.test_checkpoint_async import _hashes
from tests.test_flops_profiler import _profile_on_gpu, gpt_forward_flops

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


FUSED_ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "fused": True}}


def _engine(stage: int, precision: str, zero: dict | None = None, optimizer=FUSED_ADAMW):
    import zerotrain

    torch.manual_seed(0)
    model = DropoutModel()
    engine, *_ = zerotrain.initialize(
        model=model,
        model_parameters=param_groups(model, 0.1),
        config={
            "train_micro_batch_size_per_gpu": 4,
            "optimizer": optimizer,
            "gradient_clipping": 1.0,
            "zero_optimization": {
                "stage": stage,
                "stage3_param_persistence_threshold": 0,
                "reduce_bucket_size": 200,  # several buckets: the ring and ratio 0.5 split them
                **(zero or {}),
            },
            "bf16": {"enabled": precision == "bf16"},
            "fp16": {"enabled": precision == "fp16", "initial_scale_power": 8},
            "steps_per_print": 10**6,
        },
    )
    return engine


def _train(engine, batches) -> list[float]:
    losses = []
    for idx, tgt in zip(*batches, strict=True):
        loss = engine(idx.to(engine.device), tgt.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


# zerotrain's FusedAdam (Adam without bias correction), which keeps `step` on the GPU
FUSED_ADAM_UNCORRECTED = {"type": "Adam", "params": {"lr": 1e-2, "bias_correction": False}}


def _resume_on_gpu(root: str):
    """Per stage and precision: 4 steps straight vs 2, save, a new engine loads, 2 more; and
    zerotrain's own FusedAdam at stage 1 (key "FusedAdam")."""
    out = {}
    idx, tgt = make_batches(4, 4, seed=3)
    cases = {(s, p): (s, p, FUSED_ADAMW) for s in (0, 1, 2, 3) for p in ("fp32", "bf16", "fp16")}
    cases["FusedAdam"] = (1, "bf16", FUSED_ADAM_UNCORRECTED)
    for key, (stage, precision, optimizer) in cases.items():
        straight = _engine(stage, precision, optimizer=optimizer)
        assert straight.device.type == "cuda"
        first = _train(straight, (idx[:2], tgt[:2]))
        path = straight.save_checkpoint(f"{root}/{stage}-{precision}-{optimizer['type']}")
        # the same step saved asynchronously (side-stream copies) while the next steps run
        later = straight.save_checkpoint(
            f"{root}/async-{stage}-{precision}-{optimizer['type']}", async_save=True
        )
        rest = _train(straight, (idx[2:], tgt[2:]))
        straight.wait_for_checkpoint()
        resumed = _engine(stage, precision, optimizer=optimizer)
        resumed.load_checkpoint(f"{root}/{stage}-{precision}-{optimizer['type']}")
        again = _train(resumed, (idx[2:], tgt[2:]))
        a, b = straight.consolidated_state_dict(), resumed.consolidated_state_dict()
        states = list(resumed.optimizer.optimizer.state.values())
        out[key] = {
            "losses": (rest, again),
            "equal": all(torch.equal(a[k], b[k]) for k in a),
            "first": first,
            "path": str(path),
            "async_equal": _hashes(later) == _hashes(path),
            "state_device": {
                t.device.type for s in states for t in s.values() if torch.is_tensor(t) and t.dim()
            },
            # where each run keeps Adam's step count: torch's fused kernels and zerotrain's
            # FusedAdam read it on the GPU
            "step_device": [
                {s["step"].device.type for s in e.optimizer.optimizer.state.values()}
                for e in (straight, resumed)
            ],
        }
    return out


def test_checkpoint_resume_on_gpu_every_stage_and_precision(tmp_path):
    from zerotrain.checkpoint import load_consolidated

    results = run_distributed(_resume_on_gpu, 1, str(tmp_path))[0]
    for key, got in results.items():
        rest, again = got["losses"]
        assert rest == again and got["equal"], key  # dropout RNG on the GPU resumed too
        assert got["async_equal"], key
        assert got["state_device"] == {"cuda"}, key
        assert got["step_device"][1] == got["step_device"][0], key  # as before the checkpoint
    plain = load_consolidated(DropoutModel(), results[3, "bf16"]["path"])
    assert all(p.device.type == "cpu" for p in plain.parameters())


def _largest_relative_error(got: dict, want: dict) -> float:
    """Over the entries of two state dicts, compared on the host: an offloaded engine's masters
    live there, an in-memory one's on the GPU."""
    errors = []
    for key, value in want.items():
        a, b = got[key].cpu().float(), value.cpu().float()
        errors.append(((a - b).norm() / b.norm()).item())
    return max(errors)


def _offload_on_gpu(root: str):
    """Per stage, precision and offload layout: parameters after 3 steps, next to the same run
    without offload (dropout off: the masks would come from the same GPU generator anyway)."""
    idx, tgt = make_batches(3, 4, seed=5)
    nvme = {"device": "nvme", "nvme_path": root, "buffer_count": 2}
    layouts = {
        "cpu": {"offload_optimizer": {"device": "cpu", "buffer_count": 1}},
        "cpu-half": {"offload_optimizer": {"device": "cpu", "ratio": 0.5}},
        "nvme": {"offload_optimizer": nvme, "sub_group_size": 1024},
        "params-cpu": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
        "params-nvme": {"offload_optimizer": nvme, "offload_param": nvme},
    }
    out = {}
    for stage in (1, 2, 3):
        for precision in ("fp32", "bf16"):
            base = _engine(stage, precision)
            base.module.drop.p = 0.0
            _train(base, (idx, tgt))
            want = base.consolidated_state_dict()
            for name, zero in layouts.items():
                if name.startswith("params") and stage < 3:
                    continue
                engine = _engine(stage, precision, zero)
                engine.module.drop.p = 0.0
                _train(engine, (idx, tgt))
                got = engine.consolidated_state_dict()
                out[stage, precision, name] = {
                    "error": _largest_relative_error(got, want),
                    # where offload put the optimizer's share: host memory, or NVMe's files
                    "offloaded": engine.memory_breakdown()[
                        "disk" if "nvme" in name else "offloaded"
                    ],
                    "param_devices": {p.device.type for p in engine.module.parameters()},
                }
    return out


def test_offload_on_gpu_trains_as_in_memory(tmp_path):
    """The CUDA-only parts of offload (side stream, pinned ring, events, asynchronous copies of
    parameter shards): the same parameters as in memory, within the CPU and GPU kernels'
    rounding (fp32) or bf16's."""
    results = run_distributed(_offload_on_gpu, 1, str(tmp_path))[0]
    assert len(results) == 2 * (3 * 3 + 2)
    for key, got in results.items():
        tolerance = 1e-5 if key[1] == "fp32" else 1e-2
        assert got["error"] < tolerance, (key, got)
        assert got["offloaded"] > 0, key
        assert got["param_devices"] == {"cuda"}, key


def test_cpu_checkpointing_moves_kept_inputs_off_the_gpu():
    cfg, batch = gpt_config("demo"), 4
    x, y = (t.cuda() for t in gpt_batch(batch, cfg.block_size))
    torch.manual_seed(0)
    model = checkpointing.wrap(GPT(cfg).cuda())
    model(x, y).backward()  # the first step allocates workspaces that stay
    allocated, saved, grads = {}, {}, {}
    try:
        for offload in (False, True):
            checkpointing.configure(checkpoint_in_cpu=offload)
            model.zero_grad(set_to_none=True)
            before = torch.cuda.memory_allocated()
            with checkpointing.count_saved_activations(model.parameters()) as saved[offload]:
                loss = model(x, y)
            allocated[offload] = torch.cuda.memory_allocated() - before
            loss.backward()
            grads[offload] = [p.grad for p in model.parameters()]
    finally:
        checkpointing.configure(checkpoint_in_cpu=False)
    # Each block's input (batch x seq x width fp32) waits in pinned CPU memory instead.
    inputs = cfg.n_layer * batch * cfg.block_size * cfg.n_embd * 4
    assert saved[False].nbytes - saved[True].nbytes == inputs
    assert allocated[False] - allocated[True] == pytest.approx(inputs, abs=1024)  # allocator
    for offloaded, on_gpu in zip(grads[True], grads[False], strict=True):
        torch.testing.assert_close(offloaded, on_gpu)  # the GPU attention backward may reorder


def test_profile_and_memory_on_cuda(tmp_path):
    device, csv_files = run_distributed(_profile_on_gpu, 1, str(tmp_path))[0]
    assert device == "cuda"
    assert {"Train_memory_cuda_allocated_gb.csv", "Train_memory_peak_cuda_allocated_gb.csv"} <= set(
        csv_files
    )
    text = (tmp_path / "p.txt").read_text()
    assert "peak per device (measured: 4096x4096 bfloat16 matmul)" in text
    assert re.search(
        rf"fwd FLOPs per micro-batch\s+{gpt_forward_flops('tiny', 2) / 1e6:.2f} M", text
    )


def test_gtopk_merges_sparse_vectors_on_the_gpu():
    from zerotrain.compression.sparse import merge

    a = (torch.tensor([0, 2, 5], device="cuda"), torch.tensor([1.0, -4.0, 2.0], device="cuda"))
    b = (torch.tensor([2, 3, 5], device="cuda"), torch.tensor([1.0, 0.5, 2.5], device="cuda"))
    indices, values = merge(a, b, 2)
    assert values.device.type == "cuda"
    assert indices.tolist() == [2, 5] and values.tolist() == [-3.0, 4.5]


@pytest.mark.parametrize("method", ["topk", "gtopk", "powersgd", "acp_sgd", "onebit"])
def test_codec_state_read_to_the_host_resumes_on_the_gpu(tmp_path, method):
    """Checkpoints are read with map_location="cpu": a codec given its state on the host
    continues on GPU gradients as the codec it was saved from (one process: each collective
    is a copy)."""
    import math

    from zerotrain.comm import Communicator
    from zerotrain.compression import BucketShape, GradientCompression
    from zerotrain.compression.codec import LowRankCodec, SparseCodec
    from zerotrain.compression.encoded import OneBitCodec

    shape = (16, 12)
    bucket = BucketShape(math.prod(shape) + 8, [(0, shape), (math.prod(shape), (8,))])
    options = GradientCompression(method=method, rank=2, ratio=0.1, min_numel=0, block_size=8)
    kinds = {"topk": SparseCodec, "gtopk": SparseCodec, "onebit": OneBitCodec}
    build = lambda: kinds.get(method, LowRankCodec)(Communicator(), [bucket], options)  # noqa: E731
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(bucket.numel_padded, generator=gen).cuda() for _ in range(4)]

    def step(codec, grad):
        flat = grad.clone()
        codec.all_reduce(0, flat).wait()
        arrivals = codec.catch_up(0)
        codec.end_step()
        return flat, arrivals

    straight = build()
    for grad in grads[:2]:
        step(straight, grad)
    torch.save(straight.state_dict(), tmp_path / "codec.pt")
    resumed = build()
    resumed.load_state_dict(torch.load(tmp_path / "codec.pt", map_location="cpu"), steps=2)
    for grad in grads[2:]:
        want, want_arrivals = step(straight, grad)
        got, got_arrivals = step(resumed, grad)
        assert got.device.type == "cuda" and torch.equal(got, want), method
        if want_arrivals is not None:
            assert all(map(torch.equal, got_arrivals, want_arrivals)), method


def _pipeline_over_nccl() -> dict:
    """pp 2 over NCCL, each schedule: an evaluation and two steps whose activations (8 MiB a
    message) exceed NCCL's buffers (4 MiB by default, where a send waits for its receive), the
    sequence length changing between them; every stage output is a view (nn.Linear on 3-D)."""
    from torch import nn

    import zerotrain
    from zerotrain.pipe import LayerSpec, PipelineModule, stage_options

    vocab, width, rows = 64, 512, 8

    def loss_fn(logits, labels):
        return nn.functional.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1))

    out = {}
    for schedule in ("1f1b", "gpipe", "interleaved_1f1b", "zbv"):
        layers = [
            LayerSpec(nn.Embedding, vocab, width),
            *(LayerSpec(nn.Linear, width, width) for _ in range(5)),
            LayerSpec(nn.Linear, width, vocab),
        ]
        pipe = PipelineModule(
            layers, num_stages=2, loss_fn=loss_fn, partition_method="uniform",
            seed_layers=True, **stage_options(schedule),
        )  # fmt: skip
        engine, *_ = zerotrain.initialize(
            model=pipe,
            config={
                "train_micro_batch_size_per_gpu": rows,
                "gradient_accumulation_steps": 4,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "pipeline": {"schedule": schedule},
                "steps_per_print": 10**6,
            },
        )
        gen = torch.Generator().manual_seed(0)

        def batch(length, gen=gen):
            windows = [torch.randint(0, vocab, (rows, length + 1), generator=gen) for _ in range(4)]
            return iter([(w[:, :-1], w[:, 1:]) for w in windows])

        losses = [engine.eval_batch(batch(512)).item()]
        losses += [engine.train_batch(batch(length)).item() for length in (512, 384)]
        out[schedule] = losses
    return out


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: pp 2 over NCCL")
def test_pipeline_messages_over_nccl_beyond_its_buffers():
    """The stages' messages as torch groups its own (a send with the opposite receive in 1F1B,
    each pair of ranks in one order in the runtime): the posting order that deadlocked on NCCL
    once activations exceeded its buffers completes here under every schedule ([Note: headers
    apart from the tensors] in zerotrain/comm/stage_messages.py; on the CPU,
    tests/test_pipeline_p2p.py imposes NCCL's order on gloo)."""
    first, second = run_distributed(_pipeline_over_nccl, 2, timeout=600, collective_timeout_s=120)
    assert first == second  # every rank returns the step's mean loss
    for schedule, losses in first.items():
        assert all(0 < loss < 10 for loss in losses), (schedule, losses)


def test_the_clusters_exchange_moves_a_gpu_change_through_the_host():
    """The sites' two tiers are gloo groups on the host: a change on the GPU is summed there
    and lands back on the GPU in place (one process: each tier a group of one)."""
    from zerotrain.comm import Communicator
    from zerotrain.comm.site_clusters import SiteTiers
    from zerotrain.compression import BucketShape, make_codec
    from zerotrain.compression.clustered import ClusteredCodec

    inside, leaders = Communicator(device="cpu"), Communicator(device="cpu")
    tiers = SiteTiers(((0,),), inside, leaders, "given")
    shapes = [BucketShape(8, [(0, (8,))])]
    codec = ClusteredCodec(tiers, make_codec(None, leaders, shapes), shapes)
    change = torch.arange(8.0, device="cuda")
    codec.all_reduce(0, change).wait()
    codec.end_step()
    assert change.device.type == "cuda" and torch.equal(change.cpu(), torch.arange(8.0))
    assert codec.state_dict()["steps"] == 1
