"""Checkpoint edge cases: other optimizers and schedulers, a save before the first step, stage-3
persistent units in bf16, fp16 static <-> dynamic loss scales, the partial-load flags, saving a
tag twice, tag validation, a rank whose write fails, parameters smaller than the world, and the
data position of an epoch whose length the world size does not divide.

Most resumes here load into a *used* engine (one that trained on other data first): loading must
replace its state, not merge into it. Each section runs its whole grid in one spawned job.
"""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

from tests.distributed import run_distributed
from tests.models import DIM, VOCAB, BlockModel, make_batches, param_groups, run_steps

MICRO = 2
WARMUP_DECAY = {
    "type": "WarmupDecayLR",
    "params": {"warmup_num_steps": 2, "total_num_steps": 12, "warmup_max_lr": 1e-2},
}


def _fresh(model_cls=BlockModel) -> nn.Module:
    torch.manual_seed(0)
    return model_cls()


def _engine(model: nn.Module, config: dict | None = None, **initialize_kwargs):
    """An engine over ``model``: AdamW at stage 2 unless ``config`` overrides top-level keys."""
    import zerotrain

    base = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-6}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**6,
        **(config or {}),
    }
    if "optimizer" in initialize_kwargs:  # a torch optimizer object replaces the config section
        del base["optimizer"]
    else:
        initialize_kwargs.setdefault("model_parameters", param_groups(model, 0.1))
    engine, *_ = zerotrain.initialize(model=model, config=base, **initialize_kwargs)
    return engine


def _train(engine, steps: int, seed: int) -> None:
    world, rank = engine.world_size, engine.global_rank
    idx, tgt = make_batches(steps, MICRO * world, seed=seed)
    run_steps(engine, idx, tgt, MICRO, 1, world, rank)


def _probe_loss(engine) -> float:
    """Loss of a fixed batch under no_grad: reads the model's own (published) parameters."""
    idx, tgt = make_batches(1, MICRO * engine.world_size, seed=123)
    with torch.no_grad():
        return engine(idx[0, :MICRO], tgt[0, :MICRO]).item()


def _mismatches(expected: dict, actual: dict) -> list[str]:
    return [k for k, v in expected.items() if not torch.equal(actual[k], v)]


# -- 1-3. other optimizers and schedulers, a save before the first step, persistent units ----
def _optimizer_case(case: str):
    """A fresh engine for ``case``: a second one needs its own model (and torch optimizer)."""
    model = _fresh()
    if case == "lamb":  # segment ranges for trust ratios; parameters straddle ranks and buckets
        lamb = {"type": "Lamb", "params": {"lr": 1e-2, "weight_decay": 0.01}}
        return _engine(
            model,
            {"optimizer": lamb, "zero_optimization": {"stage": 2, "reduce_bucket_size": 50}},
        )
    if case == "sgd_momentum":
        sgd = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}
        return _engine(
            model,
            {"optimizer": sgd, "zero_optimization": {"stage": 1}, "bf16": {"enabled": True}},
        )
    if case == "torch_adam_steplr":
        adam = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-6)
        step_lr = torch.optim.lr_scheduler.StepLR(adam, step_size=2, gamma=0.5)
        zero3 = {"stage": 3, "stage3_param_persistence_threshold": 0}
        return _engine(model, {"zero_optimization": zero3}, optimizer=adam, lr_scheduler=step_lr)
    if case == "torch_sgd_steplr":  # no per-element optimizer state at all
        sgd = torch.optim.SGD(model.parameters(), lr=0.05)
        step_lr = torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.7)
        return _engine(
            model, {"zero_optimization": {"stage": 0}}, optimizer=sgd, lr_scheduler=step_lr
        )
    if case == "before_first_step":
        return _engine(model, {"scheduler": WARMUP_DECAY})
    if case == "empty_group":  # a trailing optimizer group with no parameters
        groups = [*param_groups(model, 0.1), {"params": [], "weight_decay": 0.0}]
        return _engine(model, {"zero_optimization": {"stage": 1}}, model_parameters=groups)
    if case == "stage3_persistent_bf16":
        # BlockModel's units: blocks 0/1 (209/168 elements) are sharded, blocks 2/3 and the
        # root (82/149/88) stay whole below a threshold of 150
        zero3 = {"stage": 3, "stage3_param_persistence_threshold": 150}
        return _engine(
            model,
            {"zero_optimization": zero3, "bf16": {"enabled": True}, "scheduler": WARMUP_DECAY},
        )
    raise ValueError(case)


OPTIMIZER_CASES = [
    "lamb",
    "sgd_momentum",
    "torch_adam_steplr",
    "torch_sgd_steplr",
    "before_first_step",
    "empty_group",
    "stage3_persistent_bf16",
]
SAVE_AT, MORE = 3, 3


def _resume_pair(build, save_dir: str, save_at: int = SAVE_AT) -> dict:
    """Train ``save_at`` steps, save, train ``MORE``; a second engine trains 2 steps on other
    data, loads the checkpoint and trains the same ``MORE``. Both ends, for comparison."""
    original = build()
    if save_at:
        _train(original, save_at, seed=3)
    original.save_checkpoint(save_dir)
    _train(original, MORE, seed=4)
    resumed = build()
    _train(resumed, 2, seed=9)  # a used engine: moments, counters, scheduler all differ
    resumed.load_checkpoint(save_dir)
    _train(resumed, MORE, seed=4)
    return {
        name: (
            engine.consolidated_state_dict(),
            engine.get_lr(),
            engine.global_steps,
            _probe_loss(engine),
        )
        for name, engine in (("original", original), ("resumed", resumed))
    }


def _optimizer_resumes(root: str) -> dict:
    warnings.simplefilter("ignore")  # torch schedulers re-pointed at the shards' optimizer
    out = {}
    for case in OPTIMIZER_CASES:
        save_at = 0 if case == "before_first_step" else SAVE_AT
        try:
            out[case] = _resume_pair(lambda c=case: _optimizer_case(c), f"{root}/{case}", save_at)
        except Exception as exc:  # report the case and go on with the others
            out[case] = f"{type(exc).__name__}: {exc}"
    persistent = _optimizer_case("stage3_persistent_bf16").optimizer.group.residency.gatherer.units
    out["persistent_units"] = sorted({u.persistent for u in persistent})
    return out


def test_resume_with_other_optimizers_schedulers_and_layouts(tmp_path):
    """Lamb, SGD with momentum (bf16), a user torch.optim.Adam with a StepLR object (stage 3), a
    user SGD without momentum with a StepLR object (stage 0), a save before the first optimizer
    step, an empty optimizer group, and stage 3 with persistent units in bf16: continuing a
    loaded engine gives bit for bit the parameters, learning rate and model outputs of
    continuing the original."""
    results = run_distributed(_optimizer_resumes, 2, str(tmp_path))
    assert results[0]["persistent_units"] == [False, True]  # the grid has both kinds
    failures = {}
    for case in OPTIMIZER_CASES:
        outcome = results[0][case]
        if isinstance(outcome, str):
            failures[case] = outcome
            continue
        params, lr, steps, probe = outcome["original"]
        r_params, r_lr, r_steps, r_probe = outcome["resumed"]
        problems = [f"params {p}" for p in _mismatches(params, r_params)]
        problems += [f"lr {r_lr} != {lr}"] if r_lr != lr else []
        problems += [f"global_steps {r_steps} != {steps}"] if r_steps != steps else []
        problems += [f"probe loss {r_probe} != {probe}"] if r_probe != probe else []
        if problems:
            failures[case] = problems
    assert not failures, failures


# -- 4-5. fp16 static <-> dynamic loss scale; what each load flag restores ------------------------
STATIC_FP16 = {"enabled": True, "loss_scale": 128}
DYNAMIC_FP16 = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}
LOAD_FLAGS = {
    "no_optimizer": {"load_optimizer_states": False},
    "no_scheduler": {"load_lr_scheduler_states": False},
    "module_only": {"load_module_only": True},
}
DATA_SAMPLES = 40


def _dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(7)
    return TensorDataset(
        torch.randint(0, VOCAB, (DATA_SAMPLES, 5), generator=gen),
        torch.randint(0, VOCAB, (DATA_SAMPLES, 5), generator=gen),
    )


def _loss_scales(root: str) -> dict:
    def fp16_engine(fp16: dict):
        return _engine(_fresh(), {"fp16": fp16})

    def losses(engine, steps: int) -> list[float]:
        world, rank = engine.world_size, engine.global_rank
        idx, tgt = make_batches(steps, MICRO * world, seed=6)
        out = []
        run_steps(
            engine, idx, tgt, MICRO, 1, world, rank, lambda _: out.append(_probe_loss(engine))
        )
        return out

    static = fp16_engine(STATIC_FP16)
    _train(static, 2, seed=1)
    static.save_checkpoint(f"{root}/static")
    dynamic = fp16_engine(DYNAMIC_FP16)
    _train(dynamic, 3, seed=1)
    dynamic.save_checkpoint(f"{root}/dynamic")
    out = {"static_saved": static.loss_scale, "dynamic_saved": dynamic.loss_scale}
    crossings = [
        ("dynamic<-static", DYNAMIC_FP16, "static"),
        ("static<-dynamic", STATIC_FP16, "dynamic"),
    ]
    for name, fp16, source in crossings:
        engine = fp16_engine(fp16)
        engine.load_checkpoint(f"{root}/{source}")
        loaded = engine.loss_scale
        after = losses(engine, 2)
        out[name] = (loaded, engine.loss_scale, engine.optimizer.loss_scaler.dynamic, after)
    return out


def _optimizer_snapshot(engine) -> list[dict]:
    """This rank's optimizer state per master tensor (clones)."""
    optimizer = engine.optimizer.optimizer
    return [
        {k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state.get(m, {}).items()}
        for m in engine.optimizer.group.store.master_shards()
    ]


def _observe(engine) -> dict:
    return {
        "params": engine.consolidated_state_dict(),
        "probe": _probe_loss(engine),
        "optimizer": _optimizer_snapshot(engine),
        "lr": engine.get_lr(),
        "steps": (engine.global_steps, engine.global_samples, engine.micro_steps),
        "scheduler": engine.lr_scheduler.state_dict(),
        "data": engine.training_dataloader.state_dict(),
        "rng": torch.get_rng_state(),
    }


def _load_flags(root: str) -> dict:
    """Which parts of the state each flag restores: observed on every rank."""

    def build():
        config = {"scheduler": WARMUP_DECAY, "zero_optimization": {"stage": 2}}
        return _engine(_fresh(), config, training_data=_dataset())

    def consume(engine, steps: int) -> None:  # from the engine's own dataloader
        batches = iter(engine.training_dataloader)
        for _ in range(steps):
            idx, tgt = next(batches)
            engine.backward(engine(idx, tgt))
            engine.step()

    saved = build()
    consume(saved, 3)
    saved.save_checkpoint(f"{root}/flags")
    out = {"saved": _observe(saved)}
    for name, flags in LOAD_FLAGS.items():
        engine = build()
        consume(engine, 1)
        torch.manual_seed(1000)  # an RNG state of its own
        before = _observe(engine)
        engine.load_checkpoint(f"{root}/flags", **flags)
        out[name] = (before, _observe(engine))
    return out


def _restored(saved: dict, before: dict, after: dict) -> dict[str, str]:
    """For each part of the state: 'checkpoint', 'kept' (the engine's own) or 'other'."""

    def equal(a, b) -> bool:
        if torch.is_tensor(a):
            return torch.is_tensor(b) and torch.equal(a, b)
        if isinstance(a, dict):
            return (
                isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
            )
        if isinstance(a, list | tuple):
            return type(a) is type(b) and len(a) == len(b) and all(map(equal, a, b))
        return a == b

    def part(key: str) -> str:
        if equal(saved[key], after[key]):
            return "checkpoint"
        return "kept" if equal(before[key], after[key]) else "other"

    return {key: part(key) for key in saved}


def _scales_and_flags(root: str):
    return _loss_scales(root), _load_flags(root)


def test_loss_scale_kinds_and_load_flags(tmp_path):
    """fp16 with a static scale loaded into dynamic scaling and back: no error, finite losses.
    Observed: the dynamic engine continues from the static run's scale (128) and keeps adjusting
    it; the static engine keeps its configured 128 whatever the dynamic run had reached.

    The flags (each loaded into a used engine): weights always come from the checkpoint;
    load_optimizer_states=False keeps the engine's own moments and takes the learning rate from
    the restored scheduler; load_lr_scheduler_states=False keeps the engine's scheduler but, as
    torch's optimizer state dicts do, restores the groups' learning rate with the optimizer;
    load_module_only=True restores nothing else (counters, scheduler, data position, RNG)."""
    results = run_distributed(_scales_and_flags, 2, str(tmp_path))
    scales, _ = results[0]
    assert scales["static_saved"] == 128.0
    assert scales["dynamic_saved"] == 512.0  # 256, doubled once by the 2-step window
    loaded, final, dynamic, losses = scales["dynamic<-static"]
    assert (loaded, final, dynamic) == (128.0, 256.0, True), scales
    assert all(math.isfinite(x) for x in losses)
    loaded, final, dynamic, losses = scales["static<-dynamic"]
    assert (loaded, final, dynamic) == (128.0, 128.0, False), scales
    assert all(math.isfinite(x) for x in losses)

    everything = dict.fromkeys(
        ["params", "probe", "optimizer", "lr", "steps", "scheduler", "data", "rng"], "checkpoint"
    )
    expected = {
        "no_optimizer": {**everything, "optimizer": "kept"},
        "no_scheduler": {**everything, "scheduler": "kept"},
        "module_only": {
            **dict.fromkeys(everything, "kept"),
            "params": "checkpoint",
            "probe": "checkpoint",
        },
    }
    for rank, (_, flags) in enumerate(results):
        for name in LOAD_FLAGS:
            before, after = flags[name]
            assert _restored(flags["saved"], before, after) == expected[name], (rank, name)


# -- 6, 8. saving a tag twice, save_latest, tag validation, a rank that cannot write ---------------
def _save_semantics(root: str) -> dict:
    import zerotrain.checkpoint.save as save_module
    from zerotrain.checkpoint import CheckpointError, Manifest
    from zerotrain.checkpoint.manifest import read_latest

    rank = torch.distributed.get_rank()
    out = {}
    engine = _engine(_fresh(), {"checkpoint": {"tag_validation": "Fail"}})
    _train(engine, 1, seed=1)
    engine.save_checkpoint(root, tag="t")
    first_id = Manifest.read(Path(root) / "t")["save_id"]
    _train(engine, 1, seed=2)
    engine.save_checkpoint(root, tag="t")
    out["twice"] = (first_id, sorted(os.listdir(f"{root}/t")))
    out["second"] = engine.consolidated_state_dict()
    _train(engine, 1, seed=3)
    engine.save_checkpoint(root, tag="u", save_latest=False)
    out["third"] = engine.consolidated_state_dict()
    out["latest"] = read_latest(Path(root))

    errors = {}
    for name, tag in (("different", f"r{rank}"), ("one_invalid", "ok" if rank == 0 else "a/b")):
        try:
            engine.save_checkpoint(root, tag=tag)
            errors[name] = None
        except (ValueError, CheckpointError) as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"

    real_write = save_module.write_safetensors
    if rank == 1:

        def disk_full(path, entries, metadata=None):
            raise OSError(28, "No space left on device")

        save_module.write_safetensors = disk_full
    try:
        for tag in ("broken", "t"):  # a new tag, and the tag of a committed checkpoint
            try:
                engine.save_checkpoint(root, tag=tag)
                errors[f"write_{tag}"] = None
            except CheckpointError as exc:
                errors[f"write_{tag}"] = str(exc)
    finally:
        save_module.write_safetensors = real_write
    out["errors"] = errors

    loaded = {}
    for tag in ("t", None):
        fresh = _engine(_fresh(), {"zero_optimization": {"stage": 3}})
        path, _ = fresh.load_checkpoint(root, tag=tag)
        loaded[tag] = (os.path.basename(path), fresh.consolidated_state_dict())
    out["loaded"] = loaded
    return out


def test_save_twice_latest_tag_validation_and_failed_write(tmp_path):
    """Saving a tag again replaces it (the old save's files are gone, loading gives the second);
    save_latest=False leaves `latest` alone (tag=None loads the tag it names, as DeepSpeed's
    load_checkpoint does, not the newer commit); different
    tags under tag_validation Fail raise on every rank, also when one rank's tag is not a valid
    name; a write that fails on rank 1 makes every rank raise a CheckpointError naming rank 1,
    commits nothing, removes what it wrote, and leaves the previous checkpoints loadable."""
    import json

    from zerotrain.checkpoint import scan
    from zerotrain.checkpoint.manifest import read_latest

    root = tmp_path / "ckpt"
    results = run_distributed(_save_semantics, 2, str(root), collective_timeout_s=20)
    first_id, listing = results[0]["twice"]
    manifest = json.loads((root / "t" / "manifest.json").read_text())
    # files of the failed re-save of "t" are not in its manifest and may remain until the next
    # successful save of "t" cleans them; none of the first save's files remain
    assert not any(name.startswith(first_id) for name in listing)
    assert sorted(listing) == sorted(["manifest.json", *manifest["files"]])
    assert results[0]["latest"] == "t" and read_latest(root) == "t"

    for rank, result in enumerate(results):
        errors = result["errors"]
        assert errors["different"] and "different tags" in errors["different"], (rank, errors)
        # a TagMismatch: a ValueError and, as DeepSpeed raises it, an AssertionError
        assert errors["one_invalid"] and "different tags" in errors["one_invalid"], (rank, errors)
        for tag in ("broken", "t"):
            message = errors[f"write_{tag}"] or ""
            assert "rank 1: OSError" in message and "No space left" in message, (rank, message)
            assert "rank 0" not in message, message  # rank 0 wrote its files
    status = {s.tag: s for s in scan(root)}
    assert status["t"].complete and status["u"].complete
    # the failed saves took their files with them (issue 42: a full disk stays full otherwise):
    # the new tag's directory is gone, the committed tag holds its own files only
    assert "broken" not in status and not (root / "broken").exists()
    listed = sorted(["manifest.json", *manifest["files"]])
    assert sorted(p.name for p in (root / "t").iterdir()) == listed
    assert json.loads((root / "t" / "manifest.json").read_text())["save_id"] == manifest["save_id"]

    loaded = results[0]["loaded"]
    assert loaded["t"][0] == "t" and not _mismatches(results[0]["second"], loaded["t"][1])
    assert loaded[None][0] == "t" and not _mismatches(results[0]["second"], loaded[None][1])
    assert _mismatches(results[0]["third"], loaded[None][1])  # "u", the newer commit, differs


# -- 7. parameters smaller than the world: ranks holding only padding ---------------------------
class _Gain(nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.full((1,), 1.1))  # 1 element at world 3

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.gain


class TinyModel(nn.Module):
    """Stage-3 units of 1 element (``blocks.0``) and a 2-element bias (``blocks.1.bias``); at
    stages 1-2 ``blocks.0.gain`` is alone in its optimizer group: at world 3 ranks 1 and 2 hold
    only padding of it."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([_Gain(), nn.Linear(DIM, 2)])
        self.head = nn.Linear(2, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.blocks[1](self.blocks[0](self.embed(idx))))
        return F.cross_entropy(self.head(h).view(-1, VOCAB), targets.view(-1))


TINY_CASES = {  # name: (stage, optimizer section)
    "lamb1": (1, {"type": "Lamb", "params": {"lr": 1e-2, "weight_decay": 0.01}}),
    "adamw3": (3, {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-6}}),
}
RELOAD_STAGE = {"lamb1": 3, "adamw3": 0}


def _tiny_engine(stage: int, optimizer: dict):
    model = _fresh(TinyModel)
    gain = model.blocks[0].gain
    groups = param_groups(model, 0.1)
    groups[1]["params"] = [p for p in groups[1]["params"] if p is not gain]
    groups.append({"params": [gain], "weight_decay": 0.0, "lr": 5e-3})
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    return _engine(
        model, {"optimizer": optimizer, "zero_optimization": zero}, model_parameters=groups
    )


def _tiny_at_world_3(root: str) -> dict:
    out = {}
    for name, (stage, optimizer) in TINY_CASES.items():
        out[name] = _resume_pair(lambda s=stage, o=optimizer: _tiny_engine(s, o), f"{root}/{name}")
    return out


def _tiny_at_world_2(root: str) -> dict:
    """Load each world-3 checkpoint into a fresh engine at another stage (rank 1 holds only
    padding of ``blocks.0.gain``); save it again for comparison; take a step."""
    out = {}
    for name, (_, optimizer) in TINY_CASES.items():
        engine = _tiny_engine(RELOAD_STAGE[name], optimizer)
        engine.load_checkpoint(f"{root}/{name}", tag=f"global_step{SAVE_AT}")
        engine.save_checkpoint(f"{root}/{name}-world2")
        loaded = engine.consolidated_state_dict()
        _train(engine, 1, seed=4)
        out[name] = (loaded, _probe_loss(engine))
    return out


def _full_state(directory) -> dict[tuple[str, str], torch.Tensor]:
    from zerotrain.checkpoint import Manifest, ShardReader

    manifest = Manifest.read(directory)
    reader = ShardReader(manifest)
    kinds = ["master", *manifest["optimizer_state_keys"]]
    return {(n, k): reader.full(n, k) for n in manifest.params for k in kinds}


def test_parameters_smaller_than_the_world(tmp_path):
    """World 3 with a 1-element parameter (alone in its optimizer group, and alone in a stage-3
    unit) and a 2-element bias: ranks holding only padding write no segment of them, resume is
    bitwise exact (Lamb at stage 1, AdamW at stage 3), and each checkpoint loads into a fresh
    engine at world 2 and another stage with every master and moment exact, and steps."""
    from zerotrain.checkpoint import Manifest

    results = run_distributed(_tiny_at_world_3, 3, str(tmp_path))
    for name in TINY_CASES:
        params, lr, steps, probe = results[0][name]["original"]
        assert results[0][name]["resumed"][1:] == (lr, steps, probe), name
        assert not _mismatches(params, results[0][name]["resumed"][0]), name
        manifest = Manifest.read(tmp_path / name / f"global_step{SAVE_AT}")
        assert manifest.params["blocks.0.gain"].segments == ((0, 0, 1),), name
        assert len(manifest.params["blocks.1.bias"].segments) <= 2, name

    reloaded = run_distributed(_tiny_at_world_2, 2, str(tmp_path))[0]
    for name in TINY_CASES:
        saved = _full_state(tmp_path / name / f"global_step{SAVE_AT}")
        again = _full_state(tmp_path / f"{name}-world2" / f"global_step{SAVE_AT}")
        params = Manifest.read(tmp_path / name / f"global_step{SAVE_AT}").params
        assert saved.keys() == again.keys() and len(saved) > len(params), name  # moments too
        assert [k for k, v in saved.items() if not torch.equal(again[k], v)] == [], name
        masters = {n: v for (n, kind), v in saved.items() if kind == "master"}
        loaded, probe_after_step = reloaded[name]
        assert not _mismatches(masters, loaded) and math.isfinite(probe_after_step), name


# -- a load racing another job's retention -------------------------------------------------------
def _load_while_files_go(root: str) -> dict:
    """Loads of one checkpoint: untouched, and with every shard file deleted after the ranks
    verified it (an evaluation job loading while training's keep_last removes it). Each then
    takes one step; their parameters and Adam moments."""
    from zerotrain.checkpoint import load as load_module

    engine = _engine(_fresh())
    _train(engine, 2, seed=1)
    engine.save_checkpoint(root, tag="t")
    apply = load_module._apply

    def files_deleted_first(engine, manifest, *args):
        engine.comm.barrier()  # every rank has verified what it reads
        if engine.comm.rank == 0:
            for shard in manifest.directory.glob("*.safetensors"):
                shard.unlink()
        engine.comm.barrier()
        return apply(engine, manifest, *args)

    out = {}
    for race in (False, True):
        fresh = _engine(_fresh())
        load_module._apply = files_deleted_first if race else apply
        try:
            path, _ = fresh.load_checkpoint(root, tag="t")
        finally:
            load_module._apply = apply
        assert path is not None
        _train(fresh, 1, seed=2)
        out[race] = (
            fresh.consolidated_state_dict(),
            [
                value.clone()
                for state in fresh.optimizer.state.values()
                for value in state.values()
                if torch.is_tensor(value) and value.dim()
            ],
        )
    return out


def test_a_load_reads_what_it_verified_while_another_job_deletes_it(tmp_path):
    """Issue 42: a load racing another job's keep_last retention failed with a raw
    FileNotFoundError after zeroing Adam's moments. It now reads every file through the
    handle it verified, so the files going away after the check change nothing."""
    for rank in run_distributed(_load_while_files_go, 2, str(tmp_path)):
        (params, moments), (raced_params, raced_moments) = rank[False], rank[True]
        assert not _mismatches(params, raced_params)
        assert len(moments) == len(raced_moments) > 0
        assert all(torch.equal(a, b) for a, b in zip(moments, raced_moments, strict=True))
        assert all(m.abs().sum() > 0 for m in raced_moments)


# -- the data position when the world size does not divide the epoch -----------------------------
def test_resumed_epoch_pads_like_an_uninterrupted_one():
    """An epoch of 7 or 11 samples at world 2 ends with a batch padded by repeating the epoch's
    first samples (DistributedSampler). A loader restored mid-epoch must deliver the same
    batches as the uninterrupted loader, padding included (else the resumed run's last batch of
    the epoch differs and resume is not exact)."""
    from zerotrain.data import ResumableDataLoader, ResumableDistributedSampler

    def loaders(samples: int, world: int, batch: int):
        data = TensorDataset(torch.arange(samples))
        return [
            ResumableDataLoader(
                data,
                batch_size=batch,
                sampler=ResumableDistributedSampler(data, world, rank, shuffle=True, seed=3),
                generator=torch.Generator().manual_seed(3),
            )
            for rank in range(world)
        ]

    def epoch(loader) -> list[list[int]]:
        return [b[0].tolist() for b in loader]

    for samples, world, batch in ((7, 2, 1), (11, 2, 2), (10, 3, 1)):
        straight = loaders(samples, world, batch)
        expected = [epoch(loader) for loader in straight]  # one uninterrupted epoch per rank
        data = TensorDataset(torch.arange(samples))
        for rank in range(world):  # which is DistributedSampler's order, padding included
            theirs = list(DistributedSampler(data, world, rank, shuffle=True, seed=3))
            assert sum(expected[rank], []) == theirs, (samples, world, rank)
        for cut in range(1, len(expected[0])):
            first = loaders(samples, world, batch)
            iterators = [iter(loader) for loader in first]
            head = [[next(it)[0].tolist() for _ in range(cut)] for it in iterators]
            resumed = loaders(samples, world, batch)
            for loader in resumed:
                loader.load_state_dict(first[0].state_dict())
            got = [h + epoch(loader) for h, loader in zip(head, resumed, strict=True)]
            assert got == expected, (samples, world, batch, cut)
            assert all(loader.sampler.epoch == 1 for loader in resumed)
