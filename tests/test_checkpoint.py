"""Checkpoints: exact resume in fresh processes, resharding across world sizes and stages,
atomicity under a killed rank, verification of damaged files, retention."""

from __future__ import annotations

import contextlib
import logging
import os
import warnings

import torch
from torch.utils.data import TensorDataset

from tests.distributed import run_distributed
from tests.models import SEQ, VOCAB, DropoutModel, param_groups

# Exact resume: 2K straight steps, saving at K, vs K loaded in fresh processes + K more.
K = 5
MICRO, ACCUM = 2, 2
SAMPLES = 36  # 4.5 steps per epoch at world 2: the run crosses epochs, mid-batch included


def _dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(7)
    idx = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=gen)
    return TensorDataset(idx, torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=gen))


def _config(stage: int, precision: str) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-2, "weight_decay": 0.1}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"warmup_num_steps": 3, "total_num_steps": 4 * K, "warmup_max_lr": 2e-2},
        },
        "gradient_clipping": 0.5,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 10**6,
        "seed": 11,
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    if precision == "fp16":  # small window: the scale moves during the run
        config["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 3}
    return config


def _build(stage: int, precision: str):
    import zerotrain

    torch.manual_seed(0)
    model = DropoutModel()
    engine, *_ = zerotrain.initialize(
        model=model,
        model_parameters=param_groups(model, 0.1),
        training_data=_dataset(),
        config=_config(stage, precision),
    )
    return engine


def _train(engine, steps: int, save_at: int | None = None, save_dir: str | None = None):
    losses = []
    batches = iter(engine.training_dataloader)
    for step in range(steps):
        for _ in range(ACCUM):
            try:
                idx, tgt = next(batches)
            except StopIteration:
                batches = iter(engine.training_dataloader)
                idx, tgt = next(batches)
            loss = engine(idx, tgt)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        if step + 1 == save_at:
            engine.save_checkpoint(save_dir, client_state={"note": "half way", "step": step})
    return losses


RESUME_GRID = [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (2, "bf16"), (3, "fp16")]


def _straight_runs(root: str):
    out = {}
    for stage, precision in RESUME_GRID:
        engine = _build(stage, precision)
        losses = _train(engine, 2 * K, save_at=K, save_dir=f"{root}/{stage}-{precision}")
        out[(stage, precision)] = (losses, engine.consolidated_state_dict(), engine.loss_scale)
    return out


def _resumed_runs(root: str):
    out = {}
    for stage, precision in RESUME_GRID:
        engine = _build(stage, precision)
        path, client = engine.load_checkpoint(f"{root}/{stage}-{precision}")
        assert path.endswith(f"global_step{K}") and client == {"note": "half way", "step": K - 1}
        assert engine.global_steps == K
        losses = _train(engine, K)
        out[(stage, precision)] = (losses, engine.consolidated_state_dict(), engine.loss_scale)
    return out


def test_resume_in_fresh_processes_is_bitwise_exact(tmp_path):
    """Every stage in fp32, and bf16 / fp16 (dynamic loss scale): the losses of the resumed
    steps and the final parameters equal the uninterrupted run's bit for bit (data order,
    dropout masks, scheduler, loss scale and Adam moments all resumed)."""
    straight = run_distributed(_straight_runs, 2, str(tmp_path))[0]
    resumed = run_distributed(_resumed_runs, 2, str(tmp_path))[0]
    for key in RESUME_GRID:
        losses, params, scale = straight[key]
        r_losses, r_params, r_scale = resumed[key]
        assert r_losses == losses[K * ACCUM :], key
        assert r_scale == scale, key
        for name, value in params.items():
            assert torch.equal(r_params[name], value), (key, name)
    fp16_losses = straight[(3, "fp16")][0]
    assert fp16_losses != straight[(3, "fp32")][0]  # the grid is not one run six times


def _block_engine(stage: int = 2, model=None, **config):
    """An engine over BlockModel (or ``model``); ``config`` overrides top-level keys."""
    import zerotrain
    from tests.models import BlockModel

    torch.manual_seed(0)
    model = model if model is not None else BlockModel()
    engine, *_ = zerotrain.initialize(
        model=model,
        model_parameters=param_groups(model, 0.1),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-6}},
            "zero_optimization": {"stage": stage},
            "steps_per_print": 10**6,
            **config,
        },
    )
    return engine


def _train_block(engine, steps: int, seed: int = 1) -> None:
    from tests.models import make_batches, run_steps

    world, rank = engine.world_size, engine.global_rank
    idx, tgt = make_batches(steps, 2 * world, seed=seed)
    run_steps(engine, idx, tgt, 2, 1, world, rank)


# -- any world size, any stage ----------------------------------------------------------------
GLOBAL_BATCH = 6  # divisible by every world size of the chain
RESHARD_CHAIN = [(2, 3), (3, 1), (1, 0), (3, 2), (1, 3)]  # (world size, stage)


def _reshard_link(stage: int, load_from: str | None, save_to: str):
    """Train 2 steps (first link) or load the previous link's checkpoint; save; train 1 step."""
    from tests.models import make_batches, run_steps

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    micro = GLOBAL_BATCH // world if world > 1 else 2
    accum = GLOBAL_BATCH // (micro * world)
    engine = _block_engine(
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=accum,
        zero_optimization={
            "stage": stage,
            "reduce_bucket_size": 50,  # several buckets at stages 0-2
            "stage3_param_persistence_threshold": 0,
        },
    )
    idx, tgt = make_batches(3, GLOBAL_BATCH, seed=5)
    if load_from is None:
        run_steps(engine, idx[:2], tgt[:2], micro, accum, world, rank)
    else:
        with _counting_reads() as reads:
            engine.load_checkpoint(load_from)
        # streamed: pieces of at most one parameter, and only this rank's share (x 3: master,
        # exp_avg, exp_avg_sq); stages 0 hold everything on every rank
        held = sum(p.numel for p in engine.optimizer.group.master_pieces(own_shard_only=False))
        assert sum(reads) == 3 * held, (sum(reads), held)
        assert max(reads) <= max(s.numel for b in engine.optimizer.group.buckets for s in b.slots)
    engine.save_checkpoint(save_to, tag="link")
    run_steps(engine, idx[2:], tgt[2:], micro, accum, world, rank)
    return engine.consolidated_state_dict()


@contextlib.contextmanager
def _counting_reads():
    """Record the element count of every piece a ShardReader returns."""
    from zerotrain.checkpoint import ShardReader

    sizes, real_read = [], ShardReader.read

    def read(self, *args):
        pieces = real_read(self, *args)
        sizes.extend(values.numel() for _, values in pieces)
        return pieces

    ShardReader.read = read
    try:
        yield sizes
    finally:
        ShardReader.read = real_read


def _full_state(directory) -> dict[tuple[str, str], torch.Tensor]:
    from zerotrain.checkpoint import Manifest, ShardReader

    manifest = Manifest.read(directory)
    reader = ShardReader(manifest)
    kinds = ["master", *manifest["optimizer_state_keys"]]
    return {(n, k): reader.full(n, k) for n in manifest.params for k in kinds}


def test_reshard_across_world_sizes_and_stages(tmp_path):
    """World 2 stage 3 -> 3 ranks stage 1 -> 1 rank stage 0 -> 3 ranks stage 2 -> 1 rank stage
    3, each loading the previous link's checkpoint directly: masters and Adam moments arrive
    exactly (the next link's save holds the same values), and one more step from there matches
    the step the previous link took itself (within 1e-6)."""
    from zerotrain.checkpoint import Manifest

    results, previous = [], None
    for i, (world, stage) in enumerate(RESHARD_CHAIN):
        target = str(tmp_path / f"link{i}")
        results.append(run_distributed(_reshard_link, world, stage, previous, target)[0])
        previous = target
    for i in range(1, len(RESHARD_CHAIN)):
        before = _full_state(tmp_path / f"link{i - 1}" / "link")
        after = _full_state(tmp_path / f"link{i}" / "link")
        assert before.keys() == after.keys() and len(before) == 3 * len(
            Manifest.read(tmp_path / f"link{i}" / "link").params
        )
        for key, value in before.items():
            assert torch.equal(after[key], value), (RESHARD_CHAIN[i], key)
        for name, value in results[i - 1].items():
            error = (results[i][name] - value).norm() / value.norm().clamp_min(1e-12)
            assert error < 1e-6, (RESHARD_CHAIN[i], name, error.item())
    worlds = {Manifest.read(tmp_path / f"link{i}" / "link")["world_size"] for i in range(5)}
    assert worlds == {1, 2, 3}


# -- never lose a run ---------------------------------------------------------------------------
def _killed_mid_save(save_dir: str):
    """Save 'good'; then rank 1 dies with SIGKILL half-way through writing its next shard."""
    import signal

    import zerotrain.checkpoint.save as save_module

    engine = _block_engine(stage=3)
    _train_block(engine, 1)
    logged: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = logged.append
    logging.getLogger("zerotrain").addHandler(handler)
    try:  # different tags on the ranks: rank 0's wins (checkpoint.tag_validation: Warn)
        engine.save_checkpoint(save_dir, tag="good" if engine.global_rank == 0 else "other")
    finally:
        logging.getLogger("zerotrain").removeHandler(handler)
    warned = any("different tags" in r.getMessage() for r in logged)
    good = engine.consolidated_state_dict()
    _train_block(engine, 1, seed=2)
    if engine.global_rank == 1:
        real_write = save_module.write_safetensors

        def write_then_die(path, entries, metadata=None):
            real_write(path, entries, metadata)
            with open(path, "r+b") as f:  # half-written, as if the process died mid-write
                f.truncate(path.stat().st_size // 2)
            os.kill(os.getpid(), signal.SIGKILL)

        save_module.write_safetensors = write_then_die
    try:
        engine.save_checkpoint(save_dir, tag="partial")
        error = None
    except Exception as exc:  # rank 0: the exchange with the dead rank fails
        error = f"{type(exc).__name__}: {exc}"
    return good, warned, error


def _load_after_crash(save_dir: str):
    engine = _block_engine(stage=1)
    path, client = engine.load_checkpoint(save_dir)  # tag=None: the newest complete one
    return path, client, engine.consolidated_state_dict()


def test_rank_killed_mid_save_leaves_previous_checkpoint_loadable(tmp_path):
    from zerotrain.checkpoint import CheckpointError, resolve, scan
    from zerotrain.checkpoint.manifest import read_latest

    save_dir = tmp_path / "ckpt"
    rank0, _ = run_distributed(
        _killed_mid_save, 2, str(save_dir), collective_timeout_s=20, may_die=(1,)
    )
    good, warned, error = rank0
    assert warned
    assert error is not None  # the surviving rank raised instead of hanging
    status = {s.tag: s for s in scan(save_dir)}
    assert set(status) == {"good", "partial"}
    assert status["good"].complete and not status["partial"].complete
    assert "did not finish" in status["partial"].problem
    assert read_latest(save_dir) == "good"
    assert resolve(save_dir, None).directory.name == "good"
    try:
        resolve(save_dir, "partial")
        raise AssertionError("an incomplete checkpoint was accepted")
    except CheckpointError as exc:
        assert "incomplete" in str(exc)
    path, client, params = run_distributed(_load_after_crash, 1, str(save_dir))[0]
    assert path.endswith("good") and client == {}
    for name, value in good.items():
        assert torch.equal(params[name], value), name


def _damaged_loads(root: str):
    """Each damaged checkpoint raises a CheckpointError naming the file and leaves the engine
    exactly as it was; then retention and the no-checkpoint case."""
    from safetensors.torch import load_file

    import zerotrain.checkpoint as ckpt
    from tests.models import AwkwardModel, BlockModel

    engine = _block_engine(stage=2)
    _train_block(engine, 1)
    before = engine.consolidated_state_dict()
    messages = {}
    for case in sorted(os.listdir(root), key=lambda c: c == "intact"):  # intact one last
        if case == "intact":
            after = engine.consolidated_state_dict()
            unchanged = all(torch.equal(after[k], v) for k, v in before.items())
        try:
            engine.load_checkpoint(f"{root}/{case}", tag="t")
            messages[case] = None
        except ckpt.CheckpointError as exc:
            messages[case] = str(exc)
    for other, label in (
        (AwkwardModel(), "awkward"),
        (_narrow_block_model(BlockModel()), "narrow"),
    ):
        wrong = _block_engine(stage=2, model=other)
        try:
            wrong.load_checkpoint(f"{root}/intact", tag="t")
            messages[label] = None
        except ckpt.CheckpointError as exc:
            messages[label] = str(exc)
    retained = _block_engine(stage=2, checkpoint={"keep_last": 2})
    for step in range(3):
        _train_block(retained, 1, seed=step)
        retained.save_checkpoint(f"{root}-keep")
    kept = sorted(os.listdir(f"{root}-keep"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        nothing = engine.load_checkpoint(f"{root}-empty")

    zero3 = {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}
    bf16 = _block_engine(bf16={"enabled": True}, zero_optimization=zero3)
    _train_block(bf16, 1)
    assert bf16.save_16bit_model(f"{root}-16bit", "model.safetensors")
    written = load_file(f"{root}-16bit/model.safetensors")
    expected = bf16.consolidated_state_dict(dtype=torch.bfloat16)
    exported = written.keys() == expected.keys() and all(
        torch.equal(written[k], v) and v.dtype == torch.bfloat16 for k, v in expected.items()
    )
    return messages, unchanged, kept, nothing, [str(w.message) for w in caught], exported


def _narrow_block_model(model):
    from torch import nn

    from tests.models import DIM

    model.blocks[0].up, model.blocks[0].down = nn.Linear(DIM, 12), nn.Linear(12, DIM)
    return model


def _save_intact(save_dir: str):
    engine = _block_engine(stage=3)
    _train_block(engine, 2)
    engine.save_checkpoint(save_dir, tag="t")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert engine.save_16bit_model(save_dir) is False  # stage 3 needs the gather key


def test_damaged_checkpoints_are_refused_before_anything_changes(tmp_path):
    import json
    import shutil

    from zerotrain.checkpoint.manifest import manifest_checksum

    intact = tmp_path / "cases" / "intact"
    run_distributed(_save_intact, 2, str(intact))
    manifest = json.loads((intact / "t" / "manifest.json").read_text())
    shard1 = manifest["roles"]["shard"][1]

    def variant(name: str):
        target = tmp_path / "cases" / name
        shutil.copytree(intact, target)
        return target / "t"

    with open(variant("truncated") / shard1, "r+b") as f:
        f.truncate(100)
    path = variant("corrupted") / shard1
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    (variant("missing") / shard1).unlink()
    (variant("unfinished") / "manifest.json").unlink()
    gap = variant("gap") / "manifest.json"  # a rank's segment of a parameter went missing
    edited = json.loads(gap.read_text())
    edited["params"][0]["segments"].pop()
    edited["checksum"] = manifest_checksum(edited)  # as a faulty writer would commit it
    gap.write_text(json.dumps(edited))
    retouched = variant("edited") / "manifest.json"  # edited by hand after the commit
    retouched.write_text(json.dumps({**json.loads(retouched.read_text()), "global_steps": 99}))

    messages, unchanged, kept, nothing, warned, exported = run_distributed(
        _damaged_loads, 1, str(tmp_path / "cases")
    )[0]
    assert unchanged
    assert messages["intact"] is None
    assert shard1 in messages["truncated"] and "truncated" in messages["truncated"]
    assert shard1 in messages["corrupted"] and "SHA-256" in messages["corrupted"]
    assert shard1 in messages["missing"] and "missing" in messages["missing"]
    assert "incomplete" in messages["unfinished"]
    assert f"{manifest['params'][0]['name']}: its segments do not cover it" in messages["gap"]
    assert "manifest.json: edited or corrupted" in messages["edited"]
    assert "another model" in messages["awkward"] and "'up.weight'" in messages["awkward"]
    assert "blocks.0.up.weight" in messages["narrow"] and "[13, 7]" in messages["narrow"]
    assert kept == ["global_step2", "global_step3", "latest", "zerotrain.lock"]  # the job's claim
    assert nothing == (None, None) and any("no such checkpoint directory" in w for w in warned)
    assert exported  # save_16bit_model: the bf16 weights, every key


def test_adam_states_resume_across_fused_adam_and_torchs_adamw(tmp_path):
    """The config's AdamW is FusedAdam; with `fused: false` it is torch's AdamW. A checkpoint of
    one resumes the other (the same state: step, exp_avg, exp_avg_sq), each keeping its own
    switches: FusedAdam's adam_w_mode would mark torch's groups as keeping `step` on the
    device."""
    fused = _block_engine(stage=1)
    _train_block(fused, 2)
    fused.save_checkpoint(str(tmp_path), tag="fused")
    saved = fused.optimizer.group.store.optimizer
    torch_adamw = {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-6, "fused": False}}
    plain = _block_engine(stage=1, optimizer=torch_adamw)
    plain.load_checkpoint(str(tmp_path), tag="fused")
    loaded = plain.optimizer.group.store.optimizer
    assert type(saved).__name__ == "FusedAdam" and type(loaded) is torch.optim.AdamW
    assert "adam_w_mode" not in loaded.param_groups[0] and not loaded.param_groups[0]["fused"]
    pairs = zip(saved.param_groups[0]["params"], loaded.param_groups[0]["params"], strict=True)
    for mine, theirs in pairs:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(saved.state[mine][key], loaded.state[theirs][key])
    _train_block(plain, 1)
    plain.save_checkpoint(str(tmp_path), tag="torch")
    back = _block_engine(stage=1)
    back.load_checkpoint(str(tmp_path), tag="torch")
    assert back.global_steps == 3
