"""Golden losses: every rank's per-micro-step loss, as exact float bits, and a hash of every
parameter after training, compared bit for bit with files recorded before a change.

A change that claims to be numerically neutral (a refactor, a new strategy that is off by
default) keeps this test passing unchanged. A change that means to move numerics regenerates
the files with ``.venv/bin/python tests/test_golden.py`` and says why in its commit.

The bits depend on torch's version and on which CPU kernels run (MKL and oneDNN choose theirs by
the CPU's vendor: an AMD EPYC computes other bits for the same model than the machine the first
record was made on), so the file keeps one record per platform (:func:`platform`). A platform
with a record is held to it; one without is compared with the records of platforms not named
when recorded, and skipped with the reason if none matches (parity tests still run).
``python tests/test_golden.py --add-platform``, run on a tree that moves no numerics, adds this
platform's record.

A second grid (:func:`feature_cases`, ``golden/features.json``, ``--features`` to record it)
holds what the first leaves out: offload, codecs, the 1-bit optimizers. Its first record was
made with zerotrain at 00078d0 (``PYTHONPATH=<worktree of 00078d0> .venv/bin/python
tests/test_golden.py --features``; the record names the commit), so a restructuring is held to
the code before it, not to itself.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import platform as host
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from models import SEQ, VOCAB, AwkwardModel, DropoutModel, make_batches, param_groups, run_steps

GOLDEN = Path(__file__).parent / "golden" / "losses.json"
FEATURES_GOLDEN = Path(__file__).parent / "golden" / "features.json"
"""The feature grid's records (:func:`feature_cases`), first recorded with zerotrain at
00078d0, the commit issue 41's restructuring is held to."""
WORLD, STEPS, MICRO, ACCUM = 2, 3, 2, 2


def tiny_gpt() -> torch.nn.Module:
    """examples/gpt's GPT at the test models' vocabulary and length: 4 heads of width 6, which
    tensor parallelism splits over 2 ranks."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from gpt.model import GPT, GPTConfig

    return GPT(GPTConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=24))


class TinyMoE(torch.nn.Module):
    """Tokens through one top-2 Mixture-of-Experts layer of 4 experts, spread over 2 ranks
    (expert parallelism 2: each rank holds 2)."""

    def __init__(self):
        super().__init__()
        from torch import nn

        from zerotrain.moe import MoE

        width = 8
        self.embed = nn.Embedding(VOCAB, width)
        expert = nn.Sequential(nn.Linear(width, 12), nn.GELU(), nn.Linear(12, width))
        self.moe = MoE(width, expert, 4, ep_size=2, k=2, min_capacity=0, use_rts=False)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(idx)
        out, l_aux, _ = self.moe(hidden.reshape(-1, hidden.shape[-1]))
        logits = self.head(out)
        loss = torch.nn.functional.cross_entropy(logits, targets.reshape(-1))
        return loss + 0.01 * l_aux


def tiny_pipeline() -> torch.nn.Module:
    """examples/gpt's layers (an embedding, 2 blocks, a norm, the head) as a 2-stage pipeline
    (pipeline parallelism 2: a stage a rank)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from gpt.model import Block, GPTConfig
    from torch import nn

    from zerotrain.pipe import LayerSpec, PipelineModule

    config = GPTConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=24)

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))

    layers = [
        LayerSpec(nn.Embedding, VOCAB, 24),
        LayerSpec(Block, config),
        LayerSpec(Block, config),
        LayerSpec(nn.LayerNorm, 24),
        LayerSpec(nn.Linear, 24, VOCAB),
    ]
    return PipelineModule(layers, num_stages=2, loss_fn=loss_fn, seed_layers=True)


MODELS = {
    "awkward": AwkwardModel,
    "dropout": DropoutModel,
    "gpt": tiny_gpt,
    "moe": TinyMoE,
    "pipeline": tiny_pipeline,
}
PRECISIONS = {
    "fp32": {},
    "bf16": {"bf16": {"enabled": True}},
    "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8}},
}


# A feature: the config it adds to a case's (its zero_optimization keys merged into the case's).
FEATURES: dict[str, dict] = {
    "overlap_param_gather": {"zero_optimization": {"overlap_param_gather": True}},
    "offload_cpu": {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
    "offload_nvme": {"zero_optimization": {"offload_optimizer": {"device": "nvme"}}},
    "offload_param_cpu": {"zero_optimization": {"offload_param": {"device": "cpu"}}},
    "powersgd": {"comm_compression": {"gradients": {"method": "powersgd", "min_numel": 0}}},
    "int8_gradients": {"comm_compression": {"gradients": {"method": "int8"}}},
    "int8_parameters": {"comm_compression": {"parameters": {"method": "int8"}}},
    "onebit_adam": {
        "optimizer": {"type": "OneBitAdam", "params": {"lr": 3e-2, "eps": 1e-6, "freeze_step": 1}}
    },
    "tp2": {"tensor_parallel": {"autotp_size": 2}},
    "local_steps": {
        "optimizer": {
            "type": "ZeroOneAdam",
            "params": {"lr": 3e-2, "eps": 1e-6, "var_freeze_step": 1, "local_step_clipper": 2},
        }
    },
}
Case = tuple[str, str, int, str | None]
"""(model, precision, ZeRO stage, feature of :data:`FEATURES` or None)."""


def cases() -> list[Case]:
    """Both models x fp32/bf16 x stages 0-3, plus fp16 and the stages 1-2 parameter-gather
    overlap on the awkward model."""
    grid: list[Case] = [
        (m, p, s, None) for m in ("awkward", "dropout") for p in ("fp32", "bf16") for s in range(4)
    ]
    grid += [("awkward", "fp16", s, None) for s in (0, 2, 3)]
    grid += [("awkward", "fp32", s, "overlap_param_gather") for s in (1, 2)]
    return grid


def feature_cases() -> list[Case]:
    """The features the first grid leaves out, each at a stage it serves, on the awkward model
    in fp32: optimizer offload to CPU and NVMe, stage 3's parameter offload, a gradient codec
    of each kind (low-rank, quantized), quantized parameter gathers, 1-bit Adam, 0/1 Adam's
    local steps, tensor parallelism over both ranks (the example GPT; data parallelism 1),
    expert parallelism over both (:class:`TinyMoE`), and a 2-stage pipeline (whose losses are
    the steps' means, as ``train_batch`` returns them)."""
    return [
        ("awkward", "fp32", 2, "offload_cpu"),
        ("awkward", "fp32", 3, "offload_cpu"),
        ("awkward", "fp32", 2, "offload_nvme"),
        ("awkward", "fp32", 3, "offload_param_cpu"),
        ("awkward", "fp32", 2, "powersgd"),
        ("awkward", "fp32", 2, "int8_gradients"),
        ("awkward", "fp32", 3, "int8_parameters"),
        ("awkward", "fp32", 0, "onebit_adam"),
        ("awkward", "fp32", 0, "local_steps"),
        ("gpt", "fp32", 1, "tp2"),
        ("gpt", "fp32", 3, "tp2"),
        ("moe", "fp32", 2, None),
        ("pipeline", "fp32", 1, None),
    ]


def case_name(model: str, precision: str, stage: int, feature: str | None) -> str:
    return f"{model}-{precision}-stage{stage}" + (f"-{feature}" if feature else "")


def platform() -> str:
    """What decides the bits besides the code: torch's version, the CPU's vendor (MKL and
    oneDNN dispatch on it) and the instruction set torch's own kernels use."""
    vendor = host.processor() or host.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("vendor_id"):
                vendor = line.split(":", 1)[1].strip()
                break
    return f"torch {torch.__version__}, {vendor}, {torch.backends.cpu.get_cpu_capability()}"


def platform_record(**payload) -> dict:
    """A record of ``payload`` for this platform, dated."""
    return {"platform": platform(), "recorded": datetime.date.today().isoformat(), **payload}


def float_bits(value: torch.Tensor) -> str:
    """The loss as the hex of its fp32 bits (bf16 and fp16 convert to fp32 exactly)."""
    return f"{value.detach().float().view(torch.int32).item() & 0xFFFFFFFF:08x}"


def state_hash(state: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for key in sorted(state):
        digest.update(key.encode())
        digest.update(state[key].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def build_engine(case: Case, nvme: Path | None):
    """The engine of ``case`` with every rank's model seeded alike (``nvme``: rank 0's directory
    for NVMe offload, None on the other ranks)."""
    import zerotrain
    from zerotrain.comm import Communicator

    model_name, precision, stage, feature = case
    torch.manual_seed(0)
    model = MODELS[model_name]()
    added = dict(FEATURES[feature]) if feature else {}
    zero = {
        "stage": stage,
        "reduce_bucket_size": 60,  # several buckets
        "stage3_param_persistence_threshold": 0,  # stage 3: shard every unit
        **added.pop("zero_optimization", {}),
    }
    if zero.get("offload_optimizer", {}).get("device") == "nvme":  # one directory a node
        (path,) = Communicator().all_gather_object(str(nvme) if nvme else None)[:1]
        zero["offload_optimizer"] = {**zero["offload_optimizer"], "nvme_path": path}
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-2, "eps": 1e-6}},
        "zero_optimization": zero,
        "steps_per_print": 10**6,
        **PRECISIONS[precision],
        **added,
    }
    engine, *_ = zerotrain.initialize(
        model=model, model_parameters=param_groups(model, 0.1), config=config
    )
    return engine


def train_steps(engine, idx: torch.Tensor, tgt: torch.Tensor) -> list[str]:
    """Train on the global batches ``idx``/``tgt`` (one a step), this data-parallel rank's
    micro-batches of each; the bits of every loss (a pipeline's: each step's mean)."""
    losses = []

    def backward(loss):
        losses.append(float_bits(loss))
        engine.backward(loss)

    # by data-parallel rank: tensor-parallel ranks share their micro-batches
    dp, dp_rank = engine.dp_world_size, engine.optimizer.comm.rank
    if hasattr(engine, "train_batch"):  # a pipeline: the engine runs the micro-batches
        for step in range(len(idx)):
            chunks = [(micro * dp + dp_rank) * MICRO for micro in range(ACCUM)]
            batch = [(idx[step][c : c + MICRO], tgt[step][c : c + MICRO]) for c in chunks]
            losses.append(float_bits(engine.train_batch(iter(batch))))
    else:
        run_steps(engine, idx, tgt, MICRO, ACCUM, dp, dp_rank, backward=backward)
    return losses


def nvme_directory() -> Path | None:
    """Rank 0's temporary directory for NVMe offload (None on the other ranks)."""
    from zerotrain.comm import Communicator

    return Path(tempfile.mkdtemp(prefix="golden-nvme-")) if Communicator().rank == 0 else None


def train_cases(grid):
    import os

    from zerotrain.comm import Communicator

    os.environ["ZEROTRAIN_DEBUG"] = "1"  # lifecycle checks on: they must not change a bit
    rank = Communicator().rank
    nvme = nvme_directory()
    out = {}
    for case in grid:
        engine = build_engine(case, nvme)
        torch.manual_seed(100 + rank)  # each rank draws its own dropout masks
        idx, tgt = make_batches(STEPS, MICRO * ACCUM * WORLD)
        out[case_name(*case)] = {
            "losses": train_steps(engine, idx, tgt),
            "params": state_hash(engine.consolidated_state_dict()),
        }
    if nvme is not None:
        shutil.rmtree(nvme, ignore_errors=True)
    return out


def measure(grid: list[Case] | None = None) -> dict:
    """{case: {"losses": [per rank: [bits per micro-step]], "params": hash}} for ``grid``
    (default :func:`cases`)."""
    return agreed_cases(run_distributed(train_cases, WORLD, grid or cases(), timeout=600))


def agreed_cases(per_rank: list[dict]) -> dict:
    """Each rank's {case: {"losses", "params"}} as one: every rank's losses, the one hash all
    ranks agree on."""
    out = {}
    for name in per_rank[0]:
        hashes = {r[name]["params"] for r in per_rank}
        assert len(hashes) == 1, f"{name}: ranks disagree on the trained parameters"
        out[name] = {"losses": [r[name]["losses"] for r in per_rank], "params": hashes.pop()}
    return out


def records_to_hold(records: list[dict]) -> list[dict]:
    """The records this platform's bits must equal one of: its own, else those of platforms
    not named when recorded (skips the test when there are none)."""
    here = platform()
    own = [r for r in records if r["platform"] == here]
    held = own or [r for r in records if r["platform"] is None]
    if not held:
        named = "; ".join(str(r["platform"]) for r in records)
        pytest.skip(f"no bits recorded for {here} (recorded: {named})")
    return held


def assert_one_matches(held: list[dict], differences: Callable[[dict], list[str]]) -> None:
    """That one of the ``held`` records shows no ``differences``; where only unnamed
    platforms' records were held, none matching skips: this platform's kernels may differ."""
    found = [differences(record) for record in held]
    if all(found) and held[0]["platform"] is None:
        pytest.skip(
            f"{platform()} computes other bits than the records of unnamed platforms; "
            "record its own (--add-platform) on a tree that moves no numerics"
        )
    assert not all(found), "numerics changed:\n" + "\n".join(min(found, key=len))


def moved_cases(got: dict, want: dict) -> list[str]:
    """What of ``got`` differs from the record ``want``, case by case."""
    unrecorded = [f"{name}: not in the record" for name in got.keys() - want.keys()]
    return unrecorded + [
        f"{name}: losses {'moved' if got[name]['losses'] != case['losses'] else 'same'}, "
        f"parameters {'moved' if got[name]['params'] != case['params'] else 'same'}"
        for name, case in want.items()
        if got.get(name) != case
    ]


def test_losses_and_parameters_match_golden_bits():
    held = records_to_hold(json.loads(GOLDEN.read_text())["records"])
    got = measure()
    assert_one_matches(held, lambda record: moved_cases(got, record["cases"]))


def test_features_match_their_golden_bits():
    """Offload, codecs and the 1-bit optimizers, held to their record as the first grid is."""
    held = records_to_hold(json.loads(FEATURES_GOLDEN.read_text())["records"])
    got = measure(feature_cases())
    assert_one_matches(held, lambda record: moved_cases(got, record["cases"]))


def test_a_platform_is_held_to_its_own_record_else_to_unnamed_ones(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "platform", lambda: "here")
    mine, unnamed, other = ({"platform": p} for p in ("here", None, "there"))
    assert records_to_hold([other, unnamed, mine]) == [mine]
    assert records_to_hold([other, unnamed]) == [unnamed]
    with pytest.raises(pytest.skip.Exception, match="no bits recorded for here"):
        records_to_hold([other])
    assert_one_matches([mine, unnamed], lambda r: [] if r is unnamed else ["moved"])
    with pytest.raises(AssertionError, match="moved"):
        assert_one_matches([mine], lambda r: ["moved"])
    with pytest.raises(pytest.skip.Exception, match="other bits than the records of unnamed"):
        assert_one_matches([unnamed], lambda r: ["moved"])


def zerotrain_commit() -> str | None:
    """The commit of the zerotrain these bits came from (a record may be made with another
    commit's worktree first on ``PYTHONPATH``), None outside git."""
    import subprocess

    import zerotrain

    found = subprocess.run(
        ["git", "-C", str(Path(zerotrain.__file__).parent), "rev-parse", "HEAD"],
        capture_output=True,
        text=True,
    )
    return found.stdout.strip() or None


def main() -> None:
    parser = argparse.ArgumentParser(description="Record this platform's golden bits.")
    parser.add_argument(
        "--features",
        action="store_true",
        help="record the feature grid (feature_cases, golden/features.json) instead",
    )
    parser.add_argument(
        "--add-platform",
        action="store_true",
        help="keep the other platforms' records (this tree moves no numerics); without it "
        "the change moves numerics and the other platforms' records are dropped",
    )
    args = parser.parse_args()
    here = platform()
    golden, grid = (FEATURES_GOLDEN, feature_cases()) if args.features else (GOLDEN, cases())
    records = json.loads(golden.read_text())["records"] if golden.exists() else []
    kept = [r for r in records if r["platform"] != here] if args.add_platform else []
    for dropped in records:
        if dropped not in kept and dropped["platform"] != here:
            print(f"dropped the record of {dropped['platform']}: record it there again")
    measured = measure(grid)
    # an unnamed platform's record with these very bits was this platform's: name it
    kept = [r for r in kept if not (r["platform"] is None and r["cases"] == measured)]
    record = platform_record(cases=measured, commit=zerotrain_commit())
    golden.parent.mkdir(exist_ok=True)
    golden.write_text(json.dumps({"world": WORLD, "records": [*kept, record]}, indent=1) + "\n")
    print(f"wrote {len(measured)} cases for {here} to {golden} ({len(kept)} other records)")


if __name__ == "__main__":
    main()
